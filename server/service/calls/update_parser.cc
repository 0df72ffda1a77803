#include "service/calls/update_parser.h"

#include <algorithm>
#include <utility>

namespace kvcache::service {

PieceReader::PieceReader(absl::Span<const absl::Span<const std::byte>> pieces) : pieces_(pieces) {
  for (const absl::Span<const std::byte>& piece : pieces_) size_ += piece.size();
}

bool PieceReader::NextByte(uint8_t& byte) {
  while (piece_ < pieces_.size() && offset_ == pieces_[piece_].size()) {
    ++piece_;
    offset_ = 0;
  }
  if (piece_ == pieces_.size()) return false;
  byte = static_cast<uint8_t>(pieces_[piece_][offset_++]);
  ++position_;
  return true;
}

bool PieceReader::ReadVarint(int max_bytes, uint64_t& value) {
  value = 0;
  for (int i = 0; i < max_bytes; ++i) {
    uint8_t byte = 0;
    if (!NextByte(byte)) return false;
    if (i == 9 && byte > 1) return false;  // bits past 63
    value |= uint64_t{byte & 0x7fu} << (7 * i);
    if (byte < 0x80) return true;
  }
  return false;
}

template <typename Visit>
bool PieceReader::Consume(uint64_t bytes, Visit&& visit) {
  if (bytes > size_ - position_) return false;
  position_ += bytes;
  while (bytes > 0) {
    const absl::Span<const std::byte>& piece = pieces_[piece_];
    const uint64_t take = std::min<uint64_t>(bytes, piece.size() - offset_);
    if (take > 0) visit(piece.subspan(offset_, take));
    offset_ += take;
    bytes -= take;
    if (offset_ == piece.size()) {
      ++piece_;
      offset_ = 0;
    }
  }
  return true;
}

bool PieceReader::ReadPieces(uint64_t bytes, engine::TensorBytes& out) {
  return Consume(bytes, [&](absl::Span<const std::byte> part) { out.Append(part); });
}

bool PieceReader::ReadString(uint64_t bytes, std::string& out) {
  out.clear();
  out.reserve(bytes);
  return Consume(bytes, [&](absl::Span<const std::byte> part) {
    out.append(reinterpret_cast<const char*>(part.data()), part.size());
  });
}

namespace {

// The wire types of the fields parsed here.
constexpr int kWireTypeVarint = 0, kWireTypeLengthDelimited = 2;
// Longest encodings protobuf accepts for tags and lengths, and for values.
constexpr int kTagBytes = 5, kValueBytes = 10;

struct Tag {
  uint32_t field = 0;
  int wire_type = 0;
};

using Request = v1::UpdateRequest;
using State = v1::RecurrentState;
using Tensor = v1::Tensor;

// A recursive-descent parser over the pieces. Every method returns false for
// what it leaves to protobuf, a field it does not read included (the fields
// read are those of kParsed*Fields); `end` is where the enclosing message ends.
class UpdateParser {
 public:
  explicit UpdateParser(absl::Span<const absl::Span<const std::byte>> pieces) : in_(pieces) {}

  bool Parse(UpdateView& out) {
    const uint64_t end = in_.size();
    Tag tag;
    while (in_.position() < end) {
      if (!NextTag(end, tag) || !ParseUpdateField(tag, end, out)) return false;
    }
    return true;
  }

 private:
  bool NextTag(uint64_t end, Tag& tag) {
    uint64_t value = 0;
    if (!in_.ReadVarint(kTagBytes, value) || in_.position() > end) return false;
    if (value > UINT32_MAX || (value >> 3) == 0) return false;
    tag = {static_cast<uint32_t>(value >> 3), static_cast<int>(value & 7)};
    return true;
  }

  bool ReadValue(uint64_t end, uint64_t& value) {
    return in_.ReadVarint(kValueBytes, value) && in_.position() <= end;
  }

  // A length prefix whose bytes all lie before `end`.
  bool ReadLength(uint64_t end, uint64_t& length) {
    return in_.ReadVarint(kTagBytes, length) && in_.position() <= end &&
           length <= end - in_.position();
  }

