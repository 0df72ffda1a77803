// WireDriver's speculation rounds over the wire, mirrored by
// RefSpeculation (tests/engine/reference_speculation.h): BeginSpeculation
// (isolated sometimes), k in 1..8 drafted tokens on every layer through Update
// streams carrying speculation_id (attention layers in one update or several,
// recurrent layers mostly one state per token), reads of the speculative view
// through Fetch with speculation_id compared with RefSpeculation::Fetch /
// FetchState, live operations refused while it is open, then Commit (accepted
// in 0..k; sometimes more, which is refused and leaves it open) or Abort. The
// reference gives the status code of every call and, on commit, the live
// cache after it.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference_batch.h"
#include "reference_quantized.h"
#include "reference_recurrent.h"
#include "wire_driver.h"
#include "wire_forms_util.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;


}  // namespace

void WireDriver::Speculate() {
  // Room for the longest draft under the cap, so that a commit never needs a trim.
  if (KeepStandardLayersSmall(kMaxDraft)) return;
  const std::optional<uint64_t> pages_before = PagesInUse();
  int64_t page_shift = 0;  // pages the round's snapshots took (or their releases freed)
  const std::optional<PageShadow> shadow = BeginPageShadow();
  if (::testing::Test::HasFailure()) return;
  const bool isolated = Chance(0.25);
  absl::StatusOr<v1::BeginSpeculationResponse> begun =
      client().BeginSpeculation(cache_id_, isolated);
  ASSERT_TRUE(begun.ok()) << begun.status();
  const std::string id = begun->speculation_id();
  SCOPED_TRACE(absl::StrCat(isolated ? "isolated " : "", "speculation ", id, " from ", Offset()));
  EXPECT_EQ(id.size(), 32u);
  EXPECT_EQ(begun->offset(), Offset());
  RefSpeculation reference(*reference_, isolated);
  stats_.speculations_isolated += isolated;
  // Refusals before anything is drafted, or after: either way nothing changes.
  const bool probe = Chance(0.2);
  const bool probe_first = Chance(0.5);
  if (probe && probe_first) ProbeWhileSpeculating(id, page_shift);
  if (::testing::Test::HasFailure()) return;
  DraftTokens(id, reference, Uniform(1, kMaxDraft));
  if (::testing::Test::HasFailure()) return;
  if (probe && !probe_first) ProbeWhileSpeculating(id, page_shift);
  if (Chance(0.5)) CheckSpeculativeView(id, reference);
  if (Chance(0.2)) FetchLive();  // the live cache: the committed history only
  if (::testing::Test::HasFailure()) return;
  if (Chance(0.03)) {
    if (shadow.has_value()) DropPageShadow(*shadow);
    const std::string deleted = cache_id_;
    Recreate();  // deleting the cache ends its speculation
    ++stats_.speculations_deleted;
    return ExpectSpeculationGone(id, deleted);
  }
  const uint64_t kept = EndSpeculation(id, reference);
  if (shadow.has_value()) EndPageShadow(*shadow, KeptParts(reference, kept));
  if (pages_before.has_value() && kept == 0 && !::testing::Test::HasFailure()) {
    CheckPagesAfterSpeculation(isolated, *pages_before + page_shift);
  }
}

std::optional<uint64_t> WireDriver::PagesInUse() {
  if (config_.shares_server) return std::nullopt;
  absl::StatusOr<v1::Stats> stats = client().GetStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  if (!stats.ok()) return std::nullopt;
  return stats->pages_used();
}

// Isolated drafts go to copies of the layers, which end with the round: the
// count is back exactly. Other drafts are staged in the live layers; the
// pages that hold only drafted positions must be gone, but a layer whose last
// page was partly filled and shared (with a snapshot) copied it before
// writing the first drafted token there, and keeps that copy: at most one
// page more per attention layer, none when no snapshot exists.
void WireDriver::CheckPagesAfterSpeculation(bool isolated, uint64_t pages_before) {
  const std::optional<uint64_t> pages = PagesInUse();
  ASSERT_TRUE(pages.has_value());
  if (isolated || snapshots_.empty()) {
    EXPECT_EQ(*pages, pages_before)
        << (isolated ? "isolated: " : "") << "pages of a speculation that kept nothing outlive it";
    return;
  }
  uint64_t copies = 0;
  for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) copies += !IsRecurrent(layer);
  EXPECT_GE(*pages, pages_before);
  EXPECT_LE(*pages, pages_before + copies) << "pages of drafted tokens that were not kept";
}

