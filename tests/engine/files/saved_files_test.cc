// The saved-file store: save/load/list/delete, names, overwrite, restart,
// budget, concurrent writers, I/O errors, and saves killed mid-write.
#include "engine/files/saved_files.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvcache::engine {
namespace {

namespace fs = std::filesystem;

// Two tensors of about `bytes` in all, their contents set by `seed`, and the
// seed in metadata so a loaded file says which save it came from.
PromptCacheFile MakeFile(uint64_t bytes, int seed) {
  PromptCacheFile file;
  const uint64_t tokens = std::max<uint64_t>(1, bytes / (2 * 8 * 64 * 2));
  for (const char* name : {"0.0", "0.1"}) {
    FileTensor& tensor = file.tensors[name];
    tensor.dtype = FileDType::kF16;
    tensor.shape = {1, 8, tokens, 64};
    tensor.data.resize(8 * tokens * 64 * 2);
    for (size_t i = 0; i < tensor.data.size(); ++i)
      tensor.data[i] = std::byte((seed * 7 + i) % 251);
  }
  file.metadata = {{"0.0", ""}, {"1.seed", absl::StrCat(seed)}, {"2.0", "KVCache"}};
  return file;
}

bool SameFile(const PromptCacheFile& a, const PromptCacheFile& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (const auto& [name, tensor] : a.tensors) {
    auto other = b.tensors.find(name);
    if (other == b.tensors.end() || other->second.dtype != tensor.dtype ||
        other->second.shape != tensor.shape || other->second.data != tensor.data) {
      return false;
    }
  }
  return true;
}

uint64_t EncodedSize(const PromptCacheFile& file) { return EncodeSafetensors(file)->size_bytes; }

std::vector<std::string> DirectoryEntries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

int CountTemporaries(const std::string& dir) {
  int count = 0;
  for (const std::string& name : DirectoryEntries(dir)) count += name.rfind(".tmp-", 0) == 0;
  return count;
}

class SavedFileStoreTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::path(testing::TempDir()) /
            absl::StrFormat("saved_files_%016x", absl::Uniform<uint64_t>(random_)))
               .string();
    store_ = OpenStore(0);
  }
  void TearDown() override {
    store_.reset();
    fs::remove_all(dir_);
  }
  std::unique_ptr<SavedFileStore> OpenStore(uint64_t max_bytes) {
    absl::StatusOr<std::unique_ptr<SavedFileStore>> store = SavedFileStore::Open(dir_, max_bytes);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? std::move(*store) : nullptr;
  }
  void ExpectLoads(absl::string_view name, const PromptCacheFile& expected) {
    absl::StatusOr<DecodedSafetensors> loaded = store_->Load(name);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_TRUE(loaded->checksum_verified);
    EXPECT_TRUE(SameFile(loaded->file, expected)) << name;
  }
  std::vector<std::string> ListedNames() {
    std::vector<std::string> names;
    for (const SavedFileInfo& info : store_->List()) names.push_back(info.name);
    return names;
  }

  absl::BitGen random_;
  std::string dir_;
  std::unique_ptr<SavedFileStore> store_;
};

