// DriverCore's batch operations (mlx-lm BatchKVCache extract / filter /
// merge / extend), checked against reference_batch.h: the same outcome (status
// code), then every layer of every cache involved byte for byte, sources
// unchanged. Partner caches get random batch sizes, left padding and history,
// sometimes the driven cache's offset (the only way rotating layers that keep
// sinks can be batched). Results are sometimes adopted as the driven cache, so
// later operations run on merged, filtered and extracted caches too.
#include <algorithm>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "driver_core.h"
#include "gtest/gtest.h"
#include "reference_batch.h"

namespace kvcache::testing {
namespace {

constexpr uint32_t kMaxBatch = 6;  // rows a driven or partner cache may reach
constexpr uint32_t kMaxPartnerPadding = 6;
constexpr uint64_t kMaxPartnerTokens = 60;

// Rotating layers that keep sinks take no padding: such caches batch only at
// equal lengths.
bool KeepsSinks(const engine::CacheSpec& spec) {
  return std::any_of(spec.layers.begin(), spec.layers.end(), [](const engine::LayerSpec& l) {
    const auto* rotating = std::get_if<engine::RotatingKind>(&l.kind);
    return rotating != nullptr && rotating->keep > 0;
  });
}

}  // namespace

bool DriverCore::SameOutcome(absl::StatusCode expected, const absl::Status& actual) {
  if (expected != absl::StatusCode::kOk) {
    EXPECT_EQ(actual.code(), expected) << actual;
    ++stats_.batch_ops_refused;
    return false;
  }
  EXPECT_TRUE(actual.ok()) << actual;
  if (!actual.ok()) return false;
  ++stats_.batch_ops_ok;
  return true;
}

void DriverCore::CheckCache(const std::string& id, const RefCache& reference) {
  ASSERT_TRUE(adapter_.CacheMatches(id, reference)) << "cache " << id;
}

void DriverCore::Adopt(const std::string& id, std::unique_ptr<RefCache> reference) {
  ASSERT_TRUE(adapter_.DeleteCache(cache_id_).ok());
  cache_id_ = id;
  cache_ids_.insert(id);
  reference_ = std::move(reference);
}

void DriverCore::AppendTo(const std::string& id, RefCache& reference, uint64_t tokens) {
  while (tokens > 0) {
    const uint64_t step =
        Chance(0.45) ? 1 : Uniform(1, std::min<uint64_t>(tokens, MaxUpdateTokens()));
    std::deque<StepPart> parts;
    for (uint32_t l = 0; l < reference.num_layers(); ++l) {
      parts.push_back(RandomPart(reference.spec(), l, step));
    }
    const StreamResult result = adapter_.SendUpdates(id, reference.spec(), parts, true);
    ASSERT_TRUE(result.status.ok()) << result.status;
    for (const StepPart& part : parts) ApplyTo(reference, part);
    tokens -= step;
  }
}

std::pair<std::string, std::unique_ptr<RefCache>> DriverCore::MakePartner(uint32_t batch,
                                                                            bool same_offset) {
  engine::CacheSpec spec = reference_->spec();
  spec.batch_size = batch;
  spec.left_padding.clear();
  if (!KeepsSinks(spec) && Chance(0.7)) {
    for (uint32_t r = 0; r < batch; ++r)
      spec.left_padding.push_back(Uniform(0, kMaxPartnerPadding));
  }
  absl::StatusOr<CacheState> info = adapter_.CreateCache(spec);
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return {};
  auto reference = std::make_unique<RefCache>(spec);
  AppendTo(info->cache_id, *reference, same_offset ? Offset() : Uniform(0, kMaxPartnerTokens));
  return {info->cache_id, std::move(reference)};
}

void DriverCore::ProbeBatchOpsOutOfStep() {
  if (reference_->num_layers() < 2) return;
  const std::deque<StepPart> parts = {RandomPart(reference_->spec(), 0, 1)};
  SendStream(parts, 1);
  if (::testing::Test::HasFailure()) return;
  const std::string ids[] = {cache_id_};
  const uint32_t rows[] = {0};
  for (const absl::Status& status :
       {adapter_.ExtractRow(cache_id_, 0).status(), adapter_.FilterRows(cache_id_, rows).status(),
        adapter_.MergeCaches(ids).status(), adapter_.ExtendCache(cache_id_, cache_id_).status()}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    ++stats_.batch_ops_refused;
  }
  CheckOffsets();
  FinishStep();
}

void DriverCore::ExtractRow() {
  if (Chance(0.03)) return ProbeBatchOpsOutOfStep();
  const uint32_t row = Chance(0.05) ? Batch() + Uniform(0, 2) : Uniform(0, Batch() - 1);
  SCOPED_TRACE(absl::StrCat("extract row ", row, " of ", Batch()));
  RefBatchResult expected = RefExtractRow(*reference_, row);
  absl::StatusOr<CacheState> result = adapter_.ExtractRow(cache_id_, row);
  if (!SameOutcome(expected.code, result.status())) return;
  CheckCache(result->cache_id, *expected.cache);
  if (Chance(0.2)) CheckCache(cache_id_, *reference_);  // unchanged
  if (::testing::Test::HasFailure()) return;
  if (Chance(0.25)) return Adopt(result->cache_id, std::move(expected.cache));
  ASSERT_TRUE(adapter_.DeleteCache(result->cache_id).ok());
}

void DriverCore::FilterRows() {
  if (Chance(0.03)) return ProbeBatchOpsOutOfStep();
  std::vector<uint32_t> keep(Chance(0.03) ? 0 : Uniform(1, std::min(kMaxBatch, Batch() + 1)));
  for (uint32_t& row : keep) row = Uniform(0, Batch() - 1);
  if (!keep.empty() && Chance(0.04)) keep[Uniform(0, keep.size() - 1)] = Batch();
  SCOPED_TRACE(absl::StrCat("filter ", Batch(), " rows to {", absl::StrJoin(keep, ","), "}"));
  RefBatchResult expected = RefFilterRows(*reference_, keep);
  absl::StatusOr<CacheState> result = adapter_.FilterRows(cache_id_, keep);
  if (!SameOutcome(expected.code, result.status())) return;
  EXPECT_EQ(result->cache_id, cache_id_);
  reference_ = std::move(expected.cache);
  CheckCache(cache_id_, *reference_);
}

void DriverCore::ExtendCache() {
  if (Chance(0.03)) return ProbeBatchOpsOutOfStep();
  const bool with_itself = 2 * Batch() <= kMaxBatch && Chance(0.1);
  if (!with_itself && Batch() >= kMaxBatch) return FilterRows();
  std::string other_id = cache_id_;
  std::unique_ptr<RefCache> partner;
  if (!with_itself) {
    std::tie(other_id, partner) =
        MakePartner(Uniform(1, kMaxBatch - Batch()), KeepsSinks(config_.spec) || Chance(0.3));
    if (partner == nullptr) return;
  }
  const RefCache& other = partner ? *partner : *reference_;
  SCOPED_TRACE(absl::StrCat("extend ", Batch(), " rows at ", Offset(), " by ",
                            other.spec().batch_size, " at ", other.CommonOffset().value_or(0)));
  RefBatchResult expected = RefExtend(*reference_, other);
  absl::StatusOr<CacheState> result = adapter_.ExtendCache(cache_id_, other_id);
  const bool ok = SameOutcome(expected.code, result.status());
  if (partner) {
    CheckCache(other_id, *partner);  // unchanged
    ASSERT_TRUE(adapter_.DeleteCache(other_id).ok());
  }
  if (!ok) return;
  reference_ = std::move(expected.cache);
  CheckCache(cache_id_, *reference_);
}

std::vector<std::pair<std::string, const RefCache*>> DriverCore::MergeInputs(
    std::vector<std::pair<std::string, std::unique_ptr<RefCache>>>& partners) {
  std::vector<std::pair<std::string, const RefCache*>> inputs = {{cache_id_, reference_.get()}};
  uint32_t room = kMaxBatch - std::min(kMaxBatch, Batch());
  for (uint64_t extra = Uniform(0, 2); extra > 0 && room > 0; --extra) {
    const uint32_t batch = Uniform(1, std::min(3u, room));
    room -= batch;
    partners.push_back(MakePartner(batch, KeepsSinks(config_.spec) || Chance(0.3)));
    if (partners.back().second == nullptr) return {};
    inputs.emplace_back(partners.back().first, partners.back().second.get());
  }
  if (room >= Batch() && Chance(0.15)) inputs.emplace_back(cache_id_, reference_.get());
  std::shuffle(inputs.begin(), inputs.end(), rng_);
  return inputs;
}

void DriverCore::MergeCaches() {
  if (Chance(0.03)) return ProbeBatchOpsOutOfStep();
  std::vector<std::pair<std::string, std::unique_ptr<RefCache>>> partners;
  std::vector<std::string> ids;
  std::vector<const RefCache*> references;
  for (const auto& [id, reference] : MergeInputs(partners)) {
    ids.push_back(id);
    references.push_back(reference);
  }
  if (ids.empty()) return;
  SCOPED_TRACE(absl::StrCat("merge of ", ids.size(), " caches"));
  RefBatchResult expected = RefMerge(references);
  absl::StatusOr<CacheState> result = adapter_.MergeCaches(ids);
  const bool ok = SameOutcome(expected.code, result.status());
  for (const auto& [id, reference] : partners) {
    if (reference == nullptr) continue;  // a partner that failed
    CheckCache(id, *reference);  // unchanged
    ASSERT_TRUE(adapter_.DeleteCache(id).ok());
  }
  if (!ok) return;
  CheckCache(result->cache_id, *expected.cache);
  if (Chance(0.2)) CheckCache(cache_id_, *reference_);  // unchanged
  if (::testing::Test::HasFailure()) return;
  if (Chance(0.5)) return Adopt(result->cache_id, std::move(expected.cache));
  ASSERT_TRUE(adapter_.DeleteCache(result->cache_id).ok());
}

}  // namespace kvcache::testing
