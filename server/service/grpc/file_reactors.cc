#include "service/grpc/file_reactors.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "service/grpc/status_mapping.h"

namespace kvcache::service {

ExportReactor::ExportReactor(Admitted admitted, const v1::ExportSnapshotRequest& request)
    : admitted_(std::move(admitted)) {
  absl::StatusOr<std::string> file = admitted_.handlers().ExportFile(request);
  if (!file.ok()) {
    Answer(ToGrpcStatus(file.status()));
    return;
  }
  file_ = *std::move(file);
  WriteNext();
}

void ExportReactor::WriteNext() {
  // As a Fetch's chunks: none goes to a caller whose token was revoked meanwhile.
  if (absl::Status admitted = admitted_.StillAdmitted(); !admitted.ok()) {
    Answer(ToGrpcStatus(admitted));
    return;
  }
  if (sent_ == file_.size()) {
    Answer(grpc::Status::OK);
    return;
  }
  const size_t size = std::min(kFileChunkBytes, file_.size() - sent_);
  chunk_.set_data(file_.data() + sent_, size);
  sent_ += size;
  admitted_.CountSent(Transport::kGrpc, size);
  StartWrite(&chunk_);
}

void ExportReactor::OnWriteDone(bool ok) {
  if (!ok) {
    Answer(grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading"));
    return;
  }
  WriteNext();
}

// A file larger than the pool could never load, so no more is buffered.
ImportReactor::ImportReactor(Admitted admitted, grpc::CallbackServerContext* context,
                             v1::LoadSnapshotResponse* response)
    : admitted_(std::move(admitted)),
      handlers_(admitted_.handlers()),
      context_(context),
      response_(response),
      max_file_bytes_(handlers_.MaxImportBytes()) {
  StartRead(&request_);
}

void ImportReactor::OnReadDone(bool ok) {
  if (!ok) {
    // Reads also end when the call is cancelled (by the client, or its
    // deadline): then no one would learn the new snapshot's id, so none is made.
    if (context_->IsCancelled()) {
      Answer(grpc::Status(grpc::StatusCode::CANCELLED, "the import was cancelled"));
      return;
    }
    Answer(ToGrpcStatus(Import()));  // all sent
    return;
  }
  if (first_) {
    options_ = request_;
    options_.clear_data();
    options_.clear_request_id();
    request_id_ = request_.request_id();
    first_ = false;
  }
  if (file_.size() + request_.data().size() > max_file_bytes_) {
    Answer(ToGrpcStatus(absl::ResourceExhaustedError(
        absl::StrFormat("data: the file passes %d bytes, the most this server takes (its pool)",
                        max_file_bytes_))));
    return;
  }
  file_.append(request_.data());
  admitted_.CountReceived(Transport::kGrpc, request_.data().size());
  StartRead(&request_);
}

// With a request_id the import runs once: the options and the whole file
// name it, so a stream sent again answers as the first did.
absl::Status ImportReactor::Import() {
  const auto import = [this] { return handlers_.ImportFile(options_, file_, response_); };
  if (request_id_.empty()) return import();
  return handlers_.AnswerOnce("ImportSnapshot", request_id_, options_, file_, response_, import);
}

}  // namespace kvcache::service
