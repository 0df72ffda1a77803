// The data lane's listener (kvcache.proto, LaneFrameKind): Update and Fetch
// over TCP (TLS where gRPC runs it) beside gRPC, for the bulk K/V. Each connection gets a thread
// (LaneSession) that reads, applies and answers its frames in place: gRPC
// passes each message between a reader thread, the completion queue and a
// callback thread, and on one stream those hand-offs, not the bytes, bound
// its throughput (bench/RESULTS.md).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/log.h"
#include "service/lane/lane_limits.h"
#include "service/tenants.h"
#include "wire/lane/socket.h"
#include "wire/lane/tls.h"

namespace kvcache::service {

class LaneSession;

class DataLane {
 public:
  // Listens on host:port (port 0: a free one); serves nothing until Serve.
  // With `tls` each connection runs TLS from its first byte (null: plaintext).
  // `limits` and `keepalive` must be valid (their Validate); each accepted
  // connection gets `keepalive`.
  static absl::StatusOr<std::unique_ptr<DataLane>> Listen(
      const std::string& listen, uint64_t max_message_bytes,
      std::shared_ptr<const lane::TlsContext> tls = nullptr, LaneLimits limits = {},
      lane::Keepalive keepalive = {});
  ~DataLane();  // Shutdown(no grace)

  int port() const { return port_; }
  // Accepts connections and serves each for the tenant it authenticates as;
  // `tenants` must outlive this lane.
  void Serve(Tenants& tenants);
  // Stops accepting. Connections between calls close at once; calls under
  // way may finish until `grace` has passed, then their connections are cut
  // (acknowledged updates stay applied).
  void Shutdown(absl::Duration grace);
  // Connections held now: opened, opening, or cut and still closing (for
  // tests and logs).
  int open_connections();
  LaneCounts Counts();

 private:
  // Why the lane shut a connection before it opened.
  enum class Cut { kNo, kOpeningTimeout, kDisplaced };
  struct Connection {
    lane::OwnedFd fd;
    std::unique_ptr<lane::TlsSession> tls;  // once its handshake is done
    absl::Time accepted_at;
    // Set under the lane's mutex_ once the TLS handshake is done (at once
    // without TLS); null before.
    std::unique_ptr<LaneSession> session;
    std::thread thread;
    // Read and written under the lane's mutex_. Not annotated: clang's
    // thread-safety analysis cannot name the enclosing lane's mutex from a
    // member of this struct (it would look for the connection's own).
    bool done = false;
    Cut cut = Cut::kNo;
  };

  DataLane(lane::OwnedFd listener, int port, uint64_t max_message_bytes,
           std::shared_ptr<const lane::TlsContext> tls, LaneLimits limits,
           lane::Keepalive keepalive);
  void AcceptLoop(Tenants& tenants);
  void WatchOpenings();
  void Serve(Tenants& tenants, lane::OwnedFd fd);
  // A connection's thread: the TLS handshake, then its session.
  void RunConnection(Tenants& tenants, Connection& connection);
  // The server's side of the TLS handshake (none in plaintext).
  absl::Status Handshake(Connection& connection);
  // Joins the connections whose sessions have ended.
  void ReapFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // Whether `connection` is accepted and neither opened nor ended or cut.
  static bool Opening(const Connection& connection);
  // Whether a connection just accepted may be held. Where max_opening are
  // opening, or max_connections are held and some are opening, it cuts the
  // one opening longest to make room; false: all are held and opened (or
  // twice max_connections are held or closing).
  bool MakeRoom() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // The status a cut connection's line gives.
  absl::Status CutStatus(Cut cut) const;
  // Shuts the reading side of idle connections (both sides of all, when
  // `all`); returns whether no connection is left.
  bool CloseIdle(bool all) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  lane::OwnedFd listener_;
  const int port_;
  const uint64_t max_message_bytes_;
  const std::shared_ptr<const lane::TlsContext> tls_;
  const LaneLimits limits_;
  const lane::Keepalive keepalive_;
  LogLimiter closed_lines_;
  std::thread acceptor_;
  std::thread opening_watch_;
  absl::Mutex mutex_;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  // LaneCounts' totals of connections closed unasked.
  uint64_t refused_busy_ ABSL_GUARDED_BY(mutex_) = 0;
  uint64_t cut_opening_timeout_ ABSL_GUARDED_BY(mutex_) = 0;
  uint64_t cut_displaced_ ABSL_GUARDED_BY(mutex_) = 0;
};

}  // namespace kvcache::service
