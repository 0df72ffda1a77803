// Reactors of the two file streams: ExportSnapshot writes a prompt-cache
// file's bytes in chunks, ImportSnapshot reads them and makes a snapshot
// (Handlers::ExportFile / ImportFile own the rules). Each deletes itself in
// OnDone, as gRPC's callback API expects; the reads and writes of one call
// never overlap, so neither needs a lock.
#pragma once

#include <string>

#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/handlers.h"

namespace kvcache::service {

// Chunks a little under gRPC's default 4 MiB message cap, so any client reads them.
inline constexpr size_t kFileChunkBytes = 1 << 20;

class ExportReactor final : public grpc::ServerWriteReactor<v1::FileChunk> {
 public:
  ExportReactor(Handlers& handlers, const v1::ExportSnapshotRequest& request);
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  // Writes the next chunk, or finishes when none is left.
  void WriteNext();

  std::string file_;
  size_t sent_ = 0;
  v1::FileChunk chunk_;
};

class ImportReactor final : public grpc::ServerReadReactor<v1::ImportSnapshotRequest> {
 public:
  // `max_file_bytes`: the largest file taken; more is RESOURCE_EXHAUSTED.
  ImportReactor(Handlers& handlers, grpc::CallbackServerContext* context,
                v1::LoadSnapshotResponse* response, uint64_t max_file_bytes);
  void OnReadDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  Handlers& handlers_;
  grpc::CallbackServerContext* context_;
  v1::LoadSnapshotResponse* response_;
  const uint64_t max_file_bytes_;
  v1::ImportSnapshotRequest request_;
  v1::ImportSnapshotRequest options_;  // the first message, without its data
  bool first_ = true;
  std::string file_;
};

}  // namespace kvcache::service
