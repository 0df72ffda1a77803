// DriverCore's speculation rounds (engine/speculation/speculation.h), for the engine and
// the wire alike, mirrored by RefSpeculation (reference_speculation.h):
// BeginSpeculation (isolated sometimes), k in 1..8 drafted tokens on every
// layer through update streams whose parts carry speculation_id (attention
// layers in one update or several, recurrent layers mostly one state per
// token), reads of the speculative view compared with RefSpeculation::Fetch /
// FetchState, live operations refused while it is open, then Commit (accepted
// in 0..k; sometimes more, which is refused and leaves it open), Abort, or the
// cache deleted. The reference gives the status code of every call and, on
// commit, the live cache after it; the live cache shows the committed history
// only, throughout and after. Around each round: the page check
// (driver_core_pages.cc), and the pool's page count once a round kept nothing.
#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "driver_core.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference_batch.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

}  // namespace

void PrintSpeculationStats(const DriverConfig& config, const DriverStats& s) {
  std::printf(
      "[ %-38s ] speculations: %llu committed (%llu partly), %llu aborted, %llu ended by delete, "
      "%llu isolated, %llu tokens drafted; %llu views, %llu refusals; %llu snapshot-way rounds; "
      "%llu page checks\n",
      config.name.c_str(), static_cast<unsigned long long>(s.speculations_committed),
      static_cast<unsigned long long>(s.speculations_partly_accepted),
      static_cast<unsigned long long>(s.speculations_aborted),
      static_cast<unsigned long long>(s.speculations_deleted),
      static_cast<unsigned long long>(s.speculations_isolated),
      static_cast<unsigned long long>(s.drafted_tokens),
      static_cast<unsigned long long>(s.speculation_views),
      static_cast<unsigned long long>(s.speculation_refusals),
      static_cast<unsigned long long>(s.snapshot_way_rounds),
      static_cast<unsigned long long>(s.page_checks));
}

void ExpectSpeculationCoverage(const std::string& name, const DriverStats& s) {
  EXPECT_GT(s.speculations_committed, 0u) << name;
  EXPECT_GT(s.speculations_partly_accepted, 0u) << name;
  EXPECT_GT(s.speculations_aborted, 0u) << name;
  EXPECT_GT(s.speculations_isolated, 0u) << name;
  EXPECT_GT(s.speculation_views, 0u) << name;
  EXPECT_GT(s.speculation_refusals, 0u) << name;
  EXPECT_GT(s.snapshot_way_rounds, 0u) << name;
  EXPECT_GT(s.page_checks, 0u) << name;
}

void DriverCore::Speculate() {
  // Room for the longest draft and DraftOutOfStep's extra token under the
  // cap, so that a commit never needs a trim.
  if (KeepStandardLayersSmall(kMaxDraft + 1)) return;
  const std::optional<uint64_t> pages_before = PagesInUse();
  int64_t page_shift = 0;  // pages the round's snapshots took (or their releases freed)
  const std::optional<PageShadow> shadow = BeginPageShadow();
  if (::testing::Test::HasFailure()) return;
  const bool isolated = Chance(0.25);
  absl::StatusOr<SpeculationState> begun = adapter_.BeginSpeculation(cache_id_, isolated);
  ASSERT_TRUE(begun.ok()) << begun.status();
  const std::string id = begun->speculation_id;
  SCOPED_TRACE(absl::StrCat(isolated ? "isolated " : "", "speculation ", id, " from ", Offset()));
  EXPECT_TRUE(IsServerId(id)) << id;
  EXPECT_EQ(begun->committed_offset, Offset());
  if (!begun->cache_id.empty()) {
    EXPECT_EQ(begun->cache_id, cache_id_);
  }
  if (!begun->layer_offsets.empty()) {
    EXPECT_EQ(begun->layer_offsets, reference_->layer_offsets());
  }
  RefSpeculation reference(*reference_, isolated);
  stats_.speculations_isolated += isolated;
  DraftAndProbe(id, reference, page_shift);
  if (::testing::Test::HasFailure()) return;
  if (Chance(0.03)) {
    if (shadow.has_value()) DropPageShadow(*shadow);
    const std::string deleted = cache_id_;
    Recreate();  // deleting the cache ends its speculation
    ++stats_.speculations_deleted;
    return ExpectSpeculationGone(id, deleted);
  }
  const HeldRead held = Chance(0.2) ? HoldSpeculationRead(id, reference) : nullptr;
  if (::testing::Test::HasFailure()) return;
  const uint64_t kept = EndSpeculation(id, reference);
  if (shadow.has_value()) EndPageShadow(*shadow, KeptParts(reference, kept));
  if (::testing::Test::HasFailure()) return;
  if (held == nullptr) {
    if (pages_before.has_value() && kept == 0) {
      CheckPagesAfterSpeculation(isolated, *pages_before + page_shift);
    }
    return;
  }
  // The live cache writes over the drafted positions; the read in flight
  // keeps what it read (and the pages it holds, so no page count here).
  UpdateStep();
  if (::testing::Test::HasFailure()) return;
  SCOPED_TRACE("a read of the ended speculation");
  held();
}

