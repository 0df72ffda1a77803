// Prompt-cache files: SaveSnapshot, LoadSnapshot, ListSaved, DeleteSaved, and
// the payloads of the ExportSnapshot / ImportSnapshot streams.
#include <map>
#include <string>

#include "core/status_macros.h"
#include "service/convert.h"
#include "service/handlers.h"
#include "service/validation.h"

namespace kvcache::service {
namespace {

std::map<std::string, std::string> MetadataOf(
    const google::protobuf::Map<std::string, std::string>& metadata) {
  return std::map<std::string, std::string>(metadata.begin(), metadata.end());
}

void ToProto(const engine::SavedFileInfo& info, v1::SavedFile* out) {
  out->set_name(info.name);
  out->set_size_bytes(info.size_bytes);
  service::ToProto(info.modified, out->mutable_modified());
}

void ToProto(const engine::LoadedSnapshot& loaded, v1::LoadSnapshotResponse* out) {
  service::ToProto(loaded.snapshot, out->mutable_snapshot());
  service::ToProto(loaded.spec, out->mutable_spec());
  out->mutable_metadata()->insert(loaded.metadata.begin(), loaded.metadata.end());
  out->set_checksum_verified(loaded.checksum_verified);
}

absl::Status RequireName(const std::string& name) {
  if (name.empty()) return absl::InvalidArgumentError("name: required");
  return absl::OkStatus();
}

}  // namespace

absl::Status Handlers::SaveSnapshot(const v1::SaveSnapshotRequest& request,
                                    v1::SavedFile* response) {
  RETURN_IF_ERROR(RequireId("snapshot_id", request.snapshot_id()));
  RETURN_IF_ERROR(RequireName(request.name()));
  ASSIGN_OR_RETURN(const engine::SavedFileInfo saved,
                   engine_.SaveSnapshot(request.snapshot_id(), request.name(),
                                        MetadataOf(request.metadata())));
  ToProto(saved, response);
  return absl::OkStatus();
}

absl::Status Handlers::LoadSnapshot(const v1::LoadSnapshotRequest& request,
                                    v1::LoadSnapshotResponse* response) {
  RETURN_IF_ERROR(RequireName(request.name()));
  ASSIGN_OR_RETURN(const engine::LoadedSnapshot loaded,
                   engine_.LoadSnapshot(request.name(), request.pinned(),
                                        absl::Seconds(request.ttl_seconds())));
  ToProto(loaded, response);
  return absl::OkStatus();
}

absl::Status Handlers::ListSaved(const v1::ListSavedRequest&, v1::ListSavedResponse* response) {
  ASSIGN_OR_RETURN(const std::vector<engine::SavedFileInfo> files, engine_.ListSaved());
  for (const engine::SavedFileInfo& file : files) ToProto(file, response->add_files());
  return absl::OkStatus();
}

absl::Status Handlers::DeleteSaved(const v1::DeleteSavedRequest& request,
                                   v1::DeleteSavedResponse*) {
  RETURN_IF_ERROR(RequireName(request.name()));
  return engine_.DeleteSaved(request.name());
}

absl::StatusOr<std::string> Handlers::ExportFile(const v1::ExportSnapshotRequest& request) {
  if (request.name().empty() == request.snapshot_id().empty()) {
    return absl::InvalidArgumentError("name, snapshot_id: exactly one must be set");
  }
  RETURN_IF_ERROR(CheckIdLength("snapshot_id", request.snapshot_id()));
  if (!request.name().empty()) {
    if (!request.metadata().empty()) {
      return absl::InvalidArgumentError("metadata: only with snapshot_id (a saved file has its own)");
    }
    return engine_.ReadSaved(request.name());
  }
  RETURN_IF_ERROR(RequireId("snapshot_id", request.snapshot_id()));
  ASSIGN_OR_RETURN(const engine::PromptCacheFile file,
                   engine_.ExportSnapshot(request.snapshot_id(), MetadataOf(request.metadata())));
  return engine::EncodeSafetensorsBytes(file);
}

uint64_t Handlers::MaxImportBytes() const {
  const gpu::PoolStats pool = engine_.pool().stats();
  return uint64_t{pool.max_pages} * pool.page_bytes + engine::kSafetensorsMaxHeaderBytes;
}

absl::Status Handlers::ImportFile(const v1::ImportSnapshotRequest& options, absl::string_view bytes,
                                  v1::LoadSnapshotResponse* response) {
  ASSIGN_OR_RETURN(const engine::LoadedSnapshot loaded,
                   engine_.ImportBytes(bytes, options.name(), options.pinned(),
                                       absl::Seconds(options.ttl_seconds())));
  ToProto(loaded, response);
  return absl::OkStatus();
}

}  // namespace kvcache::service
