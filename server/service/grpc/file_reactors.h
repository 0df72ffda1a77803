// Reactors of the two file streams: ExportSnapshot writes a prompt-cache
// file's bytes in chunks, ImportSnapshot reads them and makes a snapshot
// (Handlers::ExportFile / ImportFile own the rules). Each deletes itself in
// OnDone, as gRPC's callback API expects; the reads and writes of one call
// never overlap, so neither needs a lock.
#pragma once

#include <string>

#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/handlers.h"
#include "service/tenants.h"

namespace kvcache::service {

// Chunks a little under gRPC's default 4 MiB message cap, so any client reads them.
inline constexpr size_t kFileChunkBytes = 1 << 20;

class ExportReactor final : public grpc::ServerWriteReactor<v1::FileChunk> {
 public:
  ExportReactor(Admitted admitted, const v1::ExportSnapshotRequest& request);
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  // Writes the next chunk, or finishes when none is left.
  void WriteNext();
  // Finish, once the call no longer counts against the tenant's limit.
  void Answer(const grpc::Status& status) {
    admitted_.Answering();
    Finish(status);
  }

  const Admitted admitted_;
  std::string file_;
  size_t sent_ = 0;
  v1::FileChunk chunk_;
};

class ImportReactor final : public grpc::ServerReadReactor<v1::ImportSnapshotRequest> {
 public:
  // Takes files up to Handlers::MaxImportBytes; more is RESOURCE_EXHAUSTED.
  ImportReactor(Admitted admitted, grpc::CallbackServerContext* context,
                v1::LoadSnapshotResponse* response);
  void OnReadDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  void Answer(const grpc::Status& status) {
    admitted_.Answering();
    Finish(status);
  }

  // Makes the snapshot from the whole file (once, with a request_id).
  absl::Status Import();

  const Admitted admitted_;
  Handlers& handlers_;
  grpc::CallbackServerContext* context_;
  v1::LoadSnapshotResponse* response_;
  const uint64_t max_file_bytes_;  // Handlers::MaxImportBytes
  v1::ImportSnapshotRequest request_;
  v1::ImportSnapshotRequest options_;  // the first message, without its data or id
  std::string request_id_;             // the first message's
  bool first_ = true;
  std::string file_;
};

}  // namespace kvcache::service