  bool ParseUpdateField(const Tag& tag, uint64_t end, UpdateView& out) {
    uint64_t value = 0;
    switch (tag.field) {
      case Request::kCacheIdFieldNumber:
        return tag.wire_type == kWireTypeLengthDelimited && ParseAscii(end, out.cache_id);
      case Request::kLayerFieldNumber:
        if (tag.wire_type != kWireTypeVarint || !ReadValue(end, value)) return false;
        out.layer = static_cast<uint32_t>(value);  // protobuf keeps the low 32 bits
        return true;
      case Request::kKeysFieldNumber:
        return tag.wire_type == kWireTypeLengthDelimited && ParseTensorOnce(end, out.keys);
      case Request::kValuesFieldNumber:
        return tag.wire_type == kWireTypeLengthDelimited && ParseTensorOnce(end, out.values);
      case Request::kStateFieldNumber:
        return tag.wire_type == kWireTypeLengthDelimited && ParseStateOnce(end, out.state);
      case Request::kSpeculationIdFieldNumber:
        return tag.wire_type == kWireTypeLengthDelimited && ParseAscii(end, out.speculation_id);
      case Request::kExpectedOffsetFieldNumber:
        if (tag.wire_type != kWireTypeVarint || !ReadValue(end, value)) return false;
        out.expected_offset = value;
        return true;
      default:
        return false;
    }
  }

  // A string field (the last one wins, as in protobuf). Non-ASCII text is left
  // to protobuf, whose UTF-8 check decides whether the message parses.
  bool ParseAscii(uint64_t end, std::string& out) {
    uint64_t length = 0;
    if (!ReadLength(end, length) || !in_.ReadString(length, out)) return false;
    return std::all_of(out.begin(), out.end(), [](char c) { return (c & 0x80) == 0; });
  }

  // A message field seen for the first time (protobuf merges repeats).
  bool ParseTensorOnce(uint64_t end, std::optional<TensorView>& out) {
    uint64_t length = 0;
    if (out.has_value() || !ReadLength(end, length)) return false;
    return ParseTensor(in_.position() + length, out.emplace());
  }

  bool ParseStateOnce(uint64_t end, std::optional<StateView>& out) {
    uint64_t length = 0;
    if (out.has_value() || !ReadLength(end, length)) return false;
    return ParseState(in_.position() + length, out.emplace());
  }

  bool ParseTensor(uint64_t end, TensorView& out) {
    bool seen_data = false;
    uint64_t value = 0;
    Tag tag;
    while (in_.position() < end) {
      if (!NextTag(end, tag)) return false;
      bool ok = false;  // stays false for a field not read here
      switch (tag.field) {
        case Tensor::kDtypeFieldNumber:
          ok = tag.wire_type == kWireTypeVarint && ReadValue(end, value);
          out.dtype = static_cast<int32_t>(value);  // an open enum: any int32 is kept
          break;
        case Tensor::kShapeFieldNumber:
          ok = ParseShapeField(tag, end, out.shape);
          break;
        case Tensor::kDataFieldNumber:
          ok = !seen_data && tag.wire_type == kWireTypeLengthDelimited && ReadLength(end, value) &&
               in_.ReadPieces(value, out.data);
          seen_data = true;
          break;
      }
      if (!ok) return false;
    }
    return true;
  }

  // repeated uint64: one value, or a packed run of them.
  bool ParseShapeField(const Tag& tag, uint64_t end, absl::InlinedVector<uint64_t, 4>& shape) {
    uint64_t value = 0;
    if (tag.wire_type == kWireTypeVarint) {
      if (!ReadValue(end, value)) return false;
      shape.push_back(value);
      return true;
    }
    if (tag.wire_type != kWireTypeLengthDelimited || !ReadLength(end, value)) return false;
    const uint64_t packed_end = in_.position() + value;
    while (in_.position() < packed_end) {
      if (!ReadValue(packed_end, value)) return false;
      shape.push_back(value);
    }
    return true;
  }

  bool ParseState(uint64_t end, StateView& out) {
    std::optional<TensorView> conv, delta;
    uint64_t value = 0;
    Tag tag;
    while (in_.position() < end) {
      if (!NextTag(end, tag)) return false;
      bool ok = false;  // stays false for a field not read here
      switch (tag.field) {
        case State::kConvStateFieldNumber:
        case State::kDeltaStateFieldNumber:
          ok = tag.wire_type == kWireTypeLengthDelimited &&
               ParseTensorOnce(end, tag.field == State::kConvStateFieldNumber ? conv : delta);
          break;
        case State::kAdvanceFieldNumber:
          ok = tag.wire_type == kWireTypeVarint && ReadValue(end, value);
          out.advance = value;
          break;
      }
      if (!ok) return false;
    }
    if (conv.has_value()) out.conv_state = *std::move(conv);
    if (delta.has_value()) out.delta_state = *std::move(delta);
    return true;
  }

  PieceReader in_;
};

}  // namespace

bool ParseUpdateRequest(absl::Span<const absl::Span<const std::byte>> pieces, UpdateView& out) {
  return UpdateParser(pieces).Parse(out);
}

}  // namespace kvcache::service
