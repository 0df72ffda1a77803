#include "engine/files/saved_files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/client_text.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "engine/files/atomic_file.h"

namespace kvcache::engine {
namespace {

bool IsNameChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

// The size and modification time of `path` as `name`.
absl::StatusOr<SavedFileInfo> StatSavedFile(absl::string_view name, const std::string& path,
                                            absl::string_view data_dir) {
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) return FileErrorStatus(errno, "stat", path, data_dir);
  return SavedFileInfo{.name = std::string(name),
                       .size_bytes = static_cast<uint64_t>(info.st_size),
                       .modified = absl::TimeFromTimespec(info.st_mtim)};
}

}  // namespace

absl::Status ValidateSavedFileName(absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError("name is empty");
  if (name.size() > kMaxSavedFileNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("name is ", name.size(), " bytes, above ", kMaxSavedFileNameBytes));
  }
  for (char c : name) {
    if (!IsNameChar(c)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "name \"", absl::CEscape(name), "\" holds a character outside [A-Za-z0-9._-]"));
    }
  }
  if (name.front() == '.') {
    return absl::InvalidArgumentError(absl::StrCat("name ", Quoted(name), " starts with '.'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SavedFileStore>> SavedFileStore::Open(std::string data_dir,
                                                                     uint64_t max_bytes) {
  auto budget = std::make_unique<DiskBudget>(max_bytes);
  DiskBudget& own = *budget;
  return Open(std::move(data_dir), std::move(budget), own, {.tell_others_use = true});
}

absl::StatusOr<std::unique_ptr<SavedFileStore>> SavedFileStore::Open(std::string data_dir,
                                                                     DiskBudget& budget,
                                                                     SavedFileSharing sharing) {
  return Open(std::move(data_dir), nullptr, budget, sharing);
}

absl::StatusOr<std::unique_ptr<SavedFileStore>> SavedFileStore::Open(
    std::string data_dir, std::unique_ptr<DiskBudget> own_budget, DiskBudget& budget,
    SavedFileSharing sharing) {
  std::error_code error;
  std::filesystem::create_directories(data_dir, error);
  if (error) {
    return FileErrorStatus(error.value(), "create_directories", data_dir, data_dir);
  }
  std::unique_ptr<SavedFileStore> store(
      new SavedFileStore(std::move(data_dir), std::move(own_budget), budget, sharing));
  RETURN_IF_ERROR(store->IndexDirectory());
  return store;
}

SavedFileStore::~SavedFileStore() {
  absl::MutexLock lock(&mu_);
  if (own_budget_ == nullptr) budget_.Credit(used_bytes_);
}

// Removes the temporaries a crash left and indexes "<name>.safetensors" files;
// anything else in the directory is not ours and is left alone.
absl::Status SavedFileStore::IndexDirectory() {
  absl::MutexLock lock(&mu_);
  std::error_code error;
  size_t removed = 0;
  for (const auto& entry : std::filesystem::directory_iterator(data_dir_, error)) {
    const std::string file_name = entry.path().filename().string();
    if (absl::StartsWith(file_name, kSavedFileTempPrefix)) {
      if (::unlink(entry.path().c_str()) != 0) {
        return FileErrorStatus(errno, "unlink", entry.path().string(), data_dir_);
      }
      ++removed;
      continue;
    }
    if (!absl::EndsWith(file_name, kSavedFileSuffix)) continue;
    absl::string_view name(file_name.data(), file_name.size() - kSavedFileSuffix.size());
    if (!ValidateSavedFileName(name).ok()) continue;
    ASSIGN_OR_RETURN(SavedFileInfo info, StatSavedFile(name, entry.path().string(), data_dir_));
    used_bytes_ += info.size_bytes;
    budget_.Charge(info.size_bytes);
    files_.emplace(info.name, std::move(info));
  }
  if (error) return FileErrorStatus(error.value(), "readdir", data_dir_, data_dir_);
  if (removed > 0) {
    LogInfo("saved files: removed %d leftover temporaries from %s", removed, data_dir_);
    RETURN_IF_ERROR(SyncDirectory(data_dir_));
  }
  return absl::OkStatus();
}

// The name is held while the file is looked at, so no write or delete of it
// comes between the look and the index.
absl::Status SavedFileStore::AdoptFromDisk(absl::string_view name) {
  AcquireName(name);
  absl::Cleanup release = [&] { ReleaseName(name); };
  const std::string path = PathOf(name);
  const absl::Status not_found =
      absl::NotFoundError(absl::StrCat("no saved file named ", Quoted(name)));
  // lstat: a link put in the directory is not followed out of it.
  struct stat info;
  if (::lstat(path.c_str(), &info) != 0) {
    return errno == ENOENT ? not_found : FileErrorStatus(errno, "stat", path, data_dir_);
  }
  if (!S_ISREG(info.st_mode)) return not_found;
  const auto size = static_cast<uint64_t>(info.st_size);
  absl::MutexLock lock(&mu_);
  if (files_.contains(name)) return absl::OkStatus();  // indexed meanwhile
  const std::string found =
      absl::StrCat("the file ", name, kSavedFileSuffix, " found in the data dir is ", size,
                   " bytes");
  if (quota_bytes_ != 0 && used_bytes_ + reserved_bytes_ + size > quota_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "max_saved_bytes: ", found, " and would pass the quota of ", quota_bytes_, " (",
        used_bytes_, " bytes in these saved files, ", reserved_bytes_, " being written)"));
  }
  if (!budget_.TryCharge(size)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "disk_bytes: ", found, " and would pass the data dir's budget of ", budget_.max_bytes()));
  }
  used_bytes_ += size;
  files_.emplace(std::string(name), SavedFileInfo{.name = std::string(name),
                                                  .size_bytes = size,
                                                  .modified = absl::TimeFromTimespec(info.st_mtim)});
  LogInfo("saved files: indexed %s%s, put in %s while the server ran", name, kSavedFileSuffix,
          data_dir_);
  return absl::OkStatus();
}

