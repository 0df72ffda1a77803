// Prompt-cache files through a whole server: a snapshot saved to the data
// dir, listed, loaded back and fetched byte for byte; the same through the
// Export / Import streams (files larger than one message); files survive a
// restart; bad names, unknown ids, partial snapshots and damaged bytes are
// refused with their status and change nothing; without a data dir the
// data-dir calls say so and the streams still work. A replica pulls another
// replica's snapshot itself (PullSnapshot): byte for byte, with the caller's
// own token (another tenant's snapshot stays out of reach), and the ids,
// peers and owners it cannot pull from are refused by name.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service_test_util.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;


// A cache of two standard layers and a rotating one (window 8, 4 sinks)
// holding `tokens` tokens, and a snapshot of it from 0.
v1::SnapshotInfo FillSnapshot(Client& client, std::mt19937_64& rng, uint64_t tokens,
                              uint32_t heads = 2, uint32_t dim = 8) {
  const v1::CacheSpec spec = ProtoSpec(2, heads, dim, /*window=*/8);
  auto cache = client.CreateCache(spec);
  EXPECT_TRUE(cache.ok()) << cache.status();
  if (!cache.ok()) return {};
  for (uint64_t sent = 0; sent < tokens;) {
    const uint64_t step = std::min<uint64_t>(tokens - sent, 200);
    std::vector<v1::UpdateRequest> requests;
    std::vector<LayerUpdate> updates;
    for (int layer = 0; layer < spec.layers_size(); ++layer) {
      requests.push_back(RandomUpdate(cache->cache_id(), spec, layer, step, rng));
    }
    for (const v1::UpdateRequest& request : requests) updates.push_back(ToLayerUpdate(request));
    EXPECT_TRUE(client.Update(cache->cache_id(), updates).ok());
    sent += step;
  }
  auto snapshot = client.Snapshot(cache->cache_id());
  EXPECT_TRUE(snapshot.ok()) << snapshot.status();
  return snapshot.value_or(v1::SnapshotInfo());
}

// Every layer of the two snapshots (each read through its own server's
// client) holds the same positions and bytes.
void ExpectSameHistory(Client& expected_client, const std::string& expected_id,
                       Client& actual_client, const std::string& actual_id, int layers) {
  for (int layer = 0; layer < layers; ++layer) {
    auto expected = expected_client.FetchLayer("", expected_id, layer);
    auto actual = actual_client.FetchLayer("", actual_id, layer);
    ASSERT_TRUE(expected.ok()) << expected.status();
    ASSERT_TRUE(actual.ok()) << actual.status();
    EXPECT_EQ(actual->ranges, expected->ranges) << "layer " << layer;
    EXPECT_TRUE(actual->keys == expected->keys) << "layer " << layer;
    EXPECT_TRUE(actual->values == expected->values) << "layer " << layer;
  }
}

class E2eFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_dir_ = std::filesystem::path(::testing::TempDir()) /
                ("kvcached-files-" + std::to_string(std::random_device()()));
    std::filesystem::create_directories(data_dir_);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->CleanUpAndCheck();
    server_.reset();
    std::filesystem::remove_all(data_dir_);
  }
  void Start(bool with_data_dir = true) {
    server_ = TestServer::Start(ServerSetup{.data_dir = with_data_dir ? data_dir_.string() : ""});
    ASSERT_NE(server_, nullptr);
  }
  Client& client() { return server_->client(); }

  v1::SnapshotInfo FilledSnapshot(uint64_t tokens, uint32_t heads = 2, uint32_t dim = 8) {
    return FillSnapshot(client(), rng_, tokens, heads, dim);
  }
  void ExpectSameHistory(const std::string& expected_id, const std::string& actual_id, int layers) {
    testing::ExpectSameHistory(client(), expected_id, client(), actual_id, layers);
  }
  size_t SnapshotCount() { return client().ListSnapshots().value().size(); }

  std::filesystem::path data_dir_;
  std::unique_ptr<TestServer> server_;
  std::mt19937_64 rng_{11};
};

