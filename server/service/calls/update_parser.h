// kvcache.v1.UpdateRequest parsed straight from the pieces a message arrived
// in (gRPC's receive slices, cut anywhere), the tensors' data left where it
// lies: protobuf would first gather each bytes field into one string, a pass
// over every byte of K/V (15 % of the server's CPU at 1 MiB per message).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"
#include "service/update_view.h"

namespace kvcache::service {

// Reads protobuf's wire format from a list of pieces that read as their
// concatenation. Every call returns false, leaving the position unspecified,
// when the input ends too soon or an encoding is longer than protobuf allows.
class PieceReader {
 public:
  explicit PieceReader(absl::Span<const absl::Span<const std::byte>> pieces);

  uint64_t position() const { return position_; }
  uint64_t size() const { return size_; }
  // A varint of at most `max_bytes` bytes (5 for tags and lengths, 10 for
  // values, whose 10th byte may hold only bit 63).
  bool ReadVarint(int max_bytes, uint64_t& value);
  // The next `bytes` bytes, appended to `out` as spans into the pieces.
  bool ReadPieces(uint64_t bytes, engine::TensorBytes& out);
  bool ReadString(uint64_t bytes, std::string& out);

 private:
  // Calls visit(span) on each piece of the next `bytes` bytes and moves past them.
  template <typename Visit>
  bool Consume(uint64_t bytes, Visit&& visit);
  bool NextByte(uint8_t& byte);

  absl::Span<const absl::Span<const std::byte>> pieces_;
  size_t piece_ = 0;    // the piece the position is in
  uint64_t offset_ = 0;  // the position within it
  uint64_t position_ = 0;
  uint64_t size_ = 0;
};

// The fields ParseUpdateRequest reads itself, by message. A message holding
// any other field (one added to the schema since, or one this build does not
// know) goes whole to protobuf's parser, so no field is ever skipped here.
inline constexpr int kParsedUpdateRequestFields[] = {
    v1::UpdateRequest::kCacheIdFieldNumber,       v1::UpdateRequest::kLayerFieldNumber,
    v1::UpdateRequest::kKeysFieldNumber,          v1::UpdateRequest::kValuesFieldNumber,
    v1::UpdateRequest::kStateFieldNumber,         v1::UpdateRequest::kSpeculationIdFieldNumber,
    v1::UpdateRequest::kExpectedOffsetFieldNumber};
inline constexpr int kParsedTensorFields[] = {v1::Tensor::kDtypeFieldNumber,
                                              v1::Tensor::kShapeFieldNumber,
                                              v1::Tensor::kDataFieldNumber};
inline constexpr int kParsedRecurrentStateFields[] = {v1::RecurrentState::kConvStateFieldNumber,
                                                      v1::RecurrentState::kDeltaStateFieldNumber,
                                                      v1::RecurrentState::kAdvanceFieldNumber};

// Parses an UpdateRequest from `pieces` into `out` (a fresh UpdateView), the
// tensors' data pointing into the pieces. Returns false, `out` then being
// unspecified, for what it leaves to protobuf's own parser: malformed input,
// a field outside the lists above, and the rare encodings whose rules it does
// not reproduce (a message or bytes field present twice, which protobuf
// merges; a known field with another wire type; a non-ASCII cache_id, which
// protobuf checks as UTF-8; varints longer than their canonical limit).
// Whatever it accepts, it parses to exactly what protobuf would.
bool ParseUpdateRequest(absl::Span<const absl::Span<const std::byte>> pieces, UpdateView& out);

}  // namespace kvcache::service
