// The data lane end to end (kvcache.proto, LaneFrameKind): clients find and
// use it, what it returns equals what gRPC returns, and every frame the
// server refuses gets its status, naming the field, with nothing changed.
// Raw frames are written by hand here, as a client in another language would.
// The random sequences over the lane are in e2e_random_test.cc (*_DataLane).
#include <netdb.h>
#include <sys/socket.h>

#include <random>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "e2e_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/lane/data_lane.h"
#include "service_test_util.h"
#include "wire/lane/frame.h"
#include "wire/lane/frame_reader.h"
#include "wire/lane/frame_writer.h"
#include "wire/lane/socket.h"
#include "wire/net/address.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;

// A plain TCP connection to host:port.
lane::OwnedFd ConnectPlain(const std::string& address) {
  const net::HostPort host_port =
      net::ParseHostPort(address, "address", net::AddressUse::kConnect).value();
  addrinfo hints{.ai_family = AF_INET, .ai_socktype = SOCK_STREAM};
  addrinfo* found = nullptr;
  EXPECT_EQ(getaddrinfo(host_port.host.c_str(), std::to_string(host_port.port).c_str(), &hints,
                        &found),
            0);
  lane::OwnedFd fd(socket(found->ai_family, found->ai_socktype, 0));
  EXPECT_EQ(connect(fd.get(), found->ai_addr, found->ai_addrlen), 0);
  freeaddrinfo(found);
  const timeval timeout{.tv_sec = 10, .tv_usec = 0};
  setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  return fd;
}

// A frame: its 8-byte header, then `payload`.
std::string Framed(int kind, const std::string& payload) {
  std::byte header[lane::kHeaderBytes];
  lane::EncodeHeader({.length = static_cast<uint32_t>(payload.size()), .kind = kind}, header);
  return std::string(reinterpret_cast<const char*>(header), sizeof(header)) + payload;
}
std::string Framed(int kind, const google::protobuf::MessageLite& message) {
  return Framed(kind, message.SerializeAsString());
}

// The preamble of the lane's one version.
const std::string kPreamble(lane::kMagic, sizeof(lane::kMagic));

// A socket to the lane, written and read frame by frame.
class RawLane {
 public:
  // `magic`: the preamble sent first (the lane's own unless a test says).
  explicit RawLane(const std::string& address, const std::string& magic = kPreamble)
      : fd_(ConnectPlain(address)), reader_(fd_.get(), 64 << 20) {
    SendBytes(magic);
    if (magic == kPreamble) {  // answered in kind
      absl::StatusOr<absl::Span<const std::byte>> answer = reader_.ReadRaw(8);
      EXPECT_TRUE(answer.ok() && std::string(reinterpret_cast<const char*>(answer->data()),
                                             answer->size()) == magic);
    }
  }

  void SendBytes(const std::string& bytes) {
    lane::FrameWriter writer(fd_.get());
    writer.AddCopy({reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()});
    EXPECT_TRUE(writer.Send().ok());
  }
  void Send(int kind, const std::string& payload) { SendBytes(Framed(kind, payload)); }
  void Send(int kind, const google::protobuf::MessageLite& message) {
    SendBytes(Framed(kind, message));
  }

  // The next frame's kind and payload; kind -1 when the connection ended.
  std::pair<int, std::string> Read() {
    absl::StatusOr<lane::Frame> frame = reader_.Next();
    if (!frame.ok()) return {-1, std::string(frame.status().message())};
    return {frame->header.kind,
            std::string(reinterpret_cast<const char*>(frame->payload.data()),
                        frame->payload.size())};
  }
  // The next frame, which must be a STATUS.
  absl::Status ReadStatus() {
    auto [kind, payload] = Read();
    EXPECT_EQ(kind, v1::LANE_FRAME_STATUS) << payload;
    v1::LaneStatus status;
    EXPECT_TRUE(status.ParseFromString(payload));
    return lane::StatusFromLane(status);
  }
  // Whether the server closed the connection (reads end of file).
  bool Closed() { return Read().first == -1; }
  void Close() { fd_ = lane::OwnedFd(); }

 private:
  lane::OwnedFd fd_;
  lane::FrameReader reader_;
};

