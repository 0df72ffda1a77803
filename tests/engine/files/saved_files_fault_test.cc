// The saved-file store under faults, each in a forked child so the fault stays
// there: a save killed at a random moment, and a write the kernel refuses.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "engine/files/saved_files.h"
#include "gtest/gtest.h"

namespace kvcache::engine {
namespace {

namespace fs = std::filesystem;

PromptCacheFile PatternFile(uint64_t tokens, int seed) {
  PromptCacheFile file;
  for (const char* name : {"0.0", "0.1"}) {
    FileTensor& tensor = file.tensors[name];
    tensor.dtype = FileDType::kBF16;
    tensor.shape = {1, 8, tokens, 128};
    tensor.data.resize(8 * tokens * 128 * 2);
    for (size_t i = 0; i < tensor.data.size(); ++i) tensor.data[i] = std::byte((seed + i) % 253);
  }
  file.metadata = {{"1.seed", absl::StrFormat("%d", seed)}};
  return file;
}

bool SameFile(const PromptCacheFile& a, const PromptCacheFile& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (const auto& [name, tensor] : a.tensors) {
    auto other = b.tensors.find(name);
    if (other == b.tensors.end() || other->second.shape != tensor.shape ||
        other->second.data != tensor.data) {
      return false;
    }
  }
  return true;
}

int CountTemporaries(const std::string& dir) {
  int count = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    count += entry.path().filename().string().rfind(".tmp-", 0) == 0;
  }
  return count;
}

class SavedFileFaultTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::path(testing::TempDir()) /
            absl::StrFormat("saved_files_fault_%016x", absl::Uniform<uint64_t>(random_)))
               .string();
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  absl::BitGen random_;
  std::string dir_;
};

// A child saves "victim" over and over, alternating two contents of a few MB,
// until SIGKILL lands at a random moment. Whatever the moment, the store
// reopened afterwards holds no temporary and either no file or exactly one of
// the two contents.
TEST_F(SavedFileFaultTest, KilledSavesLeaveTheOldOrTheNewFile) {
  const std::vector<PromptCacheFile> contents = {PatternFile(1024, 1), PatternFile(1536, 2)};
  int rounds_with_file = 0;
  for (int round = 0; round < 20; ++round) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      absl::StatusOr<std::unique_ptr<SavedFileStore>> store = SavedFileStore::Open(dir_, 0);
      for (int save = 0; store.ok() && save < 1000; ++save) {
        if (!(*store)->Save("victim", contents[save % 2]).ok()) _exit(2);
      }
      _exit(store.ok() ? 0 : 3);
    }
    absl::SleepFor(absl::Microseconds(absl::Uniform(random_, 0, 60000)));
    kill(child, SIGKILL);
    int wait_status = 0;
    ASSERT_EQ(waitpid(child, &wait_status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(wait_status)) << "child ended by itself: " << wait_status;

    absl::StatusOr<std::unique_ptr<SavedFileStore>> store = SavedFileStore::Open(dir_, 0);
    ASSERT_TRUE(store.ok()) << store.status();
    EXPECT_EQ(CountTemporaries(dir_), 0) << "round " << round;
    if ((*store)->List().empty()) continue;
    ++rounds_with_file;
    absl::StatusOr<DecodedSafetensors> loaded = (*store)->Load("victim");
    ASSERT_TRUE(loaded.ok()) << "round " << round << ": " << loaded.status();
    EXPECT_TRUE(SameFile(loaded->file, contents[0]) || SameFile(loaded->file, contents[1]))
        << "round " << round;
  }
  EXPECT_GT(rounds_with_file, 0);  // else no kill landed after a save: the test tested nothing
}

// The kernel refuses the write (RLIMIT_FSIZE → EFBIG, as a full disk would
// with ENOSPC): the save fails cleanly, the old file stays, no temporary is left.
TEST_F(SavedFileFaultTest, RefusedWriteKeepsTheOldFile) {
  const PromptCacheFile small = PatternFile(4, 1), large = PatternFile(512, 2);
  {
    absl::StatusOr<std::unique_ptr<SavedFileStore>> store = SavedFileStore::Open(dir_, 0);
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Save("kept", small).ok());
  }
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // exit code: 0 as expected, else which check failed
    signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{.rlim_cur = 64 * 1024, .rlim_max = RLIM_INFINITY};
    if (setrlimit(RLIMIT_FSIZE, &limit) != 0) _exit(10);
    absl::StatusOr<std::unique_ptr<SavedFileStore>> store = SavedFileStore::Open(dir_, 0);
    if (!store.ok()) _exit(11);
    absl::Status saved = (*store)->Save("kept", large).status();
    if (saved.code() != absl::StatusCode::kResourceExhausted) _exit(12);
    if (saved.message().find(dir_) == absl::string_view::npos) _exit(13);
    if ((*store)->List().size() != 1 || (*store)->List()[0].size_bytes > limit.rlim_cur) _exit(14);
    _exit(0);
  }
  int wait_status = 0;
  ASSERT_EQ(waitpid(child, &wait_status, 0), child);
  ASSERT_TRUE(WIFEXITED(wait_status));
  EXPECT_EQ(WEXITSTATUS(wait_status), 0) << "failed check (see the exit codes in the child)";
  EXPECT_EQ(CountTemporaries(dir_), 0);
  absl::StatusOr<std::unique_ptr<SavedFileStore>> store = SavedFileStore::Open(dir_, 0);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<DecodedSafetensors> loaded = (*store)->Load("kept");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(SameFile(loaded->file, small));
}

}  // namespace
}  // namespace kvcache::engine
