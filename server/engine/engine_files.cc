// Prompt-cache files: snapshots out as mlx-lm save_prompt_cache files and
// back (engine/files/mlx_state.h), kept in the data dir (engine/files/saved_files.h) or
// handed to the caller as bytes.
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/client_text.h"
#include "core/status_macros.h"
#include "engine/engine.h"
#include "engine/files/mlx_state.h"
#include "engine/files/safetensors.h"

namespace kvcache::engine {
namespace {

// mlx-lm keeps the user's metadata under "1." in the file's metadata.
constexpr absl::string_view kUserMetadataPrefix = "1.";

std::map<std::string, std::string> UserMetadata(const PromptCacheFile& file) {
  std::map<std::string, std::string> user;
  for (const auto& [key, value] : file.metadata) {
    if (absl::StartsWith(key, kUserMetadataPrefix)) {
      user.emplace(key.substr(kUserMetadataPrefix.size()), value);
    }
  }
  return user;
}

}  // namespace

absl::StatusOr<SavedFileStore*> Engine::SavedFiles() const {
  if (options_.saved_files == nullptr) {
    return absl::FailedPreconditionError(
        "data_dir: this server keeps no files (start kvcached with --data_dir)");
  }
  return options_.saved_files;
}

absl::StatusOr<PromptCacheFile> Engine::ExportSnapshot(
    const std::string& snapshot_id, const std::map<std::string, std::string>& metadata) const {
  ASSIGN_OR_RETURN(const CacheSnapshotPtr snapshot, tiering_.Acquire(snapshot_id));
  return ToPromptCache(*snapshot, metadata);
}

// The file's state goes into a cache of its own, which is snapshotted from 0
// and dropped: the snapshot keeps its pages and no cache id outlives the call.
absl::StatusOr<LoadedSnapshot> Engine::ImportSnapshot(const PromptCacheFile& file,
                                                      bool checksum_verified, bool pinned,
                                                      absl::Duration ttl) {
  return tiering_.RetryAfterEviction([&]() -> absl::StatusOr<LoadedSnapshot> {
    ASSIGN_OR_RETURN(const std::unique_ptr<Cache> cache,
                     CacheFromPromptCache(file, options_.limits, pool_, options_.page_tokens));
    ASSIGN_OR_RETURN(const MetadataCharge cache_charge, ChargeCache(*cache));
    ASSIGN_OR_RETURN(CacheSnapshotPtr snapshot, cache->Snapshot("", 0));
    ASSIGN_OR_RETURN(MetadataCharge metadata, ChargeSnapshot(*snapshot));
    LoadedSnapshot loaded{.spec = cache->spec(),
                          .metadata = UserMetadata(file),
                          .checksum_verified = checksum_verified};
    ASSIGN_OR_RETURN(loaded.snapshot,
                     snapshots_.Add(std::move(snapshot), std::move(metadata), pinned, ttl));
    return loaded;
  });
}

absl::StatusOr<LoadedSnapshot> Engine::ImportBytes(absl::string_view bytes,
                                                   const std::string& name, bool pinned,
                                                   absl::Duration ttl) {
  SavedFileStore* store = nullptr;
  if (!name.empty()) {
    ASSIGN_OR_RETURN(store, SavedFiles());
    RETURN_IF_ERROR(ValidateSavedFileName(name));
  }
  ASSIGN_OR_RETURN(const DecodedSafetensors decoded, DecodeSafetensors(bytes));
  ASSIGN_OR_RETURN(LoadedSnapshot loaded,
                   ImportSnapshot(decoded.file, decoded.checksum_verified, pinned, ttl));
  if (store != nullptr) {
    if (absl::Status saved = store->WriteBytes(name, bytes).status(); !saved.ok()) {
      snapshots_.Release(loaded.snapshot.snapshot_id).IgnoreError();  // neither, then
      return saved;
    }
  }
  return loaded;
}

absl::StatusOr<SavedFileInfo> Engine::SaveSnapshot(
    const std::string& snapshot_id, const std::string& name,
    const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(SavedFileStore * store, SavedFiles());
  RETURN_IF_ERROR(ValidateSavedFileName(name));
  ASSIGN_OR_RETURN(const PromptCacheFile file, ExportSnapshot(snapshot_id, metadata));
  return store->Save(name, file);
}

absl::StatusOr<LoadedSnapshot> Engine::LoadSnapshot(const std::string& name, bool pinned,
                                                    absl::Duration ttl) {
  ASSIGN_OR_RETURN(SavedFileStore * store, SavedFiles());
  ASSIGN_OR_RETURN(const DecodedSafetensors decoded, store->Load(name));
  absl::StatusOr<LoadedSnapshot> loaded =
      ImportSnapshot(decoded.file, decoded.checksum_verified, pinned, ttl);
  if (!loaded.ok()) {
    // The file, then what in it is wrong: the name itself was fine.
    return absl::Status(loaded.status().code(),
                        absl::StrCat("saved file ", Quoted(name), " (", name, kSavedFileSuffix,
                                     "): ", loaded.status().message()));
  }
  return loaded;
}

absl::StatusOr<std::vector<SavedFileInfo>> Engine::ListSaved() const {
  ASSIGN_OR_RETURN(SavedFileStore * store, SavedFiles());
  return store->List();
}

absl::Status Engine::DeleteSaved(const std::string& name) {
  ASSIGN_OR_RETURN(SavedFileStore * store, SavedFiles());
  return store->Delete(name);
}

absl::StatusOr<std::string> Engine::ReadSaved(const std::string& name) const {
  ASSIGN_OR_RETURN(SavedFileStore * store, SavedFiles());
  return store->ReadBytes(name);
}

}  // namespace kvcache::engine
