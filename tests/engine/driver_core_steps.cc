// DriverCore's update streams: whole steps (tokens for attention layers, new
// states for recurrent ones) in one stream, pipelined decode steps, streams
// that one bad message ends part way (a wrong expected_offset, an update of
// the wrong kind for its layer, a state of the wrong size), torn steps and
// their repair. On the engine a stream is its calls one after another,
// stopping at the first refusal, as the server applies a stream.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "driver_core.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference_quantized.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

}  // namespace

StepPart DriverCore::RandomPart(const engine::CacheSpec& spec, uint32_t layer, uint64_t tokens) {
  StepPart part{.layer = layer, .recurrent = engine::IsRecurrent(spec.layers[layer])};
  if (part.recurrent) {
    part.state = RandomState(spec, layer, rng_);
    part.advance = tokens;
  } else {
    part.kv = RandomLayerKv(spec, layer, tokens, rng_);
  }
  return part;
}

void DriverCore::MakeWrongKind(const engine::CacheSpec& spec, StepPart& part) {
  part.wrong_kind = true;
  if (part.recurrent) {
    // Keys and values shaped as a small attention layer's would be.
    const RefShape shape{.batch = spec.batch_size,
                         .heads = 1,
                         .k_dim = 4,
                         .v_dim = 4,
                         .elem_bytes = DTypeSize(spec.dtype)};
    part.kv = RandomKv(shape, std::max<uint64_t>(1, part.advance), rng_);
  } else {
    // A small state, as no recurrent layer here takes.
    part.state = RefState{.conv = std::vector<std::byte>(spec.batch_size * 12, std::byte{1}),
                          .delta = std::vector<std::byte>(spec.batch_size * 8, std::byte{2})};
    part.advance = part.kv.tokens;
  }
}

void DriverCore::ApplyTo(RefCache& reference, const StepPart& part) {
  if (part.recurrent) {
    reference.UpdateState(part.layer, part.state, part.advance);
    return;
  }
  reference.Update(part.layer, TokensFromTensors(ShapeOf(reference.spec(), part.layer),
                                                 part.kv.keys, part.kv.values, part.kv.tokens));
}

void DriverCore::SendStream(const std::deque<StepPart>& parts, size_t applied) {
  SendStream(
      parts, applied,
      [this](const StepPart& part) {
        ApplyTo(*reference_, part);
        return reference_->layer(part.layer).offset();
      },
      cache_id_);
}

void DriverCore::SendStream(const std::deque<StepPart>& parts, size_t applied, const Mirror& mirror,
                            const std::string& cache_id) {
  const bool one_call = applied == parts.size() && Chance(0.5);
  const StreamResult result = adapter_.SendUpdates(cache_id, reference_->spec(), parts, one_call);
  const absl::Status& status = result.status;
  const std::string message(status.message());
  if (applied == parts.size()) {
    ASSERT_TRUE(status.ok()) << status;
  } else if (parts[applied].wrong_kind) {
    ASSERT_EQ(status.code(), Code::kInvalidArgument) << status;
    // The field that should not be there: keys for a recurrent layer.
    EXPECT_THAT(message, HasSubstr(parts[applied].recurrent ? "keys" : "state"));
    ++stats_.wrong_kind_streams;
  } else if (parts[applied].live) {
    ASSERT_EQ(status.code(), Code::kFailedPrecondition) << status;
    EXPECT_THAT(message, HasSubstr("speculation is open"));
    ++stats_.speculation_refusals;
  } else if (!parts[applied].wrong_size_field.empty()) {
    ASSERT_EQ(status.code(), Code::kInvalidArgument) << status;
    EXPECT_THAT(message, HasSubstr(parts[applied].wrong_size_field));
    ++stats_.wrong_kind_streams;
  } else {
    ASSERT_EQ(status.code(), Code::kFailedPrecondition) << status;
    EXPECT_THAT(message, HasSubstr("expected_offset"));
    ++stats_.failed_streams;
  }
  ASSERT_EQ(result.acks.size(), applied) << "acknowledgements of a stream of " << parts.size();
  for (size_t i = 0; i < applied; ++i) {
    const uint64_t offset = mirror(parts[i]);
    stats_.state_updates += parts[i].recurrent;
    ASSERT_EQ(result.acks[i].first, parts[i].layer) << "ack " << i;
    ASSERT_EQ(result.acks[i].second, offset) << "ack " << i;
  }
}

