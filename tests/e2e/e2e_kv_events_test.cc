// KV events through a whole server (--kv_events_endpoint): published prefixes
// come out as vLLM's BlockStored / BlockRemoved batches on a ZMQ PUB socket,
// decoded here by another msgpack implementation (nlohmann::json's) in both
// of vLLM's forms; the first batch is AllBlocksCleared; the replay socket
// answers as vLLM's does, and ignores malformed requests; live batches equal
// the replayed ones; two tenants' equal prompts are one block, held while
// either holds it; a publisher that falls behind starts again from what is
// held; endpoints beyond loopback are refused unless allowed.
#include <unistd.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "fleet/kv_events.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "service_test_util.h"
#include "wire/curve/curve_keys.h"

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

// A subscriber's CURVE keys: the publisher's public key and its own pair.
struct SubscriberKeys {
  std::string server_key;
  curve::KeyPair own;
};

void UseCurve(zmq::socket_t& socket, const SubscriberKeys& keys) {
  socket.set(zmq::sockopt::curve_serverkey, keys.server_key);
  socket.set(zmq::sockopt::curve_publickey, keys.own.public_key);
  socket.set(zmq::sockopt::curve_secretkey, keys.own.secret_key);
}

// A router's side of the replay socket: a DEALER, which may read every batch
// of an answer (a REQ socket reads only the first).
class Router {
 public:
  explicit Router(const std::string& replay_endpoint,
                  const std::optional<SubscriberKeys>& keys = std::nullopt, int timeout_ms = 5000)
      : request_(context_, zmq::socket_type::dealer) {
    request_.set(zmq::sockopt::rcvtimeo, timeout_ms);
    request_.set(zmq::sockopt::linger, 0);
    if (keys.has_value()) UseCurve(request_, *keys);
    request_.connect(replay_endpoint);
  }

  // Whether a replay request is answered at all (within the timeout).
  bool Answers() {
    const std::string start_bytes = SequenceBytes(0);
    const std::array<zmq::const_buffer, 2> request = {zmq::const_buffer(),
                                                      zmq::buffer(start_bytes)};
    (void)zmq::send_multipart(request_, request, zmq::send_flags::dontwait);
    std::vector<zmq::message_t> frames;
    return zmq::recv_multipart(request_, std::back_inserter(frames)).has_value();
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
    auto snapshot = client.Snapshot(cache->cache_id());
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
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(router_->EventsUntil([](const auto&) { return true; }).size(), events.size())
      << "nothing more came";

  // A live subscriber gets the batches the replay holds: [topic, sequence,
  // payload]. A subscription takes a moment to reach the publisher, so
  // prompts are published until one arrives.
  zmq::context_t context;
  zmq::socket_t live(context, zmq::socket_type::sub);
  live.set(zmq::sockopt::subscribe, kTopic);
  live.set(zmq::sockopt::rcvtimeo, 500);
  live.connect(server_->server().kv_events_endpoint());
  std::vector<zmq::message_t> frames;
  for (uint32_t attempt = 0; attempt < 40 && frames.empty(); ++attempt) {
    Publish(server_->client(), Prompt(16, 100 + attempt));
    (void)zmq::recv_multipart(live, std::back_inserter(frames));
  }
  ASSERT_EQ(frames.size(), 3u) << "no live batch";
  EXPECT_EQ(frames[0].to_string(), kTopic);
  const int64_t sequence = SequenceOf(frames[1]);
  EXPECT_EQ(frames[2].to_string(), router_->Replay(sequence)[sequence]);
}

// A router keys blocks by their tokens: the same prompt of two tenants is
// one block here too, stored with the first and removed with the last
// (each tenant's lookups still find only its own entries).
TEST_F(E2eKvEventsTest, TwoTenantsPromptIsOneBlockAndTheArrayFormIsVllmsOlderOne) {
  dir_ = std::filesystem::temp_directory_path() / absl::StrCat("kv_events_", getpid());
  std::filesystem::create_directories(dir_);
  const std::string tokens_file = (dir_ / "tokens").string();
  const std::string alice = "alice-token-0123456789abcdef", bob = "bob-token-0123456789abcdef";
  std::ofstream(tokens_file) << "tenant=alice token=" << alice << "\n"
                             << "tenant=bob token=" << bob << "\n";
  Start(KvEventFormat::kArray, tokens_file, alice);
  std::map<std::string, std::string> entries;
  for (const std::string& token : {alice, bob}) {
    tenants_[token] = server_->ConnectAs(token);
    entries[token] = Publish(*tenants_[token], Prompt(32, 7));  // the same prompt
  }
  std::vector<json> events = router_->EventsUntil([](const auto& e) { return e.size() >= 2; });
  ASSERT_EQ(events.size(), 2u) << "bob's entry stores nothing new: " << json(events);
  EXPECT_EQ(events[0], json::array({"AllBlocksCleared"}));
  // [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
  ASSERT_EQ(events[1].size(), 7u) << events[1];
  EXPECT_EQ(events[1][0], "BlockStored");
  EXPECT_EQ(events[1][1].size(), 2u);
  EXPECT_TRUE(events[1][2].is_null());
  EXPECT_EQ(events[1][3], json(Prompt(32, 7)));
  EXPECT_EQ(events[1][4], kBlock);
  EXPECT_TRUE(events[1][5].is_null());
  EXPECT_EQ(events[1][6], "GPU");

  ASSERT_TRUE(tenants_[alice]->ReleaseSnapshot(entries[alice]).ok());
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(router_->EventsUntil([](const auto&) { return true; }).size(), 2u)
      << "bob still holds the blocks";
  ASSERT_TRUE(tenants_[bob]->ReleaseSnapshot(entries[bob]).ok());
  events = router_->EventsUntil([](const auto& e) { return e.size() >= 3; });
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[2], json::array({"BlockRemoved", events[1][1], "GPU"}));
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
  refused({.endpoint = "ipc://@kvcached-events"}, "kv_events_endpoint");  // abstract: anyone
  refused({.endpoint = "ipc://*", .allow_remote = true}, "kv_events_endpoint");  // a random path

