// Prefix sharing through a whole server: worker processes of their own
// (kvcache_prefix_worker) share a 4k-token prompt: the second restores the
// first's K/V byte for byte and takes no page to do it; the RPCs refuse bad
// input with a status naming the field, changing nothing.
#include <sys/wait.h>

#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service_test_util.h"

namespace kvcache::testing {
namespace {

constexpr uint64_t kPrompt = 4096;
constexpr uint64_t kExtra = 16;
constexpr uint64_t kPageTokens = 16;
constexpr uint64_t kLayers = 2;  // the worker's model

// What a worker printed: key -> value, or empty when it failed.
std::map<std::string, std::string> RunWorker(const std::string& address, uint32_t seed) {
  const std::string command =
      absl::StrCat(KVCACHE_PREFIX_WORKER, " --server=", address, " --prompt=", kPrompt,
                   " --extra=", kExtra, " --seed=", seed);
  FILE* out = popen(command.c_str(), "r");
  if (out == nullptr) return {};
  std::string line;
  char buffer[512];
  while (fgets(buffer, sizeof(buffer), out) != nullptr) line += buffer;
  const int status = pclose(out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << command << " failed";
  std::map<std::string, std::string> fields;
  for (absl::string_view pair : absl::StrSplit(line, absl::ByAnyChar(" \n"), absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(pair, absl::MaxSplits('=', 1));
    fields.insert(std::move(kv));
  }
  return fields;
}

uint64_t Number(const std::map<std::string, std::string>& fields, const std::string& key) {
  uint64_t value = 0;
  auto it = fields.find(key);
  EXPECT_TRUE(it != fields.end() && absl::SimpleAtoi(it->second, &value)) << "no " << key;
  return value;
}

class E2ePrefixTest : public E2eTest {};

TEST_P(E2ePrefixTest, TwoWorkerProcessesShareA4kTokenPrompt) {
  const std::string address = server_->server().address();
  const auto first = RunWorker(address, /*seed=*/1);
  EXPECT_EQ(Number(first, "matched"), 0u) << "nothing was cached yet";

  const auto second = RunWorker(address, /*seed=*/2);
  EXPECT_EQ(Number(second, "matched"), kPrompt);
  EXPECT_EQ(Number(second, "restore_new_pages"), 0u);
  EXPECT_EQ(Number(second, "identical"), 1u) << "restored bytes differ from the prefill";
  EXPECT_EQ(Number(second, "shared_tokens"), kPrompt) << "the prompt's pages stored twice";

  // The prompt's pages once, plus each worker's own last page, per layer.
  auto stats = client().GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->pages_used(), kLayers * (kPrompt / kPageTokens + 2));
  EXPECT_EQ(stats->prefix_entries(), 2u);
  EXPECT_EQ(stats->prefix_hits(), 1u);

  // The first worker's request again: all of it is cached.
  const auto again = RunWorker(address, /*seed=*/1);
  EXPECT_EQ(Number(again, "matched"), kPrompt + kExtra);
  EXPECT_EQ(Number(again, "identical"), 1u);
  EXPECT_EQ(again.at("entry"), first.at("entry")) << "republishing stores nothing new";
  auto entries = client().ListPrefixes();
  ASSERT_TRUE(entries.ok()) << entries.status();
  ASSERT_EQ(entries->size(), 2u);
  for (const v1::PrefixEntry& entry : *entries) {
    EXPECT_EQ(entry.model(), "prefix-worker-2L");
    EXPECT_EQ(entry.tokens(), kPrompt + kExtra);
    EXPECT_EQ(entry.hits(), entry.snapshot().snapshot_id() == first.at("entry") ? 2u : 0u);
  }
}

TEST_P(E2ePrefixTest, BadInputIsRefusedByName) {
  const v1::CacheSpec spec = ProtoSpec(1, 2, 8);
  auto cache = client().CreateCache(spec);
  ASSERT_TRUE(cache.ok()) << cache.status();
  ExpectRefused(absl::StatusCode::kInvalidArgument, "snapshot_id", [&] {
    return client().PublishPrefix("", {1, 2}).status();
  });
  ExpectRefused(absl::StatusCode::kNotFound, "snapshot_id", [&] {
    return client().PublishPrefix(kUnknownId, {1, 2}).status();
  });
  ExpectRefused(absl::StatusCode::kInvalidArgument, "tokens",
                [&] { return client().LookupPrefix(spec, {}).status(); });
  ExpectRefused(absl::StatusCode::kInvalidArgument, "spec, cache_id",
                [&] { return client().LookupPrefixCache("", {1}).status(); });
  ExpectRefused(absl::StatusCode::kNotFound, "cache_id",
                [&] { return client().LookupPrefixCache(kUnknownId, {1}).status(); });
  // A lookup by the cache's layout: a miss, not an error.
  auto miss = client().LookupPrefixCache(cache->cache_id(), {1, 2, 3});
  ASSERT_TRUE(miss.ok()) << miss.status();
  EXPECT_EQ(miss->matched_tokens(), 0u);
  EXPECT_FALSE(miss->has_snapshot());
}

INSTANTIATE_TEST_SUITE_P(Paths, E2ePrefixTest, ::testing::ValuesIn(kE2ePaths), PathTestName);

}  // namespace
}  // namespace kvcache::testing
