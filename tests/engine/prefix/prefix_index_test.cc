// The prefix index: scope keys that tell every layout and namespace apart,
// which layouts match only where a prefix ends, publish / lookup / forget with
// their counts, and lookups running beside publishers.
#include "engine/prefix/prefix_index.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace kvcache::engine {
namespace {

CacheSpec Spec(std::vector<LayerSpec> layers, std::string model = "m") {
  return CacheSpec{.layers = std::move(layers), .model = std::move(model)};
}

LayerSpec Standard(uint32_t heads = 8, uint32_t dim = 128) {
  return {.num_kv_heads = heads, .k_head_dim = dim, .kind = StandardKind{}};
}

TEST(PrefixIndexTest, ScopeKeysTellLayoutsAndNamespacesApart) {
  const CacheSpec base = Spec({Standard(), Standard()});
  std::vector<std::string> keys = {ScopeKey("", base), ScopeKey("tenant-a", base)};
  std::vector<CacheSpec> others(8, base);
  others[0].model = "m2";
  others[1].dtype = DType::kBFloat16;
  others[2].batch_size = 2;
  others[3].layers.pop_back();
  others[4].layers[1].num_kv_heads = 4;
  others[5].layers[1].v_head_dim = 64;
  others[6].layers[1].kind = RotatingKind{.max_size = 256, .keep = 4};
  others[7].layers[1].kind = QuantizedKind{.group_size = 64, .bits = 4};
  for (const CacheSpec& spec : others) keys.push_back(ScopeKey("", spec));
  CacheSpec rotating_other_keep = others[6];
  std::get<RotatingKind>(rotating_other_keep.layers[1].kind).keep = 0;
  keys.push_back(ScopeKey("", rotating_other_keep));
  // Strings are length-prefixed: namespace "a" with model "bm" is not "ab" with "m".
  keys.push_back(ScopeKey("a", Spec({Standard(), Standard()}, "bm")));
  keys.push_back(ScopeKey("ab", Spec({Standard(), Standard()}, "m")));
  for (size_t i = 0; i < keys.size(); ++i) {
    for (size_t j = i + 1; j < keys.size(); ++j) EXPECT_NE(keys[i], keys[j]) << i << " " << j;
  }

  CacheSpec same = base;
  same.layers[0].v_head_dim = 128;  // explicit, equal to k_head_dim
  same.left_padding = {0};          // a batch's padding is not its layout
  EXPECT_EQ(ScopeKey("", same), ScopeKey("", base));
}

TEST(PrefixIndexTest, OnlyStandardAndQuantizedLayoutsRestoreAtAnyLength) {
  EXPECT_TRUE(RestorableAtAnyLength(Spec({Standard()})));
  LayerSpec quantized = Standard();
  quantized.kind = QuantizedKind{};
  EXPECT_TRUE(RestorableAtAnyLength(Spec({Standard(), quantized})));
  for (const auto& kind : std::vector<decltype(LayerSpec::kind)>{RotatingKind{.max_size = 64},
                                                                 ChunkedKind{.chunk_size = 32},
                                                                 RecurrentKind{.conv_tail = 3,
                                                                 .conv_dim = 8,
                                                                 .num_v_heads = 2,
                                                                 .head_v_dim = 4,
                                                                 .head_k_dim = 4}}) {
    LayerSpec other = Standard();
    other.kind = kind;
    EXPECT_FALSE(RestorableAtAnyLength(Spec({Standard(), other})));
  }
}

TEST(PrefixIndexTest, PublishLookupForget) {
  PrefixIndex index;
  const std::string scope = ScopeKey("", Spec({Standard()}));
  const std::string exact_scope = "window";
  EXPECT_FALSE(index.Lookup(scope, {1, 2, 3}).has_value());
  EXPECT_FALSE(index.Publish(scope, true, {1, 2, 3, 4}, "s1").has_value());
  EXPECT_FALSE(index.Publish(exact_scope, false, {1, 2, 3, 4}, "w1").has_value());

  auto found = index.Lookup(scope, {1, 2, 3, 9});
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->snapshot_id, "s1");
  EXPECT_EQ(found->matched_tokens, 3u);
  EXPECT_FALSE(index.Lookup(exact_scope, {1, 2, 3, 9}).has_value());  // ends at 4 only
  found = index.Lookup(exact_scope, {1, 2, 3, 4, 5});
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->snapshot_id, "w1");
  EXPECT_EQ(found->matched_tokens, 4u);
  EXPECT_FALSE(index.Lookup("another scope", {1, 2, 3, 4}).has_value());

  // The same tokens again: the newer id answers, the older one is forgotten.
  EXPECT_EQ(index.Publish(scope, true, {1, 2, 3, 4}, "s2"), "s1");
  EXPECT_FALSE(index.Forget("s1"));
  // An id published again moves to its new tokens.
  EXPECT_FALSE(index.Publish(scope, true, {1, 2, 3, 4, 5, 6}, "s2").has_value());
  EXPECT_EQ(index.Lookup(scope, {1, 2, 3, 4, 5, 6, 7})->matched_tokens, 6u);

  PrefixStats stats = index.Stats();
  EXPECT_EQ(stats.entries, 2u);
  EXPECT_EQ(stats.stored_tokens, 10u);  // [1..6] and the window scope's [1..4]
  EXPECT_EQ(stats.lookups, 6u);
  EXPECT_EQ(stats.hits, 3u);
  EXPECT_EQ(stats.matched_tokens, 3u + 4u + 6u);
  const std::vector<PrefixEntryInfo> listed = index.List();
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].snapshot_id, "s2");
  EXPECT_EQ(listed[0].tokens, 6u);
  EXPECT_EQ(listed[0].hits, 1u);  // s1 answered the first lookup, then went
  EXPECT_EQ(listed[1].snapshot_id, "w1");
  EXPECT_EQ(listed[1].hits, 1u);

  EXPECT_TRUE(index.Forget("s2"));
  EXPECT_TRUE(index.Forget("w1"));
  EXPECT_FALSE(index.Lookup(scope, {1, 2, 3}).has_value());
  EXPECT_EQ(index.Stats().entries, 0u);
  EXPECT_EQ(index.Stats().stored_tokens, 0u);
}