class E2eDataLaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = TestServer::Start({.path = TransferPath::kDirect});
    ASSERT_NE(server_, nullptr);
    lane_client_ = server_->Connect(/*dedicated=*/true, "auto");
    ASSERT_TRUE(lane_client_->uses_data_lane());
    spec_ = ProtoSpec(2, 2, 8);
    absl::StatusOr<v1::CacheInfo> info = server_->client().CreateCache(spec_);
    ASSERT_TRUE(info.ok()) << info.status();
    cache_id_ = info->cache_id();
  }
  void TearDown() override {
    lane_client_.reset();
    if (server_) server_->CleanUpAndCheck();
  }

  std::unique_ptr<RawLane> OpenRaw(const std::string& magic = kPreamble) {
    return std::make_unique<RawLane>(server_->server().data_lane_address(), magic);
  }
  v1::UpdateRequest NewUpdate(uint32_t layer, uint64_t tokens) {
    return RandomUpdate(cache_id_, spec_, layer, tokens, rng_);
  }
  std::vector<uint64_t> Offsets() {
    absl::StatusOr<v1::CacheInfo> info = server_->client().GetCache(cache_id_);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? std::vector<uint64_t>(info->layer_offsets().begin(),
                                             info->layer_offsets().end())
                     : std::vector<uint64_t>();
  }
  // Layer 0 given 15 tokens, a Fetch of it, and the one chunk that answers it.
  std::pair<v1::FetchRequest, v1::FetchResponse> OneChunkFetch() {
    const v1::UpdateRequest request = NewUpdate(0, 15);
    const LayerUpdate update = ToLayerUpdate(request);
    EXPECT_TRUE(lane_client_->Update(cache_id_, {&update, 1}).ok());
    v1::FetchRequest fetch;
    fetch.set_cache_id(cache_id_);
    fetch.add_layers(0);
    absl::StatusOr<std::vector<v1::FetchResponse>> chunks = server_->client().FetchAll(fetch);
    EXPECT_TRUE(chunks.ok() && chunks->size() == 1);
    return {fetch, chunks.ok() && !chunks->empty() ? chunks->front() : v1::FetchResponse()};
  }
  // The server still serves both ways, and no lane session is left behind.
  void ExpectHealthy() {
    EXPECT_TRUE(server_->client().GetStats().ok());
    const v1::UpdateRequest request = NewUpdate(0, 1);
    const LayerUpdate update = ToLayerUpdate(request);
    EXPECT_TRUE(lane_client_->Update(cache_id_, {&update, 1}).ok());
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Client> lane_client_;
  v1::CacheSpec spec_;
  std::string cache_id_;
  std::mt19937_64 rng_{11};
};

TEST_F(E2eDataLaneTest, ClientsFindTheLaneThroughStats) {
  absl::StatusOr<v1::Stats> stats = server_->client().GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->data_lane_address(), server_->server().data_lane_address());
  EXPECT_FALSE(server_->client().uses_data_lane());  // data_lane ""
  EXPECT_TRUE(server_->Connect(true, server_->server().data_lane_address())->uses_data_lane());
}

TEST(E2eDataLaneOffTest, AutoFallsBackToGrpcAndAnAddressThatDoesNotAnswerFails) {
  auto server = TestServer::Start({.data_lane = false});
  ASSERT_NE(server, nullptr);
  auto client = server->Connect(true, "auto");
  EXPECT_FALSE(client->uses_data_lane());
  absl::StatusOr<v1::CacheInfo> info = client->CreateCache(ProtoSpec(1, 1, 8));
  ASSERT_TRUE(info.ok());
  std::mt19937_64 rng(3);
  const v1::UpdateRequest request = RandomUpdate(info->cache_id(), ProtoSpec(1, 1, 8), 0, 2, rng);
  const LayerUpdate update = ToLayerUpdate(request);
  EXPECT_TRUE(client->Update(info->cache_id(), {&update, 1}).ok());

  // An explicit address is used as given: no silent fallback.
  auto pinned = server->Connect(true, "127.0.0.1:1");
  absl::StatusOr<std::vector<v1::UpdateResponse>> refused =
      pinned->Update(info->cache_id(), {&update, 1});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(refused.status().message(), HasSubstr("data lane"));
  server->CleanUpAndCheck();
}

