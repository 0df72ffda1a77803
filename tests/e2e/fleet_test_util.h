// The fleet tests' support: three kvcached processes of the binary this tree
// built (each with its --replica_name, data dir and ports on loopback), the
// fixture that starts them and a ShardedClient over them, and one-layer
// caches whose bytes the tests write and read back. After each test every
// live replica's pages are back on its free list.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "gtest/gtest.h"
#include "rendezvous.h"
#include "sharded_client.h"
#include "wire/ids/replica_id.h"
#include "wire_driver.h"

namespace kvcache::testing {

inline constexpr int kReplicas = 3;
inline constexpr uint32_t kHeadDim = 8;  // one head of float16: 16 bytes a token per tensor

// A free loopback TCP port (closed again: kvcached binds it next).
inline uint16_t FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

// Runs args[0] with `args`, its output appended to `log`: its pid.
// `env` entries (NAME=value) replace the parent's of that name in the child.
inline pid_t SpawnLogged(const std::vector<std::string>& args, const std::string& log,
                         const std::vector<std::string>& env = {}) {
  // Built before fork: the child only opens, dups and execs.
  std::vector<char*> argv;
  for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string_view inherited(*entry);
    const bool replaced = std::any_of(env.begin(), env.end(), [&](const std::string& own) {
      return inherited.substr(0, inherited.find('=') + 1) == own.substr(0, own.find('=') + 1);
    });
    if (!replaced) envp.push_back(*entry);
  }
  for (const std::string& own : env) envp.push_back(const_cast<char*>(own.c_str()));
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    dup2(fd, STDERR_FILENO);
    dup2(fd, STDOUT_FILENO);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  return pid;
}

// kvcached as a process of its own; its log in <data_dir>.log.
class KvcachedProcess {
 public:
  KvcachedProcess(std::string name, std::string data_dir, std::string replica_flag)
      : name_(std::move(name)),
        data_dir_(std::move(data_dir)),
        replica_flag_(std::move(replica_flag)),
        address_(absl::StrCat("127.0.0.1:", FreePort())),
        lane_(absl::StrCat("127.0.0.1:", FreePort())) {}
  ~KvcachedProcess() { Kill(); }

  // Starts it (again, on the same ports and data dir) and waits until it answers.
  ::testing::AssertionResult Start() {
    std::vector<std::string> args = {KVCACHED_BINARY,
                                     "--listen=" + address_,
                                     "--data_lane_listen=" + lane_,
                                     "--data_dir=" + data_dir_,
                                     "--validation",
                                     "--pool_bytes=33554432",
                                     "--page_bytes=8192",
                                     "--page_tokens=16",
                                     "--shutdown_grace=20s",
                                     replica_flag_};
    args.insert(args.end(), extra_flags_.begin(), extra_flags_.end());
    const std::string log = data_dir_ + ".log";
    pid_ = SpawnLogged(args, log, env_);
    // It serves once it logs that it listens (a client's probes would back
    // off for a second or more after the first refused connection).
    const absl::Time deadline = absl::Now() + absl::Seconds(120);
    const std::string listening = "listening on " + address_;
    while (absl::Now() < deadline) {
      std::ifstream text(log);
      const std::string lines((std::istreambuf_iterator<char>(text)), {});
      if (lines.find(listening, logged_) != std::string::npos) {
        logged_ = lines.size();
        return ::testing::AssertionSuccess();
      }
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return ::testing::AssertionFailure() << name_ << " exited at start; see " << log;
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    return ::testing::AssertionFailure() << name_ << " did not answer; see " << log;
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // SIGTERM: its exit code. A failed exit prints the end of its log (a
  // sanitizer's report, say), which the test's clean-up would delete.
  int Stop() {
    if (pid_ <= 0) return -1;
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code != 0) {
      std::ifstream text(data_dir_ + ".log");
      const std::string lines((std::istreambuf_iterator<char>(text)), {});
      std::fprintf(stderr, "%s exited %d; the end of its log:\n%s\n", name_.c_str(), code,
                   lines.substr(lines.size() > 16000 ? lines.size() - 16000 : 0).c_str());
    }
    return code;
  }
  bool running() const { return pid_ > 0; }
  // The --replica_name flag of the next Start.
  void set_replica_flag(std::string flag) { replica_flag_ = std::move(flag); }
  // Flags of every later Start, after the others.
  void add_flags(const std::vector<std::string>& flags) {
    extra_flags_.insert(extra_flags_.end(), flags.begin(), flags.end());
  }
  // Environment entries (NAME=value) of every later Start.
  void set_env(std::vector<std::string> env) { env_ = std::move(env); }
  // The next Start listens on another gRPC port (a pod that moved).
  void Relocate() { address_ = absl::StrCat("127.0.0.1:", FreePort()); }
  const std::string& name() const { return name_; }
  const std::string& address() const { return address_; }

 private:
  std::string name_, data_dir_, replica_flag_, address_, lane_;
  std::vector<std::string> extra_flags_;
  std::vector<std::string> env_;
  pid_t pid_ = -1;
  size_t logged_ = 0;  // the log's bytes of earlier runs
};

inline v1::CacheSpec OneLayer(const std::string& model = "fleet-model") {
  v1::CacheSpec spec = ToWireSpec(MakeSpec({StandardLayerSpec(1, kHeadDim)}));
  spec.set_model(model);
  return spec;
}

inline std::vector<std::byte> RandomBytes(std::mt19937_64& random, uint64_t tokens) {
  std::vector<std::byte> bytes(tokens * kHeadDim * 2);
  for (std::byte& b : bytes) b = static_cast<std::byte>(random());
  return bytes;
}

// A one-layer cache's K and V as written (one head, batch 1: appended in order).
struct Written {
  std::vector<std::byte> keys, values;
};

// Appends `tokens` random tokens to `cache_id` through `client`.
inline absl::Status Append(Client& client, const std::string& cache_id, uint64_t tokens,
                           std::mt19937_64& random, Written& written) {
  std::vector<std::byte> keys = RandomBytes(random, tokens), values = RandomBytes(random, tokens);
  LayerUpdate update{.layer = 0,
                     .keys_shape = {1, 1, tokens, kHeadDim},
                     .keys = keys,
                     .values_shape = {1, 1, tokens, kHeadDim},
                     .values = values};
  absl::StatusOr<std::vector<v1::UpdateResponse>> acked = client.Update(cache_id, {&update, 1});
  if (!acked.ok()) return acked.status();
  written.keys.insert(written.keys.end(), keys.begin(), keys.end());
  written.values.insert(written.values.end(), values.begin(), values.end());
  return absl::OkStatus();
}

inline ::testing::AssertionResult Holds(Client& client, const std::string& cache_id,
                                        const std::string& snapshot_id, const Written& written) {
  absl::StatusOr<LayerHistory> history = client.FetchLayer(cache_id, snapshot_id, 0);
  if (!history.ok()) return ::testing::AssertionFailure() << history.status();
  if (history->keys != written.keys || history->values != written.values) {
    return ::testing::AssertionFailure() << "bytes differ: " << history->tokens << " tokens read";
  }
  return ::testing::AssertionSuccess();
}

class E2eFleetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = absl::StrCat(::testing::TempDir(), "fleet-", getpid(), "-",
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
    for (int i = 0; i < kReplicas; ++i) {
      const std::string name = absl::StrCat("kvcached-", i);
      replicas_.push_back(std::make_unique<KvcachedProcess>(name, absl::StrCat(root_, "/", name),
                                                            "--replica_name=" + name));
      ASSERT_TRUE(replicas_.back()->Start());
    }
    fleet_ = ConnectFleet(/*with_names=*/true);
    ASSERT_NE(fleet_, nullptr);
  }

