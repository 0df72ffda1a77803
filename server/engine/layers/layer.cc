#include "engine/layers/layer.h"

namespace kvcache::engine {

absl::Status Layer::UpdateState(const StateInput&) {
  return absl::InvalidArgumentError(
      "state: this is an attention layer; send keys and values, not a recurrent state");
}

absl::Status LayerSnapshot::ReadPacked(TokenRange, const PackedOutput&) const {
  return absl::InvalidArgumentError("packed: only quantized layers have a packed form");
}

absl::Status LayerSnapshot::Mapped(TokenRange, KvMappedPieces&) const {
  return absl::FailedPreconditionError("this layer's tokens are not stored as they are read");
}

absl::Status LayerSnapshot::ReadState(const StateOutput&) const {
  return absl::InvalidArgumentError(
      "state: only recurrent layers hold a state; fetch keys and values instead");
}

}  // namespace kvcache::engine
