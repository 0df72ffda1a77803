// How a Fetch reaches the server: a gRPC Fetch call, or a Fetch call on the
// data lane (lane_client.h). Both deliver the same FetchResponse chunks, in
// order; Client::Fetch, FetchViews and FetchAll pick one transport per call
// and share what they do with the chunks.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "fetch_view.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvcache::internal {

// A tensor's bytes as a chunk's parser hands them out, where they lie in
// the parsed message (no copy).
inline absl::Span<const std::byte> BytesOf(const std::string& data) {
  return {reinterpret_cast<const std::byte*>(data.data()), data.size()};
}

// One chunk as its transport received it; valid during the callback that
// receives it.
class ReceivedChunk {
 public:
  virtual ~ReceivedChunk() = default;
  // The chunk as a message (DATA_LOSS when its bytes are not a FetchResponse).
  virtual absl::Status Take(v1::FetchResponse& out) = 0;
  // The chunk with its keys and values as views (fetch_view.h): of the bytes
  // as received where the transport can, `header` holding the other fields;
  // else of `header`'s own tensors, the whole message parsed into it.
  virtual absl::Status View(v1::FetchResponse& header, FetchChunkView& out) = 0;
};

using ChunkSink = std::function<absl::Status(ReceivedChunk&)>;

class FetchTransport {
 public:
  virtual ~FetchTransport() = default;
  // One Fetch call: its chunks to `on_chunk`, in order. Returns the first
  // error `on_chunk` returns (the call is then abandoned), else the call's
  // status.
  virtual absl::Status Fetch(const v1::FetchRequest& request, const ChunkSink& on_chunk) = 0;
};

// Fetch calls over gRPC through `stub`, each with `deadline`.
std::unique_ptr<FetchTransport> GrpcFetchTransport(v1::KvCacheService::Stub& stub,
                                                   absl::Duration deadline);

}  // namespace kvcache::internal
