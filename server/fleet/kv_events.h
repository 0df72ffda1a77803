// KV events (--kv_events_endpoint): each replica publishes which prefix
// blocks it stores and drops (engine/prefix/prefix_blocks.h) the way vLLM does
// (kv_event_encoding.h), so a KV-aware router sees kvcached's prefixes with
// the code it already runs against vLLM.
//
// As vLLM's ZmqEventPublisher: a ZMQ PUB socket sends each batch as three
// frames [topic, sequence (8 bytes, big-endian, from 0), payload]; where a
// replay endpoint is set, a ROUTER socket answers a request [start sequence
// (8 bytes)] with every buffered batch from there, a [sequence, payload]
// message each, then [-1 as 8 bytes, empty]. Several messages answer one
// request, so a subscriber asks from a DEALER socket (a REQ reads one). The first batch is
// AllBlocksCleared: a restarted replica holds no prefix.
//
// Prefix indexes count their entries' blocks into the publisher's ledger
// (engine/prefix/prefix_blocks.h), which queues each event here without waiting;
// one thread encodes and sends. Past its bound (a stalled thread) new events
// are dropped and the thread starts again: AllBlocksCleared, then every block
// held now, so a subscriber's view is whole again without a gap in its
// sequence. A replica that stops sends AllBlocksCleared last.
//
// The events carry prompts' token ids: the endpoint is for the router, which
// sees the prompts anyway. A non-loopback tcp endpoint (or an abstract ipc
// one, which any local user reaches) needs allow_remote, and is logged.
// With a CURVE key, both sockets speak CurveZMQ (encrypted, authenticated)
// and admit only the listed subscribers' keys: the thread answers libzmq's
// ZAP requests (RFC 27) from an inproc socket bound before the endpoints
// (libzmq admits every peer while no handler is bound, and its 4.3 stable
// API has no switch to refuse instead: the order is the guard).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "engine/prefix/prefix_blocks.h"
#include "fleet/kv_event_encoding.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace kvcache {

struct KvEventsConfig {
  // Where the PUB socket binds: "tcp://HOST:PORT" (PORT "*": any free one)
  // or "ipc://PATH"; empty: no events.
  std::string endpoint;
  // Where the replay ROUTER socket binds; empty: no replay.
  std::string replay_endpoint;
  std::string topic;  // vLLM's default: none
  // Tokens per block (vLLM's --block-size; 16 by default there too).
  uint32_t block_tokens = 16;
  KvEventFormat format = KvEventFormat::kMap;
  // Batches kept for replay (vLLM's buffer_steps), and their bytes at most.
  size_t replay_batches = 10000;
  size_t replay_bytes = 64 << 20;
  // Bytes of block hashes and token ids that may wait to be sent.
  size_t max_queued_bytes = 64 << 20;
  bool allow_remote = false;
  // CURVE (wire/curve/curve_keys.h): the publisher's secret key (Z85), and the
  // public keys of the only subscribers both sockets admit. Empty key:
  // plaintext, open to whoever reaches the endpoints.
  std::string curve_secret_key;
  std::vector<std::string> curve_subscribers;
};

class KvEventPublisher final : public engine::BlockEventSink {
 public:
  // Binds both sockets and starts sending; INVALID_ARGUMENT naming the flag
  // for an endpoint that is malformed or not allowed, UNAVAILABLE when a
  // socket cannot bind.
  static absl::StatusOr<std::unique_ptr<KvEventPublisher>> Start(const KvEventsConfig& config,
                                                                 prometheus::Registry& metrics);
  ~KvEventPublisher() override;

  // What the sockets bound (a "*" port resolved); empty where off.
  const std::string& endpoint() const { return endpoint_; }
  const std::string& replay_endpoint() const { return replay_endpoint_; }
  // What every tenant's prefix index counts its blocks into (EngineOptions).
  engine::PrefixBlocks& blocks() { return blocks_; }

  void Emit(engine::BlockEvent event) override;

  // Admits the subscribers `keys` (Z85) list from now on, in place of those
  // listed before (kvcached calls it on SIGHUP with the re-read file). Where
  // a key was taken off, every connection is dropped (the sockets bind their
  // endpoints again) and each subscriber handshakes again under the new
  // list: a revoked router stops receiving at once; listed ones reconnect by
  // themselves and fill the gap from the replay socket. INVALID_ARGUMENT
  // naming the file for a list that Start would refuse, FAILED_PRECONDITION
  // without CURVE; either way the list in use stays.
  absl::Status ReplaceSubscribers(const std::vector<std::string>& keys);

 private:
  struct Sockets;

  explicit KvEventPublisher(const KvEventsConfig& config, prometheus::Registry& metrics);
  void Run();
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mutex_) {
    return !queue_.empty() || lost_ || stopping_ || new_subscribers_.has_value();
  }
  // The thread's side of ReplaceSubscribers.
  void AdmitOnly(absl::flat_hash_set<std::string> keys);
  // Unbinds and binds again each socket, which closes every connection.
  void DropConnections();
  // Each socket that is not bound, up to `attempts` tries 10 ms apart.
  void BindUnbound(int attempts);
  // AllBlocksCleared and every block held now, after events were dropped.
  std::vector<engine::BlockEvent> StartAgain();
  // In batches of at most kMaxBatchEvents.
  void Send(const std::vector<engine::BlockEvent>& events);
  void SendBatch(absl::Span<const engine::BlockEvent> events);
  // One request at most, so a flood of them never starves the queue.
  void AnswerReplay();
  // Every pending ZAP request: admitted where its CURVE key is listed.
  void AnswerAuthentication();
  void NoteRefusal(const std::string& address, const std::string& key);

  const KvEventsConfig config_;
  std::string endpoint_;
  std::string replay_endpoint_;
  std::unique_ptr<Sockets> sockets_;  // used by the thread only, once it runs
  uint64_t next_sequence_ = 0;
  std::deque<std::pair<uint64_t, std::string>> sent_;  // for replay
  size_t sent_bytes_ = 0;
  prometheus::Counter& events_sent_;
  prometheus::Counter& batches_sent_;
  prometheus::Counter& restarts_;
  prometheus::Counter& refused_subscribers_;
  prometheus::Counter& subscriber_lists_;
  prometheus::Gauge& endpoints_unbound_;
  // The thread's: CURVE keys admitted, 32 bytes each.
  absl::flat_hash_set<std::string> subscribers_;
  bool refused_logged_ = false;               // likewise
  bool authentication_error_logged_ = false;  // likewise
  // Each endpoint's, the thread's likewise: unbound by DropConnections and
  // not bound again yet.
  struct Binding {
    bool unbound = false;
    bool failure_logged = false;
  };
  Binding pub_binding_;
  Binding replay_binding_;

  // Taken after the ledger's lock (Emit runs under it).
  absl::Mutex queue_mutex_;
  std::deque<engine::BlockEvent> queue_ ABSL_GUARDED_BY(queue_mutex_);
  size_t queued_bytes_ ABSL_GUARDED_BY(queue_mutex_) = 0;
  bool lost_ ABSL_GUARDED_BY(queue_mutex_) = false;  // events dropped: start again
  bool stopping_ ABSL_GUARDED_BY(queue_mutex_) = false;
  // From ReplaceSubscribers, for the thread to take.
  std::optional<absl::flat_hash_set<std::string>> new_subscribers_ ABSL_GUARDED_BY(queue_mutex_);
  engine::PrefixBlocks blocks_;  // emits into the queue: declared after it
  std::thread thread_;
};

}  // namespace kvcache
