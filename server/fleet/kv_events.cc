#include "fleet/kv_events.h"

#include <array>
#include <iterator>
#include <optional>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/algorithm/container.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "wire/curve/curve_keys.h"
#include "wire/net/address.h"

namespace kvcache {
namespace {

using engine::BlockEvent;

// Events per batch: what the thread takes from the queue at once, and how a
// restart's whole state is cut.
constexpr size_t kMaxBatchEvents = 1024;
// ZAP requests answered before the thread looks at events again.
constexpr int kMaxAuthenticationsPerPass = 64;
// How long the thread waits for events before it looks at replay requests.
constexpr absl::Duration kReplayPoll = absl::Milliseconds(10);
constexpr absl::Duration kIdlePoll = absl::Milliseconds(100);
// Long enough for the last AllBlocksCleared to leave as the replica stops.
constexpr int kPubLingerMs = 200;

std::array<char, 8> BigEndian(int64_t value) {
  std::array<char, 8> bytes;
  auto bits = static_cast<uint64_t>(value);
  for (int i = 7; i >= 0; --i, bits >>= 8) bytes[i] = static_cast<char>(bits & 0xff);
  return bytes;
}

uint64_t FromBigEndian(const zmq::message_t& frame) {
  uint64_t value = 0;
  for (size_t i = 0; i < frame.size(); ++i) value = value << 8 | frame.data<uint8_t>()[i];
  return value;
}

size_t QueuedBytes(const BlockEvent& event) {
  return 64 + event.block_hashes.size() * sizeof(uint64_t) +
         event.token_ids.size() * sizeof(uint32_t);
}

// Where libzmq asks who may connect (ZAP, RFC 27), in each context.
constexpr char kZapEndpoint[] = "inproc://zeromq.zap.01";
constexpr char kZapDomain[] = "kvcached-kv-events";

// The HOST:PORT of a tcp:// endpoint to bind, by the one rule for listening
// (wire/net/address.h): ZeroMQ's "*" port (any free one) is its port 0, and
// its "*" host its wildcard. None where it is no such endpoint.
std::optional<net::HostPort> TcpHostPort(const std::string& endpoint) {
  if (!absl::StartsWith(endpoint, "tcp://")) return std::nullopt;
  std::string address = endpoint.substr(6);
  if (absl::EndsWith(address, ":*")) address.back() = '0';
  absl::StatusOr<net::HostPort> parsed =
      net::ParseHostPort(address, "tcp", net::AddressUse::kListen);
  if (!parsed.ok()) return std::nullopt;
  return *std::move(parsed);
}

// tcp on loopback, or beyond it where allowed; ipc (a socket file; an
// abstract name, which any local user reaches, where allowed).
absl::Status CheckEndpoint(const std::string& endpoint, const char* flag, bool allow_remote,
                           bool encrypted) {
  if (absl::StartsWith(endpoint, "ipc://") && endpoint.size() > 6) {
    if (endpoint == "ipc://*") {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": ipc://* makes a socket file no router is told in advance: name it"));
    }
    if (endpoint[6] != '@' || allow_remote) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        flag,
        ": an abstract socket is open to every local user, and KV events carry prompts' "
        "token ids: use a socket file, or pass --kv_events_allow_remote"));
  }
  const std::optional<net::HostPort> bound = TcpHostPort(endpoint);
  if (!bound.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": \"", endpoint.substr(0, 64),
                                                   "\" is not tcp://HOST:PORT or ipc://PATH"));
  }
  const std::string& host = bound->host;
  if (net::IsLoopbackHost(host)) return absl::OkStatus();
  if (!allow_remote) {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": \"", host.substr(0, 64),
        "\" is not a loopback address, and KV events carry prompts' token ids: bind it where only "
        "the router reaches it and pass --kv_events_allow_remote"));
  }
  LogWarning("%s: KV events (prompts' token ids, %s) on %s, beyond loopback", flag,
             encrypted ? "CURVE-encrypted, listed subscribers only" : "unencrypted", endpoint);
  return absl::OkStatus();
}

