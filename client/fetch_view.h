// A Fetch chunk read without copying its tensors: the data lane hands over
// each chunk's bytes in its receive buffer, and a caller that moves keys and
// values into tensors of its own needs no FetchResponse in between (which
// would copy them once more).
#pragma once

#include <cstddef>

#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache {

// Valid only during the callback that receives it (Client::FetchViews).
struct FetchChunkView {
  // Every field of the chunk but the keys' and values' data (which read empty
  // there): layer, start, the tensors' dtypes and shapes; for packed and
  // recurrent chunks, the whole message.
  const v1::FetchResponse* header = nullptr;
  absl::Span<const std::byte> keys;
  absl::Span<const std::byte> values;
};

namespace internal {

// The fields ParseTokenChunk reads itself, by message, and the FetchResponse
// fields that make a chunk something else (packed, or a state), which it
// leaves to protobuf. A chunk holding any field outside these lists (one
// added to the schema since) goes to protobuf's parser too.
inline constexpr int kParsedTokenChunkFields[] = {
    v1::FetchResponse::kLayerFieldNumber, v1::FetchResponse::kStartFieldNumber,
    v1::FetchResponse::kKeysFieldNumber, v1::FetchResponse::kValuesFieldNumber};
inline constexpr int kTokenChunkFieldsLeftToProtobuf[] = {
    v1::FetchResponse::kPackedKeysFieldNumber, v1::FetchResponse::kPackedValuesFieldNumber,
    v1::FetchResponse::kStateFieldNumber};
inline constexpr int kParsedTensorFields[] = {
    v1::Tensor::kDtypeFieldNumber, v1::Tensor::kShapeFieldNumber, v1::Tensor::kDataFieldNumber};

// Parses a FetchResponse of keys and values from `payload` into `header`
// (its tensors' data left out) and views of the data in `payload`. False for
// anything else (packed or recurrent chunks, fields outside the lists above,
// encodings it does not take): the caller then parses with protobuf.
bool ParseTokenChunk(absl::Span<const std::byte> payload, v1::FetchResponse& header,
                     absl::Span<const std::byte>& keys, absl::Span<const std::byte>& values);

}  // namespace internal
}  // namespace kvcache
