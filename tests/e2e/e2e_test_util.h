// End-to-end test support: a whole kvcached (KvCacheServer) started in-process
// on a free loopback port with the Vulkan validation layer on, a
// kvcache::Client talking to it over TCP, and comparisons of what the wire
// returns against the CPU reference model (tests/engine/reference_*.h): tokens,
// quantized layers' packed forms, recurrent states.
#pragma once

#include <grpcpp/support/status.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/layers/cache_spec.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "kv_server.h"
#include "kvcache_client.h"
#include "reference_model.h"
#include "support/gpu_test_base.h"
#include "wire_forms_util.h"

namespace kvcache::testing {

// Bearer tokens the tenant tests give their tokens files, and an id that no
// cache, snapshot or file has.
inline constexpr char kAlice[] = "alice-token-0123456789abcdef";
inline constexpr char kBob[] = "bob-token-0123456789abcdef";
inline constexpr char kUnknownId[] = "0123456789abcdef0123456789abcdef";

struct ServerSetup {
  TransferPath path = TransferPath::kDirect;
  uint32_t page_tokens = 16;
  uint64_t page_bytes = 8 << 10;
  uint64_t budget_bytes = 64 << 20;
  // The server's data lane (on a free port) is on unless this is false.
  bool data_lane = true;
  // The first client's Update and Fetch go over the data lane.
  bool client_on_lane = false;
  // Leases: the server's --default_ttl, --max_pinned_bytes and
  // --lease_check_interval.
  absl::Duration default_ttl;
  uint64_t max_pinned_bytes = 0;
  // The server's --metadata_bytes (0: its default).
  uint64_t metadata_bytes = 0;
  // The server's --host_bytes (0: no host tier).
  uint64_t host_bytes = 0;
  // The server's --data_dir (empty: none; else the disk tier is on too) and --disk_bytes.
  std::string data_dir;
  uint64_t disk_bytes = 0;
  absl::Duration lease_check_interval = absl::Milliseconds(250);
  // The server's --tokens_file (empty: one anonymous tenant) and the bearer
  // token of the clients Connect makes.
  std::string tokens_file;
  std::string token;
  // The server's TLS (--tls_cert ...) and --allow_plaintext_lane, and the
  // TLS fields (tls, tls_*) of the clients Connect makes.
  TlsConfig tls;
  bool allow_plaintext_lane = false;
  ClientOptions client_tls;
  // Lane connections: how many, how many opening, for how long (ServerConfig::lane_limits).
  service::LaneLimits lane_limits;
  // The server's --keepalive_time, --keepalive_timeout, --grpc_handshake_timeout
  // and --grpc_max_streams_per_connection.
  lane::Keepalive keepalive;
  absl::Duration grpc_handshake_timeout = absl::Seconds(10);
  uint32_t grpc_max_streams_per_connection = 1024;
  // The server's --metrics_listen (empty: no endpoint) and --access_log.
  std::string metrics_listen;
  bool access_log = false;
  // The server's --kv_events_* (no endpoint: no events).
  KvEventsConfig kv_events;
  // The server's --replica_name, --peers (name=host:port,...), --peer_ca,
  // --peer_cert and --peer_key.
  std::string replica_name;
  std::string peers;
  std::string peer_ca_file;
  std::string peer_cert_file;
  std::string peer_key_file;
  // Where the gRPC port listens (port 0: a free one).
  std::string listen = "127.0.0.1:0";
};

class TestServer {
 public:
  // Starts the server and connects a client; on failure records a test
  // failure and returns null (callers ASSERT_NE(server, nullptr)).
  static std::unique_ptr<TestServer> Start(const ServerSetup& setup);
  ~TestServer();

  KvCacheServer& server() { return *server_; }
  Client& client() { return *client_; }
  // Another client of this server; `dedicated` gives it a TCP connection of
  // its own; `data_lane` is its ClientOptions::data_lane.
  std::unique_ptr<Client> Connect(bool dedicated = true, const std::string& data_lane = "") const;
  std::unique_ptr<Client> ConnectTo(const std::string& address) const;
  // A client with a token of its own (over the lane: data_lane "auto").
  std::unique_ptr<Client> ConnectAs(const std::string& token,
                                    const std::string& data_lane = "") const;

  // KvCacheServer::Shutdown; afterwards CleanUpAndCheck works on the engine.
  void Shutdown(absl::Duration grace);
  // Releases every snapshot and deletes every cache (over the wire while the
  // server runs), then expects no page in use and no validation message.
  void CleanUpAndCheck();