  prometheus::Registry allowed_metrics;
  auto allowed = KvEventPublisher::Start({.endpoint = "tcp://0.0.0.0:*", .allow_remote = true},
                                         allowed_metrics);
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  EXPECT_THAT((*allowed)->endpoint(), HasSubstr("tcp://0.0.0.0:"));
}

// A publisher on loopback ports with a replay socket and its queue bound,
// and a router asking it for replays.
struct LoopbackPublisher {
  explicit LoopbackPublisher(size_t max_queued_bytes)
      : publisher(KvEventPublisher::Start({.endpoint = "tcp://127.0.0.1:*",
                                           .replay_endpoint = "tcp://127.0.0.1:*",
                                           .max_queued_bytes = max_queued_bytes},
                                          metrics)
                      .value()),
        router(publisher->replay_endpoint()) {}

  prometheus::Registry metrics;  // outlives the publisher that counts into it
  std::unique_ptr<KvEventPublisher> publisher;
  Router router;
};

// The set of block hashes that `events` leave stored.
std::set<uint64_t> HeldHashes(const std::vector<json>& events) {
  std::set<uint64_t> held;
  for (const auto& [hash, parent] : Stored(events)) held.insert(hash);
  return held;
}

// A publisher that cannot queue an event (here: larger than its whole bound)
// drops it and starts again from what the ledger holds.
TEST(KvEventPublisherTest, AnEventPastTheBoundStartsAgainFromWhatIsHeld) {
  LoopbackPublisher loopback(/*max_queued_bytes=*/300);
  loopback.publisher->blocks().Add(Prompt(64, 1));  // 4 blocks: 64 + 32 + 256 bytes, past 300
  const std::vector<json> events =
      loopback.router.EventsUntil([](const auto& e) { return e.size() >= 6; });
  ASSERT_EQ(events.size(), 6u) << json(events);
  EXPECT_EQ(events[1], json({{"type", "AllBlocksCleared"}})) << "the restart";
  EXPECT_EQ(Stored(events).size(), 4u) << "each held block, parents first";
}