TEST_F(E2eFilesTest, ASavedSnapshotIsListedLoadedBackAndDeleted) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const v1::SnapshotInfo snapshot = FilledSnapshot(37);  // the rotating layer has wrapped
  auto saved = client().SaveSnapshot(snapshot.snapshot_id(), "chat-1", {{"model", "tiny"}});
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->name(), "chat-1");
  EXPECT_GT(saved->size_bytes(), 0u);
  EXPECT_TRUE(std::filesystem::exists(data_dir_ / "chat-1.safetensors"));
  auto listed = client().ListSaved();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].size_bytes(), saved->size_bytes());

  auto loaded = client().LoadSnapshot("chat-1");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(loaded->checksum_verified());
  EXPECT_EQ(loaded->metadata().at("model"), "tiny");
  EXPECT_EQ(loaded->spec().model(), "tiny");
  EXPECT_EQ(loaded->snapshot().to_offset(), 37u);
  ASSERT_EQ(loaded->spec().layers_size(), 3);
  EXPECT_EQ(loaded->spec().layers(2).rotating().max_size(), 8u);
  EXPECT_EQ(loaded->spec().layers(2).rotating().keep(), 4u);
  ExpectSameHistory(snapshot.snapshot_id(), loaded->snapshot().snapshot_id(), 3);

  // A cache restored from the loaded snapshot continues from it.
  auto cache = client().CreateCache(loaded->spec());
  ASSERT_TRUE(cache.ok()) << cache.status();
  auto restored = client().Restore(cache->cache_id(), loaded->snapshot().snapshot_id(), 37);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->offset(), 37u);

  ASSERT_TRUE(client().DeleteSaved("chat-1").ok());
  EXPECT_TRUE(client().ListSaved().value().empty());
  const absl::Status gone = client().LoadSnapshot("chat-1").status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(gone.message(), HasSubstr("chat-1"));
  EXPECT_EQ(client().DeleteSaved("chat-1").code(), absl::StatusCode::kNotFound);
}

TEST_F(E2eFilesTest, FilesStreamOutAndBackInAcrossManyMessages) {
  ASSERT_NO_FATAL_FAILURE(Start());
  // About 2.4 MiB of K/V: the streams cut it into several 1 MiB messages.
  const v1::SnapshotInfo snapshot = FilledSnapshot(600, /*heads=*/4, /*dim=*/128);
  v1::ExportSnapshotRequest by_id;
  by_id.set_snapshot_id(snapshot.snapshot_id());
  (*by_id.mutable_metadata())["model"] = "tiny";
  auto file = client().ExportSnapshot(by_id);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_GT(file->size(), 2u << 20);

  auto imported = client().ImportSnapshot(*file);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_TRUE(imported->checksum_verified());
  ExpectSameHistory(snapshot.snapshot_id(), imported->snapshot().snapshot_id(), 3);
  EXPECT_TRUE(client().ListSaved().value().empty()) << "an import without a name saved a file";

  v1::ImportSnapshotRequest options;
  options.set_name("kept");
  options.set_pinned(true);
  auto kept = client().ImportSnapshot(*file, options);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(kept->snapshot().pinned());
  v1::ExportSnapshotRequest by_name;
  by_name.set_name("kept");
  auto stored = client().ExportSnapshot(by_name);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_TRUE(*stored == *file) << "the saved file is not the bytes that were imported";
}

