// RandomDriver's speculation rounds (engine/speculation.h), mirrored by
// RefSpeculation: the same outcome (status code) for every call, the same
// offsets, byte-identical views of the speculation, and the live cache showing
// the committed history only, throughout and after.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "random_driver.h"
#include "reference_quantized.h"
#include "reference_recurrent.h"

namespace kvcache::testing {
namespace {

constexpr auto kRefused = absl::StatusCode::kFailedPrecondition;

}  // namespace

void PrintSpeculationStats(const RandomConfig& config, const RandomRunStats& s) {
  std::printf("[ %-38s ] speculations: %llu committed (%llu partly), %llu aborted, %llu ended by "
              "delete, %llu isolated; %llu views, %llu refusals; %llu snapshot-way rounds; "
              "%llu page checks\n",
              config.name.c_str(), static_cast<unsigned long long>(s.speculations_committed),
              static_cast<unsigned long long>(s.speculations_partly_accepted),
              static_cast<unsigned long long>(s.speculations_aborted),
              static_cast<unsigned long long>(s.speculations_deleted),
              static_cast<unsigned long long>(s.speculations_isolated),
              static_cast<unsigned long long>(s.speculation_views),
              static_cast<unsigned long long>(s.speculation_refusals),
              static_cast<unsigned long long>(s.snapshot_way_rounds),
              static_cast<unsigned long long>(s.page_checks));
}

void ExpectSpeculationCoverage(const RandomConfig& config, const RandomRunStats& s) {
  EXPECT_GT(s.speculations_committed, 0u) << config.name;
  EXPECT_GT(s.speculations_partly_accepted, 0u) << config.name;
  EXPECT_GT(s.speculations_aborted, 0u) << config.name;
  EXPECT_GT(s.speculations_isolated, 0u) << config.name;
  EXPECT_GT(s.speculation_views, 0u) << config.name;
  EXPECT_GT(s.speculation_refusals, 0u) << config.name;
  EXPECT_GT(s.snapshot_way_rounds, 0u) << config.name;
  EXPECT_GT(s.page_checks, 0u) << config.name;
}

void RandomDriver::Speculate() {
  // Room for the longest draft (and a probe's extra token) under the cap.
  if (KeepStandardLayersSmall(kMaxDraft + 1)) return;
  const std::optional<PageShadow> shadow = BeginPageShadow();
  if (::testing::Test::HasFailure()) return;
  const bool isolated = Chance(0.25);
  absl::StatusOr<engine::SpeculationInfo> begun = engine().BeginSpeculation(cache_id_, isolated);
  ASSERT_TRUE(begun.ok()) << begun.status();
  const std::string id = begun->speculation_id;
  SCOPED_TRACE(absl::StrCat(isolated ? "isolated " : "", "speculation from ", Offset()));
  EXPECT_EQ(id.size(), 32u);
  EXPECT_EQ(begun->cache_id, cache_id_);
  EXPECT_EQ(begun->committed_offset, Offset());
  EXPECT_EQ(begun->layer_offsets, reference_->layer_offsets());
  RefSpeculation reference(*reference_, isolated);
  stats_.speculations_isolated += isolated;
  DraftAndProbe(id, reference);
  if (::testing::Test::HasFailure()) return;
  if (Chance(0.03)) {
    if (shadow.has_value()) DropPageShadow(*shadow);
    Recreate();  // deleting the cache ends its speculation
    ++stats_.speculations_deleted;
    return ExpectSpeculationGone(id);
  }
  if (Chance(0.2)) return EndWithReaderInFlight(id, reference, shadow);
  const uint64_t kept = EndSpeculation(id, reference);
  if (shadow.has_value()) EndPageShadow(*shadow, KeptParts(reference, kept));
}

void RandomDriver::DraftAndProbe(const std::string& id, RefSpeculation& reference) {
  // Refusals before anything is drafted, or after: either way nothing changes.
  const bool probe = Chance(0.2);
  const bool probe_first = Chance(0.5);
  if (probe && probe_first) ProbeWhileSpeculating(id);
  if (::testing::Test::HasFailure()) return;
  DraftTokens(id, reference, Uniform(1, kMaxDraft));
  if (::testing::Test::HasFailure()) return;
  if (probe && !probe_first) ProbeWhileSpeculating(id);
  if (Chance(0.6)) CheckSpeculativeView(id, reference);
  if (Chance(0.2)) FetchLive();  // the live cache: the committed history only
}

void RandomDriver::EndWithReaderInFlight(const std::string& id, RefSpeculation& reference,
                                         const std::optional<PageShadow>& shadow) {
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view = engine().Freeze("", "", id);
  ASSERT_TRUE(view.ok()) << view.status();
  const std::vector<RefToken> tokens = IsRecurrent(layer) ? std::vector<RefToken>{}
                                                               : reference.Fetch(layer);
  const RefState state = IsRecurrent(layer) ? reference.FetchState(layer).value_or(
                                                       ZeroState(reference_->spec(), layer))
                                                 : RefState{};
  const uint64_t kept = EndSpeculation(id, reference);
  if (shadow.has_value()) EndPageShadow(*shadow, KeptParts(reference, kept));
  if (::testing::Test::HasFailure()) return;
  UpdateStep();
  if (::testing::Test::HasFailure()) return;
  SCOPED_TRACE("a view of the ended speculation");
  if (IsRecurrent(layer)) return CheckState(**view, layer, state);
  CheckLayer(**view, layer, tokens);
}

void RandomDriver::DraftTokens(const std::string& id, RefSpeculation& reference,
                               uint64_t tokens) {
  for (uint64_t drafted = 0; drafted < tokens;) {
    const uint64_t piece = Chance(0.5) ? 1 : Uniform(1, tokens - drafted);
    for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
      if (IsRecurrent(layer)) {
        DraftStates(id, reference, layer, piece);
      } else {
        DraftLayer(id, reference, layer, piece);
      }
      if (::testing::Test::HasFailure()) return;
    }
    drafted += piece;
    if (Chance(0.1)) CheckSpeculativeView(id, reference);
  }
}