absl::StatusOr<std::string> Bind(zmq::socket_t& socket, const std::string& endpoint,
                                 const char* flag) {
  try {
    socket.bind(endpoint);
    return socket.get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& error) {
    return absl::UnavailableError(
        absl::StrCat(flag, ": cannot bind ", endpoint, ": ", error.what()));
  }
}

absl::Status CheckSubscribers(const std::vector<std::string>& keys) {
  if (keys.empty()) {
    return absl::InvalidArgumentError(
        "kv_events_curve_subscribers_file: CURVE admits listed subscribers only; none is listed");
  }
  for (const std::string& key : keys) {
    RETURN_IF_ERROR(curve::CheckKey(key, "kv_events_curve_subscribers_file"));
  }
  return absl::OkStatus();
}

// The CURVE key and its subscribers, each named by its flag when refused.
absl::Status CheckCurve(const KvEventsConfig& config) {
  if (config.curve_secret_key.empty()) {
    if (config.curve_subscribers.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        "kv_events_curve_subscribers_file: needs --kv_events_curve_key_file (the publisher's key)");
  }
  if (!zmq_has("curve")) {
    return absl::FailedPreconditionError(
        "kv_events_curve_key_file: this libzmq was built without CURVE");
  }
  RETURN_IF_ERROR(curve::CheckKey(config.curve_secret_key, "kv_events_curve_key_file"));
  return CheckSubscribers(config.curve_subscribers);
}

// Keys as the 32 bytes ZAP hands over (one key has one byte form; its Z85
// text need not be unique). Checked already: none fails to decode.
absl::flat_hash_set<std::string> DecodedKeys(const std::vector<std::string>& keys) {
  absl::flat_hash_set<std::string> decoded;
  for (const std::string& key : keys) decoded.insert(curve::DecodeKey(key).value_or(""));
  return decoded;
}

// A server socket of CurveZMQ whose peers libzmq checks through ZAP.
void MakeCurveServer(zmq::socket_t& socket, const std::string& secret_key) {
  socket.set(zmq::sockopt::curve_server, true);
  socket.set(zmq::sockopt::curve_secretkey, secret_key);
  socket.set(zmq::sockopt::zap_domain, kZapDomain);
}

}  // namespace

struct KvEventPublisher::Sockets {
  zmq::context_t context{1};
  // Declared first, bound before the endpoints: libzmq admits every peer
  // while no ZAP handler is bound.
  std::optional<zmq::socket_t> zap;
  zmq::socket_t pub{context, zmq::socket_type::pub};
  std::optional<zmq::socket_t> replay;
};

KvEventPublisher::KvEventPublisher(const KvEventsConfig& config, prometheus::Registry& metrics)
    : config_(config),
      sockets_(std::make_unique<Sockets>()),
      events_sent_(prometheus::BuildCounter()
                       .Name("kvcached_kv_events_sent_total")
                       .Help("KV events (BlockStored, BlockRemoved, AllBlocksCleared) published")
                       .Register(metrics)
                       .Add({})),
      batches_sent_(prometheus::BuildCounter()
                        .Name("kvcached_kv_event_batches_sent_total")
                        .Help("KV event batches published (each a sequence number)")
                        .Register(metrics)
                        .Add({})),
      restarts_(prometheus::BuildCounter()
                    .Name("kvcached_kv_event_restarts_total")
                    .Help("Times the publisher fell behind, dropped events and sent "
                          "AllBlocksCleared and every held block again")
                    .Register(metrics)
                    .Add({})),
      refused_subscribers_(prometheus::BuildCounter()
                               .Name("kvcached_kv_event_refused_connections_total")
                               .Help("Connections to the KV event sockets refused: a CURVE "
                                     "key that --kv_events_curve_subscribers_file does not list")
                               .Register(metrics)
                               .Add({})),
      subscriber_lists_(prometheus::BuildCounter()
                            .Name("kvcached_kv_event_subscriber_lists_total")
                            .Help("CURVE subscriber lists put in place after the one read at "
                                  "start (SIGHUP), connections dropped where keys went")
                            .Register(metrics)
                            .Add({})),
      endpoints_unbound_(prometheus::BuildGauge()
                             .Name("kvcached_kv_event_endpoints_unbound")
                             .Help("KV event endpoints not bound now: bound again after a "
                                   "subscriber key was taken off, and not yet done")
                             .Register(metrics)
                             .Add({})),
      subscribers_(DecodedKeys(config.curve_subscribers)),
      blocks_(config.block_tokens, this) {}

