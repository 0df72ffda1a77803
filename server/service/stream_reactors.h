// Reactors of the two streaming RPCs. Each owns its state and deletes itself
// in OnDone, as gRPC's callback API expects.
#pragma once

#include <deque>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/handlers.h"
#include "service/wire_format.h"

namespace kvcache::service {

// Update: reads, applies and acknowledges requests in order. The next read is
// started as soon as a request is applied, so acknowledgements are written
// while the worker's next messages arrive. The first failing request ends the
// stream with its status, after the acknowledgements of those before it.
// Registered raw (grpc::ByteBuffer): requests are parsed from the received
// slices and the engine copies the tensors from them (wire_format.h).
class UpdateReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit UpdateReactor(Handlers& handlers);
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  // What to start once the mutex is released (gRPC may run a reaction inline,
  // so no operation is started while holding it).
  enum class Next { kNothing, kWrite, kFinish };

  absl::Status Apply(v1::UpdateResponse* response);
  Next PickNext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  void Start(Next next);

  Handlers& handlers_;
  // Touched only by the read path.
  grpc::ByteBuffer request_;
  ReceivedUpdate received_;
  KnownSpec known_spec_;  // of the cache last written to
  absl::Mutex mutex_;
  std::deque<v1::UpdateResponse> acks_ ABSL_GUARDED_BY(mutex_);
  grpc::ByteBuffer writing_ack_ ABSL_GUARDED_BY(mutex_);
  grpc::WriteOptions write_options_ ABSL_GUARDED_BY(mutex_);
  bool writing_ ABSL_GUARDED_BY(mutex_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mutex_) = false;
  std::optional<grpc::Status> final_status_ ABSL_GUARDED_BY(mutex_);  // set when reads end
  bool finished_ ABSL_GUARDED_BY(mutex_) = false;
};

// Fetch: plans the chunks from one consistent view, then fills and writes them
// one after another. Registered raw (grpc::ByteBuffer), so that each chunk is
// read from pages straight into its outgoing buffer (wire_format.h) rather
// than into a zero-filled FetchResponse that protobuf then copies again.
class FetchReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FetchReactor(Handlers& handlers, const grpc::ByteBuffer& request);
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  void WriteNext();
  // A packed or state chunk, encoded by protobuf.
  void WriteEncoded();
  void FinishFetch(const grpc::Status& status);

  Handlers& handlers_;
  FetchPlan plan_;
  size_t next_ = 0;
  grpc::ByteBuffer response_;
};

}  // namespace kvcache::service
