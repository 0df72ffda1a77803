#include "service/grpc/pull_reactor.h"

#include <grpcpp/channel.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/client_text.h"
#include "core/status_macros.h"
#include "service/grpc/status_mapping.h"
#include "service/validation.h"
#include "wire/ids/replica_id.h"

namespace kvcache::service {

PullReactor::PullReactor(Admitted admitted, grpc::CallbackServerContext* context,
                         const v1::PullSnapshotRequest& request,
                         v1::LoadSnapshotResponse* response, Peers* peers,
                         const std::string& self)
    : admitted_(std::move(admitted)),
      context_(context),
      response_(response),
      max_file_bytes_(admitted_.handlers().MaxImportBytes()) {
  if (absl::Status checked = Check(request, peers, self); !checked.ok()) {
    Answer(checked);
    return;
  }
  if (!request.request_id().empty() && AnsweredBefore(request)) return;
  if (!peers->BeginPull()) {
    Answer(absl::ResourceExhaustedError(
        absl::StrCat("snapshot_id: ", Peers::kMaxPulls,
                     " pulls are running, the most this replica runs at once; try again")));
    return;
  }
  pull_slot_ = peers;
  options_.set_pinned(request.pinned());
  options_.set_ttl_seconds(request.ttl_seconds());
  export_request_.set_snapshot_id(request.snapshot_id());
  owner_name_ = std::string(ids::ReplicaOf(request.snapshot_id()));
  Start(peers->Find(owner_name_));
}

absl::Status PullReactor::Check(const v1::PullSnapshotRequest& request, Peers* peers,
                                const std::string& self) const {
  // The id rules of every call first (validation.h): a length past the
  // limit is refused before anything else is read of it.
  RETURN_IF_ERROR(RequireId("snapshot_id", request.snapshot_id()));
  RETURN_IF_ERROR(CheckIdLength("request_id", request.request_id()));
  const absl::string_view owner = ids::ReplicaOf(request.snapshot_id());
  if (absl::Status name = ids::CheckReplicaName(owner, "snapshot_id"); !name.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("snapshot_id: ", Quoted(request.snapshot_id()),
                     " names no replica (ids of a fleet are <replica>:<hex>)"));
  }
  if (owner == self) {
    return absl::InvalidArgumentError(
        absl::StrCat("snapshot_id: already on this replica (", self, "); Restore it here"));
  }
  if (peers == nullptr || peers->empty()) {
    return absl::FailedPreconditionError(
        "snapshot_id: this replica knows no peers to pull from (kvcached --peers or "
        "--etcd_endpoints)");
  }
  return absl::OkStatus();
}

bool PullReactor::AnsweredBefore(const v1::PullSnapshotRequest& request) {
  v1::PullSnapshotRequest without_id = request;
  without_id.clear_request_id();
  absl::StatusOr<std::optional<std::string>> earlier =
      admitted_.handlers().BeginOnce("PullSnapshot", request.request_id(), without_id);
  if (!earlier.ok()) {
    Answer(earlier.status());
    return true;
  }
  if (earlier->has_value()) {
    Answer(response_->ParseFromString(**earlier)
               ? absl::OkStatus()
               : absl::InternalError("request_id: the kept answer to PullSnapshot does not parse"));
    return true;
  }
  request_id_ = request.request_id();  // this pull runs; Answer logs how it ended
  return false;
}

void PullReactor::Start(absl::StatusOr<std::shared_ptr<grpc::Channel>> owner) {
  if (!owner.ok()) {
    Answer(owner.status());
    return;
  }
  // The owner admits the caller, not this replica: its token travels on.
  const auto& metadata = context_->client_metadata();
  if (auto found = metadata.find("authorization"); found != metadata.end()) {
    peer_context_.AddMetadata("authorization",
                              std::string(found->second.data(), found->second.size()));
  }
  peer_context_.set_deadline(context_->deadline());
  stub_ = v1::KvCacheService::NewStub(*owner);
  stub_->async()->ExportSnapshot(&peer_context_, &export_request_, &reader_);
  reader_.Begin();
}

void PullReactor::Reader::OnReadDone(bool ok) {
  if (!ok) return;  // the stream ended: OnDone follows
  if (pull_.file_.size() + chunk_.data().size() > pull_.max_file_bytes_) {
    pull_.too_large_ = true;
    pull_.peer_context_.TryCancel();
    return;
  }
  pull_.file_.append(chunk_.data());
  pull_.admitted_.CountReceived(Transport::kGrpc, chunk_.data().size());
  StartRead(&chunk_);
}

void PullReactor::Pulled(const grpc::Status& status) {
  if (too_large_) {
    Answer(absl::ResourceExhaustedError(absl::StrFormat(
        "snapshot_id: the snapshot passes %d bytes, the most this replica takes (its pool)",
        max_file_bytes_)));
  } else if (!status.ok()) {
    // The owner's answer as it gave it (gRPC's codes are absl's).
    Answer(absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("replica ", owner_name_, ": ", status.error_message())));
  } else if (context_->IsCancelled()) {
    // The caller went (or its deadline passed): no one would learn the new
    // snapshot's id, so none is made.
    Answer(absl::CancelledError("the pull was cancelled"));
  } else {
    Answer(admitted_.handlers().ImportFile(options_, file_, response_));
  }
}

// The pull's slot and its file go before the caller can see the answer (as
// the tenant's in-flight count does): gRPC deletes the reactor only later,
// and a caller that pulls again at once must not find its own finished pulls
// still counted against the most this replica runs.
void PullReactor::Answer(const absl::Status& status) {
  if (!request_id_.empty()) admitted_.handlers().FinishOnce(request_id_, status, *response_);
  admitted_.Answering();
  std::string().swap(file_);
  if (pull_slot_ != nullptr) std::exchange(pull_slot_, nullptr)->EndPull();
  Finish(ToGrpcStatus(status));
}

}  // namespace kvcache::service