absl::StatusOr<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Start(
    const KvEventsConfig& config, prometheus::Registry& metrics) {
  if (config.block_tokens == 0) {
    return absl::InvalidArgumentError("kv_events_block_size: must be at least 1");
  }
  RETURN_IF_ERROR(CheckCurve(config));
  const bool curve = !config.curve_secret_key.empty();
  RETURN_IF_ERROR(CheckEndpoint(config.endpoint, "kv_events_endpoint", config.allow_remote, curve));
  if (!config.replay_endpoint.empty()) {
    RETURN_IF_ERROR(CheckEndpoint(config.replay_endpoint, "kv_events_replay_endpoint",
                                  config.allow_remote, curve));
  }
  std::unique_ptr<KvEventPublisher> publisher(new KvEventPublisher(config, metrics));
  Sockets& sockets = *publisher->sockets_;
  if (curve) {
    zmq::socket_t& zap = sockets.zap.emplace(sockets.context, zmq::socket_type::router);
    zap.set(zmq::sockopt::linger, 0);
    RETURN_IF_ERROR(Bind(zap, kZapEndpoint, "kv_events_curve_key_file").status());
    MakeCurveServer(sockets.pub, config.curve_secret_key);
  }
  sockets.pub.set(zmq::sockopt::linger, kPubLingerMs);
  // What a subscriber sends is a subscription (a topic) and, with CURVE, its
  // handshake: a few hundred bytes. Nothing larger is read into memory.
  sockets.pub.set(zmq::sockopt::maxmsgsize, int64_t{4096});
  ASSIGN_OR_RETURN(publisher->endpoint_, Bind(sockets.pub, config.endpoint, "kv_events_endpoint"));
  if (!config.replay_endpoint.empty()) {
    zmq::socket_t& replay = sockets.replay.emplace(sockets.context, zmq::socket_type::router);
    replay.set(zmq::sockopt::linger, 0);
    if (curve) MakeCurveServer(replay, config.curve_secret_key);
    // A request is 8 bytes; nothing much longer is read into memory. CURVE's
    // handshake commands (HELLO 200 bytes, INITIATE with the peer's metadata)
    // are frames too, so they need room.
    replay.set(zmq::sockopt::maxmsgsize, curve ? int64_t{1024} : int64_t{64});
    // A ROUTER drops what passes its high-water mark: room for a whole answer.
    replay.set(zmq::sockopt::sndhwm, static_cast<int>(config.replay_batches + 2));
    ASSIGN_OR_RETURN(publisher->replay_endpoint_,
                     Bind(replay, config.replay_endpoint, "kv_events_replay_endpoint"));
  }
  publisher->thread_ = std::thread([p = publisher.get()] { p->Run(); });
  return publisher;
}