TEST_F(E2eDataLaneTest, UpdatesAndFetchesEqualGrpcs) {
  std::vector<v1::UpdateRequest> requests;
  for (int step = 0; step < 5; ++step) {
    for (uint32_t layer = 0; layer < 2; ++layer) requests.push_back(NewUpdate(layer, 1 + step));
  }
  auto stream = lane_client_->OpenUpdate(cache_id_);
  for (const v1::UpdateRequest& request : requests) ASSERT_TRUE(stream->Write(ToLayerUpdate(request)));
  absl::StatusOr<std::vector<v1::UpdateResponse>> acks = stream->Finish();
  ASSERT_TRUE(acks.ok()) << acks.status();
  ASSERT_EQ(acks->size(), requests.size());
  EXPECT_EQ(acks->back().offset(), 15u);
  for (uint32_t layer = 0; layer < 2; ++layer) {
    absl::StatusOr<LayerHistory> over_lane = lane_client_->FetchLayer(cache_id_, "", layer);
    absl::StatusOr<LayerHistory> over_grpc = server_->client().FetchLayer(cache_id_, "", layer);
    ASSERT_TRUE(over_lane.ok() && over_grpc.ok());
    EXPECT_EQ(over_lane->ranges, over_grpc->ranges);
    EXPECT_EQ(over_lane->keys, over_grpc->keys);
    EXPECT_EQ(over_lane->values, over_grpc->values);
    EXPECT_EQ(over_lane->tokens, 15u);

    // FetchViews: the same chunks, their data as views, on both transports.
    v1::FetchRequest request;
    request.set_cache_id(cache_id_);
    request.add_layers(layer);
    request.set_max_chunk_tokens(4);
    absl::StatusOr<std::vector<v1::FetchResponse>> chunks = server_->client().FetchAll(request);
    ASSERT_TRUE(chunks.ok());
    ASSERT_GT(chunks->size(), 1u);
    for (Client* client : {lane_client_.get(), &server_->client()}) {
      size_t index = 0;
      const absl::Status status = client->FetchViews(request, [&](const FetchChunkView& view) {
        const v1::FetchResponse& expected = (*chunks)[index++];
        EXPECT_EQ(view.header->start(), expected.start());
        EXPECT_EQ(view.header->keys().shape(2), expected.keys().shape(2));
        EXPECT_EQ(std::string(reinterpret_cast<const char*>(view.keys.data()), view.keys.size()),
                  expected.keys().data());
        EXPECT_EQ(std::string(reinterpret_cast<const char*>(view.values.data()),
                              view.values.size()),
                  expected.values().data());
        return absl::OkStatus();
      });
      EXPECT_TRUE(status.ok()) << status;
      EXPECT_EQ(index, chunks->size());
    }
  }
}

// A stream finished before any Write is an empty Update call: OK with no
// acknowledgements on both transports, and the lane connection stays usable.
TEST_F(E2eDataLaneTest, AnUpdateStreamWithNoMessagesEndsOkOnBothTransports) {
  const std::vector<uint64_t> before = Offsets();
  for (Client* client : {lane_client_.get(), &server_->client()}) {
    SCOPED_TRACE(client == lane_client_.get() ? "over the lane" : "over gRPC");
    auto stream = client->OpenUpdate(cache_id_);
    absl::StatusOr<std::vector<v1::UpdateResponse>> acks = stream->Finish();
    ASSERT_TRUE(acks.ok()) << acks.status();
    EXPECT_TRUE(acks->empty());
  }
  EXPECT_EQ(Offsets(), before);
  ExpectHealthy();
}

TEST_F(E2eDataLaneTest, AFailedRequestEndsTheCallKeepingWhatCameBefore) {
  auto raw = OpenRaw();
  raw->Send(v1::LANE_FRAME_UPDATE, NewUpdate(0, 3));
  v1::UpdateRequest bad = NewUpdate(1, 2);
  bad.set_layer(9);
  raw->Send(v1::LANE_FRAME_UPDATE, bad);
  raw->Send(v1::LANE_FRAME_UPDATE, NewUpdate(1, 2));  // after the failure: skipped
  raw->Send(v1::LANE_FRAME_UPDATE_END, "");
  auto [kind, payload] = raw->Read();
  ASSERT_EQ(kind, v1::LANE_FRAME_UPDATE_ACK);
  v1::UpdateResponse ack;
  ASSERT_TRUE(ack.ParseFromString(payload));
  EXPECT_EQ(ack.offset(), 3u);
  const absl::Status status = raw->ReadStatus();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("layer"));
  EXPECT_EQ(Offsets(), (std::vector<uint64_t>{3, 0}));

  // The connection carries the next call: a Fetch of what was kept.
  v1::FetchRequest fetch;
  fetch.set_cache_id(cache_id_);
  fetch.add_layers(0);
  raw->Send(v1::LANE_FRAME_FETCH, fetch);
  EXPECT_EQ(raw->Read().first, v1::LANE_FRAME_FETCH_LENGTH);
  std::tie(kind, payload) = raw->Read();
  ASSERT_EQ(kind, v1::LANE_FRAME_FETCH_CHUNK);
  v1::FetchResponse chunk;
  ASSERT_TRUE(chunk.ParseFromString(payload));
  EXPECT_EQ(chunk.keys().shape(2), 3u);
  EXPECT_TRUE(raw->ReadStatus().ok());
  ExpectHealthy();
}