TEST_F(E2eFilesTest, BadRequestsAndDamagedFilesChangeNothing) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const v1::SnapshotInfo snapshot = FilledSnapshot(12);
  const size_t snapshots = SnapshotCount();
  const auto expect_refused = [&](const absl::Status& status, absl::StatusCode code,
                                  const std::string& names) {
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_THAT(status.message(), HasSubstr(names));
  };
  expect_refused(client().SaveSnapshot(snapshot.snapshot_id(), "../escape").status(),
                 absl::StatusCode::kInvalidArgument, "name");
  expect_refused(client().SaveSnapshot(snapshot.snapshot_id(), "").status(),
                 absl::StatusCode::kInvalidArgument, "name");
  expect_refused(client().SaveSnapshot(snapshot.snapshot_id(), std::string(201, 'a')).status(),
                 absl::StatusCode::kInvalidArgument, "name");
  expect_refused(client().SaveSnapshot(kUnknownId, "x").status(), absl::StatusCode::kNotFound,
                 "snapshot_id");
  expect_refused(client().LoadSnapshot("never-saved").status(), absl::StatusCode::kNotFound,
                 "never-saved");
  v1::ExportSnapshotRequest both;
  both.set_name("x");
  both.set_snapshot_id(snapshot.snapshot_id());
  expect_refused(client().ExportSnapshot(both).status(), absl::StatusCode::kInvalidArgument,
                 "snapshot_id");

  v1::ExportSnapshotRequest export_request;
  export_request.set_snapshot_id(snapshot.snapshot_id());
  auto file = client().ExportSnapshot(export_request);
  ASSERT_TRUE(file.ok()) << file.status();

  // A snapshot that does not start at 0 is not a whole cache: no file holds it.
  auto split = client().SplitSnapshot(snapshot.snapshot_id(), 6);
  ASSERT_TRUE(split.ok()) << split.status();
  expect_refused(client().SaveSnapshot(split->child().snapshot_id(), "half").status(),
                 absl::StatusCode::kFailedPrecondition, "");
  EXPECT_TRUE(client().ListSaved().value().empty());

  const size_t before_imports = SnapshotCount();
  expect_refused(client().ImportSnapshot(file->substr(0, file->size() - 3)).status(),
                 absl::StatusCode::kDataLoss, "");
  std::string flipped = *file;
  flipped[flipped.size() / 2] ^= 0x10;
  expect_refused(client().ImportSnapshot(flipped).status(), absl::StatusCode::kDataLoss,
                 "checksum");
  expect_refused(client().ImportSnapshot("").status(), absl::StatusCode::kDataLoss, "");
  v1::ImportSnapshotRequest bad_name;
  bad_name.set_name("a/b");
  expect_refused(client().ImportSnapshot(*file, bad_name).status(),
                 absl::StatusCode::kInvalidArgument, "name");
  EXPECT_EQ(SnapshotCount(), before_imports) << "a refused import made a snapshot";
  EXPECT_TRUE(client().ListSaved().value().empty());
  EXPECT_EQ(snapshots + 1, before_imports);  // the split made two of one
}

// A client that sends a whole file and then cancels gets no snapshot it
// could not name: none is made, and no file is saved.
TEST_F(E2eFilesTest, ACancelledImportMakesNothing) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const v1::SnapshotInfo snapshot = FilledSnapshot(9);
  v1::ExportSnapshotRequest request;
  request.set_snapshot_id(snapshot.snapshot_id());
  auto file = client().ExportSnapshot(request);
  ASSERT_TRUE(file.ok()) << file.status();
  const size_t snapshots = SnapshotCount();
  for (int round = 0; round < 5; ++round) {
    grpc::ClientContext context;
    v1::LoadSnapshotResponse response;
    auto writer = client().stub().ImportSnapshot(&context, &response);
    v1::ImportSnapshotRequest message;
    message.set_name("cancelled");
    message.set_pinned(true);
    message.set_data(*file);
    ASSERT_TRUE(writer->Write(message));
    absl::SleepFor(absl::Milliseconds(100));  // the server holds the whole file by now
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  absl::SleepFor(absl::Milliseconds(300));  // any import the server ran would be done
  EXPECT_EQ(SnapshotCount(), snapshots) << "a cancelled import made a snapshot";
  EXPECT_TRUE(client().ListSaved().value().empty()) << "a cancelled import saved a file";
}

TEST_F(E2eFilesTest, WithoutADataDirOnlyTheStreamsWork) {
  ASSERT_NO_FATAL_FAILURE(Start(/*with_data_dir=*/false));
  const v1::SnapshotInfo snapshot = FilledSnapshot(5);
  for (const absl::Status& status : {client().SaveSnapshot(snapshot.snapshot_id(), "x").status(),
                                     client().LoadSnapshot("x").status(),
                                     client().ListSaved().status(), client().DeleteSaved("x")}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    EXPECT_THAT(status.message(), HasSubstr("data_dir"));
  }
  v1::ExportSnapshotRequest request;
  request.set_snapshot_id(snapshot.snapshot_id());
  auto file = client().ExportSnapshot(request);
  ASSERT_TRUE(file.ok()) << file.status();
  auto imported = client().ImportSnapshot(*file);
  ASSERT_TRUE(imported.ok()) << imported.status();
  ExpectSameHistory(snapshot.snapshot_id(), imported->snapshot().snapshot_id(), 3);
}

TEST_F(E2eFilesTest, SavedFilesSurviveARestart) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const v1::SnapshotInfo snapshot = FilledSnapshot(21);
  ASSERT_TRUE(client().SaveSnapshot(snapshot.snapshot_id(), "durable").ok());
  v1::ExportSnapshotRequest request;
  request.set_snapshot_id(snapshot.snapshot_id());
  auto before = client().ExportSnapshot(request);
  ASSERT_TRUE(before.ok());
  server_->CleanUpAndCheck();
  server_.reset();

  ASSERT_NO_FATAL_FAILURE(Start());
  auto listed = client().ListSaved();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name(), "durable");
  auto loaded = client().LoadSnapshot("durable");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  v1::ExportSnapshotRequest again;
  again.set_snapshot_id(loaded->snapshot().snapshot_id());
  auto after = client().ExportSnapshot(again);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(*after == *before) << "the state read back differs from the state saved";
}