void RandomDriver::DraftLayer(const std::string& id, RefSpeculation& reference, uint32_t layer,
                              uint64_t tokens) {
  const KvTensors kv = RandomLayerKv(reference_->spec(), layer, tokens, rng_);
  const uint64_t before = reference.layer_offsets()[layer];
  if (Chance(0.02)) {
    EXPECT_EQ(engine().UpdateSpeculation(id, "", layer, kv.input(), before + 1).status().code(),
              kRefused);
    ++stats_.speculation_refusals;
  }
  if (Chance(0.02)) {  // named with a cache that is not its own
    EXPECT_EQ(engine().UpdateSpeculation(id, kOtherId, layer, kv.input()).status().code(),
              absl::StatusCode::kNotFound);
    ++stats_.speculation_refusals;
  }
  if (Chance(0.02)) {  // a recurrent state for an attention layer
    const RefState state{.conv = kv.keys, .delta = kv.values};
    EXPECT_EQ(engine().UpdateSpeculationState(id, "", layer, StateInputOf(state, tokens))
                  .status().code(),
              absl::StatusCode::kInvalidArgument);
    ++stats_.speculation_refusals;
  }
  std::optional<uint64_t> expected_offset;
  if (Chance(0.2)) expected_offset = before;
  const std::string cache_id = Chance(0.5) ? cache_id_ : "";
  absl::StatusOr<uint64_t> result =
      engine().UpdateSpeculation(id, cache_id, layer, kv.input(), expected_offset);
  ASSERT_TRUE(result.ok()) << result.status();
  reference.Update(layer, TokensFromTensors(ShapeOf(reference_->spec(), layer), kv.keys,
                                            kv.values, tokens));
  ASSERT_EQ(*result, reference.layer_offsets()[layer]);
}

