#include "service/stream_reactors.h"

#include "core/status_macros.h"
#include "service/status_mapping.h"

namespace kvcache::service {

UpdateReactor::UpdateReactor(Handlers& handlers) : handlers_(handlers) { StartRead(&request_); }

// A stream usually feeds one cache; its spec is looked up once, not per message.
absl::Status UpdateReactor::Apply(v1::UpdateResponse* response) {
  if (request_.cache_id() != spec_cache_id_ || spec_cache_id_.empty()) {
    if (request_.cache_id().empty()) return absl::InvalidArgumentError("cache_id: required");
    ASSIGN_OR_RETURN(spec_, handlers_.engine().GetSpec(request_.cache_id()));
    spec_cache_id_ = request_.cache_id();
  }
  return handlers_.Update(request_, &spec_, response);
}

void UpdateReactor::OnReadDone(bool ok) {
  absl::Status status = absl::OkStatus();
  v1::UpdateResponse ack;
  if (ok) status = Apply(&ack);
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
  Start(next);
  if (ok && status.ok()) StartRead(&request_);
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
    writing_ack_ = std::move(acks_.front());
    acks_.pop_front();
    writing_ = true;
    return Next::kWrite;
  }
  if (!final_status_.has_value()) return Next::kNothing;
  finished_ = true;
  return Next::kFinish;
}

// writing_ack_ and final_status_ are stable here: only PickNext changes them,
// and it returns kNothing until the write finishes (and never after kFinish).
void UpdateReactor::Start(Next next) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (next == Next::kWrite) StartWrite(&writing_ack_);
  if (next == Next::kFinish) Finish(*final_status_);
}

FetchReactor::FetchReactor(Handlers& handlers, const v1::FetchRequest& request)
    : handlers_(handlers) {
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
    plan_.view.reset();  // drop the page references before the stream closes
    Finish(grpc::Status::OK);
    return;
  }
  response_.Clear();
  const absl::Status status = handlers_.FillFetchChunk(plan_, next_++, &response_);
  if (!status.ok()) {
    Finish(ToGrpcStatus(status));
    return;
  }
  StartWrite(&response_);
}

void FetchReactor::OnWriteDone(bool ok) {
  if (!ok) {
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading"));
    return;
  }
  WriteNext();
}

}  // namespace kvcache::service
