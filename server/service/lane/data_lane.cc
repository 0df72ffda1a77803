#include "service/lane/data_lane.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "service/lane/lane_session.h"
#include "wire/lane/frame.h"
#include "wire/lane/frame_writer.h"

namespace kvcache::service {
namespace {

// How often connections are checked against their opening deadline.
constexpr absl::Duration kOpeningCheckInterval = absl::Milliseconds(250);
// Lines about closed connections: a peer failing on purpose fills no log.
constexpr int kClosedLinesPerPeriod = 20;
constexpr absl::Duration kClosedLinesPeriod = absl::Minutes(1);

void SetTimeouts(int fd, absl::Duration timeout) {
  const timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

// Refuses a connection over the limit with a status, then closes it.
void RefuseBusy(int fd, int max_connections) {
  lane::FrameWriter writer(fd);
  writer.AddMessage(v1::LANE_FRAME_STATUS,
                    lane::LaneStatusOf(absl::ResourceExhaustedError(
                        absl::StrCat("data lane: ", max_connections,
                                     " connections are open already (lane_max_connections)"))));
  (void)writer.Send();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataLane>> DataLane::Listen(
    const std::string& listen, uint64_t max_message_bytes,
    std::shared_ptr<const lane::TlsContext> tls, LaneLimits limits, lane::Keepalive keepalive) {
  RETURN_IF_ERROR(limits.Validate());
  RETURN_IF_ERROR(keepalive.Validate());
  int port = 0;
  absl::StatusOr<int> fd = lane::Listen(listen, port);
  if (!fd.ok()) return fd.status();
  // A frame's length is 32 bits.
  const uint64_t max_payload = std::min<uint64_t>(max_message_bytes, UINT32_MAX);
  return std::unique_ptr<DataLane>(
      new DataLane(lane::OwnedFd(*fd), port, max_payload, std::move(tls), limits, keepalive));
}

DataLane::DataLane(lane::OwnedFd listener, int port, uint64_t max_message_bytes,
                   std::shared_ptr<const lane::TlsContext> tls, LaneLimits limits,
                   lane::Keepalive keepalive)
    : listener_(std::move(listener)),
      port_(port),
      max_message_bytes_(max_message_bytes),
      tls_(std::move(tls)),
      limits_(limits),
      keepalive_(keepalive),
      closed_lines_(kClosedLinesPerPeriod, kClosedLinesPeriod) {}

DataLane::~DataLane() { Shutdown(absl::ZeroDuration()); }

void DataLane::Serve(Tenants& tenants) {
  acceptor_ = std::thread([this, &tenants] { AcceptLoop(tenants); });
  opening_watch_ = std::thread([this] { WatchOpenings(); });
}

// Cuts connections that have not opened (TLS handshake, preamble, AUTH
// where the server has tenants) within the opening timeout of their connect:
// the sockets' timeouts bound each read, not the whole, and a peer that
// sends a byte now and then would otherwise hold a thread for good.
void DataLane::WatchOpenings() {
  absl::MutexLock lock(&mutex_);
  while (!mutex_.AwaitWithTimeout(absl::Condition(&stopping_), kOpeningCheckInterval)) {
    const absl::Time now = absl::Now();
    for (Connection& connection : connections_) {
      if (!Opening(connection)) continue;
      if (now - connection.accepted_at < limits_.opening_timeout) continue;
      shutdown(connection.fd.get(), SHUT_RDWR);
      connection.cut = Cut::kOpeningTimeout;
      ++cut_opening_timeout_;
    }
  }
}

void DataLane::AcceptLoop(Tenants& tenants) {
  while (true) {
    const int fd = accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      const int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      // A client that vanished without closing its end frees its thread,
      // its slot and its tenant's connection quota in seconds.
      if (absl::Status kept = lane::SetKeepalive(fd, keepalive_); !kept.ok()) {
        static absl::once_flag said;  // the same on every socket: once is enough
        absl::call_once(said, [&] { LogError("%s", kept.message()); });
      }
      Serve(tenants, lane::OwnedFd(fd));
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    {
      absl::MutexLock lock(&mutex_);
      if (stopping_) return;
    }
    // Out of descriptors or memory: say so, and try again shortly.
    LogError("data lane: accept: %s", std::strerror(errno));
    absl::SleepFor(absl::Milliseconds(50));
  }
}

void DataLane::Serve(Tenants& tenants, lane::OwnedFd fd) {
  absl::MutexLock lock(&mutex_);
  if (stopping_) return;
  ReapFinished();
  if (!MakeRoom()) {
    ++refused_busy_;
    // Said in plaintext only: a TLS client would read it as a broken handshake.
    if (tls_ == nullptr) RefuseBusy(fd.get(), limits_.max_connections);
    return;
  }
  Connection& connection = connections_.emplace_back();
  connection.fd = std::move(fd);
  connection.accepted_at = absl::Now();
  connection.thread =
      std::thread([this, &tenants, &connection] { RunConnection(tenants, connection); });
}

void DataLane::RunConnection(Tenants& tenants, Connection& connection) {
  absl::Status status = Handshake(connection);
  if (status.ok()) {
    {
      absl::MutexLock lock(&mutex_);
      connection.session = std::make_unique<LaneSession>(tenants, connection.fd.get(),
                                                         max_message_bytes_, connection.tls.get());
    }
    status = connection.session->Run();
  }
  // The client sees the end now; the descriptor closes when reaped.
  shutdown(connection.fd.get(), SHUT_RDWR);
  // A client that broke the protocol or failed its handshake, or a Fetch
  // that broke its announced length, is worth a line; a client that left
  // is not.
  Cut cut;
  {
    absl::MutexLock lock(&mutex_);
    cut = connection.cut;
  }
  if (cut != Cut::kNo) status = CutStatus(cut);
  uint64_t held_back = 0;
  if ((cut != Cut::kNo || absl::IsInvalidArgument(status) || absl::IsAborted(status) ||
       absl::IsUnauthenticated(status) || absl::IsPermissionDenied(status)) &&
      closed_lines_.Allow(absl::Now(), held_back)) {
    LogError("data lane: closed a connection: %s%s", status.message(),
             held_back == 0 ? ""
                            : absl::StrCat(" (and ", held_back,
                                           " more since the last such line, not logged)"));
  }
  absl::MutexLock lock(&mutex_);
  connection.done = true;
}

absl::Status DataLane::Handshake(Connection& connection) {
  if (tls_ == nullptr) return absl::OkStatus();
  const int fd = connection.fd.get();
  SetTimeouts(fd, limits_.opening_timeout);  // each read and write; WatchOpenings bounds the whole
  absl::StatusOr<std::unique_ptr<lane::TlsSession>> session = lane::TlsSession::Accept(*tls_, fd);
  SetTimeouts(fd, absl::ZeroDuration());  // afterwards, as in plaintext: none
  if (!session.ok()) {
    return absl::PermissionDeniedError(session.status().message());
  }
  static absl::once_flag described;
  absl::call_once(described, [&] { LogInfo("data lane: %s", (*session)->Describe()); });
  connection.tls = *std::move(session);
  return absl::OkStatus();
}

absl::Status DataLane::CutStatus(Cut cut) const {
  if (cut == Cut::kDisplaced) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "data lane: cut while opening (TLS handshake, preamble, AUTH), the longest opening "
        "when a new connection found ",
        limits_.max_opening, " opening (lane_max_opening) or ", limits_.max_connections,
        " open (lane_max_connections)"));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "data lane: the connection did not open (TLS handshake, preamble, AUTH) within ",
      absl::FormatDuration(limits_.opening_timeout)));
}

