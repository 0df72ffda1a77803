// KV events through a whole server (--kv_events_endpoint): published prefixes
// come out as vLLM's BlockStored / BlockRemoved batches on a ZMQ PUB socket,
// decoded here by another msgpack implementation (nlohmann::json's) in both
// of vLLM's forms; the first batch is AllBlocksCleared; the replay socket
// answers as vLLM's does; live batches equal the replayed ones; two tenants'
// equal prompts never share a block hash; endpoints beyond loopback are
// refused unless allowed.
#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kv_events.h"
#include "nlohmann/json.hpp"
#include "service_test_util.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

constexpr char kTopic[] = "kv-events";
constexpr uint32_t kBlock = 16;

std::string SequenceBytes(int64_t sequence) {
  std::string bytes(8, '\0');
  auto bits = static_cast<uint64_t>(sequence);
  for (int i = 7; i >= 0; --i, bits >>= 8) bytes[i] = static_cast<char>(bits & 0xff);
  return bytes;
}

int64_t SequenceOf(const zmq::message_t& frame) {
  uint64_t value = 0;
  for (size_t i = 0; i < frame.size(); ++i) value = value << 8 | frame.data<uint8_t>()[i];
  return static_cast<int64_t>(value);
}

json Decode(const zmq::message_t& payload) {
  return json::from_msgpack(payload.data<uint8_t>(), payload.data<uint8_t>() + payload.size());
}

// A router's side of the replay socket: a DEALER, which may read every batch
// of an answer (a REQ socket reads only the first).
class Router {
 public:
  explicit Router(const std::string& replay_endpoint)
      : request_(context_, zmq::socket_type::dealer) {
    request_.set(zmq::sockopt::rcvtimeo, 5000);
    request_.set(zmq::sockopt::linger, 0);
    request_.connect(replay_endpoint);
  }

  // Every buffered batch from `start`, by sequence.
  std::map<int64_t, std::string> Replay(int64_t start) {
    std::map<int64_t, std::string> batches;
    const std::string start_bytes = SequenceBytes(start);
    const std::array<zmq::const_buffer, 2> request = {zmq::const_buffer(),
                                                      zmq::buffer(start_bytes)};
    (void)zmq::send_multipart(request_, request);
    while (true) {
      std::vector<zmq::message_t> frames;  // "", sequence, payload
      if (!zmq::recv_multipart(request_, std::back_inserter(frames))) {
        ADD_FAILURE() << "no answer to a replay";
        return batches;
      }
      EXPECT_EQ(frames.size(), 3u);
      if (frames.size() != 3) return batches;
      if (frames[2].size() == 0) {
        EXPECT_EQ(SequenceOf(frames[1]), -1) << "the end marker";
        return batches;
      }
      batches[SequenceOf(frames[1])] = frames[2].to_string();
    }
  }

  // Replays every batch until `done` holds for the decoded events (at most 10 s).
  std::vector<json> EventsUntil(const std::function<bool(const std::vector<json>&)>& done) {
    std::vector<json> events;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      events.clear();
      int64_t expected = 0;
      for (const auto& [sequence, payload] : Replay(0)) {
        EXPECT_EQ(sequence, expected++) << "sequences count up from 0 without a gap";
        const json batch = json::from_msgpack(payload);
        EXPECT_TRUE(batch.is_array() && batch.size() == 3) << batch;
        EXPECT_TRUE(batch[0].is_number_float()) << "ts";
        EXPECT_EQ(batch[2], 0) << "data_parallel_rank";
        for (const json& event : batch[1]) events.push_back(event);
      }
      if (done(events)) return events;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << "events never came: " << json(events);
    return events;
  }

 private:
  zmq::context_t context_;
  zmq::socket_t request_;
};

std::vector<uint32_t> Prompt(uint32_t count, uint32_t seed) {
  std::vector<uint32_t> tokens(count);
  for (uint32_t i = 0; i < count; ++i) tokens[i] = seed * 1000 + i;
  return tokens;
}

