// The prefix tree against a plain reference (a map of published token
// sequences): long random publish / republish / erase / lookup sequences over
// a small alphabet, so that prefixes share, split and merge all the time.
#include "engine/prefix/prefix_tree.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/random/random.h"
#include "gtest/gtest.h"

namespace kvcache::engine {
namespace {

using Tokens = std::vector<uint32_t>;

size_t CommonPrefix(const Tokens& a, const Tokens& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

bool StartsWith(const Tokens& tokens, const Tokens& prefix) {
  return prefix.size() <= tokens.size() && CommonPrefix(tokens, prefix) == prefix.size();
}

// What the tree must answer: published sequences and their values.
class ReferencePrefixes {
 public:
  void Publish(const Tokens& tokens, int value) { published_[tokens] = value; }
  void Erase(const Tokens& tokens) { published_.erase(tokens); }
  const std::map<Tokens, int>& published() const { return published_; }

  // The longest prefix of `tokens` that any published sequence runs through.
  size_t LongestCovered(const Tokens& tokens) const {
    size_t best = 0;
    for (const auto& [entry, value] : published_)
      best = std::max(best, CommonPrefix(entry, tokens));
    return best;
  }
  // The longest published sequence that is a prefix of `tokens` (0: none).
  size_t LongestEnding(const Tokens& tokens) const {
    size_t best = 0;
    for (const auto& [entry, value] : published_) {
      if (StartsWith(tokens, entry)) best = std::max(best, entry.size());
    }
    return best;
  }
  // The sequence published with `value`.
  const Tokens* Find(int value) const {
    for (const auto& [entry, v] : published_) {
      if (v == value) return &entry;
    }
    return nullptr;
  }

 private:
  std::map<Tokens, int> published_;
};

Tokens RandomTokens(absl::BitGen& random, size_t max_length) {
  Tokens tokens(absl::Uniform<size_t>(absl::IntervalClosed, random, 1, max_length));
  for (uint32_t& token : tokens) token = absl::Uniform<uint32_t>(random, 0, 3);
  return tokens;
}

void ExpectLookupMatches(const PrefixTree<int>& tree, const ReferencePrefixes& reference,
                         const Tokens& tokens) {
  const auto covered = tree.Lookup(tokens, /*exact=*/false);
  ASSERT_EQ(covered.matched_tokens, reference.LongestCovered(tokens));
  ASSERT_EQ(covered.value.has_value(), covered.matched_tokens > 0);
  if (covered.value.has_value()) {
    // Any value whose tokens run through the match answers it.
    const Tokens* entry = reference.Find(*covered.value);
    ASSERT_NE(entry, nullptr) << "a value no longer published: " << *covered.value;
    ASSERT_GE(CommonPrefix(*entry, tokens), covered.matched_tokens);
  }
  const auto ending = tree.Lookup(tokens, /*exact=*/true);
  ASSERT_EQ(ending.matched_tokens, reference.LongestEnding(tokens));
  ASSERT_EQ(ending.value.has_value(), ending.matched_tokens > 0);
  if (ending.value.has_value()) {
    const Tokens expected(tokens.begin(), tokens.begin() + ending.matched_tokens);
    ASSERT_EQ(reference.published().at(expected), *ending.value);
  }
}

TEST(PrefixTreeTest, MatchesInsideEdgesAndOnlyAtEndsWhenExact) {
  PrefixTree<int> tree;
  EXPECT_FALSE(tree.Insert({1, 2, 3, 4, 5, 6}, 10).has_value());
  EXPECT_FALSE(tree.Insert({1, 2, 3, 9}, 20).has_value());

  auto match = tree.Lookup({1, 2, 3, 4, 7}, false);
  EXPECT_EQ(match.matched_tokens, 4u);  // inside the edge [4, 5, 6]
  EXPECT_EQ(match.value, 10);
  match = tree.Lookup({1, 2, 8}, false);
  EXPECT_EQ(match.matched_tokens, 2u);
  EXPECT_TRUE(match.value == 10 || match.value == 20);
  EXPECT_EQ(tree.Lookup({1, 2, 3, 4, 7}, true).matched_tokens, 0u);
  EXPECT_EQ(tree.Lookup({1, 2, 3, 9, 9}, true).value, 20);
  EXPECT_EQ(tree.Lookup({7}, false).matched_tokens, 0u);
  EXPECT_FALSE(tree.Lookup({}, false).value.has_value());

  EXPECT_EQ(tree.Insert({1, 2, 3, 9}, 30), 20);  // republished: the old value comes back
  EXPECT_EQ(tree.values(), 2u);
  EXPECT_EQ(tree.nodes(), 3u);  // [1,2,3] then [4,5,6] and [9]
  EXPECT_EQ(tree.stored_tokens(), 7u);
  EXPECT_EQ(tree.CheckInvariants(), "");
}

TEST(PrefixTreeTest, EraseRecoversAndCompresses) {
  PrefixTree<int> tree;
  tree.Insert({1, 2, 3}, 1);
  tree.Insert({1, 2, 3, 4, 5}, 2);
  tree.Insert({1, 2, 7}, 3);
  EXPECT_FALSE(tree.Erase({1, 2, 3}, 99));  // not the value there
  EXPECT_FALSE(tree.Erase({1, 2}, 1));      // nothing ends there
  EXPECT_FALSE(tree.Erase({1, 2, 3, 4}, 2));
  EXPECT_EQ(tree.values(), 3u);

  EXPECT_TRUE(tree.Erase({1, 2, 3, 4, 5}, 2));
  EXPECT_EQ(tree.Lookup({1, 2, 3, 4}, false).matched_tokens, 3u);
  EXPECT_EQ(tree.Lookup({1, 2, 3, 4}, false).value, 1);
  EXPECT_TRUE(tree.Erase({1, 2, 3}, 1));
  EXPECT_EQ(tree.Lookup({1, 2, 3}, false).matched_tokens, 2u);
  EXPECT_EQ(tree.Lookup({1, 2, 3}, false).value, 3);
  EXPECT_EQ(tree.nodes(), 1u);  // compressed back into [1, 2, 7]
  EXPECT_EQ(tree.stored_tokens(), 3u);
  EXPECT_EQ(tree.CheckInvariants(), "");
  EXPECT_TRUE(tree.Erase({1, 2, 7}, 3));
  EXPECT_EQ(tree.nodes(), 0u);
  EXPECT_EQ(tree.stored_tokens(), 0u);
  EXPECT_FALSE(tree.Lookup({1, 2, 7}, false).value.has_value());
}

// Trees live in hash maps that move them: a moved tree's nodes still find
// their parents.
TEST(PrefixTreeTest, WorksAfterAMove) {
  PrefixTree<int> first;
  first.Insert({1, 2, 3}, 1);
  first.Insert({1, 2, 4}, 2);
  PrefixTree<int> moved = std::move(first);
  EXPECT_TRUE(moved.Erase({1, 2, 3}, 1));  // merges [1, 2] into its only child, via the root
  EXPECT_EQ(moved.CheckInvariants(), "");
  EXPECT_EQ(moved.Lookup({1, 2, 4}, true).value, 2);
  EXPECT_EQ(moved.nodes(), 1u);
}

TEST(PrefixTreeTest, RandomOperationsMatchTheReference) {
  absl::BitGen random;
  for (int round = 0; round < 20; ++round) {
    PrefixTree<int> tree;
    ReferencePrefixes reference;
    int next_value = 1;
    for (int step = 0; step < 2000; ++step) {
      const int op = absl::Uniform(random, 0, 10);
      if (op < 4) {
        const Tokens tokens = RandomTokens(random, 10);
        const int value = next_value++;
        auto old = reference.published().find(tokens);
        const std::optional<int> expected_previous =
            old == reference.published().end() ? std::nullopt : std::optional<int>(old->second);
        ASSERT_EQ(tree.Insert(tokens, value), expected_previous);
        reference.Publish(tokens, value);
      } else if (op < 6 && !reference.published().empty()) {
        auto entry = reference.published().begin();
        std::advance(entry, absl::Uniform<size_t>(random, 0, reference.published().size()));
        const Tokens tokens = entry->first;
        ASSERT_FALSE(tree.Erase(tokens, entry->second + 100000));
        ASSERT_TRUE(tree.Erase(tokens, entry->second));
        reference.Erase(tokens);
      } else if (op < 9) {
        ExpectLookupMatches(tree, reference, RandomTokens(random, 12));
      } else {
        // Extended: some published sequence is strictly longer and starts with these.
        const Tokens tokens = RandomTokens(random, 10);
        const bool extended = std::any_of(
            reference.published().begin(), reference.published().end(), [&](const auto& entry) {
              return entry.first.size() > tokens.size() &&
                     std::equal(tokens.begin(), tokens.end(), entry.first.begin());
            });
        ASSERT_EQ(tree.Extended(tokens), extended) << "step " << step;
      }
      ASSERT_EQ(tree.values(), reference.published().size());
      ASSERT_EQ(tree.CheckInvariants(), "") << "step " << step;
    }
    auto entries = tree.Entries();
    std::map<Tokens, int> listed(entries.begin(), entries.end());
    EXPECT_EQ(listed, reference.published());
    for (const auto& [tokens, value] : reference.published())
      ASSERT_TRUE(tree.Erase(tokens, value));
    EXPECT_EQ(tree.nodes(), 0u);
    EXPECT_EQ(tree.stored_tokens(), 0u);
  }
}

}  // namespace
}  // namespace kvcache::engine