// Two replicas: "owner" makes snapshots, "puller" lists it as a peer (and
// a third name at an address where nothing listens).
class E2ePullTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("kvcached-pull-" + std::to_string(std::random_device()()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    for (auto* server : {&puller_, &owner_}) {
      if (*server != nullptr) (*server)->CleanUpAndCheck();
      server->reset();
    }
    std::filesystem::remove_all(dir_);
  }
  // With a tokens file: both replicas share it (a fleet's tenants are the
  // same everywhere), and their first clients are `token`'s.
  void Start(const std::string& tokens = "", const std::string& token = "") {
    std::string tokens_file;
    if (!tokens.empty()) {
      tokens_file = (dir_ / "tokens").string();
      std::ofstream(tokens_file) << tokens;
    }
    owner_ =
        TestServer::Start({.tokens_file = tokens_file, .token = token, .replica_name = "owner"});
    ASSERT_NE(owner_, nullptr);
    puller_ = TestServer::Start({.tokens_file = tokens_file,
                                 .token = token,
                                 .replica_name = "puller",
                                 .peers = absl::StrCat("owner=", owner_->server().address(),
                                                       ",gone=127.0.0.1:", FreeLoopbackPort())});
    ASSERT_NE(puller_, nullptr);
  }
  static int FreeLoopbackPort() {
    // A port that was free a moment ago: nothing listens there.
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{.sin_family = AF_INET, .sin_port = 0, .sin_addr = {htonl(INADDR_LOOPBACK)}};
    bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    socklen_t size = sizeof(address);
    getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size);
    close(fd);
    return ntohs(address.sin_port);
  }
  size_t Snapshots(TestServer& server) { return server.client().ListSnapshots().value().size(); }

  std::filesystem::path dir_;
  std::unique_ptr<TestServer> owner_, puller_;
  std::mt19937_64 rng_{13};
};

TEST_F(E2ePullTest, AReplicaPullsAnotherReplicasSnapshotByteForByte) {
  ASSERT_NO_FATAL_FAILURE(Start());
  // About 2.4 MiB: the owner's stream cuts it into several messages.
  const v1::SnapshotInfo original = FillSnapshot(owner_->client(), rng_, 600, 4, 128);
  ASSERT_EQ(original.snapshot_id().rfind("owner:", 0), 0u) << original.snapshot_id();

  auto pulled = puller_->client().PullSnapshot(original.snapshot_id(), {.pinned = true});
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  const std::string& copy = pulled->snapshot().snapshot_id();
  EXPECT_EQ(copy.rfind("puller:", 0), 0u) << "not the puller's own snapshot: " << copy;
  EXPECT_TRUE(pulled->snapshot().pinned());
  EXPECT_EQ(pulled->snapshot().to_offset(), 600u);
  EXPECT_TRUE(pulled->checksum_verified());
  ExpectSameHistory(owner_->client(), original.snapshot_id(), puller_->client(), copy, 3);

  // It is the puller's to use: a cache there continues from it.
  auto cache = puller_->client().CreateCache(pulled->spec());
  ASSERT_TRUE(cache.ok()) << cache.status();
  auto restored = puller_->client().Restore(cache->cache_id(), copy, 600);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->offset(), 600u);
  // The owner's snapshot is untouched, and a lease asked for is kept.
  EXPECT_EQ(Snapshots(*owner_), 1u);
  auto leased = puller_->client().PullSnapshot(original.snapshot_id(), {.ttl_seconds = 60});
  ASSERT_TRUE(leased.ok()) << leased.status();
  EXPECT_EQ(leased->snapshot().ttl_seconds(), 60u);
}