std::vector<uint32_t> First(const std::vector<uint32_t>& tokens, size_t count) {
  return {tokens.begin(), tokens.begin() + count};
}

class E2eKvEventsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (auto& [token, client] : tenants_) ReleaseAll(*client);
    if (server_ != nullptr) server_->CleanUpAndCheck();
    server_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  void Start(KvEventFormat format, const std::string& tokens_file = "", std::string token = "") {
    ServerSetup setup{.tokens_file = tokens_file, .token = std::move(token)};
    setup.kv_events = {.endpoint = "tcp://127.0.0.1:*",
                       .replay_endpoint = "tcp://127.0.0.1:*",
                       .topic = kTopic,
                       .block_tokens = kBlock,
                       .format = format};
    server_ = TestServer::Start(setup);
    ASSERT_NE(server_, nullptr);
    ASSERT_THAT(server_->server().kv_events_endpoint(), HasSubstr("tcp://127.0.0.1:"));
    router_ = std::make_unique<Router>(server_->server().kv_events_replay_endpoint());
  }

  // A snapshot of `tokens.size()` random positions of a one-layer cache,
  // published as `tokens`: the entry's snapshot id.
  std::string Publish(Client& client, const std::vector<uint32_t>& tokens) {
    const v1::CacheSpec spec = ProtoSpec(1, 2, 8);
    auto cache = client.CreateCache(spec);
    EXPECT_TRUE(cache.ok()) << cache.status();
    v1::UpdateRequest request = RandomUpdate(cache->cache_id(), spec, 0, tokens.size(), rng_);
    EXPECT_TRUE(client.Update(cache->cache_id(), {ToLayerUpdate(request)}).ok());
    auto snapshot = client.Snapshot(cache->cache_id(), 0);
    EXPECT_TRUE(snapshot.ok()) << snapshot.status();
    auto published = client.PublishPrefix(snapshot->snapshot_id(), tokens);
    EXPECT_TRUE(published.ok()) << published.status();
    EXPECT_TRUE(client.ReleaseSnapshot(snapshot->snapshot_id()).ok());
    EXPECT_TRUE(client.DeleteCache(cache->cache_id()).ok());
    return published.ok() ? published->entry().snapshot_id() : "";
  }

  static void ReleaseAll(Client& client) {
    if (auto snapshots = client.ListSnapshots(); snapshots.ok()) {
      for (const auto& snapshot : *snapshots) (void)client.ReleaseSnapshot(snapshot.snapshot_id());
    }
  }

  std::mt19937_64 rng_{11};
  std::filesystem::path dir_;
  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Router> router_;
  std::map<std::string, std::unique_ptr<Client>> tenants_;
};

// A field of an event in either form (null where it has none).
json Field(const json& event, const char* name, size_t place) {
  if (event.is_object()) return event.value(name, json());
  return place < event.size() ? event[place] : json();
}

// The blocks that `events` leave stored, each with its parent.
std::map<uint64_t, json> Stored(const std::vector<json>& events) {
  std::map<uint64_t, json> stored;
  for (const json& event : events) {
    const json type = Field(event, "type", 0);
    if (type == "AllBlocksCleared") stored.clear();
    const json hashes = Field(event, "block_hashes", 1);
    if (type == "BlockStored") {
      json parent = Field(event, "parent_block_hash", 2);
      for (const json& hash : hashes) {
        EXPECT_TRUE(parent.is_null() || stored.contains(parent.get<uint64_t>())) << event;
        stored[hash.get<uint64_t>()] = parent;
        parent = hash;
      }
    }
    if (type == "BlockRemoved") {
      for (const json& hash : hashes) EXPECT_EQ(stored.erase(hash.get<uint64_t>()), 1u) << event;
    }
  }
  return stored;
}

