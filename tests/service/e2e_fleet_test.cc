// A fleet of three kvcached processes (the binary this tree built, each with
// its --replica_name, data dir and ports on loopback) used through
// kvcache::ShardedClient: ids name their replica and every call goes there;
// caches spread over the replicas; random operation sequences through the
// fleet against the CPU reference; one replica SIGKILLed while the others
// are in use: only its own caches go UNAVAILABLE, creates move on to the
// next replica, the others' every byte is still right, and once restarted
// it finds its saved snapshots again; snapshots restored and prefixes
// published across replicas. After each test every live replica's pages are
// back on its free list.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <netinet/in.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "gtest/gtest.h"
#include "ids/replica_id.h"
#include "rendezvous.h"
#include "sharded_client.h"
#include "wire_driver.h"

namespace kvcache::testing {
namespace {

constexpr int kReplicas = 3;
constexpr uint32_t kHeadDim = 8;  // one head of float16: 16 bytes a token per tensor

// A free loopback TCP port (closed again: kvcached binds it next).
uint16_t FreePort() {
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
    const std::vector<std::string> args = {KVCACHED_BINARY,
                                           "--listen=" + address_,
                                           "--data_lane_listen=" + lane_,
                                           "--data_dir=" + data_dir_,
                                           "--validation",
                                           "--pool_bytes=33554432",
                                           "--page_bytes=8192",
                                           "--page_tokens=16",
                                           "--shutdown_grace=20s",
                                           replica_flag_};
    const std::string log = data_dir_ + ".log";
    std::vector<char*> argv;  // built before fork: the child only opens, dups and execs
    for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      dup2(fd, STDERR_FILENO);
      dup2(fd, STDOUT_FILENO);
      execv(argv[0], argv.data());
      _exit(127);
    }
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
  // SIGTERM: its exit code.
  int Stop() {
    if (pid_ <= 0) return -1;
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  bool running() const { return pid_ > 0; }
  // The --replica_name flag of the next Start.
  void set_replica_flag(std::string flag) { replica_flag_ = std::move(flag); }
  const std::string& name() const { return name_; }
  const std::string& address() const { return address_; }

 private:
  std::string name_, data_dir_, replica_flag_, address_, lane_;
  pid_t pid_ = -1;
  size_t logged_ = 0;  // the log's bytes of earlier runs
};

v1::CacheSpec OneLayer(const std::string& model = "fleet-model") {
  v1::CacheSpec spec = ToWireSpec(MakeSpec({StandardLayerSpec(1, kHeadDim)}));
  spec.set_model(model);
  return spec;
}

std::vector<std::byte> RandomBytes(std::mt19937_64& random, uint64_t tokens) {
  std::vector<std::byte> bytes(tokens * kHeadDim * 2);
  for (std::byte& b : bytes) b = static_cast<std::byte>(random());
  return bytes;
}

// A one-layer cache's K and V as written (one head, batch 1: appended in order).
struct Written {
  std::vector<std::byte> keys, values;
};

// Appends `tokens` random tokens to `cache_id` through `client`.
absl::Status Append(Client& client, const std::string& cache_id, uint64_t tokens,
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

::testing::AssertionResult Holds(Client& client, const std::string& cache_id,
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
      options.replicas.push_back({.name = with_names ? replica->name() : "",
                                  .address = replica->address()});
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

TEST_F(E2eFleetTest, IdsNameTheirReplicaAndCachesSpreadOverAll) {
  constexpr int kCaches = 150;
  std::map<size_t, int> per_replica;
  std::vector<std::string> ids;
  for (int i = 0; i < kCaches; ++i) {
    absl::StatusOr<v1::CacheInfo> info = fleet_->CreateCache(OneLayer(), 0, absl::StrCat("c", i));
    ASSERT_TRUE(info.ok()) << info.status();
    absl::StatusOr<size_t> owner = fleet_->ReplicaOf(info->cache_id());
    ASSERT_TRUE(owner.ok()) << owner.status();
    EXPECT_EQ(*owner, fleet_->Order(absl::StrCat("c", i))[0]) << "not the key's first replica";
    EXPECT_EQ(info->cache_id().rfind(replicas_[*owner]->name() + ":", 0), 0u) << info->cache_id();
    ++per_replica[*owner];
    ids.push_back(info->cache_id());
  }
  for (int r = 0; r < kReplicas; ++r) {
    // 50 expected each; the keys are fixed, so this is exact, not by chance.
    EXPECT_GE(per_replica[r], 35) << "replica " << r;
    EXPECT_LE(per_replica[r], 65) << "replica " << r;
    absl::StatusOr<std::vector<v1::CacheInfo>> listed = fleet_->client(r).ListCaches();
    ASSERT_TRUE(listed.ok());
    EXPECT_EQ(listed->size(), static_cast<size_t>(per_replica[r])) << "a cache on the wrong replica";
  }
  // Snapshots and speculations name their replica too, and calls reach them.
  absl::StatusOr<Client*> owner = fleet_->Owner(ids[0]);
  ASSERT_TRUE(owner.ok());
  std::mt19937_64 random(7);
  Written written;
  ASSERT_TRUE(Append(**owner, ids[0], 5, random, written).ok());
  absl::StatusOr<v1::SnapshotInfo> snapshot = (*owner)->Snapshot(ids[0], 0);
  ASSERT_TRUE(snapshot.ok());
  EXPECT_EQ(fleet_->ReplicaOf(snapshot->snapshot_id()).value(), fleet_->ReplicaOf(ids[0]).value());
  EXPECT_TRUE(Holds(**fleet_->Owner(snapshot->snapshot_id()), "", snapshot->snapshot_id(), written));
  absl::StatusOr<v1::BeginSpeculationResponse> speculation =
      (*owner)->BeginSpeculation(ids[0], false);
  ASSERT_TRUE(speculation.ok());
  EXPECT_EQ(fleet_->ReplicaOf(speculation->speculation_id()).value(),
            fleet_->ReplicaOf(ids[0]).value());
  EXPECT_TRUE((*owner)->AbortSpeculation(speculation->speculation_id()).ok());

  // Ids that name no replica of the fleet.
  EXPECT_EQ(fleet_->Owner("0123456789abcdef0123456789abcdef").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(fleet_->Owner("kvcached-9:0123456789abcdef0123456789abcdef").status().code(),
            absl::StatusCode::kNotFound);
  // Another replica never holds an id it did not make.
  const size_t other = (fleet_->ReplicaOf(ids[0]).value() + 1) % kReplicas;
  EXPECT_EQ(fleet_->client(other).GetCache(ids[0]).status().code(), absl::StatusCode::kNotFound);
}

// HAProxy (docker/haproxy.cfg, as documented) in front of the fleet, as a
// process of its own; null with the reason in `skipped` where there is none.
class HaproxyProcess {
 public:
  static std::unique_ptr<HaproxyProcess> Start(
      const std::vector<std::unique_ptr<KvcachedProcess>>& replicas, std::string& skipped) {
    constexpr char kBinary[] = "/usr/sbin/haproxy";
    if (access(kBinary, X_OK) != 0) {
      skipped = "no /usr/sbin/haproxy (bash .ci/setup installs Debian's haproxy)";
      return nullptr;
    }
    auto proxy = std::unique_ptr<HaproxyProcess>(new HaproxyProcess);
    proxy->address_ = absl::StrCat("127.0.0.1:", FreePort());
    const std::string config =
        (std::filesystem::path(__FILE__).parent_path() / "../../docker/haproxy.cfg").string();
    std::vector<std::string> environment = {"KVCACHED_PROXY_LISTEN=" + proxy->address_};
    for (size_t i = 0; i < replicas.size(); ++i) {
      environment.push_back(absl::StrCat("KVCACHED_", i, "=", replicas[i]->address()));
    }
    std::vector<char*> envp;
    for (std::string& variable : environment) envp.push_back(variable.data());
    envp.push_back(nullptr);
    const char* argv[] = {kBinary, "-db", "-f", config.c_str(), nullptr};
    proxy->pid_ = fork();
    if (proxy->pid_ == 0) {
      execve(kBinary, const_cast<char* const*>(argv), envp.data());
      _exit(127);
    }
    return proxy;
  }
  ~HaproxyProcess() {
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
  }
  const std::string& address() const { return address_; }

 private:
  HaproxyProcess() = default;
  std::string address_;
  pid_t pid_ = -1;
};

// One address for the fleet: the sharding client lists every replica by
// name at the proxy's address, and each call reaches the replica it names
// (its id's), the data lane going direct; a replica that is down makes its
// own ids UNAVAILABLE through the proxy, never NOT_FOUND from another.
TEST_F(E2eFleetTest, HaproxyInFrontSendsEachCallToTheReplicaItNames) {
  std::string skipped;
  std::unique_ptr<HaproxyProcess> proxy = HaproxyProcess::Start(replicas_, skipped);
  if (proxy == nullptr) GTEST_SKIP() << skipped;
  for (const std::string data_lane : {"", "auto"}) {
    ShardedClientOptions options{.client = {.data_lane = data_lane}};
    for (const auto& replica : replicas_) {
      options.replicas.push_back({.name = replica->name(), .address = proxy->address()});
    }
    absl::StatusOr<std::unique_ptr<ShardedClient>> through = ShardedClient::Connect(options);
    ASSERT_TRUE(through.ok()) << through.status();
    // Connect takes named replicas that do not answer yet: the proxy may
    // still be starting.
    ASSERT_TRUE((*through)->client(0).WaitForReady(absl::Seconds(30)).ok()) << "no proxy";
    std::mt19937_64 random(11);
    for (size_t r = 0; r < replicas_.size(); ++r) {
      absl::StatusOr<v1::Stats> stats = (*through)->client(r).GetStats();
      ASSERT_TRUE(stats.ok()) << stats.status();
      EXPECT_EQ(stats->replica_name(), replicas_[r]->name()) << "answered by another replica";
      absl::StatusOr<v1::CacheInfo> cache =
          (*through)->CreateCache(OneLayer(), 0, KeyFirstOn(r, "proxied" + data_lane));
      ASSERT_TRUE(cache.ok()) << cache.status();
      Written written;
      Client& owner = *(*through)->Owner(cache->cache_id()).value();
      EXPECT_EQ(owner.uses_data_lane(), data_lane == "auto");
      ASSERT_TRUE(Append(owner, cache->cache_id(), 9, random, written).ok());
      EXPECT_TRUE(Holds(owner, cache->cache_id(), "", written));
      // It lives where its id says: that replica, asked directly, has it.
      EXPECT_TRUE(Holds(fleet_->client(r), cache->cache_id(), "", written));
    }
  }
  // Down: its ids are UNAVAILABLE through the proxy too.
  ShardedClientOptions options;
  for (const auto& replica : replicas_) {
    options.replicas.push_back({.name = replica->name(), .address = proxy->address()});
  }
  absl::StatusOr<std::unique_ptr<ShardedClient>> through = ShardedClient::Connect(options);
  ASSERT_TRUE(through.ok()) << through.status();
  absl::StatusOr<std::vector<v1::CacheInfo>> on_one = fleet_->client(1).ListCaches();
  ASSERT_TRUE(on_one.ok() && !on_one->empty());
  replicas_[1]->Kill();
  absl::SleepFor(absl::Seconds(3));  // the proxy's checks see it down (docker/haproxy.cfg)
  const absl::Status lost = (*through)->client(1).GetCache(on_one->front().cache_id()).status();
  EXPECT_EQ(lost.code(), absl::StatusCode::kUnavailable) << lost;
  EXPECT_TRUE((*through)->client(0).GetStats().ok()) << "the others still answer";
}

TEST_F(E2eFleetTest, NamesAreLearnedAndChecked) {
  std::unique_ptr<ShardedClient> learned = ConnectFleet(/*with_names=*/false);
  ASSERT_NE(learned, nullptr);
  for (int r = 0; r < kReplicas; ++r) EXPECT_EQ(learned->replica(r).name, replicas_[r]->name());

  ShardedClientOptions wrong;
  wrong.replicas = {{.name = "kvcached-1", .address = replicas_[0]->address()}};
  EXPECT_EQ(ShardedClient::Connect(wrong).status().code(),
            absl::StatusCode::kFailedPrecondition);

  KvcachedProcess unnamed("unnamed", absl::StrCat(root_, "/unnamed"), "--replica_name=");
  ASSERT_TRUE(unnamed.Start());
  ShardedClientOptions without;
  without.replicas = {{.address = unnamed.address()}};
  absl::Status refused = ShardedClient::Connect(without).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("--replica_name"), absl::string_view::npos) << refused;
  EXPECT_EQ(unnamed.Stop(), 0);

  // A replica name kvcached will not take.
  KvcachedProcess bad("bad", absl::StrCat(root_, "/bad"), "--replica_name=a:b");
  EXPECT_FALSE(bad.Start());
}

// A replica restarted at its address under another replica's name answers a
// create (or a copy of a snapshot) with an id that later calls would route to
// that other replica: the fleet client refuses it and lets go of what it
// cannot reach again.
TEST_F(E2eFleetTest, ACacheNamedForAnotherReplicaIsRefusedAndDeleted) {
  // A snapshot on replica 2, to be copied to the renamed replica below.
  absl::StatusOr<v1::CacheInfo> source = fleet_->CreateCache(OneLayer(), 0, KeyFirstOn(2, "src"));
  ASSERT_TRUE(source.ok()) << source.status();
  std::mt19937_64 random(3);
  Written written;
  ASSERT_TRUE(Append(fleet_->client(2), source->cache_id(), 4, random, written).ok());
  absl::StatusOr<v1::SnapshotInfo> snapshot = fleet_->client(2).Snapshot(source->cache_id(), 0);
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();

  ASSERT_EQ(replicas_[0]->Stop(), 0);
  replicas_[0]->set_replica_flag("--replica_name=kvcached-1");
  ASSERT_TRUE(replicas_[0]->Start());
  // Fail-fast calls alone would not drive the reconnect: only a waiting
  // caller polls the connect grpc starts when its backoff ends.
  ASSERT_TRUE(fleet_->client(0).WaitForReady(absl::Seconds(30)).ok());
  absl::StatusOr<v1::Stats> back = fleet_->client(0).GetStats();
  ASSERT_TRUE(back.ok()) << back.status();
  absl::StatusOr<v1::CacheInfo> created =
      fleet_->CreateCache(OneLayer(), 0, KeyFirstOn(0, "renamed"));
  EXPECT_EQ(created.status().code(), absl::StatusCode::kFailedPrecondition) << created.status();
  EXPECT_NE(created.status().message().find("--replica_name"), absl::string_view::npos);
  absl::StatusOr<std::vector<v1::CacheInfo>> left = fleet_->client(0).ListCaches();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_TRUE(left->empty()) << left->size() << " caches left on the renamed replica";

  absl::StatusOr<v1::SnapshotInfo> copy = fleet_->CopySnapshotTo(snapshot->snapshot_id(), 0);
  EXPECT_EQ(copy.status().code(), absl::StatusCode::kFailedPrecondition) << copy.status();
  absl::StatusOr<std::vector<v1::SnapshotInfo>> copies = fleet_->client(0).ListSnapshots();
  ASSERT_TRUE(copies.ok()) << copies.status();
  EXPECT_TRUE(copies->empty()) << copies->size() << " copies left on the renamed replica";
}

TEST_F(E2eFleetTest, RandomSequencesThroughTheFleetMatchTheReference) {
  const engine::CacheSpec specs[] = {
      MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(1, 8, 4)}),
      MakeSpec({RotatingLayerSpec(2, 8, 8, 12, 4), StandardLayerSpec(1, 8)}),
  };
  std::vector<std::unique_ptr<WireDriver>> drivers;
  for (int i = 0; i < 6; ++i) {
    drivers.push_back(std::make_unique<WireDriver>(
        *fleet_, WireConfig{.name = absl::StrCat("fleet-", i),
                            .spec = specs[i % 2],
                            .operations = 800,
                            .seed = 1000 + static_cast<uint64_t>(i),
                            .shares_server = true}));
  }
  ASSERT_FALSE(HasFailure());
  std::vector<std::thread> threads;
  for (auto& driver : drivers) threads.emplace_back([&driver] { driver->Run(); });
  for (std::thread& thread : threads) thread.join();
  for (auto& driver : drivers) driver->Finish();
}

TEST_F(E2eFleetTest, AKilledReplicaTakesOnlyItsOwnCachesAndFindsItsSavedSnapshotsAgain) {
  constexpr size_t kVictim = 1;
  std::mt19937_64 random(11);
  struct Tracked {
    std::string id;
    size_t replica;
    Written written;
  };
  std::vector<Tracked> caches;
  for (int i = 0; i < 12; ++i) {
    absl::StatusOr<v1::CacheInfo> info =
        fleet_->CreateCache(OneLayer(), 0, KeyFirstOn(i % kReplicas, absl::StrCat("k", i)));
    ASSERT_TRUE(info.ok()) << info.status();
    Tracked tracked{info->cache_id(), fleet_->ReplicaOf(info->cache_id()).value(), {}};
    ASSERT_EQ(tracked.replica, static_cast<size_t>(i % kReplicas));
    ASSERT_TRUE(Append(fleet_->client(tracked.replica), tracked.id, 20, random, tracked.written).ok());
    caches.push_back(std::move(tracked));
  }
  // The victim's caches are saved as prompt-cache files in its data dir.
  std::map<std::string, Written> saved;
  for (const Tracked& cache : caches) {
    if (cache.replica != kVictim) continue;
    Client& client = fleet_->client(kVictim);
    absl::StatusOr<v1::SnapshotInfo> snapshot = client.Snapshot(cache.id, 0);
    ASSERT_TRUE(snapshot.ok());
    const std::string name = absl::StrCat("saved-", saved.size());
    ASSERT_TRUE(client.SaveSnapshot(snapshot->snapshot_id(), name).ok());
    ASSERT_TRUE(client.ReleaseSnapshot(snapshot->snapshot_id()).ok());
    saved[name] = cache.written;
  }

  // Workers keep writing to and reading every other replica's caches while
  // the victim is killed.
  std::atomic<bool> stop{false};
  std::atomic<int> rounds{0};
  std::thread worker([&] {
    std::mt19937_64 worker_random(12);
    while (!stop.load()) {
      for (Tracked& cache : caches) {
        if (cache.replica == kVictim) continue;
        Client& client = **fleet_->Owner(cache.id);
        EXPECT_TRUE(Append(client, cache.id, 3, worker_random, cache.written).ok());
        EXPECT_TRUE(Holds(client, cache.id, "", cache.written)) << cache.id;
      }
      rounds.fetch_add(1);
    }
  });
  while (rounds.load() < 2) absl::SleepFor(absl::Milliseconds(10));
  replicas_[kVictim]->Kill();
  const int rounds_at_kill = rounds.load();
  while (rounds.load() < rounds_at_kill + 3) absl::SleepFor(absl::Milliseconds(10));
  stop = true;
  worker.join();

  for (const Tracked& cache : caches) {
    Client& owner = **fleet_->Owner(cache.id);
    if (cache.replica == kVictim) {
      EXPECT_EQ(owner.GetCache(cache.id).status().code(), absl::StatusCode::kUnavailable);
    } else {
      EXPECT_TRUE(Holds(owner, cache.id, "", cache.written)) << cache.id;
    }
  }
  // Creates that would go to the victim go to their key's next replica.
  for (int i = 0; i < 4; ++i) {
    const std::string key = KeyFirstOn(kVictim, absl::StrCat("while-down", i));
    absl::StatusOr<v1::CacheInfo> info = fleet_->CreateCache(OneLayer(), 0, key);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(fleet_->ReplicaOf(info->cache_id()).value(), fleet_->Order(key)[1]);
  }

  // Restarted on its data dir: its saved snapshots are listed and load with
  // every byte; the caches it held in memory are gone (NOT_FOUND, not
  // someone else's).
  ASSERT_TRUE(replicas_[kVictim]->Start());
  Client& victim = fleet_->client(kVictim);
  ASSERT_TRUE(victim.WaitForReady(absl::Seconds(30)).ok());
  absl::StatusOr<std::vector<v1::SavedFile>> listed = victim.ListSaved();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->size(), saved.size());
  for (const auto& [name, written] : saved) {
    absl::StatusOr<v1::LoadSnapshotResponse> loaded = victim.LoadSnapshot(name);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(fleet_->ReplicaOf(loaded->snapshot().snapshot_id()).value(), kVictim);
    EXPECT_TRUE(Holds(victim, "", loaded->snapshot().snapshot_id(), written)) << name;
    EXPECT_TRUE(victim.DeleteSaved(name).ok());
  }
  for (const Tracked& cache : caches) {
    if (cache.replica == kVictim) {
      EXPECT_EQ(victim.GetCache(cache.id).status().code(), absl::StatusCode::kNotFound);
    }
  }
}

TEST_F(E2eFleetTest, SnapshotsRestoreAndPrefixesPublishAcrossReplicas) {
  std::mt19937_64 random(21);
  // A snapshot on replica 0 restored into a cache on replica 2.
  absl::StatusOr<v1::CacheInfo> source = fleet_->CreateCache(OneLayer(), 0, KeyFirstOn(0, "src"));
  absl::StatusOr<v1::CacheInfo> target = fleet_->CreateCache(OneLayer(), 0, KeyFirstOn(2, "dst"));
  ASSERT_TRUE(source.ok() && target.ok());
  Written written;
  ASSERT_TRUE(Append(fleet_->client(0), source->cache_id(), 40, random, written).ok());
  absl::StatusOr<v1::SnapshotInfo> snapshot = fleet_->client(0).Snapshot(source->cache_id(), 0);
  ASSERT_TRUE(snapshot.ok());
  absl::StatusOr<v1::CacheInfo> restored =
      fleet_->Restore(target->cache_id(), snapshot->snapshot_id(), 40);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->offset(), 40u);
  EXPECT_TRUE(Holds(fleet_->client(2), target->cache_id(), "", written));
  EXPECT_TRUE(fleet_->client(2).ListSnapshots()->empty()) << "the copy outlived the restore";
  EXPECT_EQ(fleet_->client(0).ListSnapshots()->size(), 1u) << "the original went";