 private:
  TestServer() = default;

  std::unique_ptr<KvCacheServer> server_;
  std::unique_ptr<Client> client_;
  std::string token_;
  ClientOptions client_tls_;
  bool shut_down_ = false;
};

// Every end-to-end fixture: one server per test on GetParam()'s transfer path.
class E2eTest : public ::testing::TestWithParam<TransferPath> {
 protected:
  void SetUp() override;
  void TearDown() override;
  Client& client() { return server_->client(); }
  // Runs `call`; expects `code`, `field` in the message, and no change a
  // client can see (WireFingerprint).
  void ExpectRefused(absl::StatusCode code, const std::string& field,
                     const std::function<absl::Status()>& call);

  std::unique_ptr<TestServer> server_;
};

// The transfer paths the end-to-end suites run on (the engine suites cover all).
inline constexpr TransferPath kE2ePaths[] = {TransferPath::kDirect, TransferPath::kStagingRegions};
std::string PathTestName(const ::testing::TestParamInfo<TransferPath>& info);

// KvCacheServer::Start(config), on free loopback ports, refuses with
// INVALID_ARGUMENT naming `field`.
void ExpectStartRefused(ServerConfig config, const std::string& field);

// "/kvcache.v1.KvCacheService/<name>" of every RPC of the proto.
std::vector<std::string> EveryRpcMethod();
// The status code of `method` called on `address` with an empty message
// through a generic stub (any RPC, streaming ones too), with `authorization`
// metadata where it is not empty.
grpc::StatusCode CallWithEmptyMessage(const std::string& address, const std::string& method,
                                      const std::string& authorization = "");
// The status of `method` called with `request` as its message's bytes.
grpc::Status CallWithBytes(const std::string& address, const std::string& method,
                           const std::string& request, const std::string& authorization = "");

// One layer's update as the client sends it.
LayerUpdate MakeLayerUpdate(const engine::CacheSpec& spec, uint32_t layer, const KvTensors& kv);
// A recurrent layer's new state as the client sends it (`state` must outlive it).
LayerUpdate MakeStateUpdate(const engine::CacheSpec& spec, uint32_t layer, const RefState& state,
                            uint64_t advance);
// One step of random data for every layer of cache `id` (tokens, or states
// advancing by `tokens`) in one Update stream, mirrored in `reference`.
absl::Status StepBoth(Client& client, const std::string& id, RefCache& reference, uint64_t tokens,
                      std::mt19937_64& rng);
// The client library's form of a raw request (its tensors stay in `request`).
LayerUpdate ToLayerUpdate(const v1::UpdateRequest& request);
absl::Span<const std::byte> BytesOf(const std::string& data);

// The tokens a fetched history holds, at the positions its ranges give.
std::vector<RefToken> TokensOf(const LayerHistory& history, const RefShape& shape);
// Same ranges, same tokens, same bytes; the message names the first difference.
::testing::AssertionResult HistoryMatches(const std::vector<RefToken>& expected,
                                          const absl::StatusOr<LayerHistory>& history,
                                          const RefShape& shape);

// Layer `layer` of cache `cache_id` (or of snapshot `snapshot_id`), read over
// the wire, equals the reference: an attention layer's `stored` tokens (as the
// reference stores them) by FetchLayer, a quantized one's also packed by
// FetchPacked; a recurrent layer's `state` by FetchState (nullopt: the
// snapshot holds none, and FetchState must say so).
::testing::AssertionResult LayerMatchesReference(Client& client, const std::string& cache_id,
                                                 const std::string& snapshot_id,
                                                 const engine::CacheSpec& spec, uint32_t layer,
                                                 const std::vector<RefToken>& stored,
                                                 const std::optional<RefState>& state);
// The state a live reference layer reads as: zeros before its first update
// (ollama ensure()).
RefState LiveStateOf(const RefCache& reference, uint32_t layer);
// Cache `id` equals `reference`: rows, padding (all zeros reads as none),
// offsets, and every layer as LayerMatchesReference reads it.
::testing::AssertionResult CacheMatchesReference(Client& client, const std::string& id,
                                                 const RefCache& reference);

// Everything a client can see (caches with offsets and fetched bytes,
// snapshots with ranges and bytes, pages in use), read over the wire. A
// recurrent layer's state reads as one layer entry: the range {offset,
// offset}, keys the conv state's bytes, values the delta state's.
EngineFingerprint WireFingerprint(Client& client);

}  // namespace kvcache::testing
