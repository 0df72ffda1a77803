// The saved prompt-cache files: one "<name>.safetensors" per name in a data
// directory, written crash-safely, within a byte budget.
//
// A write goes to ".tmp-<random>" in the same directory, is fsynced, renamed
// over "<name>.safetensors", and the directory is fsynced. A crash at any point
// leaves the old file or the new one, never a mix; Open removes the leftover
// temporaries and lists what the directory holds, so saved files survive a
// restart. Saving an existing name replaces it atomically. A file put in the
// directory while the server runs (moved in whole: a copy still being
// written would be charged at the size it had) is indexed when a call first
// reads it (LoadSnapshot, ExportSnapshot) and by every List (ListSaved),
// charged then as an import of it would be; Delete removes it either way.
//
// Threads: writes (Save, WriteBytes, Delete) of one name take turns; the store's
// mutex is held only to check and update its index, never across file I/O, so
// a long save blocks nothing but other writes of its own name.
//
// Status: a bad name → INVALID_ARGUMENT naming `name`; an unknown one →
// NOT_FOUND naming it; a save past the budget → RESOURCE_EXHAUSTED naming
// `disk_bytes`; a full disk (ENOSPC, EDQUOT, EFBIG) → RESOURCE_EXHAUSTED naming
// the data directory; other I/O errors → INTERNAL naming the call and path. A
// refused write leaves the old file and no temporary behind.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/disk_budget.h"
#include "core/log.h"
#include "engine/files/prompt_cache.h"
#include "engine/files/safetensors.h"

namespace kvcache::engine {

inline constexpr size_t kMaxSavedFileNameBytes = 200;
inline constexpr absl::string_view kSavedFileSuffix = ".safetensors";
inline constexpr absl::string_view kSavedFileTempPrefix = ".tmp-";

struct SavedFileInfo {
  std::string name;  // without the ".safetensors" suffix
  uint64_t size_bytes = 0;
  absl::Time modified;
};

// Non-empty, at most kMaxSavedFileNameBytes of [A-Za-z0-9._-], not starting with '.'.
absl::Status ValidateSavedFileName(absl::string_view name);

// How a SavedFileStore shares its DiskBudget.
struct SavedFileSharing {
  // The most the store's own files may hold within the budget (a tenant's
  // max_saved_bytes; 0: only the budget).
  uint64_t quota_bytes = 0;
  // Whether a refusal may say what else holds the budget: only where all of
  // that is the caller's own too (a server without tenants).
  bool tell_others_use = false;
};

class SavedFileStore {
 public:
  // Creates `data_dir` if missing, removes leftover temporaries, indexes the
  // saved files. `max_bytes` bounds the files' total size (0: no limit).
  static absl::StatusOr<std::unique_ptr<SavedFileStore>> Open(std::string data_dir,
                                                              uint64_t max_bytes);
  // The same within `budget`, shared with whatever else writes under
  // data_dir (the pool's disk tier, other tenants' stores); it must outlive
  // the store.
  static absl::StatusOr<std::unique_ptr<SavedFileStore>> Open(std::string data_dir,
                                                              DiskBudget& budget,
                                                              SavedFileSharing sharing = {});
  // Gives a shared budget back what this store's files were charged: they
  // stay on disk, but no longer count until a store indexes them again (a
  // tenant that failed to start, or a server that stops).
  ~SavedFileStore();

  absl::StatusOr<SavedFileInfo> Save(absl::string_view name, const PromptCacheFile& file);
  // The decoded file, and whether its checksum was verified (files from mlx-lm
  // have none). Its tensors borrow the mapped file, which it keeps alive.
  absl::StatusOr<DecodedSafetensors> Load(absl::string_view name);
  // Sorted by name; files put in the directory since it was indexed included.
  std::vector<SavedFileInfo> List();
  absl::Status Delete(absl::string_view name);

  // Whole-file bytes for Export/Import: ReadBytes returns the file as stored;
  // WriteBytes verifies `bytes` (VerifySafetensors) before anything changes.
  absl::StatusOr<std::string> ReadBytes(absl::string_view name);
  absl::StatusOr<SavedFileInfo> WriteBytes(absl::string_view name, absl::string_view bytes);

  uint64_t used_bytes() const;
  // The most its files may hold: the quota, else the budget (0: no limit).
  uint64_t max_bytes() const { return quota_bytes_ != 0 ? quota_bytes_ : budget_.max_bytes(); }
  const std::string& data_dir() const { return data_dir_; }

 private:
  SavedFileStore(std::string data_dir, std::unique_ptr<DiskBudget> own_budget, DiskBudget& budget,
                 SavedFileSharing sharing)
      : data_dir_(std::move(data_dir)),
        own_budget_(std::move(own_budget)),
        budget_(budget),
        quota_bytes_(sharing.quota_bytes),
        tell_others_use_(sharing.tell_others_use) {}

  static absl::StatusOr<std::unique_ptr<SavedFileStore>> Open(
      std::string data_dir, std::unique_ptr<DiskBudget> own_budget, DiskBudget& budget,
      SavedFileSharing sharing);
  std::string PathOf(absl::string_view name) const;
  absl::Status IndexDirectory();
  // Indexes "<name>.safetensors" found in the directory though the index
  // lacks it: a file someone put there while the server runs (an mlx-lm
  // prompt cache copied in). It is charged as an import of its size would
  // be (RESOURCE_EXHAUSTED naming max_saved_bytes or disk_bytes past them,
  // the file left where it is); NOT_FOUND naming it where there is none, or
  // where it is not a regular file (a link is not followed). Takes the name
  // (AcquireName): the caller must not hold it.
  absl::Status AdoptFromDisk(absl::string_view name);
  // AdoptFromDisk of every such file; those refused are logged and skipped.
  void AdoptNewFiles();
  absl::StatusOr<std::string> ReadExisting(absl::string_view name);
  // read(path, data_dir) of a name indexed, or adopted from the directory;
  // NOT_FOUND naming it if absent.
  template <typename Contents, typename Reader>
  absl::StatusOr<Contents> OpenExisting(absl::string_view name, Reader read);

  // Writes `pieces` (size_bytes in all) as `name`, crash-safely, within budget.
  absl::StatusOr<SavedFileInfo> Commit(absl::string_view name, absl::Span<const iovec> pieces,
                                       uint64_t size_bytes);
  absl::StatusOr<uint64_t> ReserveBytes(absl::string_view name, uint64_t size_bytes);
  // Makes the index hold `on_disk` for `name` (NOT_FOUND: no entry).
  void ReindexLocked(absl::string_view name, const absl::StatusOr<SavedFileInfo>& on_disk)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AcquireName(absl::string_view name) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseName(absl::string_view name) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string data_dir_;
  const std::unique_ptr<DiskBudget> own_budget_;  // null when shared
  // Charged with used_bytes_ + reserved_bytes_ (and whatever shares it).
  DiskBudget& budget_;
  const uint64_t quota_bytes_;  // 0: none
  const bool tell_others_use_;

  mutable absl::Mutex mu_;
  std::map<std::string, SavedFileInfo, std::less<>> files_ ABSL_GUARDED_BY(mu_);
  uint64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;                      // sum of files_' sizes
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;                  // growth of writes in flight
  absl::flat_hash_set<std::string> busy_names_ ABSL_GUARDED_BY(mu_);  // being written
  absl::CondVar name_released_;
  LogLimiter refusals_logged_{3, absl::Minutes(1)};  // files found but refused (AdoptNewFiles)
};

}  // namespace kvcache::engine
