// WireDriver's Update streams: whole steps (tokens for attention layers, new
// states for recurrent ones) in one stream, pipelined decode steps, streams
// that one bad message ends part way (a wrong expected_offset, or an update of
// the wrong kind for its layer), torn steps and their repair.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "chunked_recurrent_test_util.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference_quantized.h"
#include "wire_driver.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;
using Code = absl::StatusCode;

}  // namespace

WireDriver::StepPart WireDriver::RandomPart(const engine::CacheSpec& spec, uint32_t layer,
                                            uint64_t tokens) {
  StepPart part{.layer = layer, .recurrent = engine::IsRecurrent(spec.layers[layer])};
  if (part.recurrent) {
    part.state = RandomState(spec, layer, rng_);
    part.advance = tokens;
  } else {
    part.kv = RandomLayerKv(spec, layer, tokens, rng_);
  }
  return part;
}

void WireDriver::MakeWrongKind(const engine::CacheSpec& spec, StepPart& part) {
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
    // A state as a recurrent layer of the cache would take, or a small one.
    part.state = RefState{.conv = std::vector<std::byte>(spec.batch_size * 12, std::byte{1}),
                          .delta = std::vector<std::byte>(spec.batch_size * 8, std::byte{2})};
    part.advance = part.kv.tokens;
  }
}

LayerUpdate WireDriver::UpdateOf(const engine::CacheSpec& spec, const StepPart& part) {
  if (part.recurrent == part.wrong_kind) {
    // Tokens: right for an attention layer; for a recurrent one, wrong.
    if (!part.wrong_kind) return MakeLayerUpdate(spec, part.layer, part.kv);
    const uint64_t b = spec.batch_size;
    return LayerUpdate{.layer = part.layer,
                       .dtype = static_cast<v1::DType>(spec.dtype),
                       .keys_shape = {b, 1, part.kv.tokens, 4},
                       .keys = part.kv.keys,
                       .values_shape = {b, 1, part.kv.tokens, 4},
                       .values = part.kv.values};
  }
  if (!part.wrong_kind) return MakeStateUpdate(spec, part.layer, part.state, part.advance);
  const uint64_t b = spec.batch_size;
  const uint64_t elem = DTypeSize(spec.dtype);
  return LayerUpdate{.layer = part.layer,
                     .dtype = static_cast<v1::DType>(spec.dtype),
                     .state = RecurrentStateUpdate{.conv_shape = {b, 12 / elem},
                                                   .conv = part.state.conv,
                                                   .delta_shape = {b, 8 / elem},
                                                   .delta = part.state.delta,
                                                   .advance = part.advance}};
}

std::vector<LayerUpdate> WireDriver::UpdatesOf(const engine::CacheSpec& spec,
                                               const std::deque<StepPart>& parts) {
  std::vector<LayerUpdate> updates;
  for (const StepPart& part : parts) updates.push_back(UpdateOf(spec, part));
  return updates;
}

void WireDriver::ApplyTo(RefCache& reference, const StepPart& part) {
  if (part.recurrent) {
    reference.UpdateState(part.layer, part.state, part.advance);
    return;
  }
  reference.Update(part.layer, TokensFromTensors(ShapeOf(reference.spec(), part.layer),
                                                 part.kv.keys, part.kv.values, part.kv.tokens));
}

void WireDriver::SendStream(const std::vector<LayerUpdate>& updates,
                            const std::deque<StepPart>& parts, size_t applied) {
  SendStream(updates, parts, applied, [this](const StepPart& part) {
    ApplyTo(*reference_, part);
    return reference_->layer(part.layer).offset();
  });
}

void WireDriver::SendStream(const std::vector<LayerUpdate>& updates,
                            const std::deque<StepPart>& parts, size_t applied,
                            const Mirror& mirror) {
  absl::Status status;
  std::vector<v1::UpdateResponse> acks;
  if (applied == updates.size() && Chance(0.5)) {
    absl::StatusOr<std::vector<v1::UpdateResponse>> result = client_.Update(cache_id_, updates);
    status = result.status();
    if (result.ok()) acks = *std::move(result);
  } else {
    std::unique_ptr<UpdateStream> stream = client_.OpenUpdate(cache_id_);
    for (const LayerUpdate& update : updates) {
      if (!stream->Write(update)) break;  // the server has ended the stream
    }
    status = stream->Finish().status();
    acks = stream->acknowledged();
  }
  if (applied == updates.size()) {
    ASSERT_TRUE(status.ok()) << status;
  } else if (parts[applied].wrong_kind) {
    ASSERT_EQ(status.code(), Code::kInvalidArgument) << status;
    // The field that should not be there: keys for a recurrent layer.
    EXPECT_THAT(std::string(status.message()),
                HasSubstr(parts[applied].recurrent ? "keys" : "state"));
    ++stats_.wrong_kind_streams;
  } else if (parts[applied].live) {
    ASSERT_EQ(status.code(), Code::kFailedPrecondition) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("speculation is open"));
    ++stats_.speculation_refusals;
  } else {
    ASSERT_EQ(status.code(), Code::kFailedPrecondition) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("expected_offset"));
    ++stats_.failed_streams;
  }
  ASSERT_EQ(acks.size(), applied) << "acknowledgements of a stream of " << updates.size();
  for (size_t i = 0; i < applied; ++i) {
    const uint64_t offset = mirror(parts[i]);
    stats_.state_updates += parts[i].recurrent;
    ASSERT_EQ(acks[i].layer(), updates[i].layer) << "ack " << i;
    ASSERT_EQ(acks[i].offset(), offset) << "ack " << i;
  }
}