KvEventPublisher::~KvEventPublisher() {
  {
    absl::MutexLock lock(&queue_mutex_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void KvEventPublisher::Emit(BlockEvent event) {
  absl::MutexLock lock(&queue_mutex_);
  const size_t bytes = QueuedBytes(event);
  if (queued_bytes_ + bytes > config_.max_queued_bytes) {
    lost_ = true;  // the thread sends the whole state again
    return;
  }
  queued_bytes_ += bytes;
  queue_.push_back(std::move(event));
}

void KvEventPublisher::Run() {
  Send({BlockEvent{.kind = BlockEvent::Kind::kAllCleared}});
  // Replay requests and connections wait at most one short poll.
  const absl::Duration poll =
      sockets_->replay.has_value() || sockets_->zap.has_value() ? kReplayPoll : kIdlePoll;
  while (true) {
    if (pub_binding_.unbound || replay_binding_.unbound) BindUnbound(/*attempts=*/1);
    if (sockets_->zap.has_value()) {
      AnswerAuthentication();
      // A socket handles libzmq's commands (a connection closed, a pipe
      // gone) only when called: without a call, a connection dropped for
      // a revoked key would stay open until the next batch goes out.
      (void)sockets_->pub.get(zmq::sockopt::events);
    }
    if (sockets_->replay.has_value()) AnswerReplay();
    bool start_again = false;
    std::vector<BlockEvent> batch;
    std::optional<absl::flat_hash_set<std::string>> new_subscribers;
    {
      absl::MutexLock lock(&queue_mutex_);
      queue_mutex_.AwaitWithTimeout(absl::Condition(this, &KvEventPublisher::HasWork), poll);
      new_subscribers.swap(new_subscribers_);
      if (lost_) {
        start_again = true;
      } else if (queue_.empty()) {
        if (stopping_) break;
      } else {
        while (!queue_.empty() && batch.size() < kMaxBatchEvents) {
          queued_bytes_ -= QueuedBytes(queue_.front());
          batch.push_back(std::move(queue_.front()));
          queue_.pop_front();
        }
      }
    }
    if (new_subscribers.has_value()) AdmitOnly(*std::move(new_subscribers));
    if (start_again) batch = StartAgain();
    if (!batch.empty()) Send(batch);
  }
  // Routers forget what a replica that stops held.
  Send({BlockEvent{.kind = BlockEvent::Kind::kAllCleared}});
}

// Under the ledger's lock no event can come, so what is queued is dropped
// and what is held sent in its place.
std::vector<BlockEvent> KvEventPublisher::StartAgain() {
  restarts_.Increment();
  std::vector<BlockEvent> events{BlockEvent{.kind = BlockEvent::Kind::kAllCleared}};
  blocks_.Held([&](std::vector<BlockEvent> held) {
    absl::MutexLock lock(&queue_mutex_);
    queue_.clear();
    queued_bytes_ = 0;
    lost_ = false;
    std::move(held.begin(), held.end(), std::back_inserter(events));
  });
  return events;
}

void KvEventPublisher::Send(const std::vector<BlockEvent>& events) {
  const absl::Span<const BlockEvent> all(events);
  for (size_t at = 0; at < all.size(); at += kMaxBatchEvents) {
    SendBatch(all.subspan(at, kMaxBatchEvents));
  }
}

void KvEventPublisher::SendBatch(absl::Span<const BlockEvent> events) {
  const uint64_t sequence = next_sequence_++;
  std::string payload =
      EncodeKvEventBatch(absl::Now(), events, config_.format, config_.block_tokens);
  const std::array<char, 8> sequence_bytes = BigEndian(static_cast<int64_t>(sequence));
  const std::array<zmq::const_buffer, 3> frames = {
      zmq::buffer(config_.topic), zmq::buffer(sequence_bytes), zmq::buffer(payload)};
  try {
    // A PUB socket never blocks: past its high-water mark a slow subscriber
    // misses batches, sees the gap in the sequence and asks for a replay.
    (void)zmq::send_multipart(sockets_->pub, frames);
  } catch (const zmq::error_t& error) {
    LogWarning("kv events: batch %d not sent: %s", sequence, error.what());
  }
  events_sent_.Increment(static_cast<double>(events.size()));
  batches_sent_.Increment();
  if (!sockets_->replay.has_value()) return;
  sent_bytes_ += payload.size();
  sent_.emplace_back(sequence, std::move(payload));
  while (sent_.size() > config_.replay_batches || sent_bytes_ > config_.replay_bytes) {
    sent_bytes_ -= sent_.front().second.size();
    sent_.pop_front();
  }
}

void KvEventPublisher::AnswerReplay() {
  zmq::socket_t& router = *sockets_->replay;
  static const std::array<char, 8> kEnd = BigEndian(-1);
  try {
    std::vector<zmq::message_t> request;
    if (!zmq::recv_multipart(router, std::back_inserter(request), zmq::recv_flags::dontwait)) {
      return;
    }
    // [identity, "", start]: a DEALER's (or REQ's) request as a ROUTER sees it.
    if (request.size() != 3 || request[2].size() != 8) return;
    const zmq::const_buffer identity = zmq::buffer(request[0].data(), request[0].size());
    const uint64_t start = FromBigEndian(request[2]);
    for (const auto& [sequence, payload] : sent_) {
      if (sequence < start) continue;
      const std::array<char, 8> sequence_bytes = BigEndian(static_cast<int64_t>(sequence));
      const std::array<zmq::const_buffer, 4> frames = {
          identity, zmq::const_buffer(), zmq::buffer(sequence_bytes), zmq::buffer(payload)};
      (void)zmq::send_multipart(router, frames, zmq::send_flags::dontwait);
    }
    const std::array<zmq::const_buffer, 4> end = {identity, zmq::const_buffer(), zmq::buffer(kEnd),
                                                  zmq::const_buffer()};
    (void)zmq::send_multipart(router, end, zmq::send_flags::dontwait);
  } catch (const zmq::error_t& error) {
    LogWarning("kv events: replay: %s", error.what());
  }
}

// A ZAP request (RFC 27) is [version, request id, domain, address,
// identity, mechanism, credentials...], for CURVE one credential: the
// client's 32-byte public key; the answer [version, request id, status,
// text, user id, metadata]. The handler is a ROUTER, so each request comes
// after [peer, ""] and one that fails half-way leaves nothing owed.
void KvEventPublisher::AnswerAuthentication() {
  zmq::socket_t& zap = *sockets_->zap;
  try {
    // A bounded number per pass, as replays: handshakes from strangers cost
    // them nothing, so they must not starve the events.
    for (int answered = 0; answered < kMaxAuthenticationsPerPass; ++answered) {
      std::vector<zmq::message_t> request;
      if (!zmq::recv_multipart(zap, std::back_inserter(request), zmq::recv_flags::dontwait)) {
        return;
      }
      if (request.size() < 4) continue;  // not ZAP: no request id to answer
      const bool curve =
          request.size() == 9 && request[7].to_string_view() == "CURVE" && request[8].size() == 32;
      const std::string key = curve ? request[8].to_string() : "";
      const bool admitted = curve && subscribers_.contains(key);
      if (!admitted) NoteRefusal(request[5].to_string(), key);
      const std::string user = admitted ? curve::EncodeKey(key) : "";
      const std::array<zmq::const_buffer, 8> answer = {
          zmq::buffer(request[0].data(), request[0].size()),
          zmq::const_buffer(),
          zmq::str_buffer("1.0"),
          zmq::buffer(request[3].data(), request[3].size()),
          admitted ? zmq::str_buffer("200") : zmq::str_buffer("400"),
          admitted ? zmq::str_buffer("OK") : zmq::str_buffer("subscriber key not listed"),
          zmq::buffer(user),
          zmq::const_buffer()};
      (void)zmq::send_multipart(zap, answer, zmq::send_flags::dontwait);
    }
  } catch (const zmq::error_t& error) {
    if (!authentication_error_logged_) {
      authentication_error_logged_ = true;
      LogWarning("kv events: authentication: %s (later errors are not logged)", error.what());
    }
  }
}

absl::Status KvEventPublisher::ReplaceSubscribers(const std::vector<std::string>& keys) {
  if (config_.curve_secret_key.empty()) {
    return absl::FailedPreconditionError(
        "kv_events_curve_subscribers_file: KV events run without CURVE (no "
        "--kv_events_curve_key_file); restart to turn it on");
  }
  RETURN_IF_ERROR(CheckSubscribers(keys));
  absl::flat_hash_set<std::string> decoded = DecodedKeys(keys);
  absl::MutexLock lock(&queue_mutex_);
  new_subscribers_ = std::move(decoded);
  return absl::OkStatus();
}

void KvEventPublisher::AdmitOnly(absl::flat_hash_set<std::string> keys) {
  const bool revoked =
      absl::c_any_of(subscribers_, [&](const std::string& key) { return !keys.contains(key); });
  subscribers_ = std::move(keys);
  if (revoked) DropConnections();
  subscriber_lists_.Increment();
  LogInfo("kv events: %d subscriber keys admitted from now on%s", subscribers_.size(),
          revoked ? "; keys were taken off: every connection was dropped to handshake again" : "");
}

void KvEventPublisher::DropConnections() {
  // Batches queued for a revoked subscriber must not leave as its
  // connection closes (an unbind gives the connections the socket's linger).
  const auto unbind = [&](zmq::socket_t& socket, const std::string& endpoint, Binding& binding) {
    if (binding.unbound) return;  // a bind after the last drop has yet to succeed
    try {
      socket.unbind(endpoint);
    } catch (const zmq::error_t& error) {
      LogError("kv events: cannot unbind %s, so its connections stay: %s", endpoint, error.what());
      return;
    }
    binding.unbound = true;
    endpoints_unbound_.Increment();
  };
  sockets_->pub.set(zmq::sockopt::linger, 0);
  unbind(sockets_->pub, endpoint_, pub_binding_);
  if (sockets_->replay.has_value()) unbind(*sockets_->replay, replay_endpoint_, replay_binding_);
  sockets_->pub.set(zmq::sockopt::linger, kPubLingerMs);
  // libzmq closes the old listener on its I/O thread: the port is taken
  // until then. A bind that fails for longer is tried again on every pass.
  BindUnbound(/*attempts=*/200);
}

void KvEventPublisher::BindUnbound(int attempts) {
  const auto bind = [&](zmq::socket_t& socket, const std::string& endpoint, const char* flag,
                        Binding& binding) {
    if (!binding.unbound) return;
    absl::Status bound;
    for (int attempt = 0; attempt < attempts; ++attempt) {
      if (attempt > 0) absl::SleepFor(absl::Milliseconds(10));
      bound = Bind(socket, endpoint, flag).status();
      if (!bound.ok()) continue;
      binding.unbound = false;
      endpoints_unbound_.Decrement();
      if (binding.failure_logged) LogInfo("kv events: %s bound again", endpoint);
      binding.failure_logged = false;
      return;
    }
    if (binding.failure_logged) return;
    binding.failure_logged = true;
    LogError("kv events: not published on %s until it binds again (tried on every pass): %s",
             endpoint, bound.ToString());
  };
  bind(sockets_->pub, endpoint_, "kv_events_endpoint", pub_binding_);
  if (sockets_->replay.has_value()) {
    bind(*sockets_->replay, replay_endpoint_, "kv_events_replay_endpoint", replay_binding_);
  }
}

void KvEventPublisher::NoteRefusal(const std::string& address, const std::string& key) {
  refused_subscribers_.Increment();
  if (refused_logged_) return;
  refused_logged_ = true;
  LogWarning(
      "kv events: refused a connection from %s (CURVE key %s not listed in "
      "--kv_events_curve_subscribers_file); later ones are only counted in "
      "kvcached_kv_event_refused_connections_total",
      address, key.empty() ? "none" : curve::EncodeKey(key));
}

}  // namespace kvcache