void DriverCore::DraftAndProbe(const std::string& id, RefSpeculation& reference,
                               int64_t& page_shift) {
  // Refusals before anything is drafted, or after: either way nothing changes.
  const bool probe = Chance(0.2);
  const bool probe_first = Chance(0.5);
  if (probe && probe_first) ProbeWhileSpeculating(id, page_shift);
  if (::testing::Test::HasFailure()) return;
  DraftTokens(id, reference, Uniform(1, kMaxDraft));
  if (::testing::Test::HasFailure()) return;
  if (probe && !probe_first) ProbeWhileSpeculating(id, page_shift);
  if (::testing::Test::HasFailure()) return;
  if (Chance(0.5)) CheckSpeculativeView(id, reference);
  if (Chance(0.2)) FetchLive();  // the live cache: the committed history only
}

std::optional<uint64_t> DriverCore::PagesInUse() {
  if (config_.shares_server) return std::nullopt;
  absl::StatusOr<uint64_t> pages = adapter_.PagesInUse();
  EXPECT_TRUE(pages.ok()) << pages.status();
  if (!pages.ok()) return std::nullopt;
  return *pages;
}

// Isolated drafts go to copies of the layers, which end with the round: the
// count is back exactly. Other drafts are staged in the live layers; the
// pages that hold only drafted positions must be gone, but a layer whose last
// page was partly filled and shared (with a snapshot) copied it before
// writing the first drafted token there, and keeps that copy: at most one
// page more per attention layer, none when no snapshot exists.
void DriverCore::CheckPagesAfterSpeculation(bool isolated, uint64_t pages_before) {
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

void DriverCore::DraftTokens(const std::string& id, RefSpeculation& reference, uint64_t tokens) {
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
void DriverCore::AddDraftParts(uint32_t layer, uint64_t tokens, std::deque<StepPart>& parts) {
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

void DriverCore::SendDraft(const std::string& id, RefSpeculation& reference,
                           std::deque<StepPart> parts) {
  const engine::CacheSpec& spec = reference_->spec();
  if (Chance(0.03)) ProbeDraftElsewhere(id, parts.front());
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
  // Drafts may name the speculation alone; a live update needs its cache.
  const std::string cache_id = fault != 2 && Chance(0.5) ? "" : cache_id_;
  SendStream(
      parts, applied,
      [&](const StepPart& part) {
        if (part.recurrent) {
          reference.UpdateState(part.layer, part.state, part.advance);
        } else {
          reference.Update(part.layer, TokensFromTensors(ShapeOf(spec, part.layer), part.kv.keys,
                                                         part.kv.values, part.kv.tokens));
        }
        return reference.layer_offsets()[part.layer];
      },
      cache_id);
  if (applied == parts.size() || ::testing::Test::HasFailure()) return;
  ProbeCommitOutOfStep(id, reference);
  if (::testing::Test::HasFailure()) return;
  // The worker sends the rest again, the refused message made right.
  std::deque<StepPart> rest;
  const StepPart& refused = parts[applied];
  rest.push_back(
      RandomPart(spec, refused.layer, refused.recurrent ? refused.advance : refused.kv.tokens));
  for (size_t i = applied + 1; i < parts.size(); ++i) rest.push_back(parts[i]);
  SendDraft(id, reference, std::move(rest));
}

void DriverCore::ProbeDraftElsewhere(const std::string& id, StepPart part) {
  part.speculation_id = id;
  part.expected_offset.reset();
  const std::deque<StepPart> parts = {std::move(part)};
  const StreamResult sent = adapter_.SendUpdates(kOtherId, reference_->spec(), parts, true);
  EXPECT_EQ(sent.status.code(), Code::kNotFound) << sent.status;
  EXPECT_THAT(std::string(sent.status.message()), HasSubstr("speculation_id"));
  EXPECT_TRUE(sent.acks.empty());
  ++stats_.speculation_refusals;
}

void DriverCore::DraftOutOfStep(const std::string& id, RefSpeculation& reference) {
  std::deque<StepPart> first;
  AddDraftParts(0, 1, first);
  SendDraft(id, reference, std::move(first));
  if (::testing::Test::HasFailure()) return;
  ProbeCommitOutOfStep(id, reference);
  if (::testing::Test::HasFailure()) return;
  std::deque<StepPart> rest;
  for (uint32_t layer = 1; layer < reference_->num_layers(); ++layer) {
    AddDraftParts(layer, 1, rest);
  }
  SendDraft(id, reference, std::move(rest));
}

// A stream ended part way may leave the drafted layers out of step; a commit
// then is refused (whatever it accepts) and changes nothing.
void DriverCore::ProbeCommitOutOfStep(const std::string& id, const RefSpeculation& reference) {
  const std::vector<uint64_t> offsets = reference.layer_offsets();
  if (std::all_of(offsets.begin(), offsets.end(), [&](uint64_t o) { return o == offsets[0]; })) {
    return;  // in step: a commit would succeed and end the round early
  }
  const uint64_t accepted = Uniform(0, offsets[0] - reference.committed());
  // Refused, so the reference leaves reference_ alone.
  ASSERT_EQ(reference.Commit(accepted, *reference_), Code::kFailedPrecondition);
  const absl::Status status = adapter_.CommitSpeculation(id, accepted).status();
  EXPECT_EQ(status.code(), Code::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("out of step"));
  ++stats_.speculation_refusals;
}

void DriverCore::CheckSpeculativeView(const std::string& id, const RefSpeculation& reference) {
  SCOPED_TRACE("the speculative view");
  ++stats_.speculation_views;
  if (Chance(0.3)) return FetchSpeculationWindow(id, reference);
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  // Named by its id alone, or with its own cache too.
  ASSERT_TRUE(adapter_.SpeculationMatches(id, Chance(0.5) ? cache_id_ : "", layer, reference))
      << "layer " << layer;
  if (!Chance(0.05)) return;
  // A speculation and a snapshot at once is malformed; a speculation named
  // with a cache that is not its own is unknown.
  const std::string snapshot_id =
      snapshots_.empty() ? kOtherId : snapshots_[RandomSnapshotIndex()].id;
  const absl::Status both = adapter_.ReadSpeculation(id, "", snapshot_id);
  EXPECT_EQ(both.code(), Code::kInvalidArgument) << both;
  const absl::Status other = adapter_.ReadSpeculation(id, kOtherId, "");
  EXPECT_EQ(other.code(), Code::kNotFound) << other;
  stats_.speculation_refusals += 2;
}

void DriverCore::ProbeWhileSpeculating(const std::string& id, int64_t& page_shift) {
  SCOPED_TRACE("live operations while speculating");
  const auto expect_refused = [&](const absl::Status& status) {
    EXPECT_EQ(status.code(), Code::kFailedPrecondition) << status;
    ++stats_.speculation_refusals;
  };
  expect_refused(adapter_.BeginSpeculation(cache_id_, Chance(0.5)).status());
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  const std::deque<StepPart> live_part = {RandomPart(reference_->spec(), layer, 1)};
  const absl::Status live =  // no speculation_id: live
      adapter_.SendUpdates(cache_id_, reference_->spec(), live_part, true).status;
  expect_refused(live);
  EXPECT_THAT(std::string(live.message()), HasSubstr("speculation"));
  expect_refused(adapter_.Trim(cache_id_, Uniform(0, 2)).status());
  expect_refused(adapter_.Restore(cache_id_, "", Offset()).status());
  if (!snapshots_.empty()) {
    const TrackedSnapshot& snapshot = snapshots_[RandomSnapshotIndex()];
    expect_refused(adapter_.Restore(cache_id_, snapshot.id, snapshot.reference->to).status());
  }
  if (config_.batch_ops) {
    const uint32_t rows[] = {0};
    expect_refused(adapter_.FilterRows(cache_id_, rows).status());
    expect_refused(adapter_.ExtendCache(cache_id_, cache_id_).status());
  }
  CheckOffsets();
  if (::testing::Test::HasFailure()) return;
  // Reads, snapshots and extracted rows of the committed history stay allowed.
  FetchLive();
  if (Chance(0.5)) FetchSnapshot();
  if (Chance(0.4)) {
    const std::optional<uint64_t> before = PagesInUse();
    TakeSnapshot();
    if (before.has_value()) page_shift += static_cast<int64_t>(PagesInUse().value_or(0) - *before);
  }
  if (::testing::Test::HasFailure() || !config_.batch_ops || !Chance(0.3)) return;
  const uint32_t row = Uniform(0, Batch() - 1);
  RefBatchResult expected = RefExtractRow(*reference_, row);
  absl::StatusOr<CacheState> extracted = adapter_.ExtractRow(cache_id_, row);
  if (!SameOutcome(expected.code, extracted.status())) return;
  CheckCache(extracted->cache_id, *expected.cache);
  ASSERT_TRUE(adapter_.DeleteCache(extracted->cache_id).ok());
}

uint64_t DriverCore::EndSpeculation(const std::string& id, RefSpeculation& reference) {
  if (reference_->num_layers() > 1 && Chance(0.05)) DraftOutOfStep(id, reference);
  if (::testing::Test::HasFailure()) return 0;
  const uint64_t drafted = reference.layer_offsets()[0] - reference.committed();
  if (Chance(0.08)) {
    // More than drafted: refused, nothing changes, and it stays open.
    const uint64_t beyond = drafted + (Chance(0.7) ? 1 : Uniform(2, 5));
    EXPECT_EQ(reference.Commit(beyond, *reference_), Code::kInvalidArgument);
    const absl::Status status = adapter_.CommitSpeculation(id, beyond).status();
    EXPECT_EQ(status.code(), Code::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("accepted"));
    ++stats_.speculation_refusals;
    CheckOffsets();
    if (Chance(0.5)) CheckSpeculativeView(id, reference);
    if (::testing::Test::HasFailure()) return 0;
  }
  if (Chance(0.15)) {
    absl::StatusOr<CacheState> info = adapter_.AbortSpeculation(id);
    EXPECT_TRUE(info.ok()) << info.status();
    if (!info.ok()) return 0;
    EXPECT_EQ(info->layer_offsets, reference_->layer_offsets());
    ++stats_.speculations_aborted;
    if (Chance(0.2)) ExpectSpeculationGone(id, cache_id_);
    return 0;
  }
  uint64_t accepted = Chance(0.25) ? drafted : Uniform(0, drafted);
  // The reference applies an accepted commit to reference_ itself.
  const Code expected = reference.Commit(accepted, *reference_);
  if (expected != Code::kOk) {
    // A recurrent layer drafted no state after exactly `accepted` tokens.
    const absl::Status status = adapter_.CommitSpeculation(id, accepted).status();
    EXPECT_EQ(status.code(), expected) << status;
    ++stats_.speculation_refusals;
    accepted = Chance(0.5) ? 0 : drafted;
    EXPECT_EQ(reference.Commit(accepted, *reference_), Code::kOk);
  }
  SCOPED_TRACE(absl::StrCat("committed ", accepted, " of ", drafted));
  absl::StatusOr<CacheState> info = adapter_.CommitSpeculation(id, accepted);
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return 0;
  EXPECT_EQ(info->layer_offsets, reference_->layer_offsets());
  ++stats_.speculations_committed;
  stats_.speculations_partly_accepted += accepted < drafted;
  // The kept tokens read as live updates of them would.
  if (accepted > 0 && !reference.isolated()) FetchLive();
  if (Chance(0.2)) ExpectSpeculationGone(id, cache_id_);
  return reference.isolated() ? 0 : accepted;
}

void DriverCore::ExpectSpeculationGone(const std::string& id, const std::string& cache_id) {
  SCOPED_TRACE("an ended speculation");
  EXPECT_EQ(adapter_.CommitSpeculation(id, 0).status().code(), Code::kNotFound);
  EXPECT_EQ(adapter_.AbortSpeculation(id).status().code(), Code::kNotFound);
  const absl::Status read = adapter_.ReadSpeculation(id, "", "");
  EXPECT_EQ(read.code(), Code::kNotFound) << read;
  // A draft for it, named with the cache it was open on, changes nothing
  // (CheckOffsets follows every operation); the speculation is what is unknown.
  std::deque<StepPart> parts = {RandomPart(reference_->spec(), 0, 1)};
  parts[0].speculation_id = id;
  const absl::Status draft = adapter_.SendUpdates(cache_id, reference_->spec(), parts, true).status;
  EXPECT_EQ(draft.code(), Code::kNotFound) << draft;
  EXPECT_THAT(std::string(draft.message()), HasSubstr("speculation_id")) << draft;
  stats_.speculation_refusals += 4;
}

}  // namespace kvcache::testing