  // Prompts: every extension of the first 64 tokens goes to one replica.
  std::vector<uint32_t> prompt(200);
  for (uint32_t& token : prompt) token = static_cast<uint32_t>(random() % 32000);
  const v1::CacheSpec spec = OneLayer("prompt-model");
  const size_t home = fleet_->Order(fleet_->PromptKey(spec, prompt))[0];
  for (size_t length : {64, 65, 100, 200}) {
    EXPECT_EQ(fleet_->Order(fleet_->PromptKey(spec, {prompt.data(), length}))[0], home);
  }
  // A worker prefills the prompt in a cache placed anywhere, and publishes it:
  // the snapshot is copied to the prompt's replica.
  const size_t elsewhere = (home + 1) % kReplicas;
  absl::StatusOr<v1::CacheInfo> prefill =
      fleet_->CreateCache(spec, 0, KeyFirstOn(elsewhere, "prefill"));
  ASSERT_TRUE(prefill.ok());
  Written prefix;
  ASSERT_TRUE(Append(fleet_->client(elsewhere), prefill->cache_id(), 200, random, prefix).ok());
  absl::StatusOr<v1::SnapshotInfo> prompt_snapshot =
      fleet_->client(elsewhere).Snapshot(prefill->cache_id(), 0);
  ASSERT_TRUE(prompt_snapshot.ok());
  absl::StatusOr<v1::PublishPrefixResponse> published =
      fleet_->PublishPrefix(spec, prompt_snapshot->snapshot_id(), prompt);
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(fleet_->ReplicaOf(published->entry().snapshot_id()).value(), home);