  void TearDown() override {
    // Everything the test left is released, and then every live replica's
    // pages are all free again.
    for (size_t i = 0; fleet_ != nullptr && i < replicas_.size(); ++i) {
      if (!replicas_[i]->running()) continue;
      Client& client = fleet_->client(i);
      if (auto prefixes = client.ListPrefixes(); prefixes.ok()) {
        for (const v1::PrefixEntry& entry : *prefixes) {
          EXPECT_TRUE(client.ReleaseSnapshot(entry.snapshot().snapshot_id()).ok());
        }
      }
      if (auto snapshots = client.ListSnapshots(); snapshots.ok()) {
        for (const v1::SnapshotInfo& s : *snapshots) {
          client.ReleaseSnapshot(s.snapshot_id()).IgnoreError();  // some went with their prefix
        }
      }
      if (auto caches = client.ListCaches(); caches.ok()) {
        for (const v1::CacheInfo& c : *caches) EXPECT_TRUE(client.DeleteCache(c.cache_id()).ok());
      }
      absl::StatusOr<v1::Stats> stats = client.GetStats();
      ASSERT_TRUE(stats.ok()) << stats.status();
      EXPECT_EQ(stats->pages_used(), 0u) << replicas_[i]->name() << " leaked pages";
      EXPECT_EQ(stats->host_pages_used() + stats->disk_pages_used(), 0u);
    }
    // SIGTERM with the fleet's clients still connected, idle: once no call
    // is under way kvcached exits at once, without waiting its 20 s grace for
    // clients to hang up (idle ones that do not poll never do). The bound
    // leaves room for a sanitizer's exit checks.
    for (const auto& replica : replicas_) {
      if (!replica->running()) continue;
      const absl::Time start = absl::Now();
      EXPECT_EQ(replica->Stop(), 0) << replica->name() << " exit";
      EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << replica->name() << " waited its grace";
    }
    fleet_.reset();
    replicas_.clear();
    if (!HasFailure()) std::filesystem::remove_all(root_);
  }

  std::unique_ptr<ShardedClient> ConnectFleet(bool with_names) {
    ShardedClientOptions options{.client = {.data_lane = "auto"}};
    for (const auto& replica : replicas_) {
      options.replicas.push_back(
          {.name = with_names ? replica->name() : "", .address = replica->address()});
    }
    absl::StatusOr<std::unique_ptr<ShardedClient>> fleet = ShardedClient::Connect(options);
    EXPECT_TRUE(fleet.ok()) << fleet.status();
    return fleet.ok() ? *std::move(fleet) : nullptr;
  }

  // A placement key whose first replica is `replica`.
  std::string KeyFirstOn(size_t replica, const std::string& stem) {
    for (int i = 0;; ++i) {
      std::string key = absl::StrCat(stem, "-", i);
      if (fleet_->Order(key)[0] == replica) return key;
    }
  }

  std::string root_;
  std::vector<std::unique_ptr<KvcachedProcess>> replicas_;
  std::unique_ptr<ShardedClient> fleet_;
};

}  // namespace kvcache::testing
