// PullSnapshot's reactor: finds the replica a snapshot id names (peers.h),
// reads the snapshot from it as an ExportSnapshot stream made with the
// caller's own credentials, and makes a snapshot of the bytes here
// (Handlers::ImportFile, as ImportSnapshot does). Nothing blocks a gRPC
// thread: the lookup and the stream are gRPC callbacks, and the call answers
// from the stream's end. It deletes itself in OnDone, which gRPC calls only
// after Finish, which comes only once the stream has ended.
#pragma once

#include <memory>
#include <string>

#include "fleet/peers.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/handlers.h"
#include "service/tenants.h"

namespace kvcache::service {

class PullReactor final : public grpc::ServerUnaryReactor {
 public:
  // `peers` null: this replica has none (FAILED_PRECONDITION). `self` is
  // this replica's name.
  PullReactor(Admitted admitted, grpc::CallbackServerContext* context,
              const v1::PullSnapshotRequest& request, v1::LoadSnapshotResponse* response,
              Peers* peers, const std::string& self);
  void OnCancel() override { peer_context_.TryCancel(); }
  void OnDone() override { delete this; }
  ~PullReactor() override {
    if (pull_slot_ != nullptr) pull_slot_->EndPull();
  }

 private:
  // The ExportSnapshot stream from the owner; its bytes go to file_.
  class Reader final : public grpc::ClientReadReactor<v1::FileChunk> {
   public:
    explicit Reader(PullReactor& pull) : pull_(pull) {}
    void Begin() {
      StartRead(&chunk_);
      StartCall();
    }
    void OnReadDone(bool ok) override;
    void OnDone(const grpc::Status& status) override { pull_.Pulled(status); }

   private:
    PullReactor& pull_;
    v1::FileChunk chunk_;
  };

  absl::Status Check(const v1::PullSnapshotRequest& request, Peers* peers,
                     const std::string& self) const;
  // True when the request's id was answered before (or cannot be used):
  // the call is answered now, as the request log says.
  bool AnsweredBefore(const v1::PullSnapshotRequest& request);
  void Start(absl::StatusOr<std::shared_ptr<grpc::Channel>> owner);
  void Pulled(const grpc::Status& status);
  void Answer(const absl::Status& status);

  const Admitted admitted_;
  Peers* pull_slot_ = nullptr;  // the Peers whose BeginPull this holds
  grpc::CallbackServerContext* const context_;
  v1::LoadSnapshotResponse* const response_;
  const uint64_t max_file_bytes_;  // Handlers::MaxImportBytes
  v1::ImportSnapshotRequest options_;
  v1::ExportSnapshotRequest export_request_;
  std::string owner_name_;
  std::string request_id_;  // set while a pull with an id runs: its answer is kept
  grpc::ClientContext peer_context_;  // cancelled with the call (OnCancel)
  std::unique_ptr<v1::KvCacheService::Stub> stub_;
  Reader reader_{*this};
  std::string file_;
  bool too_large_ = false;  // the reader's; read in Pulled after it ends
};

}  // namespace kvcache::service