TEST_F(E2ePullTest, WhatCannotBePulledIsRefusedByNameAndChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const v1::SnapshotInfo original = FillSnapshot(owner_->client(), rng_, 20);
  const size_t before = Snapshots(*puller_);
  const auto expect_refused = [&](TestServer& server, const std::string& id, absl::StatusCode code,
                                  const std::string& says) {
    const absl::Status status = server.client().PullSnapshot(id).status();
    EXPECT_EQ(status.code(), code) << id << ": " << status;
    EXPECT_THAT(status.message(), HasSubstr(says)) << id;
  };
  expect_refused(*puller_, "", absl::StatusCode::kInvalidArgument, "snapshot_id");
  expect_refused(*puller_, kUnknownId, absl::StatusCode::kInvalidArgument, "names no replica");
  expect_refused(*puller_, "bad/name:00", absl::StatusCode::kInvalidArgument, "names no replica");
  expect_refused(*puller_, "puller:00", absl::StatusCode::kInvalidArgument, "this replica");
  // A replica that is no peer: its address is never taken from the caller.
  expect_refused(*puller_, "elsewhere:00", absl::StatusCode::kNotFound, "elsewhere");
  expect_refused(*puller_, "gone:00", absl::StatusCode::kUnavailable, "replica gone");
  // The owner's own answer, as it gave it.
  expect_refused(*puller_, absl::StrCat("owner:", kUnknownId), absl::StatusCode::kNotFound,
                 "replica owner");
  // A replica without peers says so.
  expect_refused(*owner_, "puller:00", absl::StatusCode::kFailedPrecondition, "peers");
  EXPECT_EQ(Snapshots(*puller_), before);
  EXPECT_EQ(Snapshots(*owner_), 1u);
  EXPECT_TRUE(puller_->client().PullSnapshot(original.snapshot_id()).ok());
}

TEST_F(E2ePullTest, APullSentAgainWithItsRequestIdMakesOneCopy) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const v1::SnapshotInfo original = FillSnapshot(owner_->client(), rng_, 40);
  v1::PullSnapshotRequest request;
  request.set_snapshot_id(original.snapshot_id());
  request.set_request_id("pull-1");
  const auto pull = [&](const v1::PullSnapshotRequest& sent) {
    grpc::ClientContext context;
    v1::LoadSnapshotResponse response;
    const grpc::Status status = puller_->client().stub().PullSnapshot(&context, sent, &response);
    return std::make_pair(status, response);
  };
  const auto [first_status, first] = pull(request);
  ASSERT_TRUE(first_status.ok()) << first_status.error_message();
  const auto [again_status, again] = pull(request);
  ASSERT_TRUE(again_status.ok()) << again_status.error_message();
  EXPECT_EQ(again.SerializeAsString(), first.SerializeAsString());
  EXPECT_EQ(Snapshots(*puller_), 1u);
  // The id on another request is refused, and pulls nothing.
  request.set_pinned(true);
  const auto [reused_status, reused] = pull(request);
  EXPECT_EQ(reused_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(reused_status.error_message(), HasSubstr("request_id"));
  EXPECT_EQ(Snapshots(*puller_), 1u);
  // A failed pull keeps nothing: the id then serves a pull that works.
  v1::PullSnapshotRequest failing;
  failing.set_snapshot_id(absl::StrCat("owner:", kUnknownId));
  failing.set_request_id("pull-2");
  EXPECT_EQ(pull(failing).first.error_code(), grpc::StatusCode::NOT_FOUND);
  failing.set_snapshot_id(original.snapshot_id());
  EXPECT_TRUE(pull(failing).first.ok());
  EXPECT_EQ(Snapshots(*puller_), 2u);
}

TEST_F(E2ePullTest, APullCarriesTheCallersTokenSoOtherTenantsSnapshotsStayOutOfReach) {
  ASSERT_NO_FATAL_FAILURE(Start(
      absl::StrCat("tenant=alice token=", kAlice, "\ntenant=bob token=", kBob, "\n"), kAlice));
  const v1::SnapshotInfo alices = FillSnapshot(owner_->client(), rng_, 30);
  std::unique_ptr<Client> bob = puller_->ConnectAs(kBob);
  const absl::Status refused = bob->PullSnapshot(alices.snapshot_id()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kNotFound) << refused;
  EXPECT_TRUE(bob->ListSnapshots().value().empty());
  auto pulled = puller_->client().PullSnapshot(alices.snapshot_id());
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  ExpectSameHistory(owner_->client(), alices.snapshot_id(), puller_->client(),
                    pulled->snapshot().snapshot_id(), 3);
  // A caller without a token is refused here, before any pull.
  std::unique_ptr<Client> nobody = puller_->ConnectAs("");
  EXPECT_EQ(nobody->PullSnapshot(alices.snapshot_id()).status().code(),
            absl::StatusCode::kUnauthenticated);
}

}  // namespace
}  // namespace kvcache::testing