  // Another worker (a client of its own) finds it with a longer prompt and
  // restores it into a cache created for that prompt: all on one replica.
  std::unique_ptr<ShardedClient> second = ConnectFleet(/*with_names=*/true);
  std::vector<uint32_t> longer = prompt;
  longer.insert(longer.end(), {1, 2, 3});
  absl::StatusOr<v1::LookupPrefixResponse> found = second->LookupPrefix(spec, longer);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(found->matched_tokens(), 200u);
  absl::StatusOr<v1::CacheInfo> worker_cache = second->CreateCacheForPrompt(spec, longer);
  ASSERT_TRUE(worker_cache.ok());
  EXPECT_EQ(second->ReplicaOf(worker_cache->cache_id()).value(), home);
  ASSERT_TRUE(second->Restore(worker_cache->cache_id(), found->snapshot().snapshot_id(), 200).ok());
  EXPECT_TRUE(Holds(second->client(home), worker_cache->cache_id(), "", prefix));
  EXPECT_TRUE(second->client(home).ReleaseSnapshot(found->snapshot().snapshot_id()).ok());
}

// kvcachectl's output of `args` run over the fleet (--peers), and its exit code.
std::pair<std::string, int> Kvcachectl(const std::string& peers, const std::string& args) {
  const std::string command =
      absl::StrCat(KVCACHECTL_BINARY, " --peers=", peers, " ", args, " 2>&1");
  FILE* out = popen(command.c_str(), "r");
  std::string text;
  char buffer[512];
  while (out != nullptr && fgets(buffer, sizeof(buffer), out) != nullptr) text += buffer;
  const int status = out != nullptr ? pclose(out) : -1;
  return {text, WIFEXITED(status) ? WEXITSTATUS(status) : -1};
}

