// Fetch chunks encoded by hand: protobuf would have the engine read into a
// zero-filled string, then copy it once more while serialising. Here a chunk
// is one gRPC slice, the engine reads pages straight into its data fields, and
// gRPC sends the slice as it is. The bytes on the wire are protobuf's
// encoding of kvcache.v1.FetchResponse.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>

#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache::service {

// A FetchResponse in one uninitialised slice: `header` (every field but the
// keys' and values' data) encoded in protobuf's field order, with room for
// the data left where protobuf would put it. Fill keys() and values(), then
// Finish() hands the slice over without a copy.
class FetchChunkBuffer {
 public:
  FetchChunkBuffer(const v1::FetchResponse& header, uint64_t key_bytes, uint64_t value_bytes);

  absl::Span<std::byte> keys() { return At(keys_offset_, key_bytes_); }
  absl::Span<std::byte> values() { return At(values_offset_, value_bytes_); }
  grpc::ByteBuffer Finish();

 private:
  absl::Span<std::byte> At(size_t offset, uint64_t bytes);

  uint64_t key_bytes_;
  uint64_t value_bytes_;
  size_t keys_offset_ = 0;
  size_t values_offset_ = 0;
  grpc::Slice slice_;
};

}  // namespace kvcache::service
