#include "engine/layer.h"

#include <cstring>

namespace kvcache::engine {

void TensorBytes::Append(absl::Span<const std::byte> piece) {
  if (piece.empty()) return;
  pieces_.push_back(piece);
  size_ += piece.size();
}

void TensorBytes::CopyTo(uint64_t offset, absl::Span<std::byte> dst) const {
  std::byte* out = dst.data();
  ForEachPart(offset, dst.size(), [&](absl::Span<const std::byte> part) {
    std::memcpy(out, part.data(), part.size());
    out += part.size();
  });
}

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
