// An UpdateRequest as the Update handler reads it: every field of
// kvcache.v1.UpdateRequest, with the tensors' data as engine::TensorBytes that
// point into memory owned elsewhere. The Update stream fills it straight from
// gRPC's receive slices (update_parser.h), so a tensor's bytes are never
// gathered into one string; a parsed v1::UpdateRequest converts with ViewOf.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/container/inlined_vector.h"
#include "engine/layers/layer.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache::service {

// kvcache.v1.Tensor.
struct TensorView {
  int32_t dtype = 0;  // a v1::DType value as received (proto3 enums are open)
  absl::InlinedVector<uint64_t, 4> shape;
  engine::TensorBytes data;
};

// kvcache.v1.RecurrentState.
struct StateView {
  TensorView conv_state;
  TensorView delta_state;
  uint64_t advance = 0;
};

// kvcache.v1.UpdateRequest. The message fields are set when they were present
// on the wire (protobuf's has_keys() and so on), even if empty.
struct UpdateView {
  std::string cache_id;
  uint32_t layer = 0;
  std::optional<TensorView> keys;
  std::optional<TensorView> values;
  std::optional<StateView> state;
  std::optional<uint64_t> expected_offset;
  std::string speculation_id;  // empty: the live cache
};

// A view of `request`, whose tensors' data it points into: `request` must
// outlive it, unchanged.
UpdateView ViewOf(const v1::UpdateRequest& request);

}  // namespace kvcache::service