// Lookups on several threads while others publish and forget: every answer is
// a prefix that was published with the id it names.
TEST(PrefixIndexTest, LookupsRunBesidePublishers) {
  PrefixIndex index;
  const std::string scope = "scope";
  std::vector<uint32_t> base(64);
  for (uint32_t i = 0; i < base.size(); ++i) base[i] = i;
  std::atomic<bool> done{false};
  std::atomic<uint64_t> answered{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r) {
    readers.emplace_back([&] {
      while (!done.load()) {
        const auto found = index.Lookup(scope, base);
        if (!found.has_value()) continue;
        // Ids name their length: "p<length>".
        EXPECT_EQ(found->snapshot_id, absl::StrCat("p", found->matched_tokens));
        ++answered;
      }
    });
  }
  // Rounds go on until the readers have seen answers (they may not be
  // scheduled at all for a while on a loaded machine), within a bound.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (int round = 0; round < 200 || (answered.load() < 100 && absl::Now() < deadline); ++round) {
    for (uint32_t length = 8; length <= 64; length += 8) {
      const absl::Span<const uint32_t> tokens(base.data(), length);
      index.Publish(scope, false, tokens, absl::StrCat("p", length));
    }
    for (uint32_t length = 8; length <= 64; length += 8) {
      EXPECT_TRUE(index.Forget(absl::StrCat("p", length)));
    }
  }
  done = true;
  for (std::thread& reader : readers) reader.join();
  EXPECT_EQ(index.Stats().entries, 0u);
  EXPECT_GT(answered.load(), 0u);
}

}  // namespace
}  // namespace kvcache::engine