TEST_F(E2eKvEventsTest, PrefixesComeAndGoAsVllmBlockEvents) {
  Start(KvEventFormat::kMap);
  zmq::context_t context;
  zmq::socket_t live(context, zmq::socket_type::sub);
  live.set(zmq::sockopt::subscribe, kTopic);
  live.set(zmq::sockopt::rcvtimeo, 5000);
  live.connect(server_->server().kv_events_endpoint());
  absl::SleepFor(absl::Milliseconds(200));  // a subscription reaches the publisher

  const std::vector<uint32_t> prompt = Prompt(70, 1);
  const std::string short_entry = Publish(server_->client(), First(prompt, 40));
  std::vector<json> events = router_->EventsUntil([](const auto& e) { return e.size() >= 2; });
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0], json({{"type", "AllBlocksCleared"}})) << "a new replica holds nothing";
  const json stored = events[1];  // a copy: events is read again below
  EXPECT_EQ(stored["type"], "BlockStored");
  ASSERT_EQ(stored["block_hashes"].size(), 2u) << "40 tokens: two full blocks of 16";
  EXPECT_TRUE(stored["parent_block_hash"].is_null());
  EXPECT_EQ(stored["token_ids"], json(First(prompt, 32)));
  EXPECT_EQ(stored["block_size"], kBlock);
  EXPECT_TRUE(stored["lora_id"].is_null());
  EXPECT_EQ(stored["medium"], "GPU");
  EXPECT_TRUE(stored["lora_name"].is_null());
  EXPECT_EQ(stored.size(), 8u) << "vLLM's fields and no others: " << stored;

  // The live socket sent the same batch: [topic, sequence, payload].
  std::map<int64_t, std::string> replayed = router_->Replay(1);
  std::vector<zmq::message_t> frames;
  ASSERT_TRUE(zmq::recv_multipart(live, std::back_inserter(frames)));
  ASSERT_EQ(frames.size(), 3u);
  EXPECT_EQ(frames[0].to_string(), kTopic);
  EXPECT_EQ(SequenceOf(frames[1]), 1);
  EXPECT_EQ(frames[2].to_string(), replayed[1]);

  // The whole prompt extends the entry: only its new blocks are stored, after
  // their parent; the shorter entry it replaces takes no block with it.
  const std::string long_entry = Publish(server_->client(), prompt);
  events = router_->EventsUntil([](const auto& e) { return e.size() >= 3; });
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[2]["block_hashes"].size(), 2u);
  EXPECT_EQ(events[2]["parent_block_hash"], stored["block_hashes"][1]);
  EXPECT_EQ(events[2]["token_ids"],
            json(std::vector<uint32_t>(prompt.begin() + 32, prompt.begin() + 64)));
  EXPECT_EQ(Stored(events).size(), 4u);

  // Releasing the entry unpublishes it: its four blocks are removed at once.
  ASSERT_TRUE(server_->client().ReleaseSnapshot(long_entry).ok());
  (void)server_->client().ReleaseSnapshot(short_entry);  // replaced already
  events = router_->EventsUntil([](const auto& e) { return Stored(e).empty(); });
  EXPECT_EQ(events.back()["type"], "BlockRemoved");
  EXPECT_EQ(events.back()["block_hashes"].size(), 4u);
  EXPECT_EQ(events.back()["medium"], "GPU");
}