// A Fetch's plan pins the pages it reads. They are let go before its status
// goes out, so a client that deletes the cache on seeing it finds them back.
// The wrong order only shows when the server thread is preempted between the
// two, so the rounds run beside threads that keep every core busy.
TEST_F(E2eDataLaneTest, AFetchLetsGoOfItsPagesBeforeItsStatus) {
  std::vector<std::jthread> spinners;
  for (unsigned i = 0; i < std::max(2u, std::thread::hardware_concurrency()); ++i) {
    spinners.emplace_back([](std::stop_token stop) {
      while (!stop.stop_requested()) {
      }
    });
  }
  engine::Engine& engine = server_->server().engine();
  for (Client* client : {lane_client_.get(), &server_->client()}) {
    for (int round = 0; round < 200; ++round) {
      absl::StatusOr<v1::CacheInfo> info = client->CreateCache(spec_);
      ASSERT_TRUE(info.ok()) << info.status();
      const v1::UpdateRequest request = RandomUpdate(info->cache_id(), spec_, 0, 20, rng_);
      const LayerUpdate update = ToLayerUpdate(request);
      ASSERT_TRUE(client->Update(info->cache_id(), {&update, 1}).ok());
      ASSERT_TRUE(client->FetchLayer(info->cache_id(), "", 0).ok());
      ASSERT_TRUE(engine.DeleteCache(info->cache_id()).ok());
      ASSERT_EQ(engine.pool().stats().used_pages, 0u)
          << "round " << round << (client == lane_client_.get() ? " over the lane" : " over gRPC");
    }
  }
}

TEST_F(E2eDataLaneTest, MalformedMessagesAreRefusedNamingTheirType) {
  auto raw = OpenRaw();
  raw->Send(v1::LANE_FRAME_UPDATE, std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 11));
  absl::Status status = raw->ReadStatus();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("UpdateRequest"));
  raw->Send(v1::LANE_FRAME_UPDATE_END, "");
  raw->Send(v1::LANE_FRAME_FETCH, std::string("\x0a\x7f", 2));
  status = raw->ReadStatus();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("FetchRequest"));
  // A well-formed Fetch that names no cache: the field, as over gRPC.
  raw->Send(v1::LANE_FRAME_FETCH, v1::FetchRequest());
  status = raw->ReadStatus();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("cache_id"));
  EXPECT_EQ(Offsets(), (std::vector<uint64_t>{0, 0}));
  ExpectHealthy();
}

// An update holding fields the schema lacks (in the request and in its keys)
// is read as protobuf reads it, not by the hand parser, and applied whole.
TEST_F(E2eDataLaneTest, FieldsTheSchemaLacksLeaveTheUpdateToProtobuf) {
  v1::UpdateRequest request = NewUpdate(0, 4);
  request.GetReflection()->MutableUnknownFields(&request)->AddVarint(1000, 1);
  v1::Tensor& keys = *request.mutable_keys();
  keys.GetReflection()->MutableUnknownFields(&keys)->AddLengthDelimited(1000, "later");
  auto raw = OpenRaw();
  raw->Send(v1::LANE_FRAME_UPDATE, request);
  raw->Send(v1::LANE_FRAME_UPDATE_END, "");
  auto [kind, payload] = raw->Read();
  ASSERT_EQ(kind, v1::LANE_FRAME_UPDATE_ACK) << payload;
  v1::UpdateResponse ack;
  ASSERT_TRUE(ack.ParseFromString(payload));
  EXPECT_EQ(ack.offset(), 4u);
  EXPECT_TRUE(raw->ReadStatus().ok());
  absl::StatusOr<LayerHistory> history = server_->client().FetchLayer(cache_id_, "", 0);
  ASSERT_TRUE(history.ok()) << history.status();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(history->keys.data()), history->keys.size()),
            request.keys().data());
}