void SavedFileStore::AdoptNewFiles() {
  // The directory is read outside the mutex (file I/O), then filtered under it.
  std::vector<std::string> named;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(data_dir_, error)) {
    const std::string file_name = entry.path().filename().string();
    if (!absl::EndsWith(file_name, kSavedFileSuffix)) continue;
    std::string name = file_name.substr(0, file_name.size() - kSavedFileSuffix.size());
    if (ValidateSavedFileName(name).ok()) named.push_back(std::move(name));
  }
  std::vector<std::string> unindexed;
  {
    absl::MutexLock lock(&mu_);
    for (std::string& name : named) {
      if (!files_.contains(name)) unindexed.push_back(std::move(name));
    }
  }
  for (const std::string& name : unindexed) {
    absl::Status adopted = AdoptFromDisk(name);
    uint64_t held_back = 0;
    // A file over the quota stays refused at each List: said a few times a minute.
    if (!adopted.ok() && !absl::IsNotFound(adopted) &&
        refusals_logged_.Allow(absl::Now(), held_back)) {
      LogError("saved files: not indexed: %s (%d such lines held back)", adopted.ToString(),
               held_back);
    }
  }
}

std::string SavedFileStore::PathOf(absl::string_view name) const {
  return absl::StrCat(data_dir_, "/", name, kSavedFileSuffix);
}

absl::StatusOr<SavedFileInfo> SavedFileStore::Save(absl::string_view name,
                                                   const PromptCacheFile& file) {
  RETURN_IF_ERROR(ValidateSavedFileName(name));
  ASSIGN_OR_RETURN(EncodedSafetensors encoded, EncodeSafetensors(file));
  std::vector<iovec> pieces;
  pieces.reserve(encoded.tensor_data.size() + 1);
  pieces.push_back({encoded.prefix.data(), encoded.prefix.size()});
  for (absl::Span<const std::byte> data : encoded.tensor_data) {
    pieces.push_back({const_cast<std::byte*>(data.data()), data.size()});
  }
  return Commit(name, pieces, encoded.size_bytes);
}