TEST_F(E2eKvEventsTest, TenantsNeverShareABlockHashAndTheArrayFormIsVllmsOlderOne) {
  dir_ = std::filesystem::temp_directory_path() / absl::StrCat("kv_events_", getpid());
  std::filesystem::create_directories(dir_);
  const std::string tokens_file = (dir_ / "tokens").string();
  std::ofstream(tokens_file) << "tenant=alice token=alice-token-0123456789abcdef\n"
                             << "tenant=bob token=bob-token-0123456789abcdef\n";
  Start(KvEventFormat::kArray, tokens_file, "alice-token-0123456789abcdef");
  for (const char* token : {"alice-token-0123456789abcdef", "bob-token-0123456789abcdef"}) {
    tenants_[token] = server_->ConnectAs(token);
    Publish(*tenants_[token], Prompt(32, 7));  // the same prompt, the same layout
  }
  const std::vector<json> events =
      router_->EventsUntil([](const auto& e) { return e.size() >= 3; });
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0], json::array({"AllBlocksCleared"}));
  for (int i : {1, 2}) {
    // [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ASSERT_EQ(events[i].size(), 7u) << events[i];
    EXPECT_EQ(events[i][0], "BlockStored");
    EXPECT_EQ(events[i][3], json(Prompt(32, 7)));
    EXPECT_EQ(events[i][4], kBlock);
    EXPECT_EQ(events[i][6], "GPU");
  }
  std::set<uint64_t> hashes;
  for (int i : {1, 2}) {
    for (const json& hash : events[i][1]) hashes.insert(hash.get<uint64_t>());
  }
  EXPECT_EQ(hashes.size(), 4u) << "each tenant's two blocks hash apart";
}

TEST(KvEventPublisherTest, EndpointsBeyondLoopbackNeedAllowingAndMustBeZmqAddresses) {
  prometheus::Registry metrics;
  const auto refused = [&](KvEventsConfig config, const std::string& field) {
    auto publisher = KvEventPublisher::Start(config, metrics);
    ASSERT_FALSE(publisher.ok());
    EXPECT_EQ(publisher.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(publisher.status().message(), HasSubstr(field));
  };
  refused({.endpoint = "tcp://0.0.0.0:*"}, "kv_events_endpoint");
  refused({.endpoint = "tcp://*:5557"}, "kv_events_endpoint");
  refused({.endpoint = "udp://127.0.0.1:1"}, "kv_events_endpoint");
  refused({.endpoint = "tcp://127.0.0.1"}, "kv_events_endpoint");
  refused({.endpoint = "tcp://127.0.0.1:*", .replay_endpoint = "tcp://10.1.2.3:*"},
          "kv_events_replay_endpoint");
  refused({.endpoint = "tcp://127.0.0.1:*", .block_tokens = 0}, "kv_events_block_size");

  prometheus::Registry allowed_metrics;
  auto allowed = KvEventPublisher::Start({.endpoint = "tcp://0.0.0.0:*", .allow_remote = true},
                                         allowed_metrics);
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  EXPECT_THAT((*allowed)->endpoint(), HasSubstr("tcp://0.0.0.0:"));
}

// A publisher whose queue overflows drops what it cannot hold and starts
// again: AllBlocksCleared, then every block its sources hold, in one batch.
TEST(KvEventPublisherTest, AnOverflowStartsAgainFromWhatSourcesHold) {
  prometheus::Registry metrics;
  auto publisher = KvEventPublisher::Start({.endpoint = "tcp://127.0.0.1:*",
                                            .replay_endpoint = "tcp://127.0.0.1:*",
                                            .format = KvEventFormat::kArray,
                                            .max_queued_bytes = 100},  // one small event
                                           metrics);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  const auto stored = [](uint64_t hash) {
    return engine::BlockEvent{.kind = engine::BlockEvent::Kind::kStored, .block_hashes = {hash}};
  };
  int source = 0;  // any address names a source
  (*publisher)->Attach(&source, [&](const auto& under_lock) {
    under_lock({stored(1), stored(2)});
  });
  (*publisher)->Emit(&source, {stored(1), stored(2)});  // the second does not fit

  Router router((*publisher)->replay_endpoint());
  std::vector<json> events = router.EventsUntil([](const auto& e) { return e.size() >= 4; });
  ASSERT_EQ(events.size(), 4u) << json(events);
  EXPECT_EQ(events[0], json::array({"AllBlocksCleared"}));  // the start
  EXPECT_EQ(events[1], json::array({"AllBlocksCleared"}));  // the restart, not event 1 alone
  EXPECT_EQ(events[2][1], json::array({1}));
  EXPECT_EQ(events[3][1], json::array({2}));
  (*publisher)->Detach(&source);
}

}  // namespace
}  // namespace kvcache::testing