// Frames the server cannot take end the connection, after a status that says why.
TEST_F(E2eDataLaneTest, ProtocolErrorsCloseTheConnectionAndChangeNothing) {
  struct Case {
    const char* name;
    std::function<void(RawLane&)> send;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"over the size limit",
       [](RawLane& raw) {
         std::byte header[lane::kHeaderBytes];
         lane::EncodeHeader({.length = (64u << 20) + 1, .kind = v1::LANE_FRAME_UPDATE}, header);
         raw.SendBytes(std::string(reinterpret_cast<const char*>(header), sizeof(header)));
       },
       "max_message_bytes"},
      {"unknown kind", [](RawLane& raw) { raw.Send(99, ""); }, "kind 99"},
      {"a response kind", [](RawLane& raw) { raw.Send(v1::LANE_FRAME_STATUS, ""); }, "kind 18"},
      {"reserved bytes set",
       [](RawLane& raw) { raw.SendBytes(std::string("\0\0\0\0\x01\0\x01\0", 8)); }, "kind"},
      {"UPDATE_END outside a call",
       [](RawLane& raw) { raw.Send(v1::LANE_FRAME_UPDATE_END, ""); }, "UPDATE_END"},
      {"FETCH inside an Update call",
       [this](RawLane& raw) {
         raw.Send(v1::LANE_FRAME_UPDATE, NewUpdate(0, 1));
         raw.Send(v1::LANE_FRAME_FETCH, v1::FetchRequest());
       },
       "FETCH inside"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<uint64_t> before = Offsets();
    auto raw = OpenRaw();
    c.send(*raw);
    auto [kind, payload] = raw->Read();
    if (kind == v1::LANE_FRAME_UPDATE_ACK) std::tie(kind, payload) = raw->Read();
    ASSERT_EQ(kind, v1::LANE_FRAME_STATUS) << payload;
    v1::LaneStatus status;
    ASSERT_TRUE(status.ParseFromString(payload));
    EXPECT_EQ(status.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(status.message(), HasSubstr(c.says));
    EXPECT_TRUE(raw->Closed());
    // The FETCH case applied (and acknowledged) its one update first.
    std::vector<uint64_t> expected = before;
    if (std::string(c.name) == "FETCH inside an Update call") expected[0] += 1;
    EXPECT_EQ(Offsets(), expected);
  }
  ExpectHealthy();
}

// A connection that opens with anything but the lane's preamble is closed
// unanswered, its calls not taken, and the server's log says what it opened
// with. KVLANE01, a draft of the lane that never shipped, is one of them.
TEST_F(E2eDataLaneTest, AConnectionOpeningWithAnotherPreambleIsClosedUnanswered) {
  service::DataLane& lane = *server_->server().data_lane();
  for (const std::string preamble : {"KVLANE01", "GET / HT"}) {
    SCOPED_TRACE(preamble);
    const std::vector<uint64_t> before = Offsets();
    ::testing::internal::CaptureStderr();
    auto refused = OpenRaw(preamble);
    refused->Send(v1::LANE_FRAME_UPDATE, NewUpdate(0, 1));
    EXPECT_TRUE(refused->Closed());
    // The server logs why before it counts the connection closed.
    for (int i = 0; i < 500 && lane.open_connections() > 1; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(lane.open_connections(), 1);  // lane_client_'s probe connection only
    EXPECT_THAT(log, HasSubstr("data lane: closed a connection: data lane: the connection "
                               "opened with \"" + preamble + "\", not the preamble KVLANE02"));
    EXPECT_EQ(Offsets(), before);
  }
  ExpectHealthy();
}

// A Fetch of keys and values announces the bytes of its chunk frames first.
// A Fetch refused before any chunk is a STATUS alone, the connection kept.
TEST_F(E2eDataLaneTest, FetchesAnnounceTheirLength) {
  for (uint32_t layer = 0; layer < 2; ++layer) {
    const v1::UpdateRequest request = NewUpdate(layer, 15);
    const LayerUpdate update = ToLayerUpdate(request);
    ASSERT_TRUE(lane_client_->Update(cache_id_, {&update, 1}).ok());
  }
  v1::FetchRequest fetch;
  fetch.set_cache_id(cache_id_);
  fetch.add_layers(0);
  fetch.add_layers(1);
  fetch.set_max_chunk_tokens(4);
  auto raw = OpenRaw();
  raw->Send(v1::LANE_FRAME_FETCH, fetch);
  auto [kind, payload] = raw->Read();
  ASSERT_EQ(kind, v1::LANE_FRAME_FETCH_LENGTH) << payload;
  v1::LaneFetchLength length;
  ASSERT_TRUE(length.ParseFromString(payload));
  uint64_t bytes = 0;
  int chunks = 0;
  for (std::tie(kind, payload) = raw->Read(); kind == v1::LANE_FRAME_FETCH_CHUNK;
       std::tie(kind, payload) = raw->Read()) {
    bytes += lane::kHeaderBytes + payload.size();
    ++chunks;
  }
  ASSERT_EQ(kind, v1::LANE_FRAME_STATUS) << payload;
  EXPECT_EQ(chunks, 8);  // 2 layers of 15 tokens, 4 to a chunk
  EXPECT_EQ(length.chunk_frame_bytes(), bytes);

  v1::FetchRequest unknown = fetch;
  unknown.set_cache_id("no-such-cache");
  raw->Send(v1::LANE_FRAME_FETCH, unknown);
  const absl::Status refused = raw->ReadStatus();
  EXPECT_EQ(refused.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(refused.message(), HasSubstr("cache_id"));
  raw->Send(v1::LANE_FRAME_FETCH, fetch);
  EXPECT_EQ(raw->Read().first, v1::LANE_FRAME_FETCH_LENGTH);
  ExpectHealthy();
}

// A lane server of the test's own. Each connection: a KVLANE02 preamble
// answered as `answer` says, then a FETCH read, `frames` sent and the
// connection closed.
class FakeLane {
 public:
  enum class Answer {
    kInKind,  // a server of today
    kClose,   // a server that speaks no lane of this version: closed unanswered
    kFrames,  // a busy server: `frames` at once
  };
  // `port`: 0 for any free one.
  explicit FakeLane(std::string frames, Answer answer = Answer::kInKind, int port = 0)
      : frames_(std::move(frames)), answer_(answer) {
    absl::StatusOr<int> listener = lane::Listen("127.0.0.1:" + std::to_string(port), port);
    EXPECT_TRUE(listener.ok()) << listener.status();
    listener_ = lane::OwnedFd(listener.value_or(-1));
    address_ = "127.0.0.1:" + std::to_string(port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~FakeLane() {
    shutdown(listener_.get(), SHUT_RDWR);  // wakes accept()
    thread_.join();
  }
  const std::string& address() const { return address_; }
  // The preambles of the connections so far.
  std::vector<std::string> preambles() {
    absl::MutexLock lock(&mutex_);
    return preambles_;
  }

 private:
  void Serve() {
    while (true) {
      lane::OwnedFd connection(accept(listener_.get(), nullptr, nullptr));
      if (connection.get() < 0) return;
      lane::FrameReader reader(connection.get(), 1 << 20);
      absl::StatusOr<absl::Span<const std::byte>> preamble = reader.ReadRaw(8);
      if (!preamble.ok()) continue;
      const std::string magic(reinterpret_cast<const char*>(preamble->data()), 8);
      {
        absl::MutexLock lock(&mutex_);
        preambles_.push_back(magic);
      }
      if (magic == "KVLANE02" && answer_ == Answer::kClose) continue;
      lane::FrameWriter writer(connection.get());
      if (magic == "KVLANE02" && answer_ == Answer::kInKind) {
        writer.AddCopy(*preamble);
        if (!writer.Send().ok()) continue;
      }
      if (answer_ != Answer::kFrames && !reader.Next().ok()) continue;
      writer.AddCopy({reinterpret_cast<const std::byte*>(frames_.data()), frames_.size()});
      (void)writer.Send();
    }
  }

  const std::string frames_;
  const Answer answer_;
  lane::OwnedFd listener_;
  std::string address_;
  std::thread thread_;
  absl::Mutex mutex_;
  std::vector<std::string> preambles_ ABSL_GUARDED_BY(mutex_);
};

// A server that announced more than it sent and then failed closes the
// connection: the client returns its status at once, not at the deadline
// (30 s) of a wait for the rest. Chunks past an announcement are DATA_LOSS.
TEST_F(E2eDataLaneTest, TheClientHoldsServersToTheirAnnouncedLength) {
  const auto [fetch, answer] = OneChunkFetch();
  const std::string chunk = Framed(v1::LANE_FRAME_FETCH_CHUNK, answer);
  v1::LaneFetchLength length;

  length.set_chunk_frame_bytes(2 << 20);
  FakeLane failing(Framed(v1::LANE_FRAME_FETCH_LENGTH, length) + chunk +
                   Framed(v1::LANE_FRAME_STATUS,
                          lane::LaneStatusOf(absl::InternalError("reading the pages failed"))));
  auto client = server_->Connect(/*dedicated=*/true, failing.address());
  for (int call = 0; call < 2; ++call) {
    int seen = 0;
    const absl::Time start = absl::Now();
    const absl::Status status = client->FetchViews(fetch, [&](const FetchChunkView&) {
      ++seen;
      return absl::OkStatus();
    });
    EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
    EXPECT_THAT(status.message(), HasSubstr("reading the pages failed"));
    EXPECT_EQ(seen, 1);
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  }

  EXPECT_EQ(failing.preambles(), (std::vector<std::string>{"KVLANE02", "KVLANE02"}));

  // Frames that break the protocol: DATA_LOSS, saying how.
  length.set_chunk_frame_bytes(chunk.size());
  const std::string ok = Framed(v1::LANE_FRAME_STATUS, lane::LaneStatusOf(absl::OkStatus()));
  const std::string announced = Framed(v1::LANE_FRAME_FETCH_LENGTH, length);
  const std::pair<std::string, const char*> broken[] = {
      {announced + chunk + chunk + ok, "ran past"},
      {chunk + announced + ok, "misplaced FETCH_LENGTH"},  // after a chunk
  };
  for (const auto& [frames, says] : broken) {
    SCOPED_TRACE(says);
    FakeLane fake(frames);
    client = server_->Connect(/*dedicated=*/true, fake.address());
    const absl::Status status =
        client->FetchViews(fetch, [](const FetchChunkView&) { return absl::OkStatus(); });
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    EXPECT_THAT(status.message(), HasSubstr(says));
  }
}

// A server that closes the client's connection without answering its
// preamble fails the call UNAVAILABLE, saying so; the client opens no other
// kind of connection. A server that comes back on that address is used.
TEST_F(E2eDataLaneTest, TheClientFailsOnServersThatDoNotAnswerItsPreamble) {
  const v1::FetchResponse answer = OneChunkFetch().second;
  const std::string frames =
      Framed(v1::LANE_FRAME_FETCH_CHUNK, answer) +
      Framed(v1::LANE_FRAME_STATUS, lane::LaneStatusOf(absl::OkStatus()));
  auto other = std::make_unique<FakeLane>(frames, FakeLane::Answer::kClose);
  const std::string address = other->address();
  auto client = server_->Connect(/*dedicated=*/true, address);
  for (int call = 0; call < 2; ++call) {
    const absl::Status unanswered = client->FetchLayer(cache_id_, "", 0).status();
    EXPECT_EQ(unanswered.code(), absl::StatusCode::kUnavailable) << unanswered;
    EXPECT_THAT(unanswered.message(), HasSubstr("without answering its KVLANE02 preamble"));
  }
  EXPECT_EQ(other->preambles(), (std::vector<std::string>{kPreamble, kPreamble}));

  other.reset();
  const int port = net::ParseHostPort(address, "address", net::AddressUse::kConnect).value().port;
  FakeLane current(frames, FakeLane::Answer::kInKind, port);
  absl::StatusOr<LayerHistory> history = client->FetchLayer(cache_id_, "", 0);
  ASSERT_TRUE(history.ok()) << history.status();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(history->keys.data()), history->keys.size()),
            answer.keys().data());
  EXPECT_EQ(current.preambles(), (std::vector<std::string>{kPreamble}));

  // A server with too many connections answers with its STATUS instead.
  FakeLane busy(Framed(v1::LANE_FRAME_STATUS,
                       lane::LaneStatusOf(absl::ResourceExhaustedError("1024 connections"))),
                FakeLane::Answer::kFrames);
  client = server_->Connect(/*dedicated=*/true, busy.address());
  const absl::Status refused = client->FetchLayer(cache_id_, "", 0).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("1024 connections"));
}

// Half of a small message, then a quarter of a large one (whose rest the
// server waits for in poll, not in recv): each time the connection drops,
// and what was acknowledged stays.
TEST_F(E2eDataLaneTest, AClientLostMidFrameLeavesWhatWasAcknowledged) {
  service::DataLane& lane = *server_->server().data_lane();
  for (const uint64_t tokens : {uint64_t{4}, uint64_t{4000}}) {  // 256 B, 256 KiB of K+V
    SCOPED_TRACE(tokens);
    const std::vector<uint64_t> before = Offsets();
    auto raw = OpenRaw();
    raw->Send(v1::LANE_FRAME_UPDATE, NewUpdate(0, 2));
    raw->Send(v1::LANE_FRAME_UPDATE, NewUpdate(1, 2));
    EXPECT_EQ(raw->Read().first, v1::LANE_FRAME_UPDATE_ACK);
    EXPECT_EQ(raw->Read().first, v1::LANE_FRAME_UPDATE_ACK);
    const std::string third = NewUpdate(0, tokens).SerializeAsString();
    std::byte header[lane::kHeaderBytes];
    lane::EncodeHeader(
        {.length = static_cast<uint32_t>(third.size()), .kind = v1::LANE_FRAME_UPDATE}, header);
    raw->SendBytes(std::string(reinterpret_cast<const char*>(header), 8) +
                   third.substr(0, tokens > 4 ? third.size() / 4 : third.size() / 2));
    absl::SleepFor(absl::Milliseconds(20));  // the server is waiting for the rest
    raw->Close();
    for (int i = 0; i < 500 && lane.open_connections() > 1; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(lane.open_connections(), 1);  // lane_client_'s probe connection only
    EXPECT_EQ(Offsets(), (std::vector<uint64_t>{before[0] + 2, before[1] + 2}));
    ExpectHealthy();
  }
}

TEST_F(E2eDataLaneTest, ShutdownLetsAnOpenUpdateFinishAndCutsAStalledOne) {
  auto finishing = lane_client_->OpenUpdate(cache_id_);
  ASSERT_TRUE(finishing->Write(ToLayerUpdate(NewUpdate(0, 1))));
  while (finishing->acknowledged_count() < 1) absl::SleepFor(absl::Milliseconds(1));
  const absl::Time start = absl::Now();
  std::thread shutdown([&] { server_->Shutdown(absl::Seconds(20)); });
  absl::SleepFor(absl::Milliseconds(200));
  // Still under way: its next message is applied, and it ends well.
  ASSERT_TRUE(finishing->Write(ToLayerUpdate(NewUpdate(1, 1))));
  absl::StatusOr<std::vector<v1::UpdateResponse>> acks = finishing->Finish();
  ASSERT_TRUE(acks.ok()) << acks.status();
  EXPECT_EQ(acks->size(), 2u);
  shutdown.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // it did not wait out the grace
  EXPECT_EQ(server_->server().data_lane()->open_connections(), 0);
}

TEST(E2eDataLaneShutdownTest, AStalledUpdateIsCutAfterTheGrace) {
  auto server = TestServer::Start({});
  ASSERT_NE(server, nullptr);
  auto client = server->Connect(true, "auto");
  const v1::CacheSpec spec = ProtoSpec(1, 1, 8);
  absl::StatusOr<v1::CacheInfo> info = client->CreateCache(spec);
  ASSERT_TRUE(info.ok());
  std::mt19937_64 rng(5);
  auto stalled = client->OpenUpdate(info->cache_id());
  const v1::UpdateRequest request = RandomUpdate(info->cache_id(), spec, 0, 2, rng);
  ASSERT_TRUE(stalled->Write(ToLayerUpdate(request)));
  while (stalled->acknowledged_count() < 1) absl::SleepFor(absl::Milliseconds(1));
  const absl::Time start = absl::Now();
  server->Shutdown(absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(250));
  EXPECT_LT(took, absl::Seconds(5));
  absl::StatusOr<std::vector<v1::UpdateResponse>> finished = stalled->Finish();
  EXPECT_FALSE(finished.ok());
  EXPECT_EQ(stalled->acknowledged().size(), 1u);
  EXPECT_EQ(server->server().engine().GetCache(info->cache_id())->offset, 2u);
  server->CleanUpAndCheck();
}

// The same within a large frame, whose rest the server waits for in poll.
TEST(E2eDataLaneShutdownTest, AStallWithinALargeFrameIsCutAfterTheGrace) {
  auto server = TestServer::Start({});
  ASSERT_NE(server, nullptr);
  const v1::CacheSpec spec = ProtoSpec(1, 1, 8);  // 64 B of K+V a token
  absl::StatusOr<v1::CacheInfo> info = server->client().CreateCache(spec);
  ASSERT_TRUE(info.ok());
  std::mt19937_64 rng(6);
  RawLane raw(server->server().data_lane_address());
  raw.Send(v1::LANE_FRAME_UPDATE, RandomUpdate(info->cache_id(), spec, 0, 2, rng));
  EXPECT_EQ(raw.Read().first, v1::LANE_FRAME_UPDATE_ACK);
  const std::string large = RandomUpdate(info->cache_id(), spec, 0, 4000, rng).SerializeAsString();
  std::byte header[lane::kHeaderBytes];
  lane::EncodeHeader({.length = static_cast<uint32_t>(large.size()), .kind = v1::LANE_FRAME_UPDATE},
                     header);
  raw.SendBytes(std::string(reinterpret_cast<const char*>(header), 8) +
                large.substr(0, large.size() / 4));
  absl::SleepFor(absl::Milliseconds(20));  // the server is waiting for the rest
  const absl::Time start = absl::Now();
  server->Shutdown(absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(250));
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_TRUE(raw.Closed());
  EXPECT_EQ(server->server().engine().GetCache(info->cache_id())->offset, 2u);
  server->CleanUpAndCheck();
}

// Behind a container's published port or a NAT the lane is reached at
// another address than it listens on: Stats gives clients that one.
TEST(E2eDataLaneAdvertiseTest, StatsNameTheAdvertisedAddress) {
  ServerConfig config;
  config.listen = "127.0.0.1:0";
  config.data_lane_listen = "127.0.0.1:0";
  config.pool.budget_bytes = 4 << 20;
  config.data_lane_advertise = "lane.example:7000";
  absl::StatusOr<std::unique_ptr<KvCacheServer>> server = KvCacheServer::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions options;
  options.address = (*server)->address();
  absl::StatusOr<v1::Stats> stats = Client::Connect(options)->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->data_lane_address(), "lane.example:7000");
  EXPECT_NE((*server)->data_lane_address(), "lane.example:7000") << "it listens where it did";
  server->reset();

  for (const auto& [listen, advertise] :
       {std::pair<std::string, std::string>{"127.0.0.1:0", "lane.example"},
        {"", "lane.example:7000"}}) {
    config.data_lane_listen = listen;
    config.data_lane_advertise = advertise;
    absl::StatusOr<std::unique_ptr<KvCacheServer>> refused = KvCacheServer::Start(config);
    ASSERT_FALSE(refused.ok()) << advertise;
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.status().message(), HasSubstr("data_lane_advertise"));
  }
}

}  // namespace
}  // namespace kvcache::testing