absl::StatusOr<SavedFileInfo> SavedFileStore::WriteBytes(absl::string_view name,
                                                         absl::string_view bytes) {
  RETURN_IF_ERROR(ValidateSavedFileName(name));
  absl::StatusOr<bool> verified = VerifySafetensors(bytes);
  if (!verified.ok()) {
    return absl::Status(verified.status().code(), absl::StrCat("bytes for name ", Quoted(name),
                                                               ": ", verified.status().message()));
  }
  const iovec piece{const_cast<char*>(bytes.data()), bytes.size()};
  return Commit(name, {&piece, 1}, bytes.size());
}

absl::StatusOr<std::string> SavedFileStore::ReadBytes(absl::string_view name) {
  RETURN_IF_ERROR(ValidateSavedFileName(name));
  return ReadExisting(name);
}

absl::StatusOr<DecodedSafetensors> SavedFileStore::Load(absl::string_view name) {
  RETURN_IF_ERROR(ValidateSavedFileName(name));
  ASSIGN_OR_RETURN(std::shared_ptr<const MappedFile> mapped,
                   OpenExisting<std::shared_ptr<const MappedFile>>(name, MappedFile::Open));
  const absl::string_view bytes = mapped->bytes();
  absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensorsInPlace(bytes, std::move(mapped));
  if (!decoded.ok()) {
    return absl::Status(decoded.status().code(), absl::StrCat("saved file ", Quoted(name), ": ",
                                                              decoded.status().message()));
  }
  return decoded;
}

// Reads outside the mutex: a rename replaces the file whole, so a read sees
// the old file or the new one.
template <typename Contents, typename Reader>
absl::StatusOr<Contents> SavedFileStore::OpenExisting(absl::string_view name, Reader read) {
  const absl::Status not_found =
      absl::NotFoundError(absl::StrCat("no saved file named ", Quoted(name)));
  bool indexed = false;
  {
    absl::MutexLock lock(&mu_);
    indexed = files_.contains(name);
  }
  if (!indexed) RETURN_IF_ERROR(AdoptFromDisk(name));
  absl::StatusOr<Contents> contents = read(PathOf(name), data_dir_);
  if (absl::IsNotFound(contents.status())) return not_found;  // deleted meanwhile
  return contents;
}

absl::StatusOr<std::string> SavedFileStore::ReadExisting(absl::string_view name) {
  return OpenExisting<std::string>(name, ReadWholeFile);
}

std::vector<SavedFileInfo> SavedFileStore::List() {
  AdoptNewFiles();
  absl::MutexLock lock(&mu_);
  std::vector<SavedFileInfo> infos;
  infos.reserve(files_.size());
  for (const auto& [name, info] : files_) infos.push_back(info);
  return infos;
}

uint64_t SavedFileStore::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_bytes_;
}

absl::Status SavedFileStore::Delete(absl::string_view name) {
  RETURN_IF_ERROR(ValidateSavedFileName(name));
  AcquireName(name);
  absl::Cleanup release = [&] { ReleaseName(name); };
  bool indexed = false;
  {
    absl::MutexLock lock(&mu_);
    indexed = files_.contains(name);
  }
  const std::string path = PathOf(name);
  if (!indexed) {
    // Put in the directory while the server runs and never indexed: removed
    // as it is, nothing to credit (it was never charged), over a quota or not.
    struct stat info;
    if (::lstat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode)) {
      return absl::NotFoundError(absl::StrCat("no saved file named ", Quoted(name)));
    }
    if (::unlink(path.c_str()) != 0) return FileErrorStatus(errno, "unlink", path, data_dir_);
    return SyncDirectory(data_dir_);
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return FileErrorStatus(errno, "unlink", path, data_dir_);
  }
  {
    absl::MutexLock lock(&mu_);
    auto file = files_.find(name);
    used_bytes_ -= file->second.size_bytes;
    budget_.Credit(file->second.size_bytes);
    files_.erase(file);
  }
  return SyncDirectory(data_dir_);
}

