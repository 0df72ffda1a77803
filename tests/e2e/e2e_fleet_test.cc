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
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "fleet_test_util.h"
#include "gtest/gtest.h"
#include "rendezvous.h"
#include "sharded_client.h"
#include "wire/ids/replica_id.h"
#include "wire_driver.h"

namespace kvcache::testing {
namespace {

TEST_F(E2eFleetTest, IdsNameTheirReplicaAndCachesSpreadOverAll) {
  constexpr int kCaches = 150;
  std::map<size_t, int> per_replica;
  std::vector<std::string> ids;
  for (int i = 0; i < kCaches; ++i) {
    absl::StatusOr<v1::CacheInfo> info =
        fleet_->CreateCache(OneLayer(), {.placement_key = absl::StrCat("c", i)});
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
  absl::StatusOr<v1::SnapshotInfo> snapshot = (*owner)->Snapshot(ids[0]);
  ASSERT_TRUE(snapshot.ok());
  EXPECT_EQ(fleet_->ReplicaOf(snapshot->snapshot_id()).value(), fleet_->ReplicaOf(ids[0]).value());
  EXPECT_TRUE(Holds(**fleet_->Owner(snapshot->snapshot_id()), "", snapshot->snapshot_id(), written));
  absl::StatusOr<v1::BeginSpeculationResponse> speculation = (*owner)->BeginSpeculation(ids[0]);
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
  absl::StatusOr<v1::CacheInfo> source =
      fleet_->CreateCache(OneLayer(), {.placement_key = KeyFirstOn(2, "src")});
  ASSERT_TRUE(source.ok()) << source.status();
  std::mt19937_64 random(3);
  Written written;
  ASSERT_TRUE(Append(fleet_->client(2), source->cache_id(), 4, random, written).ok());
  absl::StatusOr<v1::SnapshotInfo> snapshot = fleet_->client(2).Snapshot(source->cache_id());
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
      fleet_->CreateCache(OneLayer(), {.placement_key = KeyFirstOn(0, "renamed")});
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
    absl::StatusOr<v1::CacheInfo> info = fleet_->CreateCache(
        OneLayer(), {.placement_key = KeyFirstOn(i % kReplicas, absl::StrCat("k", i))});
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
    absl::StatusOr<v1::SnapshotInfo> snapshot = client.Snapshot(cache.id);
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
    absl::StatusOr<v1::CacheInfo> info = fleet_->CreateCache(OneLayer(), {.placement_key = key});
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
  absl::StatusOr<v1::CacheInfo> source =
      fleet_->CreateCache(OneLayer(), {.placement_key = KeyFirstOn(0, "src")});
  absl::StatusOr<v1::CacheInfo> target =
      fleet_->CreateCache(OneLayer(), {.placement_key = KeyFirstOn(2, "dst")});
  ASSERT_TRUE(source.ok() && target.ok());
  Written written;
  ASSERT_TRUE(Append(fleet_->client(0), source->cache_id(), 40, random, written).ok());
  absl::StatusOr<v1::SnapshotInfo> snapshot = fleet_->client(0).Snapshot(source->cache_id());
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
      fleet_->CreateCache(spec, {.placement_key = KeyFirstOn(elsewhere, "prefill")});
  ASSERT_TRUE(prefill.ok());
  Written prefix;
  ASSERT_TRUE(Append(fleet_->client(elsewhere), prefill->cache_id(), 200, random, prefix).ok());
  absl::StatusOr<v1::SnapshotInfo> prompt_snapshot =
      fleet_->client(elsewhere).Snapshot(prefill->cache_id());
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
  absl::StatusOr<v1::CacheInfo> cache =
      fleet_->CreateCache(OneLayer(), {.placement_key = KeyFirstOn(2, "ctl")});
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