TEST_F(E2eFleetTest, KvcachectlWorksOnTheFleet) {
  std::vector<std::string> peers;
  for (const auto& replica : replicas_) {
    peers.push_back(absl::StrCat(replica->name(), "=", replica->address()));
  }
  const std::string fleet = absl::StrJoin(peers, ",");
  const auto [stats, stats_code] = Kvcachectl(fleet, "stats");
  EXPECT_EQ(stats_code, 0) << stats;
  for (const auto& replica : replicas_) {
    EXPECT_NE(stats.find("== replica " + replica->name()), std::string::npos) << stats;
    EXPECT_NE(stats.find("replica       " + replica->name()), std::string::npos) << stats;
  }
  // describe and snapshot go to the replica an id names.
  absl::StatusOr<v1::CacheInfo> cache = fleet_->CreateCache(OneLayer(), 0, KeyFirstOn(2, "ctl"));
  ASSERT_TRUE(cache.ok());
  const auto [described, described_code] = Kvcachectl(fleet, "describe " + cache->cache_id());
  EXPECT_EQ(described_code, 0) << described;
  EXPECT_NE(described.find("cache " + cache->cache_id()), std::string::npos) << described;
  std::mt19937_64 random(31);
  Written written;
  ASSERT_TRUE(Append(fleet_->client(2), cache->cache_id(), 4, random, written).ok());
  const auto [snapshot, snapshot_code] = Kvcachectl(fleet, "snapshot " + cache->cache_id());
  EXPECT_EQ(snapshot_code, 0) << snapshot;
  EXPECT_EQ(fleet_->client(2).ListSnapshots()->size(), 1u);
  // File commands need the replica named.
  const auto [load, load_code] = Kvcachectl(fleet, "load-saved nothing");
  EXPECT_NE(load_code, 0);
  EXPECT_NE(load.find("--replica=NAME"), std::string::npos) << load;
}

}  // namespace
}  // namespace kvcache::testing