void WireDriver::DraftTokens(const std::string& id, RefSpeculation& reference, uint64_t tokens) {
  stats_.drafted_tokens += tokens;
  std::deque<StepPart> parts;
  for (uint64_t drafted = 0; drafted < tokens;) {
    // One forward pass of the target model: `piece` tokens on every layer.
    const uint64_t piece = Chance(0.5) ? 1 : Uniform(1, tokens - drafted);
    for (uint32_t layer = 0; layer < reference_->num_layers(); ++layer) {
      AddDraftParts(layer, piece, parts);
    }
    drafted += piece;
    // Pieces pipelined in one stream, or a stream each.
    if (drafted < tokens && Chance(0.5)) continue;
    SendDraft(id, reference, std::move(parts));
    parts.clear();
    if (::testing::Test::HasFailure()) return;
    if (Chance(0.1)) CheckSpeculativeView(id, reference);
  }
}

// Recurrent layers: one state per token (advance 1), so that every prefix can
// be committed; sometimes one state for the whole piece (prefixes inside it
// cannot be), or a state that consumed no token first (it is replaced).
void WireDriver::AddDraftParts(uint32_t layer, uint64_t tokens, std::deque<StepPart>& parts) {
  const engine::CacheSpec& spec = reference_->spec();
  if (!IsRecurrent(layer)) {
    parts.push_back(RandomPart(spec, layer, tokens));
    return;
  }
  std::vector<uint64_t> advances(tokens, 1);
  if (tokens > 1 && Chance(0.1)) advances = {tokens};
  if (Chance(0.05)) advances.insert(advances.begin(), 0);
  for (uint64_t advance : advances) parts.push_back(RandomPart(spec, layer, advance));
}

void WireDriver::SendDraft(const std::string& id, RefSpeculation& reference,
                           std::deque<StepPart> parts) {
  const engine::CacheSpec& spec = reference_->spec();
  // Each part's layer offset in the speculative view just before it.
  std::vector<uint64_t> before;
  std::vector<uint64_t> offsets = reference.layer_offsets();
  for (const StepPart& part : parts) {
    before.push_back(offsets[part.layer]);
    offsets[part.layer] += part.recurrent ? part.advance : part.kv.tokens;
  }
  // Sometimes one bad message ends the stream: of the wrong kind, a live
  // update (no speculation_id), or a wrong expected_offset.
  size_t applied = parts.size();
  uint64_t fault = 0;
  if (Chance(0.06)) {
    applied = Uniform(0, parts.size() - 1);
    fault = Uniform(1, 3);
  }
  if (fault == 1) MakeWrongKind(spec, parts[applied]);
  if (fault == 2) parts[applied].live = true;
  for (size_t i = 0; i < parts.size(); ++i) {
    // A part sent again after a refusal already names the speculation.
    parts[i].speculation_id = parts[i].live ? "" : id;
    if (!parts[i].live && Chance(0.2)) parts[i].expected_offset = before[i];
  }
  if (fault == 3) {
    parts[applied].expected_offset =
        before[applied] > 0 && Chance(0.5) ? before[applied] - 1 : before[applied] + 1;
  }
  SendStream(parts, applied, [&](const StepPart& part) {
    if (part.recurrent) {
      reference.UpdateState(part.layer, part.state, part.advance);
    } else {
      reference.Update(part.layer, TokensFromTensors(ShapeOf(spec, part.layer), part.kv.keys,
                                                     part.kv.values, part.kv.tokens));
    }
    return reference.layer_offsets()[part.layer];
  });
  if (applied == parts.size() || ::testing::Test::HasFailure()) return;
  ProbeCommitOutOfStep(id, reference);
  if (::testing::Test::HasFailure()) return;
  // The worker sends the rest again, the refused message made right.
  std::deque<StepPart> rest;
  const StepPart& refused = parts[applied];
  rest.push_back(RandomPart(spec, refused.layer,
                            refused.recurrent ? refused.advance : refused.kv.tokens));
  for (size_t i = applied + 1; i < parts.size(); ++i) rest.push_back(parts[i]);
  SendDraft(id, reference, std::move(rest));
}

