// UpdateRequests encoded by hand into gRPC slices, so a step's tensors are
// copied once (into the message) or not at all (referenced where they lie),
// instead of twice (into a protobuf message, then by its serialiser). The
// bytes are protobuf's encoding of kvcache.v1.UpdateRequest.
#pragma once

#include <grpcpp/support/byte_buffer.h>

#include <memory>
#include <string>
#include <vector>

#include "kvcache_client.h"

namespace kvcache::internal {

// An UpdateRequest as runs of [framing][data]: the framing bytes built here,
// the data the caller's tensors, where they lie. Their concatenation is the
// message; the encoders below and the data lane send it from these runs.
struct UpdateRun {
  std::string framing;
  absl::Span<const std::byte> data;
};
std::vector<UpdateRun> FrameUpdate(const std::string& cache_id, const LayerUpdate& update);

// One slice holding the whole request: the tensors are copied once.
grpc::ByteBuffer EncodeUpdateCopy(const std::string& cache_id, const LayerUpdate& update);

// The tensors are referenced, not copied: gRPC holds `owner` until it has
// written them to the socket, so whatever `owner` keeps alive must hold
// update.keys and update.values (and the state's conv and delta) unchanged
// until then.
grpc::ByteBuffer EncodeUpdateShared(const std::string& cache_id, const LayerUpdate& update,
                                    std::shared_ptr<const void> owner);

}  // namespace kvcache::internal