// One step of every layer in one stream. Sometimes with expected_offset set
// right; sometimes one layer's message is bad (a wrong expected_offset, or the
// wrong kind), which ends the stream there: the layers before it stay applied
// (the cache is then out of step).
void WireDriver::UpdateStep() {
  // A cache of recurrent layers only may step by 0 tokens (a state that
  // consumed none); attention layers need at least one.
  const uint64_t tokens = all_recurrent_ ? Uniform(0, 4)
                          : Chance(0.45) ? 1
                                         : Uniform(2, MaxUpdateTokens());
  if (KeepStandardLayersSmall(tokens)) return;
  const engine::CacheSpec& spec = reference_->spec();
  const uint32_t layers = reference_->num_layers();
  std::deque<StepPart> parts;
  for (uint32_t l = 0; l < layers; ++l) parts.push_back(RandomPart(spec, l, tokens));
  size_t applied = layers;
  if (Chance(0.06)) applied = Uniform(0, layers - 1);
  if (applied < layers && Chance(0.5)) MakeWrongKind(spec, parts[applied]);
  std::vector<LayerUpdate> updates = UpdatesOf(spec, parts);
  for (uint32_t l = 0; l < layers; ++l) {
    if (Chance(0.25)) updates[l].expected_offset = reference_->layer(l).offset();
  }
  if (applied < layers && !parts[applied].wrong_kind) {
    const uint64_t before = reference_->layer(applied).offset();
    updates[applied].expected_offset = before > 0 && Chance(0.5) ? before - 1 : before + 1;
  }
  SendStream(updates, parts, applied);
  ++stats_.steps;
  if (!::testing::Test::HasFailure() && !reference_->CommonOffset().has_value()) {
    ++stats_.torn_steps;
    ProbeOutOfStep();
    Repair();
  }
}

// Several single-token decode steps pipelined through one stream.
void WireDriver::StreamSteps() {
  const uint64_t steps = Uniform(2, 4);
  if (KeepStandardLayersSmall(steps)) return;
  const engine::CacheSpec& spec = reference_->spec();
  std::deque<StepPart> parts;
  for (uint64_t s = 0; s < steps; ++s) {
    for (uint32_t l = 0; l < reference_->num_layers(); ++l) parts.push_back(RandomPart(spec, l, 1));
  }
  SendStream(UpdatesOf(spec, parts), parts, parts.size());
  stats_.steps += steps;
}

// A worker that updates one layer and stops: the cache is out of step until
// the step is finished or the cache restored.
void WireDriver::TornStep() {
  const uint64_t tokens = Chance(0.5) ? 1 : Uniform(2, MaxUpdateTokens());
  if (KeepStandardLayersSmall(tokens)) return;
  const uint32_t layer = Uniform(0, reference_->num_layers() - 1);
  const std::deque<StepPart> parts = {RandomPart(reference_->spec(), layer, tokens)};
  SendStream(UpdatesOf(reference_->spec(), parts), parts, 1);
  ++stats_.torn_steps;
  ProbeOutOfStep();
  Repair();
}

void WireDriver::ProbeOutOfStep() {
  SCOPED_TRACE("out of step");
  CheckOffsets();
  ASSERT_EQ(reference_->Snapshot(0), nullptr);
  ASSERT_FALSE(reference_->Trim(0).has_value());
  const absl::Status snapshot = client_.Snapshot(cache_id_, 0).status();
  EXPECT_EQ(snapshot.code(), Code::kFailedPrecondition) << snapshot;
  EXPECT_THAT(std::string(snapshot.message()), HasSubstr("out of step"));
  const absl::Status trim = client_.Trim(cache_id_, 0).status();
  EXPECT_EQ(trim.code(), Code::kFailedPrecondition) << trim;
  FetchLive();  // reads still work, layer by layer
}

// Back in step: a restore (from a snapshot or a live rewind to the lowest
// layer's offset) where the reference allows it, else the missing updates.
void WireDriver::Repair() {
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

void WireDriver::FinishStep() {
  const std::vector<uint64_t> offsets = reference_->layer_offsets();
  const uint64_t highest = *std::max_element(offsets.begin(), offsets.end());
  std::deque<StepPart> parts;
  for (uint32_t l = 0; l < offsets.size(); ++l) {
    if (offsets[l] != highest)
      parts.push_back(RandomPart(reference_->spec(), l, highest - offsets[l]));
  }
  SendStream(UpdatesOf(reference_->spec(), parts), parts, parts.size());
  ASSERT_TRUE(reference_->CommonOffset().has_value());
}

}  // namespace kvcache::testing
