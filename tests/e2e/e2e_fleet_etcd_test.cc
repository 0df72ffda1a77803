// A fleet that etcd lists: three kvcached processes list themselves in a
// real etcd (Debian's etcd-server) under leases, and a ShardedClient watches
// the list. Replicas that stop, die, lose their lease or move are followed
// by the client, and a name is never listed by two replicas at once.
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "etcd_process.h"
#include "fleet_test_util.h"
#include "tools/http_get.h"

namespace kvcache::testing {
namespace {

constexpr char kPrefix[] = "/kvcached/replicas/";

class E2eFleetEtcdTest : public E2eFleetTest {
 protected:
  void SetUp() override {
    if (EtcdProcess::Binary().empty()) {
      GTEST_SKIP() << "etcd is not installed (Debian's etcd-server; bash .ci/setup installs it)";
    }
    root_ = absl::StrCat(::testing::TempDir(), "fleet-etcd-", getpid(), "-",
                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
    etcd_ = std::make_unique<EtcdProcess>(root_ + "/etcd");
    ASSERT_TRUE(etcd_->Start());
    for (int i = 0; i < kReplicas; ++i) {
      const std::string name = absl::StrCat("kvcached-", i);
      replicas_.push_back(std::make_unique<KvcachedProcess>(name, absl::StrCat(root_, "/", name),
                                                            "--replica_name=" + name));
      replicas_.back()->add_flags(EtcdFlags());
      ASSERT_TRUE(replicas_.back()->Start());
    }
    // Connected once all three are listed, so the fleet's indexes are the
    // replicas' (etcd lists them by name).
    ASSERT_TRUE(Eventually([&] { return etcd_->Listed(kPrefix).size() == kReplicas; }));
    absl::StatusOr<std::unique_ptr<ShardedClient>> fleet = ShardedClient::Connect(
        {.etcd = {.endpoints = etcd_->endpoint()}, .client = {.data_lane = "auto"}});
    ASSERT_TRUE(fleet.ok()) << fleet.status();
    fleet_ = *std::move(fleet);
    for (size_t r = 0; r < kReplicas; ++r) ASSERT_EQ(fleet_->replica(r).name, replicas_[r]->name());
  }

  void TearDown() override {
    E2eFleetTest::TearDown();
    if (etcd_) etcd_->Kill();
  }

  std::vector<std::string> EtcdFlags() const {
    // 3 s: renewals every second, each given a second to answer (which a
    // replica under a sanitizer has too).
    return {"--etcd_endpoints=" + etcd_->endpoint(), "--etcd_lease_ttl=3s"};
  }

  // Polls `holds` for up to `bound`.
  template <typename Condition>
  static bool Eventually(const Condition& holds, absl::Duration bound = absl::Seconds(20)) {
    const absl::Time deadline = absl::Now() + bound;
    while (!holds()) {
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return true;
  }

  // How many Range calls etcd has served, from its own metrics.
  absl::StatusOr<double> EtcdRanges() const {
    absl::StatusOr<std::string> metrics = HttpGet(etcd_->endpoint(), "/metrics");
    if (!metrics.ok()) return metrics.status();
    double ranges = 0;
    for (absl::string_view line : absl::StrSplit(*metrics, '\n')) {
      if (!absl::StartsWith(line, "grpc_server_started_total{") ||
          !absl::StrContains(line, "grpc_method=\"Range\"")) {
        continue;
      }
      double count = 0;
      if (!absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &count)) {
        return absl::InternalError(absl::StrCat("etcd metrics: ", line));
      }
      ranges += count;
    }
    return ranges;
  }
  bool MembersAre(const std::vector<size_t>& expected) {
    return Eventually([&] { return fleet_->Members() == expected; });
  }

  // The replica each of `count` new caches (random keys) went to.
  std::map<size_t, int> CreateSpread(int count) {
    std::map<size_t, int> per_replica;
    for (int i = 0; i < count; ++i) {
      absl::StatusOr<v1::CacheInfo> cache = fleet_->CreateCache(OneLayer());
      EXPECT_TRUE(cache.ok()) << cache.status();
      if (!cache.ok()) continue;
      ++per_replica[fleet_->ReplicaOf(cache->cache_id()).value()];
      EXPECT_TRUE(fleet_->Owner(cache->cache_id()).value()->DeleteCache(cache->cache_id()).ok());
    }
    return per_replica;
  }

  std::unique_ptr<EtcdProcess> etcd_;
};

TEST_F(E2eFleetEtcdTest, ReplicasJoinAndLeaveTheClientsFleet) {
  EXPECT_EQ(fleet_->Members(), (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(etcd_->Listed(kPrefix)[absl::StrCat(kPrefix, "kvcached-1")], replicas_[1]->address());
  std::map<size_t, int> spread = CreateSpread(60);
  EXPECT_EQ(spread.size(), 3u) << "a replica got no cache";

  // Caches with bytes on every replica.
  std::mt19937_64 random(7);
  std::vector<std::pair<std::string, Written>> caches;
  for (size_t r = 0; r < kReplicas; ++r) {
    absl::StatusOr<v1::CacheInfo> cache =
        fleet_->CreateCache(OneLayer(), {.placement_key = KeyFirstOn(r, "bytes")});
    ASSERT_TRUE(cache.ok()) << cache.status();
    ASSERT_EQ(fleet_->ReplicaOf(cache->cache_id()).value(), r);
    Written written;
    ASSERT_TRUE(Append(fleet_->client(r), cache->cache_id(), 24, random, written).ok());
    caches.emplace_back(cache->cache_id(), written);
  }

  // A replica that stops takes itself off the list: no create goes there,
  // its caches are UNAVAILABLE and every other byte is right.
  EXPECT_EQ(replicas_[1]->Stop(), 0);
  ASSERT_TRUE(MembersAre({0, 2})) << "the stopped replica is still a member";
  EXPECT_FALSE(etcd_->Listed(kPrefix).contains(absl::StrCat(kPrefix, "kvcached-1")));
  spread = CreateSpread(30);
  EXPECT_FALSE(spread.contains(1)) << spread[1] << " caches went to the stopped replica";
  for (const auto& [id, written] : caches) {
    Client& owner = **fleet_->Owner(id);
    if (fleet_->ReplicaOf(id).value() == 1) {
      EXPECT_EQ(owner.GetCache(id).status().code(), absl::StatusCode::kUnavailable);
    } else {
      EXPECT_TRUE(Holds(owner, id, "", written)) << id;
    }
  }

  // Back, it lists itself again and takes its share.
  ASSERT_TRUE(replicas_[1]->Start());
  ASSERT_TRUE(MembersAre({0, 1, 2}));
  ASSERT_TRUE(fleet_->client(1).WaitForReady(absl::Seconds(30)).ok());
  EXPECT_TRUE(CreateSpread(60).contains(1));
}

// A replica finds the owner of a snapshot it is asked to pull in etcd (it
// has no --peers): the bytes go from replica to replica.
TEST_F(E2eFleetEtcdTest, AReplicaPullsASnapshotFromTheOwnerEtcdLists) {
  std::mt19937_64 random(3);
  absl::StatusOr<v1::CacheInfo> cache =
      fleet_->CreateCache(OneLayer(), {.placement_key = KeyFirstOn(0, "pull")});
  ASSERT_TRUE(cache.ok()) << cache.status();
  Written written;
  ASSERT_TRUE(Append(fleet_->client(0), cache->cache_id(), 40, random, written).ok());
  absl::StatusOr<v1::SnapshotInfo> snapshot = fleet_->client(0).Snapshot(cache->cache_id());
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();

  absl::StatusOr<v1::LoadSnapshotResponse> pulled =
      fleet_->client(1).PullSnapshot(snapshot->snapshot_id());
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ASSERT_EQ(fleet_->ReplicaOf(pulled->snapshot().snapshot_id()).value(), 1u);
  absl::StatusOr<v1::CacheInfo> copy =
      fleet_->CreateCache(OneLayer(), {.placement_key = KeyFirstOn(1, "copy")});
  ASSERT_TRUE(copy.ok()) << copy.status();
  ASSERT_TRUE(
      fleet_->client(1).Restore(copy->cache_id(), pulled->snapshot().snapshot_id(), 40).ok());
  EXPECT_TRUE(Holds(fleet_->client(1), copy->cache_id(), "", written));
  ASSERT_TRUE(fleet_->client(1).ReleaseSnapshot(pulled->snapshot().snapshot_id()).ok());
  ASSERT_TRUE(fleet_->client(0).ReleaseSnapshot(snapshot->snapshot_id()).ok());

  // A name etcd does not list is no peer, and asking for made-up names costs
  // etcd nothing: the replica looks them up in the list it watches.
  const absl::StatusOr<double> ranges_before = EtcdRanges();
  ASSERT_TRUE(ranges_before.ok()) << ranges_before.status();
  ASSERT_GT(*ranges_before, 0) << "etcd's metrics count no Range call (the fleet made some)";
  // 200 lookups; the replicas' own lease renewals read etcd too, a few a second.
  for (int i = 0; i < 200; ++i) {
    const absl::Status unlisted =
        fleet_->client(1).PullSnapshot(absl::StrCat("kvcached-made-up-", i, ":00")).status();
    EXPECT_EQ(unlisted.code(), absl::StatusCode::kNotFound) << unlisted;
    EXPECT_NE(unlisted.message().find("not listed in etcd"), absl::string_view::npos) << unlisted;
  }
  const absl::StatusOr<double> ranges_after = EtcdRanges();
  ASSERT_TRUE(ranges_after.ok()) << ranges_after.status();
  EXPECT_LT(*ranges_after - *ranges_before, 100) << "lookups read etcd";
}

// A replica that joins after the others started is found by them: each
// watches etcd's list.
TEST_F(E2eFleetEtcdTest, AReplicaThatJoinsLaterIsFoundByThePeersWatch) {
  EXPECT_EQ(replicas_[2]->Stop(), 0);
  ASSERT_TRUE(MembersAre({0, 1}));
  ASSERT_TRUE(replicas_[2]->Start());
  ASSERT_TRUE(MembersAre({0, 1, 2}));
  std::mt19937_64 random(5);
  absl::StatusOr<v1::CacheInfo> cache =
      fleet_->CreateCache(OneLayer(), {.placement_key = KeyFirstOn(2, "late")});
  ASSERT_TRUE(cache.ok()) << cache.status();
  Written written;
  ASSERT_TRUE(Append(fleet_->client(2), cache->cache_id(), 24, random, written).ok());
  absl::StatusOr<v1::SnapshotInfo> snapshot = fleet_->client(2).Snapshot(cache->cache_id());
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  absl::StatusOr<v1::LoadSnapshotResponse> pulled;
  // The puller's watch may see the new key a moment after the client's did.
  EXPECT_TRUE(Eventually([&] {
    pulled = fleet_->client(0).PullSnapshot(snapshot->snapshot_id());
    return pulled.ok();
  })) << pulled.status();
  ASSERT_TRUE(pulled.ok());
  ASSERT_TRUE(fleet_->client(0).ReleaseSnapshot(pulled->snapshot().snapshot_id()).ok());
  ASSERT_TRUE(fleet_->client(2).ReleaseSnapshot(snapshot->snapshot_id()).ok());
}

TEST_F(E2eFleetEtcdTest, AKilledReplicaLeavesWhenItsLeaseRunsOut) {
  replicas_[2]->Kill();  // no withdrawal: only its 3 s lease ends the listing
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(MembersAre({0, 1}));
  EXPECT_LT(absl::Now() - killed, absl::Seconds(10));
  EXPECT_FALSE(CreateSpread(30).contains(2));
}

TEST_F(E2eFleetEtcdTest, ALostLeaseIsListedAgain) {
  // Every lease revoked (an etcd operator's mistake, or an etcd that lost
  // them): the keys go, and each replica grants itself a new lease.
  etcdserverpb::LeaseLeasesRequest request;
  etcdserverpb::LeaseLeasesResponse leases;
  grpc::ClientContext context;
  ASSERT_TRUE(etcd_->Lease()->LeaseLeases(&context, request, &leases).ok());
  ASSERT_EQ(leases.leases_size(), kReplicas);
  for (const etcdserverpb::LeaseStatus& lease : leases.leases()) {
    etcdserverpb::LeaseRevokeRequest revoke;
    revoke.set_id(lease.id());
    etcdserverpb::LeaseRevokeResponse revoked;
    grpc::ClientContext revoke_context;
    ASSERT_TRUE(etcd_->Lease()->LeaseRevoke(&revoke_context, revoke, &revoked).ok());
  }
  EXPECT_TRUE(Eventually([&] { return etcd_->Listed(kPrefix).size() == kReplicas; }));
  EXPECT_TRUE(MembersAre({0, 1, 2}));
  EXPECT_EQ(CreateSpread(60).size(), 3u);
}

TEST_F(E2eFleetEtcdTest, AKeyDeletedByHandIsPutBack) {
  etcdserverpb::DeleteRangeRequest request;
  request.set_key(absl::StrCat(kPrefix, "kvcached-2"));
  etcdserverpb::DeleteRangeResponse deleted;
  grpc::ClientContext context;
  ASSERT_TRUE(etcd_->Kv()->DeleteRange(&context, request, &deleted).ok());
  ASSERT_EQ(deleted.deleted(), 1);
  // Seen by the replica at its next renewal, a third of its lease on.
  EXPECT_TRUE(Eventually([&] {
    return etcd_->Listed(kPrefix)[absl::StrCat(kPrefix, "kvcached-2")] == replicas_[2]->address();
  }));
  EXPECT_TRUE(MembersAre({0, 1, 2}));
}

TEST_F(E2eFleetEtcdTest, AnEtcdRestartLosesNeitherListingsNorTheWatch) {
  etcd_->Kill();
  absl::SleepFor(absl::Seconds(1));
  // While etcd is away the client keeps its last list, and serves.
  EXPECT_EQ(fleet_->Members(), (std::vector<size_t>{0, 1, 2}));
  EXPECT_FALSE(CreateSpread(6).empty());
  ASSERT_TRUE(etcd_->Start());  // same ports, same data dir
  EXPECT_TRUE(Eventually([&] { return etcd_->Listed(kPrefix).size() == kReplicas; }));
  // The client watches again: a replica that stops now is seen to go.
  EXPECT_EQ(replicas_[2]->Stop(), 0);
  EXPECT_TRUE(MembersAre({0, 1}));
}

TEST_F(E2eFleetEtcdTest, AReplicaThatMovedIsReachedAtItsNewAddress) {
  // A snapshot saved in replica 0's data dir, before it moves to another port.
  std::mt19937_64 random(9);
  absl::StatusOr<v1::CacheInfo> cache =
      fleet_->CreateCache(OneLayer(), {.placement_key = KeyFirstOn(0, "move")});
  ASSERT_TRUE(cache.ok()) << cache.status();
  Written written;
  ASSERT_TRUE(Append(fleet_->client(0), cache->cache_id(), 40, random, written).ok());
  absl::StatusOr<v1::SnapshotInfo> snapshot = fleet_->client(0).Snapshot(cache->cache_id());
  ASSERT_TRUE(snapshot.ok()) << snapshot.status();
  ASSERT_TRUE(fleet_->client(0).SaveSnapshot(snapshot->snapshot_id(), "before-move").ok());
  const std::string old_address = replicas_[0]->address();
  EXPECT_EQ(replicas_[0]->Stop(), 0);
  replicas_[0]->Relocate();
  ASSERT_TRUE(replicas_[0]->Start());
  ASSERT_NE(replicas_[0]->address(), old_address);
  ASSERT_TRUE(Eventually([&] { return fleet_->replica(0).address == replicas_[0]->address(); }));
  ASSERT_TRUE(MembersAre({0, 1, 2}));
  Client& moved = fleet_->client(0);
  ASSERT_TRUE(moved.WaitForReady(absl::Seconds(30)).ok());
  absl::StatusOr<v1::LoadSnapshotResponse> loaded = moved.LoadSnapshot("before-move");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(fleet_->ReplicaOf(loaded->snapshot().snapshot_id()).value(), 0u);
  EXPECT_TRUE(Holds(**fleet_->Owner(loaded->snapshot().snapshot_id()), "",
                    loaded->snapshot().snapshot_id(), written));
  EXPECT_TRUE(moved.DeleteSaved("before-move").ok());
}

TEST_F(E2eFleetEtcdTest, ANameIsListedByOneReplicaOnly) {
  // A second process under replica 0's name, at another address, does not
  // start; the listing stays the first one's.
  KvcachedProcess impostor("impostor", root_ + "/impostor", "--replica_name=kvcached-0");
  impostor.add_flags(EtcdFlags());
  EXPECT_FALSE(impostor.Start());
  std::ifstream log(root_ + "/impostor.log");
  const std::string text((std::istreambuf_iterator<char>(log)), {});
  EXPECT_NE(text.find("two replicas must not share a name"), std::string::npos) << text;
  EXPECT_EQ(etcd_->Listed(kPrefix)[absl::StrCat(kPrefix, "kvcached-0")], replicas_[0]->address());

  // The same name at the same address is the replica's own next run: it
  // takes the listing over without waiting for the old lease.
  replicas_[0]->Kill();
  ASSERT_TRUE(replicas_[0]->Start());
  EXPECT_EQ(etcd_->Listed(kPrefix)[absl::StrCat(kPrefix, "kvcached-0")], replicas_[0]->address());
  absl::SleepFor(absl::Seconds(4));  // past the old lease: the new one keeps the key
  EXPECT_EQ(etcd_->Listed(kPrefix)[absl::StrCat(kPrefix, "kvcached-0")], replicas_[0]->address());
  EXPECT_TRUE(MembersAre({0, 1, 2}));
}

TEST_F(E2eFleetEtcdTest, RefusesABadEtcdConfiguration) {
  // Without etcd the client fails at once, naming it.
  absl::StatusOr<std::unique_ptr<ShardedClient>> nowhere =
      ShardedClient::Connect({.etcd = {.endpoints = absl::StrCat("127.0.0.1:", FreePort())},
                              .connect_timeout = absl::Milliseconds(500)});
  ASSERT_FALSE(nowhere.ok());
  EXPECT_NE(nowhere.status().message().find("etcd at 127.0.0.1:"), std::string::npos)
      << nowhere.status();
  for (const char* endpoints : {"", "http://", "127.0.0.1:1/x"}) {
    absl::StatusOr<std::unique_ptr<ShardedClient>> bad =
        ShardedClient::Connect({.etcd = {.endpoints = endpoints}});
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << endpoints;
  }
  EXPECT_EQ(ShardedClient::Connect({.replicas = {{.name = "a", .address = "127.0.0.1:1"}},
                                    .etcd = {.endpoints = etcd_->endpoint()}})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  // A replica without a name, or listening on every address without saying
  // which one clients reach, does not start.
  KvcachedProcess unnamed("unnamed", root_ + "/unnamed", "--replica_name=");
  unnamed.add_flags(EtcdFlags());
  EXPECT_FALSE(unnamed.Start());
  std::ifstream log(root_ + "/unnamed.log");
  const std::string text((std::istreambuf_iterator<char>(log)), {});
  EXPECT_NE(text.find("replica_name: a replica listed in etcd needs a name"), std::string::npos)
      << text;
  KvcachedProcess anywhere("anywhere", root_ + "/anywhere", "--replica_name=anywhere");
  anywhere.add_flags(EtcdFlags());
  anywhere.add_flags({absl::StrCat("--listen=0.0.0.0:", FreePort())});
  EXPECT_FALSE(anywhere.Start());
  std::ifstream anywhere_log(root_ + "/anywhere.log");
  const std::string anywhere_text((std::istreambuf_iterator<char>(anywhere_log)), {});
  EXPECT_NE(anywhere_text.find("advertise_address: the host:port clients reach"), std::string::npos)
      << anywhere_text;
  EXPECT_EQ(etcd_->Listed(kPrefix).size(), static_cast<size_t>(kReplicas));
}

// etcd as a security team runs it: TLS, and only clients with a certificate
// of its CA. Replicas and clients given one are listed and read the list;
// without one they are refused, and nothing is sent in plaintext.
TEST(E2eFleetEtcdTlsTest, OnlyClientsWithCertificatesListOrReadReplicas) {
  if (EtcdProcess::Binary().empty()) {
    GTEST_SKIP() << "etcd is not installed (Debian's etcd-server; bash .ci/setup installs it)";
  }
  const std::string root = absl::StrCat(::testing::TempDir(), "fleet-etcd-tls-", getpid());
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  const std::string script = absl::StrCat(
      "set -e; cd '", root, "'\n",
      "key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out $1; }\n",
      "key ca.key; openssl req -x509 -new -key ca.key -days 1 -subj /CN=etcd-ca -out ca.pem\n",
      "printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth\\n' > server.ext\n",
      "printf 'extendedKeyUsage=clientAuth\\n' > client.ext\n",
      "for who in server client; do key $who.key; openssl req -new -key $who.key "
      "-subj /CN=$who -out $who.csr; openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key "
      "-CAcreateserial -days 1 -extfile $who.ext -out $who.pem; done\n");
  std::ofstream(root + "/make.sh") << script;
  ASSERT_EQ(std::system(absl::StrCat("bash '", root, "/make.sh' 2>/dev/null").c_str()), 0)
      << "openssl could not make the certificates";
  auto file = [&](const char* name) { return absl::StrCat(root, "/", name); };
  EtcdProcess etcd(root + "/etcd", EtcdTls{.ca = file("ca.pem"),
                                           .cert = file("server.pem"),
                                           .key = file("server.key"),
                                           .client_cert = file("client.pem"),
                                           .client_key = file("client.key")});
  ASSERT_TRUE(etcd.Start());
  const std::string https = "--etcd_endpoints=https://" + etcd.endpoint();

  KvcachedProcess listed("kvcached-0", root + "/kvcached-0", "--replica_name=kvcached-0");
  listed.add_flags({https, "--etcd_ca=" + file("ca.pem"), "--etcd_cert=" + file("client.pem"),
                    "--etcd_key=" + file("client.key")});
  ASSERT_TRUE(listed.Start());
  // Trusting the CA but without a certificate of its own: etcd refuses it,
  // so it serves unlisted (and keeps trying).
  KvcachedProcess refused("kvcached-1", root + "/kvcached-1", "--replica_name=kvcached-1");
  refused.add_flags({https, "--etcd_ca=" + file("ca.pem")});
  // Under AddressSanitizer, its leak check is off: about one run in 15 it
  // ends with some 9 KiB in 55 allocations made inside libcrypto
  // unreleased, after etcd rejected its handshakes (a client without a
  // certificate). Its only OpenSSL user is gRPC's TLS channel to etcd
  // (Debian's gRPC 1.51; its own server is plaintext), so the leak is
  // gRPC's. Every other process of the suite keeps the check.
  const char* asan = std::getenv("ASAN_OPTIONS");
  refused.set_env({absl::StrCat("ASAN_OPTIONS=", asan ? asan : "", ":detect_leaks=0")});
  ASSERT_TRUE(refused.Start());

  const etcd::EtcdOptions with_certificate = {.endpoints = "https://" + etcd.endpoint(),
                                              .ca_file = file("ca.pem"),
                                              .cert_file = file("client.pem"),
                                              .key_file = file("client.key")};
  absl::StatusOr<std::unique_ptr<ShardedClient>> fleet =
      ShardedClient::Connect({.etcd = with_certificate});
  ASSERT_TRUE(fleet.ok()) << fleet.status();
  absl::SleepFor(absl::Seconds(2));  // time for the refused one to have tried
  ASSERT_EQ((*fleet)->size(), 1u);
  EXPECT_EQ((*fleet)->replica(0).name, "kvcached-0");
  EXPECT_EQ((*fleet)->replica(0).address, listed.address());
  EXPECT_EQ(etcd.Listed("/kvcached/replicas/").size(), 1u);

  // Clients without a certificate, or speaking plaintext, read nothing.
  etcd::EtcdOptions without_certificate = with_certificate;
  without_certificate.cert_file = without_certificate.key_file = "";
  for (const etcd::EtcdOptions& options :
       {without_certificate, etcd::EtcdOptions{.endpoints = etcd.endpoint()}}) {
    absl::StatusOr<std::unique_ptr<ShardedClient>> denied =
        ShardedClient::Connect({.etcd = options, .connect_timeout = absl::Seconds(1)});
    EXPECT_FALSE(denied.ok());
  }
  EXPECT_EQ(listed.Stop(), 0);
  EXPECT_EQ(refused.Stop(), 0);
  EXPECT_TRUE(etcd.Listed("/kvcached/replicas/").empty()) << "the listed one withdrew";
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace kvcache::testing