// One state per drafted token most of the time, so that any prefix can be
// committed; sometimes one state for the whole piece (prefixes inside it are
// refused) or one that consumed no token first.
void RandomDriver::DraftStates(const std::string& id, RefSpeculation& reference, uint32_t layer,
                               uint64_t tokens) {
  std::vector<uint64_t> advances(tokens, 1);
  if (tokens > 1 && Chance(0.1)) advances = {tokens};
  if (Chance(0.05)) advances.insert(advances.begin(), 0);
  if (Chance(0.02)) {  // keys and values for a recurrent layer
    const KvTensors kv = RandomKv(RefShape{}, 1, rng_);
    EXPECT_EQ(engine().UpdateSpeculation(id, "", layer, kv.input()).status().code(),
              absl::StatusCode::kInvalidArgument);
    ++stats_.speculation_refusals;
  }
  for (uint64_t advance : advances) {
    RefState state = RandomState(reference_->spec(), layer, rng_);
    std::optional<uint64_t> expected_offset;
    if (Chance(0.2)) expected_offset = reference.layer_offsets()[layer];
    absl::StatusOr<uint64_t> result = engine().UpdateSpeculationState(
        id, Chance(0.5) ? cache_id_ : "", layer, StateInputOf(state, advance), expected_offset);
    ASSERT_TRUE(result.ok()) << result.status();
    reference.UpdateState(layer, std::move(state), advance);
    ASSERT_EQ(*result, reference.layer_offsets()[layer]);
  }
}

void RandomDriver::CheckSpeculativeView(const std::string& id, const RefSpeculation& reference) {
  SCOPED_TRACE("the speculative view");
  absl::StatusOr<std::shared_ptr<const engine::CacheSnapshot>> view =
      engine().Freeze(Chance(0.5) ? cache_id_ : "", "", id);
  ASSERT_TRUE(view.ok()) << view.status();
  const std::vector<uint64_t> offsets = reference.layer_offsets();
  EXPECT_EQ((*view)->to, *std::max_element(offsets.begin(), offsets.end()));
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  if (IsRecurrent(layer)) {
    CheckState(**view, layer,
               reference.FetchState(layer).value_or(ZeroState(reference_->spec(), layer)));
  } else {
    CheckLayer(**view, layer, reference.Fetch(layer));
  }
  ++stats_.speculation_views;
  if (Chance(0.2)) {
    absl::StatusOr<engine::SpeculationInfo> info = engine().GetSpeculation(id);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->layer_offsets, offsets);
    EXPECT_EQ(info->committed_offset, reference.committed());
    EXPECT_EQ(info->isolated, reference.isolated());
  }
}

void RandomDriver::ProbeWhileSpeculating(const std::string& id) {
  EXPECT_EQ(engine().BeginSpeculation(cache_id_, Chance(0.5)).status().code(), kRefused);
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  if (IsRecurrent(layer)) {
    const RefState state = RandomState(reference_->spec(), layer, rng_);
    EXPECT_EQ(engine().UpdateState(cache_id_, layer, StateInputOf(state, 1)).status().code(),
              kRefused);
  } else {
    const KvTensors kv = RandomLayerKv(reference_->spec(), layer, 1, rng_);
    EXPECT_EQ(engine().Update(cache_id_, layer, kv.input()).status().code(), kRefused);
  }
  EXPECT_EQ(engine().Trim(cache_id_, 0).status().code(), kRefused);
  EXPECT_EQ(engine().Restore(cache_id_, "", Offset()).status().code(), kRefused);
  stats_.speculation_refusals += 4;
  if (!snapshots_.empty()) {
    const TrackedSnapshot& snapshot = snapshots_[RandomSnapshotIndex()];
    EXPECT_EQ(engine().Restore(cache_id_, snapshot.id, snapshot.reference->to).status().code(),
              kRefused);
    ++stats_.speculation_refusals;
  }
  if (config_.batch_ops) {
    EXPECT_EQ(engine().FilterRows(cache_id_, {0}).status().code(), kRefused);
    EXPECT_EQ(engine().ExtendCache(cache_id_, cache_id_).status().code(), kRefused);
    stats_.speculation_refusals += 2;
  }
  CheckOffsets();
  if (::testing::Test::HasFailure()) return;
  if (Chance(0.5)) TakeSnapshot();  // the committed history: allowed
  if (Chance(0.5)) FetchSnapshot();
}

