// How an UpdateStream reaches the server: a gRPC Update call, or an Update
// call on the data lane (lane_client.h). Both send the same UpdateRequests and
// collect the same acknowledgements.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvcache_client.h"

namespace kvcache::internal {

class UpdateTransport {
 public:
  virtual ~UpdateTransport() = default;

  // Sends one request. With `owner`, the tensors may be sent from where they
  // lie after this returns, until `owner` is dropped; without, they are not
  // used after it. False once the call is known to have broken (Finish tells
  // why); a transport may learn it a few messages late.
  virtual bool Write(const LayerUpdate& update, const std::shared_ptr<const void>* owner) = 0;
  // Ends the call: waits for every acknowledgement and the final status.
  virtual absl::Status Finish() = 0;
  // Abandons the call (before a Finish).
  virtual void Cancel() = 0;
  // Takes the acknowledgements that have arrived, where no thread of the
  // transport's own does; safe to call while another thread writes.
  virtual void CollectAcks() {}

  uint64_t ack_count() const { return ack_count_.load(std::memory_order_relaxed); }
  // Filled by the transport's reader until Finish returns.
  const std::vector<v1::UpdateResponse>& acks() const { return acks_; }

 protected:
  void AddAck(const v1::UpdateResponse& ack) {
    acks_.push_back(ack);
    ack_count_.fetch_add(1, std::memory_order_relaxed);
  }

 private:
  std::vector<v1::UpdateResponse> acks_;
  std::atomic<uint64_t> ack_count_{0};
};

// An Update call over gRPC on `channel`, for requests of `cache_id`.
std::unique_ptr<UpdateTransport> OpenGrpcUpdate(grpc::ChannelInterface& channel,
                                                const grpc::internal::RpcMethod& method,
                                                std::string cache_id, absl::Duration deadline);

}  // namespace kvcache::internal
