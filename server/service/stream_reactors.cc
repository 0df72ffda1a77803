#include "service/stream_reactors.h"

#include "core/status_macros.h"
#include "service/status_mapping.h"
#include "service/wire_format.h"

namespace kvcache::service {

UpdateReactor::UpdateReactor(Handlers& handlers) : handlers_(handlers) { StartRead(&request_); }

// A stream usually feeds one cache; its spec is looked up once, not per
// message (Handlers::Update keeps it in known_spec_).
absl::Status UpdateReactor::Apply(v1::UpdateResponse* response) {
  RETURN_IF_ERROR(received_.Parse(request_));
  return handlers_.Update(received_.view(), &known_spec_, response);
}

void UpdateReactor::OnReadDone(bool ok) {
  absl::Status status = absl::OkStatus();
  v1::UpdateResponse ack;
  if (ok) {
    status = Apply(&ack);
    received_.Clear();  // the engine has copied the tensors; free the slices
  }
  Next next;
  {
    absl::MutexLock lock(&mutex_);
    if (!ok || !status.ok()) {
      if (!final_status_.has_value()) final_status_ = ToGrpcStatus(status);
    } else {
      acks_.push_back(std::move(ack));
    }
    next = PickNext();
  }
  // The next read first: sending an acknowledgement may take a system call.
  if (ok && status.ok()) StartRead(&request_);
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
  if (next == Next::kFinish) Finish(*final_status_);
}

FetchReactor::FetchReactor(Handlers& handlers, const grpc::ByteBuffer& raw_request)
    : handlers_(handlers) {
  grpc::ByteBuffer buffer = raw_request;  // shares the slices; Deserialize consumes it
  v1::FetchRequest request;
  const grpc::Status parsed =
      grpc::SerializationTraits<v1::FetchRequest>::Deserialize(&buffer, &request);
  if (!parsed.ok()) {
    Finish(parsed);
    return;
  }
  absl::StatusOr<FetchPlan> plan = handlers_.PlanFetch(request);
  if (!plan.ok()) {
    Finish(ToGrpcStatus(plan.status()));
    return;
  }
  plan_ = *std::move(plan);
  WriteNext();
}

void FetchReactor::WriteNext() {
  if (next_ == plan_.chunks.size()) {
    FinishFetch(grpc::Status::OK);
    return;
  }
  if (plan_.chunks[next_].form != FetchPlan::Form::kTokens) {
    WriteEncoded();
    return;
  }
  v1::FetchResponse header;
  uint64_t key_bytes = 0, value_bytes = 0;
  handlers_.FetchChunkHeader(plan_, next_, &header, &key_bytes, &value_bytes);
  FetchChunkBuffer chunk(header, key_bytes, value_bytes);
  const absl::Status status =
      handlers_.ReadFetchChunk(plan_, next_++, {.keys = chunk.keys(), .values = chunk.values()});
  if (!status.ok()) {
    FinishFetch(ToGrpcStatus(status));
    return;
  }
  response_ = chunk.Finish();
  StartWrite(&response_);
}

void FetchReactor::WriteEncoded() {
  v1::FetchResponse chunk;
  const absl::Status status = handlers_.FillFetchChunk(plan_, next_++, &chunk);
  if (!status.ok()) {
    FinishFetch(ToGrpcStatus(status));
    return;
  }
  bool own_buffer = false;
  // The serializer writes only into an empty buffer (gRPC asserts it), and
  // response_ still holds the previous chunk once that write is done.
  response_.Clear();
  const grpc::Status encoded =
      grpc::SerializationTraits<v1::FetchResponse>::Serialize(chunk, &response_, &own_buffer);
  if (!encoded.ok()) {
    FinishFetch(encoded);
    return;
  }
  StartWrite(&response_);
}

// The plan's page references go before the status: a client that frees the
// cache on seeing it finds every page back.
void FetchReactor::FinishFetch(const grpc::Status& status) {
  plan_.view.reset();
  Finish(status);
}

void FetchReactor::OnWriteDone(bool ok) {
  if (!ok) {
    FinishFetch(grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading"));
    return;
  }
  WriteNext();
}

}  // namespace kvcache::service
