#include "service/grpc/stream_reactors.h"

#include "core/status_macros.h"
#include "service/grpc/status_mapping.h"

namespace kvcache::service {
namespace {

// The request as gRPC's serializer reads it.
absl::StatusOr<v1::FetchRequest> ParseFetchRequest(const grpc::ByteBuffer& raw_request) {
  grpc::ByteBuffer buffer = raw_request;  // shares the slices; Deserialize consumes it
  v1::FetchRequest request;
  const grpc::Status parsed =
      grpc::SerializationTraits<v1::FetchRequest>::Deserialize(&buffer, &request);
  if (!parsed.ok()) return UnparsableRequest(v1::FetchRequest::descriptor()->full_name());
  return request;
}

}  // namespace

UpdateReactor::UpdateReactor(Admitted admitted)
    : admitted_(std::move(admitted)), call_(admitted_.handlers(), &admitted_) {
  StartRead(&request_);
}

absl::StatusOr<EncodedAck> UpdateReactor::Apply() {
  admitted_.CountReceived(Transport::kGrpc, request_.Length());
  RETURN_IF_ERROR(received_.Receive(request_));
  absl::StatusOr<EncodedAck> ack = call_.Apply(received_.pieces());
  received_.Clear();  // the engine has copied the tensors; free the slices
  return ack;
}

void UpdateReactor::OnReadDone(bool ok) {
  std::optional<absl::StatusOr<EncodedAck>> applied;  // none: the client ended its requests
  if (ok) applied = Apply();
  const bool applied_ok = applied.has_value() && applied->ok();
  Next next;
  {
    absl::MutexLock lock(&mutex_);
    if (applied_ok) {
      acks_.push_back(**applied);
    } else if (!final_status_.has_value()) {
      // A request failed, or could not be read: its status. Else the call's.
      final_status_ = ToGrpcStatus(applied.has_value() ? applied->status() : call_.Finish());
    }
    next = PickNext();
  }
  // The next read first: sending an acknowledgement may take a system call.
  if (applied_ok) StartRead(&request_);
  Start(next);
}

void UpdateReactor::OnWriteDone(bool ok) {
  Next next;
  {
    absl::MutexLock lock(&mutex_);
    writing_ = false;
    if (!ok) {
      write_failed_ = true;  // the client is gone; finish once the reads end too
      acks_.clear();
    }
    next = PickNext();
  }
  Start(next);
}

UpdateReactor::Next UpdateReactor::PickNext() {
  if (writing_ || finished_) return Next::kNothing;
  if (!acks_.empty() && !write_failed_) {
    grpc::ByteBuffer encoded = EncodeUpdateResponse(acks_.front());
    writing_ack_.Swap(&encoded);
    acks_.pop_front();
    // More to come: let gRPC hold this one back and send them together; the
    // last one, written without the hint, flushes them all.
    write_options_ = acks_.empty() ? grpc::WriteOptions() : grpc::WriteOptions().set_buffer_hint();
    writing_ = true;
    return Next::kWrite;
  }
  if (!final_status_.has_value()) return Next::kNothing;
  finished_ = true;
  return Next::kFinish;
}

// writing_ack_ and final_status_ are stable here: only PickNext changes them,
// and it returns kNothing until the write finishes (and never after kFinish).
// The thread-safety analysis cannot express that hand-off (a flag set under
// the mutex, not the mutex itself, keeps them still), and the mutex cannot be
// held here because gRPC may run a reaction inline: hence the opt-out.
void UpdateReactor::Start(Next next) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (next == Next::kWrite) StartWrite(&writing_ack_, write_options_);
  if (next == Next::kFinish) {
    admitted_.Answering();  // before the client can see the end (Admitted::Answering)
    Finish(*final_status_);
  }
}

FetchReactor::FetchReactor(Admitted admitted, const grpc::ByteBuffer& request)
    : admitted_(std::move(admitted)), call_(admitted_.handlers(), ParseFetchRequest(request), &admitted_) {
  WriteNext();
}

void FetchReactor::WriteNext() {
  if (!call_.has_next()) {
    FinishFetch(absl::OkStatus());
    return;
  }
  const absl::Status filled = call_.next_is_tokens() ? ReadNextChunk(call_, response_) : EncodeNext();
  if (!filled.ok()) {
    FinishFetch(filled);
    return;
  }
  admitted_.CountSent(Transport::kGrpc, response_.Length());
  StartWrite(&response_);
}

absl::Status FetchReactor::EncodeNext() {
  v1::FetchResponse chunk;
  RETURN_IF_ERROR(call_.FillNext(chunk));
  bool own_buffer = false;
  // The serializer writes only into an empty buffer (gRPC asserts it), and
  // response_ still holds the previous chunk once that write is done.
  response_.Clear();
  const grpc::Status encoded =
      grpc::SerializationTraits<v1::FetchResponse>::Serialize(chunk, &response_, &own_buffer);
  if (encoded.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(encoded.error_code()), encoded.error_message());
}

// FetchCall::Finish lets go of the plan's pages before it returns the status.
void FetchReactor::FinishFetch(const absl::Status& transport) {
  const grpc::Status status = ToGrpcStatus(call_.Finish(transport));
  admitted_.Answering();
  Finish(status);
}

void FetchReactor::OnWriteDone(bool ok) {
  if (!ok) {
    FinishFetch(absl::CancelledError("the client stopped reading"));
    return;
  }
  WriteNext();
}

}  // namespace kvcache::service
