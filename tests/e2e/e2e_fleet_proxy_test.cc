// HAProxy in front of a fleet (docker/haproxy.cfg, as documented): the
// sharding client lists every replica by name at the proxy's one address,
// each call reaches the replica it names (the data lane going direct), and a
// replica that is down makes its own ids UNAVAILABLE through the proxy,
// never another replica's NOT_FOUND.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "fleet_test_util.h"
#include "gtest/gtest.h"
#include "sharded_client.h"

namespace kvcache::testing {
namespace {

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
      absl::StatusOr<v1::CacheInfo> cache = (*through)->CreateCache(
          OneLayer(), {.placement_key = KeyFirstOn(r, "proxied" + data_lane)});
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

}  // namespace
}  // namespace kvcache::testing