void RandomDriver::ProbeCommitOutOfStep(const std::string& id, RefSpeculation& reference) {
  const auto draft_one = [&](uint32_t layer) {
    return IsRecurrent(layer) ? DraftStates(id, reference, layer, 1)
                                   : DraftLayer(id, reference, layer, 1);
  };
  draft_one(0);
  if (::testing::Test::HasFailure()) return;
  ASSERT_EQ(reference.Commit(0, *reference_), kRefused);
  EXPECT_EQ(engine().CommitSpeculation(id, 0).status().code(), kRefused);
  ++stats_.speculation_refusals;
  for (uint32_t layer = 1; layer < reference_->num_layers(); ++layer) draft_one(layer);
}

uint64_t RandomDriver::EndSpeculation(const std::string& id, RefSpeculation& reference) {
  if (reference_->num_layers() > 1 && Chance(0.05)) ProbeCommitOutOfStep(id, reference);
  if (::testing::Test::HasFailure()) return 0;
  const uint64_t drafted = reference.layer_offsets()[0] - reference.committed();
  if (Chance(0.08)) {
    const uint64_t beyond = drafted + Uniform(1, 3);
    EXPECT_EQ(reference.Commit(beyond, *reference_), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(engine().CommitSpeculation(id, beyond).status().code(),
              absl::StatusCode::kInvalidArgument);
    ++stats_.speculation_refusals;
  }
  if (Chance(0.15)) {
    absl::StatusOr<engine::CacheInfo> info = engine().AbortSpeculation(id);
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return 0;
    EXPECT_EQ(info->layer_offsets, reference_->layer_offsets());
    ++stats_.speculations_aborted;
    if (Chance(0.2)) ExpectSpeculationGone(id);
    return 0;
  }
  uint64_t accepted = Uniform(0, drafted);
  if (reference.Commit(accepted, *reference_) != absl::StatusCode::kOk) {
    // A recurrent layer drafted no state after exactly `accepted` tokens.
    EXPECT_EQ(engine().CommitSpeculation(id, accepted).status().code(), kRefused);
    ++stats_.speculation_refusals;
    accepted = 0;
    EXPECT_EQ(reference.Commit(accepted, *reference_), absl::StatusCode::kOk);
  }
  absl::StatusOr<engine::CacheInfo> info = engine().CommitSpeculation(id, accepted);
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return 0;
  EXPECT_EQ(info->layer_offsets, reference_->layer_offsets());
  ++stats_.speculations_committed;
  stats_.speculations_partly_accepted += accepted < drafted;
  if (Chance(0.2)) ExpectSpeculationGone(id);
  return reference.isolated() ? 0 : accepted;
}

void RandomDriver::ExpectSpeculationGone(const std::string& id) {
  const auto gone = absl::StatusCode::kNotFound;
  const KvTensors kv = RandomKv(RefShape{}, 1, rng_);
  EXPECT_EQ(engine().CommitSpeculation(id, 0).status().code(), gone);
  EXPECT_EQ(engine().AbortSpeculation(id).status().code(), gone);
  EXPECT_EQ(engine().GetSpeculation(id).status().code(), gone);
  EXPECT_EQ(engine().Freeze("", "", id).status().code(), gone);
  EXPECT_EQ(engine().UpdateSpeculation(id, "", 0, kv.input()).status().code(), gone);
  stats_.speculation_refusals += 5;
}

}  // namespace kvcache::testing
