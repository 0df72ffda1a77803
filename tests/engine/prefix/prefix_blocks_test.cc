// Block events of the prefix indexes (engine/prefix/prefix_blocks.h): chained
// hashes over the tokens alone, a block stored once however many entries (of
// however many indexes) hold it and removed with the last; and, over long
// random publish/forget sequences, on one thread and on several, a
// subscriber that applies the events holds exactly the blocks of the entries
// there are, as does the ledger's own account of what it holds.
#include "engine/prefix/prefix_blocks.h"

#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine/prefix/prefix_index.h"
#include "gtest/gtest.h"

namespace kvcache::engine {
namespace {

std::vector<uint32_t> Tokens(uint32_t count, uint32_t first = 1) {
  std::vector<uint32_t> tokens(count);
  for (uint32_t i = 0; i < count; ++i) tokens[i] = first + i;
  return tokens;
}

// A router's view: the blocks that events say are stored.
class Subscriber : public BlockEventSink {
 public:
  void Emit(BlockEvent event) override {
    Apply(event);
    events_.push_back(std::move(event));
  }

  void Apply(const BlockEvent& event) {
    switch (event.kind) {
      case BlockEvent::Kind::kAllCleared:
        held_.clear();
        break;
      case BlockEvent::Kind::kStored:
        if (event.parent_block_hash.has_value()) {
          EXPECT_TRUE(held_.contains(*event.parent_block_hash)) << "a parent not stored";
        }
        EXPECT_EQ(event.token_ids.size(), event.block_hashes.size() * block_tokens_);
        for (uint64_t hash : event.block_hashes) {
          EXPECT_TRUE(held_.insert(hash).second) << "stored twice";
        }
        break;
      case BlockEvent::Kind::kRemoved:
        for (uint64_t hash : event.block_hashes) EXPECT_EQ(held_.erase(hash), 1u) << "not stored";
        break;
    }
  }

  uint32_t block_tokens_ = 4;
  std::set<uint64_t> held_;
  std::vector<BlockEvent> events_;
};

std::set<uint64_t> HeldByLedger(const PrefixBlocks& blocks) {
  Subscriber replayed;
  replayed.block_tokens_ = blocks.block_tokens();
  blocks.Held([&](std::vector<BlockEvent> held) {
    for (const BlockEvent& event : held) replayed.Apply(event);
  });
  return replayed.held_;
}

TEST(PrefixBlocksTest, AnEntryStoresItsFullBlocksAndExtensionsOnlyTheirTail) {
  Subscriber subscriber;
  subscriber.block_tokens_ = 16;
  PrefixBlocks blocks(16, &subscriber);
  const std::vector<uint32_t> tokens = Tokens(70);
  const std::vector<uint64_t> hashes = blocks.Hashes(tokens);
  ASSERT_EQ(hashes.size(), 4u);  // 70 tokens: 4 full blocks, 6 left over

  blocks.Add(absl::MakeSpan(tokens).first(40));
  ASSERT_EQ(subscriber.events_.size(), 1u);
  const BlockEvent first = subscriber.events_[0];
  EXPECT_EQ(first.kind, BlockEvent::Kind::kStored);
  EXPECT_EQ(first.block_hashes, std::vector<uint64_t>(hashes.begin(), hashes.begin() + 2));
  EXPECT_FALSE(first.parent_block_hash.has_value());
  EXPECT_EQ(first.token_ids, Tokens(32));

  blocks.Add(tokens);
  ASSERT_EQ(subscriber.events_.size(), 2u);
  const BlockEvent longer = subscriber.events_[1];
  EXPECT_EQ(longer.block_hashes, std::vector<uint64_t>(hashes.begin() + 2, hashes.end()));
  EXPECT_EQ(longer.parent_block_hash, hashes[1]);
  EXPECT_EQ(longer.token_ids, Tokens(32, 33));
  blocks.Add(absl::MakeSpan(tokens).first(33));  // all held
  blocks.Add(Tokens(15));                        // no full block
  EXPECT_EQ(subscriber.events_.size(), 2u);
  EXPECT_EQ(HeldByLedger(blocks), std::set<uint64_t>(hashes.begin(), hashes.end()));

  // Shorter entries go first: their blocks stay while the longer one holds them.
  blocks.Remove(absl::MakeSpan(tokens).first(40));
  blocks.Remove(absl::MakeSpan(tokens).first(33));
  EXPECT_EQ(subscriber.events_.size(), 2u);
  blocks.Remove(tokens);
  ASSERT_EQ(subscriber.events_.size(), 3u);
  EXPECT_EQ(subscriber.events_[2].kind, BlockEvent::Kind::kRemoved);
  EXPECT_TRUE(subscriber.held_.empty());
  EXPECT_EQ(blocks.blocks(), 0u);
}

TEST(PrefixBlocksTest, HashesChainOverTheTokensAlone) {
  Subscriber subscriber;
  PrefixBlocks blocks(4, &subscriber);
  const std::vector<uint32_t> tokens = Tokens(8);
  std::vector<uint32_t> other_first = tokens;
  other_first[0] = 99;  // the second block's tokens are equal, its hash is not
  const auto hashes = blocks.Hashes(tokens);
  EXPECT_NE(hashes[1], blocks.Hashes(other_first)[1]);
  EXPECT_EQ(hashes, PrefixBlocks(4, &subscriber).Hashes(tokens));  // no state in a hash
  EXPECT_NE(hashes[0], PrefixBlocks(8, &subscriber).Hashes(tokens)[0]);
}

// Two tenants' indexes over one ledger, each with scopes that restore at any
// length and one that does not (never announced).
struct Tenant {
  PrefixIndex index;
  std::map<std::string, std::pair<std::string, std::vector<uint32_t>>> entries;  // the reference

