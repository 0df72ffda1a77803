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

// The fields FrameUpdate writes, by message: every one a LayerUpdate can
// carry. Tests hold these lists against the schema, so a field added to it
// is written here (and given a place in LayerUpdate) or the tests fail.
inline constexpr int kEncodedUpdateRequestFields[] = {
    v1::UpdateRequest::kCacheIdFieldNumber,       v1::UpdateRequest::kLayerFieldNumber,
    v1::UpdateRequest::kKeysFieldNumber,          v1::UpdateRequest::kValuesFieldNumber,
    v1::UpdateRequest::kStateFieldNumber,         v1::UpdateRequest::kSpeculationIdFieldNumber,
    v1::UpdateRequest::kExpectedOffsetFieldNumber};
inline constexpr int kEncodedTensorFields[] = {
    v1::Tensor::kDtypeFieldNumber, v1::Tensor::kShapeFieldNumber, v1::Tensor::kDataFieldNumber};
inline constexpr int kEncodedRecurrentStateFields[] = {v1::RecurrentState::kConvStateFieldNumber,
                                                       v1::RecurrentState::kDeltaStateFieldNumber,
                                                       v1::RecurrentState::kAdvanceFieldNumber};

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