absl::StatusOr<SavedFileInfo> SavedFileStore::Commit(absl::string_view name,
                                                     absl::Span<const iovec> pieces,
                                                     uint64_t size_bytes) {
  AcquireName(name);
  absl::Cleanup release = [&] { ReleaseName(name); };
  ASSIGN_OR_RETURN(uint64_t growth, ReserveBytes(name, size_bytes));
  const std::string path = PathOf(name);
  absl::Status written = WriteFileAtomically(data_dir_, kSavedFileTempPrefix, path, pieces);
  // Index what is on disk, whatever happened: the old file when the write
  // failed before its rename, the new one after (even if the directory's
  // fsync then failed).
  absl::StatusOr<SavedFileInfo> on_disk = StatSavedFile(name, path, data_dir_);
  {
    absl::MutexLock lock(&mu_);
    reserved_bytes_ -= growth;
    const uint64_t used_before = used_bytes_;
    ReindexLocked(name, on_disk);
    // One net change to the shared budget: a momentary credit could be taken
    // by the disk tier meanwhile, and the charge after it would overrun.
    const int64_t change = static_cast<int64_t>(used_bytes_) -
                           static_cast<int64_t>(used_before) - static_cast<int64_t>(growth);
    if (change > 0) budget_.Charge(change);
    if (change < 0) budget_.Credit(-change);
  }
  RETURN_IF_ERROR(written);
  return on_disk;
}

void SavedFileStore::ReindexLocked(absl::string_view name,
                                   const absl::StatusOr<SavedFileInfo>& on_disk) {
  if (!on_disk.ok() && !absl::IsNotFound(on_disk.status())) return;  // unknown: keep the entry
  if (auto old = files_.find(name); old != files_.end()) {
    used_bytes_ -= old->second.size_bytes;
    files_.erase(old);
  }
  if (on_disk.ok()) {
    used_bytes_ += on_disk->size_bytes;
    files_.emplace(on_disk->name, *on_disk);
  }
}

// Refuses a write that would take the files past max_bytes_, counting the
// growth of writes in flight; returns this write's growth, now reserved.
absl::StatusOr<uint64_t> SavedFileStore::ReserveBytes(absl::string_view name, uint64_t size_bytes) {
  absl::MutexLock lock(&mu_);
  auto old = files_.find(name);
  const uint64_t old_bytes = old == files_.end() ? 0 : old->second.size_bytes;
  const uint64_t growth = size_bytes > old_bytes ? size_bytes - old_bytes : 0;
  std::string held = absl::StrCat(used_bytes_, " bytes in these saved files, ", reserved_bytes_,
                                  " being written");
  // A write that adds nothing passes even a store over its quota (one that
  // found more on disk at start than its quota allows): it can only shrink.
  if (quota_bytes_ != 0 && growth > 0 && used_bytes_ + reserved_bytes_ + growth > quota_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat("max_saved_bytes: saving ", size_bytes,
                                                     " bytes as ", Quoted(name),
                                                     " would pass the quota of ", quota_bytes_,
                                                     " (", held, ")"));
  }
  if (!budget_.TryCharge(growth)) {
    // The rest of a shared budget is other tenants' files and the disk
    // tier's pages: said only where those are all the caller's own.
    absl::StrAppend(&held, tell_others_use_
                               ? absl::StrCat(", ", budget_.used() - used_bytes_ - reserved_bytes_,
                                              " holding evicted pages")
                               : "; the rest is held by others");
    return absl::ResourceExhaustedError(absl::StrCat(
        "disk_bytes: saving ", size_bytes, " bytes as ", Quoted(name),
        " would pass the data dir's budget of ", budget_.max_bytes(), " (", held, ")"));
  }
  reserved_bytes_ += growth;
  return growth;
}

void SavedFileStore::AcquireName(absl::string_view name) {
  absl::MutexLock lock(&mu_);
  while (busy_names_.contains(name)) name_released_.Wait(&mu_);
  busy_names_.emplace(name);
}

void SavedFileStore::ReleaseName(absl::string_view name) {
  absl::MutexLock lock(&mu_);
  busy_names_.erase(name);
  name_released_.SignalAll();
}

}  // namespace kvcache::engine