  void Step(std::mt19937& random, const std::string& id_stem) {
    const auto pick = [&](uint32_t n) {
      return std::uniform_int_distribution<uint32_t>(0, n - 1)(random);
    };
    const std::string id = absl::StrCat(id_stem, pick(40));
    if (pick(3) == 0) {
      EXPECT_EQ(index.Forget(id), entries.erase(id) == 1);
      return;
    }
    const std::string scope = std::vector<std::string>{"a", "b", "exact"}[pick(3)];
    // Few distinct tokens, so prefixes are shared and often equal.
    std::vector<uint32_t> tokens(1 + pick(20));
    for (uint32_t& token : tokens) token = pick(2);
    entries.erase(id);
    std::erase_if(entries,
                  [&](const auto& entry) { return entry.second == std::pair(scope, tokens); });
    entries[id] = {scope, tokens};
    index.Publish(scope, scope != "exact", tokens, id);
  }

  void Expect(const PrefixBlocks& blocks, std::set<uint64_t>& expected) const {
    for (const auto& [id, entry] : entries) {
      if (entry.first == "exact") continue;  // announced only where any length restores
      for (uint64_t hash : blocks.Hashes(entry.second)) expected.insert(hash);
    }
  }
};

TEST(PrefixBlocksTest, RandomPublishesAndForgetsOfTwoTenantsKeepASubscriberExact) {
  Subscriber subscriber;
  PrefixBlocks blocks(4, &subscriber);
  Tenant tenants[2];
  for (Tenant& tenant : tenants) tenant.index.CountBlocksIn(&blocks);
  std::mt19937 random(7);
  for (int step = 0; step < 4000; ++step) {
    tenants[step % 2].Step(random, "snap");  // the same ids in both: they never meet
    std::set<uint64_t> expected;
    for (const Tenant& tenant : tenants) tenant.Expect(blocks, expected);
    ASSERT_EQ(subscriber.held_, expected) << "step " << step;
    if (step % 500 == 0) {
      EXPECT_EQ(HeldByLedger(blocks), expected) << "step " << step;
    }
  }
}

// After churn the map gives its slots back: never more than three per held
// block (what an entry's charge counts), once past a few dozen.
TEST(PrefixBlocksTest, RemovedBlocksGiveTheirSlotsBack) {
  Subscriber subscriber;
  PrefixBlocks blocks(4, &subscriber);
  std::vector<std::vector<uint32_t>> prompts;
  for (uint32_t i = 0; i < 5000; ++i) prompts.push_back({i, i + 1, i + 2, i + 3});
  for (const auto& prompt : prompts) blocks.Add(prompt);
  EXPECT_GE(blocks.slots(), 5000u);
  for (size_t i = 0; i < prompts.size(); ++i) {
    blocks.Remove(prompts[i]);
    const size_t held = prompts.size() - i - 1;
    ASSERT_LE(blocks.slots(), std::max<size_t>(3 * held, 63)) << "after " << i + 1 << " removals";
  }
  EXPECT_EQ(blocks.blocks(), 0u);
  EXPECT_TRUE(subscriber.held_.empty());
}

TEST(PrefixBlocksTest, ConcurrentPublishersLeaveASubscriberExact) {
  // Emit runs under the ledger's lock: the subscriber needs no lock of its own.
  Subscriber subscriber;
  PrefixBlocks blocks(4, &subscriber);
  Tenant tenants[2];
  for (Tenant& tenant : tenants) tenant.index.CountBlocksIn(&blocks);
  absl::Mutex tenant_mutex[2];
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 random(100 + t);
      for (int step = 0; step < 1500; ++step) {
        // Two threads per tenant, each step under its tenant's lock so the
        // reference follows the index; the tenants run side by side.
        absl::MutexLock lock(&tenant_mutex[t % 2]);
        tenants[t % 2].Step(random, absl::StrCat("t", t, "-"));
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::set<uint64_t> expected;
  for (const Tenant& tenant : tenants) tenant.Expect(blocks, expected);
  EXPECT_EQ(subscriber.held_, expected);
  EXPECT_EQ(HeldByLedger(blocks), expected);
  EXPECT_GT(subscriber.events_.size(), 1000u);
}

}  // namespace
}  // namespace kvcache::engine