// A stream ended part way may leave the drafted layers out of step; a commit
// then is refused (whatever it accepts) and changes nothing.
void WireDriver::ProbeCommitOutOfStep(const std::string& id, const RefSpeculation& reference) {
  const std::vector<uint64_t> offsets = reference.layer_offsets();
  if (std::all_of(offsets.begin(), offsets.end(), [&](uint64_t o) { return o == offsets[0]; })) {
    return;  // in step: a commit would succeed and end the round early
  }
  const uint64_t accepted = Uniform(0, offsets[0] - reference.committed());
  // Refused, so the reference leaves reference_ alone.
  ASSERT_EQ(reference.Commit(accepted, *reference_), Code::kFailedPrecondition);
  const absl::Status status = client().CommitSpeculation(id, accepted).status();
  EXPECT_EQ(status.code(), Code::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("out of step"));
  ++stats_.speculation_refusals;
}

void WireDriver::CheckSpeculativeView(const std::string& id, const RefSpeculation& reference) {
  SCOPED_TRACE("the speculative view");
  ++stats_.speculation_views;
  if (Chance(0.3)) return FetchSpeculationWindow(id, reference);
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  ASSERT_TRUE(SpeculativeLayerMatches(id, layer, reference)) << "layer " << layer;
  if (!Chance(0.05)) return;
  // A speculation and a snapshot at once is malformed; a speculation named
  // with a cache that is not its own is unknown.
  v1::FetchRequest both;
  both.set_speculation_id(id);
  both.set_snapshot_id(snapshots_.empty() ? kOtherId : snapshots_[RandomSnapshotIndex()].id);
  EXPECT_EQ(client().FetchAll(both).status().code(), Code::kInvalidArgument);
  v1::FetchRequest other;
  other.set_speculation_id(id);
  other.set_cache_id(kOtherId);
  EXPECT_EQ(client().FetchAll(other).status().code(), Code::kNotFound);
  stats_.speculation_refusals += 2;
}

// As LayerMatchesReference, for the speculative view: an attention layer's
// history (a quantized one's also packed), a recurrent layer's state (zeros
// before any) at its offset in the view.
::testing::AssertionResult WireDriver::SpeculativeLayerMatches(const std::string& id,
                                                               uint32_t layer,
                                                               const RefSpeculation& reference) {
  const engine::CacheSpec& spec = reference_->spec();
  v1::FetchRequest request;
  request.set_speculation_id(id);
  if (Chance(0.5)) request.set_cache_id(cache_id_);  // its own cache: allowed
  request.add_layers(layer);
  if (IsRecurrent(layer)) {
    absl::StatusOr<std::vector<v1::FetchResponse>> chunks = client().FetchAll(request);
    if (!chunks.ok()) return ::testing::AssertionFailure() << "Fetch: " << chunks.status();
    if (chunks->size() != 1 || !(*chunks)[0].has_state()) {
      return ::testing::AssertionFailure() << chunks->size() << " chunks, not one state";
    }
    if ((*chunks)[0].start() != reference.layer_offsets()[layer]) {
      return ::testing::AssertionFailure() << "state at " << (*chunks)[0].start() << ", not "
                                           << reference.layer_offsets()[layer];
    }
    absl::StatusOr<RefState> actual = StateOf(spec, layer, (*chunks)[0].state());
    if (!actual.ok()) return ::testing::AssertionFailure() << actual.status();
    if (!(*actual == reference.FetchState(layer).value_or(ZeroState(spec, layer)))) {
      return ::testing::AssertionFailure() << "state bytes differ";
    }
    return ::testing::AssertionSuccess();
  }
  const std::vector<RefToken> stored = reference.Fetch(layer);
  // The client's FetchSpeculation, or the same read named with its cache too.
  absl::StatusOr<LayerHistory> history = absl::UnknownError("not read");
  if (request.cache_id().empty()) {
    history = client().FetchSpeculation(id, layer);
  } else if (absl::StatusOr<std::vector<v1::FetchResponse>> chunks = client().FetchAll(request);
             chunks.ok()) {
    history = AssembleHistory(*chunks);
  } else {
    history = chunks.status();
  }
  ::testing::AssertionResult same =
      HistoryMatches(AsFetched(spec, layer, stored), history, ShapeOf(spec, layer));
  if (!same || !std::holds_alternative<engine::QuantizedKind>(spec.layers[layer].kind)) {
    return same;
  }
  request.set_packed(true);
  absl::StatusOr<std::vector<v1::FetchResponse>> packed = client().FetchAll(request);
  if (!packed.ok()) return ::testing::AssertionFailure() << "packed Fetch: " << packed.status();
  absl::StatusOr<std::vector<RefToken>> tokens = PackedTokensOf(spec, layer, *packed);
  if (!tokens.ok()) return ::testing::AssertionFailure() << tokens.status();
  ++stats_.packed_fetches;
  return SameTokens(stored, *tokens) << " (packed)";
}

