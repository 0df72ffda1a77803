// Block events of the prefix index (engine/prefix_blocks.h): chained hashes
// per scope, a block stored once however many entries hold it and removed
// with the last, and, over long random publish/forget sequences, a subscriber
// that applies the events holding exactly the blocks of the entries there are,
// as does a replay of the index.
#include "engine/prefix_blocks.h"

#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/prefix_index.h"
#include "gtest/gtest.h"

namespace kvcache::engine {
namespace {

std::vector<uint32_t> Tokens(uint32_t count, uint32_t first = 1) {
  std::vector<uint32_t> tokens(count);
  for (uint32_t i = 0; i < count; ++i) tokens[i] = first + i;
  return tokens;
}

TEST(PrefixBlocksTest, AnEntryStoresItsFullBlocksAndExtensionsOnlyTheirTail) {
  PrefixBlocks blocks(16, "");
  const std::vector<uint32_t> tokens = Tokens(70);
  const std::vector<uint64_t> hashes = blocks.Hashes("s", tokens);
  ASSERT_EQ(hashes.size(), 4u);  // 70 tokens: 4 full blocks, 6 left over

  const auto first = blocks.Add("s", absl::MakeSpan(tokens).first(40));
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->kind, BlockEvent::Kind::kStored);
  EXPECT_EQ(first->block_hashes, std::vector<uint64_t>(hashes.begin(), hashes.begin() + 2));
  EXPECT_FALSE(first->parent_block_hash.has_value());
  EXPECT_EQ(first->token_ids, Tokens(32));

  const auto longer = blocks.Add("s", tokens);
  ASSERT_TRUE(longer.has_value());
  EXPECT_EQ(longer->block_hashes, std::vector<uint64_t>(hashes.begin() + 2, hashes.end()));
  EXPECT_EQ(longer->parent_block_hash, hashes[1]);
  EXPECT_EQ(longer->token_ids, Tokens(32, 33));
  EXPECT_FALSE(blocks.Add("s", absl::MakeSpan(tokens).first(33)).has_value());  // all held
  EXPECT_FALSE(blocks.Add("s", Tokens(15)).has_value());                        // no full block

  // Shorter entries go first: their blocks stay while the longer one holds them.
  EXPECT_FALSE(blocks.Remove("s", absl::MakeSpan(tokens).first(40)).has_value());
  EXPECT_FALSE(blocks.Remove("s", absl::MakeSpan(tokens).first(33)).has_value());
  const auto removed = blocks.Remove("s", tokens);
  ASSERT_TRUE(removed.has_value());
  EXPECT_EQ(removed->kind, BlockEvent::Kind::kRemoved);
  EXPECT_EQ(std::set<uint64_t>(removed->block_hashes.begin(), removed->block_hashes.end()),
            std::set<uint64_t>(hashes.begin(), hashes.end()));
  EXPECT_EQ(blocks.blocks(), 0u);
}

TEST(PrefixBlocksTest, HashesChainAndDependOnTheScope) {
  PrefixBlocks blocks(4, "tenant");
  const std::vector<uint32_t> tokens = Tokens(8);
  std::vector<uint32_t> other_first = tokens;
  other_first[0] = 99;  // the second block's tokens are equal, its hash is not
  const auto a = blocks.Hashes("tenant-a", tokens);
  EXPECT_NE(a, blocks.Hashes("tenant-b", tokens));
  EXPECT_NE(a[1], blocks.Hashes("tenant-a", other_first)[1]);
  EXPECT_EQ(a, PrefixBlocks(4, "tenant").Hashes("tenant-a", tokens));  // no state in a hash
  EXPECT_NE(a[0], PrefixBlocks(8, "tenant").Hashes("tenant-a", tokens)[0]);
  EXPECT_NE(a, PrefixBlocks(4, "other tenant").Hashes("tenant-a", tokens));
}

// A router's view: the blocks that events say are stored.
class Subscriber : public BlockEventSink {
 public:
  void Attach(const void* source, Replay replay) override { replays_[source] = std::move(replay); }
  void Detach(const void* source) override { replays_.erase(source); }
  void Emit(const void*, std::vector<BlockEvent> events) override {
    for (const BlockEvent& event : events) Apply(event);
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
        EXPECT_EQ(event.token_ids.size(), event.block_hashes.size() * kBlockTokens);
        for (uint64_t hash : event.block_hashes) {
          EXPECT_TRUE(held_.insert(hash).second) << "stored twice";
        }
        break;
      case BlockEvent::Kind::kRemoved:
        for (uint64_t hash : event.block_hashes) EXPECT_EQ(held_.erase(hash), 1u) << "not stored";
        break;
    }
  }

  static constexpr uint32_t kBlockTokens = 4;
  std::set<uint64_t> held_;
  std::map<const void*, Replay> replays_;
};

TEST(PrefixBlocksTest, RandomPublishesAndForgetsKeepASubscriberExact) {
  Subscriber subscriber;
  std::map<std::string, std::pair<std::string, std::vector<uint32_t>>> entries;  // the reference
  {
    PrefixIndex index;
    index.SendBlockEvents(&subscriber, Subscriber::kBlockTokens, "salt");
    ASSERT_EQ(subscriber.replays_.size(), 1u);
    const std::vector<std::pair<std::string, bool>> scopes = {
        {"a", true}, {"b", true}, {"exact", false}};
    std::mt19937 random(7);
    const auto pick = [&](uint32_t n) {
      return std::uniform_int_distribution<uint32_t>(0, n - 1)(random);
    };
    for (int step = 0; step < 4000; ++step) {
      const std::string id = absl::StrCat("snap", pick(40));
      if (pick(3) == 0) {
        EXPECT_EQ(index.Forget(id), entries.erase(id) == 1);
      } else {
        const auto& [scope, any_length] = scopes[pick(scopes.size())];
        // Few distinct tokens, so prefixes are shared and often equal.
        std::vector<uint32_t> tokens(1 + pick(20));
        for (uint32_t& token : tokens) token = pick(2);
        entries.erase(id);
        std::erase_if(entries,
                      [&](const auto& entry) { return entry.second == std::pair(scope, tokens); });
        entries[id] = {scope, tokens};
        index.Publish(scope, any_length, tokens, id);
      }
      std::set<uint64_t> expected;
      PrefixBlocks hasher(Subscriber::kBlockTokens, "salt");
      for (const auto& [entry_id, entry] : entries) {
        if (entry.first == "exact") continue;  // announced only where any length restores
        for (uint64_t hash : hasher.Hashes(entry.first, entry.second)) expected.insert(hash);
      }
      ASSERT_EQ(subscriber.held_, expected) << "step " << step;
      if (step % 500 == 0) {
        Subscriber replayed;
        subscriber.replays_.begin()->second([&](std::vector<BlockEvent> held) {
          for (const BlockEvent& event : held) replayed.Apply(event);
        });
        EXPECT_EQ(replayed.held_, expected) << "replay at step " << step;
      }
    }
  }
  EXPECT_TRUE(subscriber.replays_.empty());  // the index detached as it went
}

}  // namespace
}  // namespace kvcache::engine