// Under concurrent adds and removes that overflow a bound of a few events
// now and then, a subscriber that reads every batch ends with exactly the
// blocks held. Malformed replay requests are ignored.
TEST(KvEventPublisherTest, UnderConcurrentOverflowsASubscriberEndsWithWhatIsHeld) {
  LoopbackPublisher loopback(/*max_queued_bytes=*/2000);
  engine::PrefixBlocks& blocks = loopback.publisher->blocks();
  std::vector<std::thread> threads;
  std::vector<std::vector<std::vector<uint32_t>>> kept(2);
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 random(t);
      for (int step = 0; step < 400; ++step) {
        std::vector<uint32_t> tokens(16 * (1 + random() % 4));
        for (uint32_t& token : tokens) token = random() % 2;
        if (!kept[t].empty() && random() % 2 == 0) {
          blocks.Remove(kept[t].back());
          kept[t].pop_back();
        } else {
          blocks.Add(tokens);
          kept[t].push_back(tokens);
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::set<uint64_t> expected;
  for (const auto& added : kept) {
    for (const auto& tokens : added) {
      for (uint64_t hash : blocks.Hashes(tokens)) expected.insert(hash);
    }
  }
  blocks.Add(Prompt(16, 9));  // a last event, after every other
  expected.insert(blocks.Hashes(Prompt(16, 9))[0]);
  const std::vector<json> events =
      loopback.router.EventsUntil([&](const auto& e) { return HeldHashes(e) == expected; });
  EXPECT_EQ(HeldHashes(events), expected);

  // Requests of other shapes are not answered; the next good one is.
  zmq::context_t context;
  zmq::socket_t odd(context, zmq::socket_type::dealer);
  odd.set(zmq::sockopt::linger, 0);
  odd.connect(loopback.publisher->replay_endpoint());
  const std::array<zmq::const_buffer, 2> short_start = {zmq::const_buffer(), zmq::str_buffer("7")};
  (void)zmq::send_multipart(odd, short_start);
  const std::array<zmq::const_buffer, 3> extra = {zmq::const_buffer(), zmq::str_buffer("12345678"),
                                                  zmq::str_buffer("x")};
  (void)zmq::send_multipart(odd, extra);
  EXPECT_FALSE(loopback.router.Replay(0).empty());
}

// With a CURVE key, both sockets admit only the listed subscribers: a listed
// router replays and subscribes; an unlisted key and plaintext get nothing,
// and are counted.
TEST(KvEventPublisherTest, CurveAdmitsOnlyListedSubscribers) {
  const curve::KeyPair server = curve::NewKeyPair().value();
  const SubscriberKeys listed{.server_key = server.public_key, .own = curve::NewKeyPair().value()};
  const SubscriberKeys unlisted{.server_key = server.public_key,
                                .own = curve::NewKeyPair().value()};
  prometheus::Registry metrics;
  auto publisher = KvEventPublisher::Start({.endpoint = "tcp://127.0.0.1:*",
                                            .replay_endpoint = "tcp://127.0.0.1:*",
                                            .curve_secret_key = server.secret_key,
                                            .curve_subscribers = {listed.own.public_key}},
                                           metrics);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  const std::string replay = (*publisher)->replay_endpoint();

  Router router(replay, listed);
  EXPECT_FALSE(router.EventsUntil([](const auto& e) { return !e.empty(); }).empty());

  zmq::context_t context;
  zmq::socket_t live(context, zmq::socket_type::sub);
  UseCurve(live, listed);
  live.set(zmq::sockopt::subscribe, "");
  live.set(zmq::sockopt::rcvtimeo, 100);
  live.connect((*publisher)->endpoint());
  bool received = false;
  // A PUB socket sends to subscribers it has met: publish until one arrives.
  for (uint32_t seed = 1; seed <= 50 && !received; ++seed) {
    (*publisher)->blocks().Add(Prompt(kBlock, seed));
    std::vector<zmq::message_t> frames;
    received = zmq::recv_multipart(live, std::back_inserter(frames)).has_value();
  }
  EXPECT_TRUE(received) << "a listed subscriber receives live batches";

  const auto refused = [&] {
    for (const prometheus::MetricFamily& family : metrics.Collect()) {
      if (family.name == "kvcached_kv_event_refused_connections_total") {
        return family.metric.at(0).counter.value;
      }
    }
    return -1.0;
  };
  EXPECT_FALSE(Router(replay, unlisted, 1000).Answers()) << "a key not listed";
  EXPECT_FALSE(Router(replay, std::nullopt, 1000).Answers()) << "plaintext";
  const double refused_routers = refused();  // those routers are closed: no more tries
  EXPECT_GE(refused_routers, 1) << "the unlisted router";

  // Batches go out all through the window: the listed subscriber gets them,
  // the unlisted one none, however long its handshake would take.
  zmq::socket_t eavesdropper(context, zmq::socket_type::sub);
  UseCurve(eavesdropper, unlisted);
  eavesdropper.set(zmq::sockopt::subscribe, "");
  eavesdropper.set(zmq::sockopt::rcvtimeo, 50);
  eavesdropper.connect((*publisher)->endpoint());
  int listed_batches = 0;
  int eavesdropped_batches = 0;
  for (uint32_t seed = 100; seed < 130; ++seed) {
    (*publisher)->blocks().Add(Prompt(kBlock, seed));
    std::vector<zmq::message_t> frames;
    listed_batches += zmq::recv_multipart(live, std::back_inserter(frames)).has_value();
    frames.clear();
    eavesdropped_batches +=
        zmq::recv_multipart(eavesdropper, std::back_inserter(frames)).has_value();
  }
  EXPECT_GT(listed_batches, 0);
  EXPECT_EQ(eavesdropped_batches, 0) << "an unlisted subscriber receives nothing";
  EXPECT_GT(refused(), refused_routers) << "the unlisted subscriber was refused";
}

// Batches that `subscriber` receives while `count` more go out (one each).
int BatchesReceived(KvEventPublisher& publisher, zmq::socket_t& subscriber, uint32_t first_seed,
                    int count) {
  int received = 0;
  for (uint32_t seed = first_seed; seed < first_seed + count; ++seed) {
    publisher.blocks().Add(Prompt(kBlock, seed));
    std::vector<zmq::message_t> frames;
    received += zmq::recv_multipart(subscriber, std::back_inserter(frames)).has_value();
  }
  return received;
}

double CounterValue(prometheus::Registry& metrics, const std::string& name) {
  for (const prometheus::MetricFamily& family : metrics.Collect()) {
    if (family.name == name) return family.metric.at(0).counter.value;
  }
  return -1;
}

// Waits (10 s at most) until the publisher has put `lists` subscriber lists
// in place since its start, connections dropped where keys went.
void AwaitSubscriberLists(prometheus::Registry& metrics, double lists) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (CounterValue(metrics, "kvcached_kv_event_subscriber_lists_total") < lists) {
    ASSERT_LT(absl::Now(), deadline) << "the list was never put in place";
    absl::SleepFor(absl::Milliseconds(5));
  }
}

// Tells when a socket loses a connection (its monitor's DISCONNECTED): a
// publisher's unbind closes connections on libzmq's I/O thread, after the
// call has returned.
class DisconnectWatch {
 public:
  DisconnectWatch(zmq::context_t& context, zmq::socket_t& socket, const std::string& name)
      : events_(context, zmq::socket_type::pair) {
    const std::string address = "inproc://disconnects-" + name;
    EXPECT_EQ(zmq_socket_monitor(socket.handle(), address.c_str(), ZMQ_EVENT_DISCONNECTED), 0);
    events_.set(zmq::sockopt::rcvtimeo, 10000);
    events_.set(zmq::sockopt::linger, 0);
    events_.connect(address);
  }

  // Whether one came within 10 s.
  bool Disconnected() {
    std::vector<zmq::message_t> frames;  // [event, value], [endpoint]
    return zmq::recv_multipart(events_, std::back_inserter(frames)).has_value();
  }

 private:
  zmq::socket_t events_;
};

// Reads whatever has reached `subscriber` already.
void Drain(zmq::socket_t& subscriber) {
  std::vector<zmq::message_t> frames;
  while (zmq::recv_multipart(subscriber, std::back_inserter(frames))) frames.clear();
}

// A CURVE subscriber of the publisher's live batches.
zmq::socket_t CurveSubscriber(zmq::context_t& context, const SubscriberKeys& keys,
                              const std::string& endpoint) {
  zmq::socket_t subscriber(context, zmq::socket_type::sub);
  UseCurve(subscriber, keys);
  subscriber.set(zmq::sockopt::subscribe, "");
  subscriber.set(zmq::sockopt::rcvtimeo, 100);
  subscriber.set(zmq::sockopt::linger, 0);
  subscriber.connect(endpoint);
  return subscriber;
}

// A new list (kvcached re-reads its file on SIGHUP) admits its keys from
// then on; a key taken off loses the connection it has, on both sockets,
// while one still listed gets back in by itself. A list Start would refuse
// changes nothing.
TEST(KvEventPublisherTest, ReplacedSubscribersAreAdmittedAndRevokedOnesCutOff) {
  const curve::KeyPair server = curve::NewKeyPair().value();
  const SubscriberKeys first{.server_key = server.public_key, .own = curve::NewKeyPair().value()};
  const SubscriberKeys second{.server_key = server.public_key, .own = curve::NewKeyPair().value()};
  const SubscriberKeys kept{.server_key = server.public_key, .own = curve::NewKeyPair().value()};
  prometheus::Registry metrics;
  auto publisher =
      KvEventPublisher::Start({.endpoint = "tcp://127.0.0.1:*",
                               .replay_endpoint = "tcp://127.0.0.1:*",
                               .curve_secret_key = server.secret_key,
                               .curve_subscribers = {first.own.public_key, kept.own.public_key}},
                              metrics);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  const std::string replay = (*publisher)->replay_endpoint();
  zmq::context_t context;
  zmq::socket_t revoked = CurveSubscriber(context, first, (*publisher)->endpoint());
  DisconnectWatch revoked_watch(context, revoked, "tcp-revoked");
  zmq::socket_t stays = CurveSubscriber(context, kept, (*publisher)->endpoint());
  EXPECT_GT(BatchesReceived(**publisher, revoked, 1, 50), 0) << "the first key, listed";
  EXPECT_GT(BatchesReceived(**publisher, stays, 51, 50), 0);
  EXPECT_FALSE(Router(replay, second, 1000).Answers()) << "the second key, not yet listed";
  Router revoked_router(replay, first, 2000);
  EXPECT_FALSE(revoked_router.Replay(0).empty()) << "the whole answer, read";

  ASSERT_TRUE((*publisher)->ReplaceSubscribers({second.own.public_key, kept.own.public_key}).ok());
  zmq::socket_t admitted = CurveSubscriber(context, second, (*publisher)->endpoint());
  AwaitSubscriberLists(metrics, 1);
  ASSERT_TRUE(revoked_watch.Disconnected());  // what each socket holds now came before the drop
  EXPECT_GT(BatchesReceived(**publisher, admitted, 101, 50), 0) << "the second key, now listed";
  Drain(stays);
  Drain(revoked);
  EXPECT_GT(BatchesReceived(**publisher, stays, 151, 50), 0) << "a kept key reconnects";
  EXPECT_EQ(BatchesReceived(**publisher, revoked, 201, 30), 0) << "the first key, taken off";
  EXPECT_FALSE(revoked_router.Answers()) << "its replay connection is gone too";
  EXPECT_TRUE(Router(replay, second).Answers());

  const auto refused_with = [&](const std::vector<std::string>& keys, absl::StatusCode code) {
    const absl::Status replaced = (*publisher)->ReplaceSubscribers(keys);
    EXPECT_EQ(replaced.code(), code) << replaced;
    EXPECT_THAT(replaced.message(), HasSubstr("kv_events_curve_subscribers_file"));
  };
  refused_with({}, absl::StatusCode::kInvalidArgument);
  refused_with({second.own.public_key, "short"}, absl::StatusCode::kInvalidArgument);
  Drain(admitted);
  EXPECT_GT(BatchesReceived(**publisher, admitted, 231, 50), 0) << "the list in use stays";

  prometheus::Registry plain_metrics;
  auto plain = KvEventPublisher::Start({.endpoint = "tcp://127.0.0.1:*"}, plain_metrics);
  ASSERT_TRUE(plain.ok()) << plain.status();
  const absl::Status replaced = (*plain)->ReplaceSubscribers({second.own.public_key});
  EXPECT_EQ(replaced.code(), absl::StatusCode::kFailedPrecondition) << replaced;
}

// On a socket file too, a key taken off drops its connection and the
// sockets bind their files again: the listed subscriber gets back in.
TEST(KvEventPublisherTest, ReplacedSubscribersOnSocketFiles) {
  const curve::KeyPair server = curve::NewKeyPair().value();
  const SubscriberKeys revoked_keys{.server_key = server.public_key,
                                    .own = curve::NewKeyPair().value()};
  const SubscriberKeys kept_keys{.server_key = server.public_key,
                                 .own = curve::NewKeyPair().value()};
  // Short, whatever TMPDIR says: a socket file's path has at most 107 bytes.
  const std::filesystem::path directory = absl::StrCat("/tmp/kv_events_ipc_", getpid());
  std::filesystem::create_directories(directory);
  absl::Cleanup remove_directory = [&] { std::filesystem::remove_all(directory); };
  prometheus::Registry metrics;
  auto publisher = KvEventPublisher::Start(
      {.endpoint = absl::StrCat("ipc://", (directory / "events").string()),
       .replay_endpoint = absl::StrCat("ipc://", (directory / "replay").string()),
       .curve_secret_key = server.secret_key,
       .curve_subscribers = {revoked_keys.own.public_key, kept_keys.own.public_key}},
      metrics);
  ASSERT_TRUE(publisher.ok()) << publisher.status();
  {
    zmq::context_t context;
    zmq::socket_t revoked = CurveSubscriber(context, revoked_keys, (*publisher)->endpoint());
    DisconnectWatch revoked_watch(context, revoked, "ipc-revoked");
    zmq::socket_t kept = CurveSubscriber(context, kept_keys, (*publisher)->endpoint());
    EXPECT_GT(BatchesReceived(**publisher, revoked, 1, 50), 0);
    EXPECT_GT(BatchesReceived(**publisher, kept, 51, 50), 0);
    ASSERT_TRUE((*publisher)->ReplaceSubscribers({kept_keys.own.public_key}).ok());
    AwaitSubscriberLists(metrics, 1);
    ASSERT_TRUE(revoked_watch.Disconnected());  // what each holds now came before the drop
    EXPECT_TRUE(Router((*publisher)->replay_endpoint(), kept_keys).Answers());
    Drain(kept);
    Drain(revoked);
    EXPECT_GT(BatchesReceived(**publisher, kept, 101, 50), 0) << "back in on the same file";
    EXPECT_EQ(BatchesReceived(**publisher, revoked, 151, 20), 0);
  }
  publisher->reset();  // before its files go
}

TEST(KvEventPublisherTest, CurveKeysAreCheckedAndNamed) {
  const curve::KeyPair server = curve::NewKeyPair().value();
  const std::string subscriber = curve::NewKeyPair()->public_key;
  const auto refused = [](KvEventsConfig config, const std::string& field) {
    prometheus::Registry metrics;
    config.endpoint = "tcp://127.0.0.1:*";
    auto publisher = KvEventPublisher::Start(config, metrics);
    ASSERT_FALSE(publisher.ok());
    EXPECT_EQ(publisher.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(publisher.status().message(), HasSubstr(field));
  };
  refused({.curve_secret_key = server.secret_key.substr(1), .curve_subscribers = {subscriber}},
          "kv_events_curve_key_file");
  refused({.curve_secret_key = server.secret_key}, "kv_events_curve_subscribers_file");
  refused({.curve_subscribers = {subscriber}}, "kv_events_curve_subscribers_file");
  refused({.curve_secret_key = server.secret_key, .curve_subscribers = {subscriber, "short"}},
          "kv_events_curve_subscribers_file");
}

}  // namespace
}  // namespace kvcache::testing