void WireDriver::FetchSpeculationWindow(const std::string& id, const RefSpeculation& reference) {
  const std::vector<uint64_t> offsets = reference.layer_offsets();
  std::vector<uint32_t> layers;
  v1::FetchRequest request =
      RandomFetchRequest(*std::max_element(offsets.begin(), offsets.end()) + 2, layers);
  request.set_speculation_id(id);
  if (Chance(0.5)) request.set_cache_id(cache_id_);
  SCOPED_TRACE(absl::StrCat("fetch ", request.ShortDebugString()));
  absl::StatusOr<std::vector<v1::FetchResponse>> chunks = client().FetchAll(request);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  CheckFetchedChunks(request, layers, *chunks, nullptr, &reference);
}

void WireDriver::ProbeWhileSpeculating(const std::string& id, int64_t& page_shift) {
  SCOPED_TRACE("live operations while speculating");
  const auto expect_refused = [&](const absl::Status& status) {
    EXPECT_EQ(status.code(), Code::kFailedPrecondition) << status;
    ++stats_.speculation_refusals;
  };
  expect_refused(client().BeginSpeculation(cache_id_, Chance(0.5)).status());
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  const std::deque<StepPart> live_part = {RandomPart(reference_->spec(), layer, 1)};
  const absl::Status live =  // no speculation_id: live
      adapter_.SendUpdates(cache_id_, reference_->spec(), live_part, true).status;
  expect_refused(live);
  EXPECT_THAT(std::string(live.message()), HasSubstr("speculation"));
  expect_refused(client().Trim(cache_id_, Uniform(0, 2)).status());
  expect_refused(client().Restore(cache_id_, "", Offset()).status());
  if (!snapshots_.empty()) {
    const TrackedSnapshot& snapshot = snapshots_[RandomSnapshotIndex()];
    expect_refused(client().Restore(cache_id_, snapshot.id, snapshot.reference->to).status());
  }
  if (config_.batch_ops) {
    const uint32_t rows[] = {0};
    expect_refused(client().FilterRows(cache_id_, rows).status());
    expect_refused(client().ExtendCache(cache_id_, cache_id_).status());
  }
  CheckOffsets();
  if (::testing::Test::HasFailure()) return;
  FetchLive();  // unchanged
  // Reads and snapshots of the committed history stay allowed.
  if (Chance(0.3)) {
    const std::optional<uint64_t> before = PagesInUse();
    TakeSnapshot();
    if (before.has_value()) page_shift += static_cast<int64_t>(PagesInUse().value_or(0) - *before);
  }
  if (::testing::Test::HasFailure() || !config_.batch_ops || !Chance(0.3)) return;
  const uint32_t row = Uniform(0, Batch() - 1);
  RefBatchResult expected = RefExtractRow(*reference_, row);
  absl::StatusOr<v1::CacheInfo> extracted = client().ExtractRow(cache_id_, row);
  if (!SameOutcome(expected.code, extracted.status())) return;
  CheckCache(extracted->cache_id(), *expected.cache);
  ASSERT_TRUE(client().DeleteCache(extracted->cache_id()).ok());
}