TEST_F(SavedFileStoreTest, SavesLoadsListsAndDeletes) {
  const PromptCacheFile a = MakeFile(4096, 1), b = MakeFile(8192, 2);
  const absl::Time before = absl::Now() - absl::Seconds(5);
  ASSERT_TRUE(store_->Save("b", b).ok());
  absl::StatusOr<SavedFileInfo> saved = store_->Save("a", a);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->size_bytes, EncodedSize(a));
  EXPECT_EQ(saved->size_bytes, fs::file_size(dir_ + "/a.safetensors"));
  EXPECT_GT(saved->modified, before);
  ExpectLoads("a", a);
  ExpectLoads("b", b);
  EXPECT_EQ(ListedNames(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(store_->used_bytes(), EncodedSize(a) + EncodedSize(b));

  ASSERT_TRUE(store_->Delete("a").ok());
  EXPECT_EQ(ListedNames(), (std::vector<std::string>{"b"}));
  EXPECT_EQ(store_->used_bytes(), EncodedSize(b));
  EXPECT_EQ(DirectoryEntries(dir_), (std::vector<std::string>{"b.safetensors"}));
  for (absl::Status status :
       {store_->Load("a").status(), store_->Delete("a"), store_->ReadBytes("a").status()}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
    EXPECT_NE(status.message().find("\"a\""), absl::string_view::npos) << status;
  }
}

TEST_F(SavedFileStoreTest, NamesAreValidated) {
  const PromptCacheFile file = MakeFile(1024, 1);
  const std::string encoded = *EncodeSafetensorsBytes(file);
  for (const std::string& bad :
       {std::string(""), std::string(201, 'a'), std::string("a/b"), std::string("."),
        std::string(".."), std::string(".hidden"), std::string("a b"), std::string("caf\xc3\xa9"),
        std::string("a\0b", 3)}) {
    for (absl::Status status :
         {store_->Save(bad, file).status(), store_->Load(bad).status(), store_->Delete(bad),
          store_->ReadBytes(bad).status(), store_->WriteBytes(bad, encoded).status()}) {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_NE(status.message().find("name"), absl::string_view::npos) << status;
    }
  }
  EXPECT_TRUE(DirectoryEntries(dir_).empty());
  for (const std::string& good : {std::string("a"), std::string("Qwen3-8B_v1.2"),
                                  std::string(200, 'z'), std::string("a..b")}) {
    EXPECT_TRUE(store_->Save(good, file).ok()) << good;
    ExpectLoads(good, file);
  }
}

TEST_F(SavedFileStoreTest, SaveOverwritesAnExistingName) {
  const PromptCacheFile first = MakeFile(16384, 1), second = MakeFile(4096, 2);
  ASSERT_TRUE(store_->Save("x", first).ok());
  ASSERT_TRUE(store_->Save("x", second).ok());
  ExpectLoads("x", second);
  ASSERT_EQ(store_->List().size(), 1u);
  EXPECT_EQ(store_->List()[0].size_bytes, EncodedSize(second));
  EXPECT_EQ(store_->used_bytes(), EncodedSize(second));
  EXPECT_EQ(CountTemporaries(dir_), 0);
}

// A load maps the file and its tensors borrow the mapping: what was loaded
// stays intact while the name is saved over and deleted, and writing to a
// loaded tensor changes that tensor's own copy, never the file.
TEST_F(SavedFileStoreTest, LoadedTensorsOutliveTheFileAndCopyOnWrite) {
  const PromptCacheFile first = MakeFile(1 << 20, 1), second = MakeFile(1 << 20, 2);
  ASSERT_TRUE(store_->Save("x", first).ok());
  absl::StatusOr<DecodedSafetensors> loaded = store_->Load("x");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_NE(loaded->file.backing, nullptr);
  for (const auto& [name, tensor] : loaded->file.tensors) EXPECT_TRUE(tensor.data.borrowed());

  ASSERT_TRUE(store_->Save("x", second).ok());
  EXPECT_TRUE(SameFile(loaded->file, first));
  ASSERT_TRUE(store_->Delete("x").ok());
  EXPECT_TRUE(SameFile(loaded->file, first));

  PromptCacheFile copy = loaded->file;  // shares the mapping
  FileTensor& written = copy.tensors.at("0.0");
  written.data[0] = std::byte{0xee};
  EXPECT_FALSE(written.data.borrowed());
  EXPECT_EQ(written.data[0], std::byte{0xee});
  EXPECT_EQ(loaded->file.tensors.at("0.0").data[0], first.tensors.at("0.0").data[0]);
  EXPECT_TRUE(SameFile(loaded->file, first));
  loaded = absl::UnknownError("dropped");  // the copy alone holds the mapping now
  EXPECT_EQ(copy.tensors.at("0.1").data, first.tensors.at("0.1").data);
}

TEST_F(SavedFileStoreTest, RestartListsFilesAndRemovesTemporaries) {
  const PromptCacheFile a = MakeFile(4096, 1), b = MakeFile(2048, 2);
  ASSERT_TRUE(store_->Save("a", a).ok());
  ASSERT_TRUE(store_->Save("b", b).ok());
  store_.reset();
  std::ofstream(dir_ + "/.tmp-0123456789abcdef") << "half a file";
  std::ofstream(dir_ + "/notes.txt") << "not ours";
  store_ = OpenStore(0);
  ASSERT_NE(store_, nullptr);
  EXPECT_EQ(ListedNames(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(store_->used_bytes(), EncodedSize(a) + EncodedSize(b));
  EXPECT_EQ(DirectoryEntries(dir_),
            (std::vector<std::string>{"a.safetensors", "b.safetensors", "notes.txt"}));
  ExpectLoads("a", a);
  ExpectLoads("b", b);
}

TEST_F(SavedFileStoreTest, BudgetRefusesSavesPastDiskBytes) {
  const PromptCacheFile file = MakeFile(4096, 1);
  const uint64_t size = EncodedSize(file);
  store_ = OpenStore(2 * size + size / 2);
  ASSERT_TRUE(store_->Save("a", file).ok());
  ASSERT_TRUE(store_->Save("b", file).ok());
  absl::StatusOr<SavedFileInfo> refused = store_->Save("c", file);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("disk_bytes"), absl::string_view::npos);
  absl::Status refused_upload = store_->WriteBytes("c", *EncodeSafetensorsBytes(file)).status();
  EXPECT_EQ(refused_upload.code(), absl::StatusCode::kResourceExhausted) << refused_upload;
  EXPECT_EQ(ListedNames(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(DirectoryEntries(dir_), (std::vector<std::string>{"a.safetensors", "b.safetensors"}));
  EXPECT_EQ(store_->used_bytes(), 2 * size);

  EXPECT_TRUE(store_->Save("a", MakeFile(4096, 2)).ok());  // replacing counts the old file out
  ASSERT_TRUE(store_->Delete("b").ok());
  EXPECT_TRUE(store_->Save("c", file).ok());
  EXPECT_EQ(store_->used_bytes(), 2 * size);
}

// A tenant's store: its own quota inside a budget other stores share. A
// refusal gives the refused store's own figures only, and a store that goes
// gives the budget back what its files were charged (they stay on disk for
// the next store to index).
TEST_F(SavedFileStoreTest, AQuotaInsideASharedBudget) {
  const uint64_t theirs = EncodedSize(MakeFile(4096, 1));
  const uint64_t mine = EncodedSize(MakeFile(8192, 1));
  ASSERT_NE(theirs, mine);
  store_.reset();
  // Declared after the budget, so they go before it whatever fails.
  DiskBudget shared(3 * theirs + mine + theirs / 2);
  const std::string other_dir = dir_ + "-other";
  absl::Cleanup remove_other = [&] { fs::remove_all(other_dir); };
  absl::StatusOr<std::unique_ptr<SavedFileStore>> other = SavedFileStore::Open(other_dir, shared);
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_TRUE((*other)->Save("t1", MakeFile(4096, 1)).ok());
  absl::StatusOr<std::unique_ptr<SavedFileStore>> quota =
      SavedFileStore::Open(dir_, shared, {.quota_bytes = mine + mine / 2});
  ASSERT_TRUE(quota.ok()) << quota.status();
  SavedFileStore& store = **quota;

  EXPECT_EQ(store.max_bytes(), mine + mine / 2);
  ASSERT_TRUE(store.Save("a", MakeFile(8192, 1)).ok());
  const absl::StatusOr<SavedFileInfo> past_quota = store.Save("b", MakeFile(8192, 2));
  EXPECT_EQ(past_quota.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(past_quota.status().message().find("max_saved_bytes"), absl::string_view::npos)
      << past_quota.status();
  EXPECT_EQ(shared.used(), theirs + mine);
  EXPECT_EQ(store.List().size(), 1u);

  // The other store, past the shared budget: refused naming it, and nothing
  // of this store's use shown to it.
  ASSERT_TRUE((*other)->Save("t2", MakeFile(4096, 2)).ok());
  ASSERT_TRUE((*other)->Save("t3", MakeFile(4096, 3)).ok());
  const absl::StatusOr<SavedFileInfo> past_budget = (*other)->Save("t4", MakeFile(4096, 4));
  EXPECT_EQ(past_budget.status().code(), absl::StatusCode::kResourceExhausted);
  const absl::string_view message = past_budget.status().message();
  EXPECT_NE(message.find("disk_bytes"), absl::string_view::npos) << message;
  EXPECT_NE(message.find(absl::StrCat(3 * theirs, " bytes in")), absl::string_view::npos)
      << message;
  EXPECT_EQ(message.find(absl::StrCat(mine)), absl::string_view::npos) << message;
  EXPECT_EQ(message.find(absl::StrCat(shared.used())), absl::string_view::npos) << message;

  quota->reset();
  EXPECT_EQ(shared.used(), 3 * theirs);
  other->reset();
  EXPECT_EQ(shared.used(), 0u);
  store_ = OpenStore(0);
  EXPECT_EQ(ListedNames(), (std::vector<std::string>{"a"}));  // still on disk
}

// A store that finds more on disk than its quota (the quota was lowered) may
// still replace a file with one no larger, which can only bring it down.
TEST_F(SavedFileStoreTest, AStoreOverItsQuotaMayStillShrink) {
  ASSERT_TRUE(store_->Save("a", MakeFile(8192, 1)).ok());
  ASSERT_TRUE(store_->Save("b", MakeFile(8192, 2)).ok());
  const uint64_t file = EncodedSize(MakeFile(8192, 1));
  store_.reset();
  DiskBudget shared(0);
  absl::StatusOr<std::unique_ptr<SavedFileStore>> lowered =
      SavedFileStore::Open(dir_, shared, {.quota_bytes = file});
  ASSERT_TRUE(lowered.ok()) << lowered.status();
  SavedFileStore& store = **lowered;
  EXPECT_EQ(store.used_bytes(), 2 * file);
  EXPECT_EQ(store.Save("c", MakeFile(4096, 3)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(store.Save("a", MakeFile(8192, 4)).ok());  // the same size
  EXPECT_TRUE(store.Save("b", MakeFile(4096, 5)).ok());  // smaller
  EXPECT_LT(store.used_bytes(), 2 * file);
  EXPECT_EQ(shared.used(), store.used_bytes());
  lowered->reset();
  EXPECT_EQ(shared.used(), 0u);
}

TEST_F(SavedFileStoreTest, BytesStreamOutAndBackIn) {
  const PromptCacheFile file = MakeFile(8192, 3);
  ASSERT_TRUE(store_->Save("a", file).ok());
  absl::StatusOr<std::string> bytes = store_->ReadBytes("a");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, *EncodeSafetensorsBytes(file));
  absl::StatusOr<SavedFileInfo> imported = store_->WriteBytes("copy", *bytes);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->size_bytes, bytes->size());
  ExpectLoads("copy", file);

  // A damaged upload is refused and changes nothing, not even the name it would replace.
  std::string damaged = *bytes;
  damaged[damaged.size() / 2] ^= 1;
  absl::Status refused = store_->WriteBytes("copy", damaged).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kDataLoss) << refused;
  EXPECT_NE(refused.message().find("\"copy\""), absl::string_view::npos) << refused;
  refused = store_->WriteBytes("new", bytes->substr(0, 100)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kDataLoss) << refused;
  ExpectLoads("copy", file);
  EXPECT_EQ(ListedNames(), (std::vector<std::string>{"a", "copy"}));
  EXPECT_EQ(CountTemporaries(dir_), 0);
}

TEST_F(SavedFileStoreTest, LoadRefusesAFileDamagedOnDisk) {
  ASSERT_TRUE(store_->Save("a", MakeFile(4096, 1)).ok());
  {
    std::fstream on_disk(dir_ + "/a.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    on_disk.seekp(-10, std::ios::end);
    on_disk.put('\x5a');
  }
  absl::Status loaded = store_->Load("a").status();
  EXPECT_EQ(loaded.code(), absl::StatusCode::kDataLoss) << loaded;
  EXPECT_NE(loaded.message().find("saved file \"a\""), absl::string_view::npos) << loaded;
  EXPECT_NE(loaded.message().find("1.kvcached_checksum"), absl::string_view::npos) << loaded;
}

// Files copied into the directory while the store runs (an operator moving
// mlx-lm prompt caches in): found by the first call that names them and by
// List, charged as an import would be, refused past the quota (left on
// disk, unindexed), and refused as damaged like any saved file.
TEST_F(SavedFileStoreTest, FilesCopiedInWhileRunningAreFoundAndCharged) {
  const PromptCacheFile file = MakeFile(8192, 1);
  const uint64_t size = EncodedSize(file);
  store_.reset();
  DiskBudget shared(0);
  absl::StatusOr<std::unique_ptr<SavedFileStore>> opened =
      SavedFileStore::Open(dir_, shared, {.quota_bytes = 2 * size + size / 2});
  ASSERT_TRUE(opened.ok()) << opened.status();
  SavedFileStore& store = **opened;
  ASSERT_TRUE(store.Save("a", file).ok());
  const auto copy_in = [&](const std::string& name) {
    fs::copy_file(dir_ + "/a.safetensors", dir_ + "/" + name + ".safetensors");
  };
  copy_in("loaded");
  absl::StatusOr<DecodedSafetensors> loaded = store.Load("loaded");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(SameFile(loaded->file, file));
  EXPECT_EQ(store.used_bytes(), 2 * size);
  EXPECT_EQ(shared.used(), 2 * size);

  copy_in("over");  // past the quota: refused naming it, the file left alone
  const absl::Status over = store.Load("over").status();
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_NE(over.message().find("max_saved_bytes"), absl::string_view::npos) << over;
  EXPECT_NE(over.message().find("over.safetensors"), absl::string_view::npos) << over;
  EXPECT_EQ(store.used_bytes(), 2 * size);
  EXPECT_TRUE(fs::exists(dir_ + "/over.safetensors"));
  fs::remove(dir_ + "/over.safetensors");

  ASSERT_TRUE(store.Delete("loaded").ok());
  copy_in("listed");
  std::vector<std::string> listed;
  for (const SavedFileInfo& info : store.List()) listed.push_back(info.name);
  EXPECT_EQ(listed, (std::vector<std::string>{"a", "listed"}));
  EXPECT_EQ(shared.used(), 2 * size);

  ASSERT_TRUE(store.Delete("listed").ok());
  // Deleted before anything indexed it, over the quota or not: nothing to credit.
  copy_in("never-indexed");
  copy_in("never-indexed-2");
  ASSERT_TRUE(store.Delete("never-indexed").ok());
  EXPECT_EQ(shared.used(), size);
  const absl::Status deleted_twice = store.Delete("never-indexed");
  EXPECT_EQ(deleted_twice.code(), absl::StatusCode::kNotFound) << deleted_twice;
  ASSERT_TRUE(store.Load("never-indexed-2").ok());
  copy_in("over-quota");  // a and never-indexed-2 hold 2 of the 2.5 sizes
  ASSERT_TRUE(store.Delete("over-quota").ok());
  EXPECT_FALSE(fs::exists(dir_ + "/over-quota.safetensors"));
  ASSERT_TRUE(store.Delete("never-indexed-2").ok());
  EXPECT_EQ(shared.used(), size);
  // A link is not followed out of the directory.
  fs::create_symlink(dir_ + "/a.safetensors", dir_ + "/link.safetensors");
  EXPECT_EQ(store.Load("link").status().code(), absl::StatusCode::kNotFound);
  fs::remove(dir_ + "/link.safetensors");
  {
    std::ofstream damaged(dir_ + "/damaged.safetensors", std::ios::binary);
    damaged << "not a safetensors file";
  }
  const absl::Status refused = store.Load("damaged").status();
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("saved file \"damaged\""), absl::string_view::npos) << refused;
  EXPECT_EQ(store.Load("never-there").status().code(), absl::StatusCode::kNotFound);
  opened->reset();
  EXPECT_EQ(shared.used(), 0u);
}

TEST_F(SavedFileStoreTest, ConcurrentSavesOfOneNameLeaveOneCompleteFile) {
  constexpr int kThreads = 6;
  std::vector<PromptCacheFile> contents;
  for (int seed = 0; seed < kThreads; ++seed)
    contents.push_back(MakeFile(65536 * (seed + 1), seed));
  std::vector<std::thread> threads;
  for (int seed = 0; seed < kThreads; ++seed) {
    threads.emplace_back([&, seed] {
      for (int round = 0; round < 3; ++round)
        EXPECT_TRUE(store_->Save("same", contents[seed]).ok());
    });
  }
  for (std::thread& thread : threads) thread.join();
  absl::StatusOr<DecodedSafetensors> loaded = store_->Load("same");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const int matches = std::count_if(contents.begin(), contents.end(),
                                    [&](const auto& file) { return SameFile(loaded->file, file); });
  EXPECT_EQ(matches, 1);
  EXPECT_EQ(DirectoryEntries(dir_), (std::vector<std::string>{"same.safetensors"}));
  EXPECT_EQ(store_->used_bytes(), fs::file_size(dir_ + "/same.safetensors"));
}

}  // namespace
}  // namespace kvcache::engine