bool DataLane::Opening(const Connection& connection) {
  if (connection.done || connection.cut != Cut::kNo) return false;
  return connection.session == nullptr || !connection.session->opened();
}

bool DataLane::MakeRoom() {
  // Cut ones still closing hold threads too: a peer that connects faster
  // than they close cannot grow the threads past twice the limit.
  if (connections_.size() >= 2 * static_cast<size_t>(limits_.max_connections)) return false;
  int held = 0;
  int opening = 0;
  Connection* oldest_opening = nullptr;
  // In accept order: the first that is opening has been opening longest.
  for (Connection& connection : connections_) {
    // Cut ones are on their way out (their reads fail at once).
    if (connection.done || connection.cut != Cut::kNo) continue;
    ++held;
    if (!Opening(connection)) continue;
    if (oldest_opening == nullptr) oldest_opening = &connection;
    ++opening;
  }
  if (opening < limits_.max_opening && held < limits_.max_connections) return true;
  if (oldest_opening == nullptr) return false;  // every one has opened
  shutdown(oldest_opening->fd.get(), SHUT_RDWR);
  oldest_opening->cut = Cut::kDisplaced;
  ++cut_displaced_;
  return true;
}

void DataLane::ReapFinished() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (!it->done) {
      ++it;
      continue;
    }
    it->thread.join();  // it has set done and is returning
    it = connections_.erase(it);
  }
}

bool DataLane::CloseIdle(bool all) {
  for (Connection& connection : connections_) {
    if (connection.done) continue;
    if (all) {
      shutdown(connection.fd.get(), SHUT_RDWR);
    } else if (connection.session == nullptr || !connection.session->in_call()) {
      shutdown(connection.fd.get(), SHUT_RD);
    }
  }
  return connections_.empty();
}

void DataLane::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  shutdown(listener_.get(), SHUT_RDWR);  // wakes accept()
  if (acceptor_.joinable()) acceptor_.join();
  if (opening_watch_.joinable()) opening_watch_.join();
  const absl::Time deadline = absl::Now() + grace;
  while (true) {
    {
      absl::MutexLock lock(&mutex_);
      ReapFinished();
      if (CloseIdle(/*all=*/absl::Now() >= deadline)) return;
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
}

LaneCounts DataLane::Counts() {
  absl::MutexLock lock(&mutex_);
  LaneCounts counts{.refused_busy = refused_busy_,
                    .cut_opening_timeout = cut_opening_timeout_,
                    .cut_displaced = cut_displaced_};
  for (const Connection& connection : connections_) {
    if (Opening(connection)) {
      ++counts.opening;
    } else if (!connection.done && connection.cut == Cut::kNo) {
      ++counts.open;
    }
  }
  return counts;
}

int DataLane::open_connections() {
  absl::MutexLock lock(&mutex_);
  int open = 0;
  for (const Connection& connection : connections_) open += connection.done ? 0 : 1;
  return open;
}

}  // namespace kvcache::service