// One step of every layer in one stream (a recurrent layer sometimes sends a
// state that consumed no token first). Sometimes with expected_offset set
// right; sometimes one layer's message is bad (a wrong expected_offset, the
// wrong kind, or a state of the wrong size), which ends the stream there: the
// layers before it stay applied (the cache is then out of step).
void DriverCore::UpdateStep() {
  // A cache of recurrent layers only may step by 0 tokens (a state that
  // consumed none); attention layers need at least one.
  const uint64_t tokens = all_recurrent_ ? Uniform(0, 4)
                          : Chance(0.45) ? 1
                                         : Uniform(2, MaxUpdateTokens());
  if (KeepStandardLayersSmall(tokens)) return;
  const engine::CacheSpec& spec = reference_->spec();
  std::deque<StepPart> parts;
  std::vector<uint64_t> offsets = reference_->layer_offsets();
  for (uint32_t l = 0; l < reference_->num_layers(); ++l) {
    if (IsRecurrent(l) && Chance(0.1)) parts.push_back(RandomPart(spec, l, 0));
    parts.push_back(RandomPart(spec, l, tokens));
  }
  for (StepPart& part : parts) {
    if (Chance(0.25)) part.expected_offset = offsets[part.layer];
    offsets[part.layer] += part.recurrent ? part.advance : part.kv.tokens;
  }
  size_t applied = parts.size();
  if (Chance(0.06)) applied = Uniform(0, parts.size() - 1);
  if (applied < parts.size()) SpoilPart(parts[applied]);
  SendStream(parts, applied);
  ++stats_.steps;
  if (!::testing::Test::HasFailure() && !reference_->CommonOffset().has_value()) {
    ++stats_.torn_steps;
    ProbeOutOfStep();
    Repair();
  }
}

void DriverCore::SpoilPart(StepPart& bad) {
  const engine::CacheSpec& spec = reference_->spec();
  const uint64_t before = reference_->layer(bad.layer).offset();
  if (Chance(0.5)) {
    MakeWrongKind(spec, bad);
    bad.expected_offset.reset();
  } else if (bad.recurrent && Chance(0.4)) {
    // A conv or delta state two elements off.
    const bool conv = Chance(0.5);
    const int64_t wrong = Chance(0.5) ? 2 : -2;
    bad.state = RandomState(spec, bad.layer, rng_, conv ? wrong : 0, conv ? 0 : wrong);
    bad.wrong_size_field = conv ? "state.conv_state" : "state.delta_state";
  } else {
    bad.expected_offset = before > 0 && Chance(0.5) ? before - 1 : before + 1;
  }
}

// Several single-token decode steps pipelined through one stream.
void DriverCore::StreamSteps() {
  const uint64_t steps = Uniform(2, 4);
  if (KeepStandardLayersSmall(steps)) return;
  std::deque<StepPart> parts;
  for (uint64_t s = 0; s < steps; ++s) {
    for (uint32_t l = 0; l < reference_->num_layers(); ++l) {
      parts.push_back(RandomPart(reference_->spec(), l, 1));
    }
  }
  SendStream(parts, parts.size());
  stats_.steps += steps;
}

// A worker that updates one layer and stops: the cache is out of step until
// the step is finished or the cache restored.
void DriverCore::TornStep() {
  const uint64_t tokens = Chance(0.5) ? 1 : Uniform(2, MaxUpdateTokens());
  if (KeepStandardLayersSmall(tokens)) return;
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  const std::deque<StepPart> parts = {RandomPart(reference_->spec(), layer, tokens)};
  SendStream(parts, 1);
  ++stats_.torn_steps;
  ProbeOutOfStep();
  Repair();
}

void DriverCore::ProbeOutOfStep() {
  SCOPED_TRACE("out of step");
  CheckOffsets();
  ASSERT_EQ(reference_->Snapshot(0), nullptr);
  ASSERT_FALSE(reference_->Trim(0).has_value());
  const absl::Status snapshot = adapter_.Snapshot(cache_id_, 0, false).status();
  EXPECT_EQ(snapshot.code(), Code::kFailedPrecondition) << snapshot;
  EXPECT_THAT(std::string(snapshot.message()), HasSubstr("out of step"));
  const absl::Status trim = adapter_.Trim(cache_id_, 0).status();
  EXPECT_EQ(trim.code(), Code::kFailedPrecondition) << trim;
  FetchLive();  // reads still work, layer by layer
}

// Back in step: a restore (from a snapshot or a live rewind to the lowest
// layer's offset) where the reference allows it, else the missing updates.
void DriverCore::Repair() {
  const std::vector<uint64_t> offsets = reference_->layer_offsets();
  const uint64_t lowest = *std::min_element(offsets.begin(), offsets.end());
  if (!snapshots_.empty() && Chance(0.3)) {
    const TrackedSnapshot& snapshot = snapshots_[RandomSnapshotIndex()];
    CompareRestore(snapshot.id, snapshot.reference.get(), snapshot.reference->to);
  } else if (Chance(0.5)) {
    CompareRestore("", nullptr, lowest);
  }
  if (!::testing::Test::HasFailure() && !reference_->CommonOffset().has_value()) FinishStep();
}

void DriverCore::FinishStep() {
  const std::vector<uint64_t> offsets = reference_->layer_offsets();
  const uint64_t highest = *std::max_element(offsets.begin(), offsets.end());
  std::deque<StepPart> parts;
  for (uint32_t l = 0; l < offsets.size(); ++l) {
    if (offsets[l] != highest) {
      parts.push_back(RandomPart(reference_->spec(), l, highest - offsets[l]));
    }
  }
  SendStream(parts, parts.size());
  ASSERT_TRUE(reference_->CommonOffset().has_value());
}

}  // namespace kvcache::testing
