// Reactors of the two streaming RPCs: gRPC's transport for the Update and
// Fetch calls (update_call.h, fetch_call.h), which own every rule about them.
// Each reactor owns its state and deletes itself in OnDone, as gRPC's
// callback API expects.
#pragma once

#include <deque>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/calls/fetch_call.h"
#include "service/calls/update_call.h"
#include "service/grpc/wire_format.h"
#include "service/handlers.h"
#include "service/tenants.h"

namespace kvcache::service {

// Update: reads, applies and acknowledges requests in order. The next read is
// started as soon as a request is applied, so acknowledgements are written
// while the worker's next messages arrive. The first failing request ends the
// stream with its status, after the acknowledgements of those before it.
// Registered raw (grpc::ByteBuffer): requests are parsed from the received
// slices and the engine copies the tensors from them (wire_format.h).
class UpdateReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // Runs on the handlers of the tenant the call was admitted for.
  explicit UpdateReactor(Admitted admitted);
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  // What to start once the mutex is released (gRPC may run a reaction inline,
  // so no operation is started while holding it).
  enum class Next { kNothing, kWrite, kFinish };

  absl::StatusOr<EncodedAck> Apply();
  Next PickNext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void Start(Next next);

  const Admitted admitted_;  // counted in the tenant's requests until the call answers
  // Touched only by the read path.
  UpdateCall call_;
  grpc::ByteBuffer request_;
  ReceivedUpdate received_;
  absl::Mutex mutex_;
  std::deque<EncodedAck> acks_ ABSL_GUARDED_BY(mutex_);
  grpc::ByteBuffer writing_ack_ ABSL_GUARDED_BY(mutex_);
  grpc::WriteOptions write_options_ ABSL_GUARDED_BY(mutex_);
  bool writing_ ABSL_GUARDED_BY(mutex_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mutex_) = false;
  std::optional<grpc::Status> final_status_ ABSL_GUARDED_BY(mutex_);  // set when reads end
  bool finished_ ABSL_GUARDED_BY(mutex_) = false;
};

// Fetch: writes the call's chunks one after another. Registered raw
// (grpc::ByteBuffer), so that each chunk of keys and values is read from
// pages straight into its outgoing buffer (wire_format.h) rather than into a
// zero-filled FetchResponse that protobuf then copies again.
class FetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FetchReactor(Admitted admitted, const grpc::ByteBuffer& request);
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  void WriteNext();
  // A packed or state chunk, encoded by protobuf.
  absl::Status EncodeNext();
  void FinishFetch(const absl::Status& transport);

  const Admitted admitted_;
  FetchCall call_;
  grpc::ByteBuffer response_;
};

}  // namespace kvcache::service