uint64_t WireDriver::EndSpeculation(const std::string& id, RefSpeculation& reference) {
  const uint64_t drafted = reference.layer_offsets()[0] - reference.committed();
  if (Chance(0.08)) {
    // More than drafted: refused, nothing changes, and it stays open.
    const uint64_t beyond = drafted + (Chance(0.7) ? 1 : Uniform(2, 5));
    EXPECT_EQ(reference.Commit(beyond, *reference_), Code::kInvalidArgument);
    const absl::Status status = client().CommitSpeculation(id, beyond).status();
    EXPECT_EQ(status.code(), Code::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("accepted"));
    ++stats_.speculation_refusals;
    CheckOffsets();
    if (Chance(0.5)) CheckSpeculativeView(id, reference);
    if (::testing::Test::HasFailure()) return 0;
  }
  if (Chance(0.15)) {
    absl::StatusOr<v1::CacheInfo> info = client().AbortSpeculation(id);
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return 0;
    EXPECT_THAT(info->layer_offsets(), ::testing::ElementsAreArray(reference_->layer_offsets()));
    ++stats_.speculations_aborted;
    if (Chance(0.2)) ExpectSpeculationGone(id, cache_id_);
    return 0;
  }
  uint64_t accepted = Chance(0.25) ? drafted : Uniform(0, drafted);
  // The reference applies an accepted commit to reference_ itself.
  const Code expected = reference.Commit(accepted, *reference_);
  if (expected != Code::kOk) {
    // A recurrent layer drafted no state after exactly `accepted` tokens.
    const absl::Status status = client().CommitSpeculation(id, accepted).status();
    EXPECT_EQ(status.code(), expected) << status;
    ++stats_.speculation_refusals;
    accepted = Chance(0.5) ? 0 : drafted;
    EXPECT_EQ(reference.Commit(accepted, *reference_), Code::kOk);
  }
  SCOPED_TRACE(absl::StrCat("committed ", accepted, " of ", drafted));
  absl::StatusOr<v1::CacheInfo> info = client().CommitSpeculation(id, accepted);
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return 0;
  EXPECT_THAT(info->layer_offsets(), ::testing::ElementsAreArray(reference_->layer_offsets()));
  ++stats_.speculations_committed;
  stats_.speculations_partly_accepted += accepted < drafted;
  // The kept tokens read as live updates of them would.
  if (accepted > 0 && !reference.isolated()) FetchLive();
  if (Chance(0.2)) ExpectSpeculationGone(id, cache_id_);
  return reference.isolated() ? 0 : accepted;
}

void WireDriver::ExpectSpeculationGone(const std::string& id, const std::string& cache_id) {
  SCOPED_TRACE("an ended speculation");
  EXPECT_EQ(client().CommitSpeculation(id, 0).status().code(), Code::kNotFound);
  EXPECT_EQ(client().AbortSpeculation(id).status().code(), Code::kNotFound);
  v1::FetchRequest fetch;
  fetch.set_speculation_id(id);
  EXPECT_EQ(client().FetchAll(fetch).status().code(), Code::kNotFound);
  // A draft for it, named with the cache it was open on, changes nothing
  // (CheckOffsets follows every operation); the speculation is what is unknown.
  std::deque<StepPart> parts = {RandomPart(reference_->spec(), 0, 1)};
  parts[0].speculation_id = id;
  const absl::Status draft =
      adapter_.SendUpdates(cache_id, reference_->spec(), parts, true).status;
  EXPECT_EQ(draft.code(), Code::kNotFound) << draft;
  EXPECT_THAT(std::string(draft.message()), HasSubstr("speculation_id")) << draft;
  stats_.speculation_refusals += 4;
}

}  // namespace kvcache::testing
