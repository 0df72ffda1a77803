// TensorBytes (engine/layers/layer.h), apart from the layers so that code that only
// reads requests (the Update parser and its fuzzer) links without them.
#include <cstring>

#include "engine/layers/layer.h"

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

}  // namespace kvcache::engine
