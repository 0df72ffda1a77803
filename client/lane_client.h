// The client's end of the data lane (kvcache.proto, LaneFrameKind): a pool of
// connections kept between calls, Update calls and Fetch calls on them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "fetch_transport.h"
#include "update_transport.h"
#include "wire/lane/frame.h"
#include "wire/lane/frame_reader.h"
#include "wire/lane/frame_writer.h"
#include "wire/lane/socket.h"
#include "wire/lane/tls.h"

namespace kvcache::internal {

// One connection with its buffers, kept between calls.
struct LaneConnection {
  LaneConnection(int socket, std::unique_ptr<lane::TlsSession> session, uint64_t max_payload)
      : fd(socket),
        tls(std::move(session)),
        reader(socket, max_payload, tls.get()),
        writer(socket, tls.get()) {}
  lane::OwnedFd fd;
  std::unique_ptr<lane::TlsSession> tls;  // null: plaintext
  lane::FrameReader reader;
  lane::FrameWriter writer;
  bool reused = false;  // it served a call before this one
};

class LanePool {
 public:
  // `setting` is ClientOptions::data_lane: "" (off), "auto" (the address the
  // server gives in Stats, found by `ask_server`; gRPC where it has none or
  // it cannot be reached) or host:port.
  // `token`: sent in each connection's AUTH frame where not empty.
  // `keepalive`: each connection's TCP keepalive (none: the kernel's).
  // `tls`: connections run TLS with it (null: plaintext; an error: none can
  // be made, for that reason); the server's certificate must name
  // `tls_server_name`, or where that is empty the lane address's host.
  LanePool(std::string setting, std::string grpc_address, absl::Duration timeout,
           uint64_t max_payload, std::string token,
           std::function<absl::StatusOr<std::string>()> ask_server,
           absl::StatusOr<std::shared_ptr<const lane::TlsContext>> tls = nullptr,
           std::string tls_server_name = "",
           std::optional<lane::Keepalive> keepalive = std::nullopt);

  // Whether Update and Fetch go over the lane (resolves "auto" once).
  bool enabled();
  // An idle connection, or a new one.
  absl::StatusOr<std::unique_ptr<LaneConnection>> Take();
  // A connection whose call ended cleanly, for the next call.
  void Give(std::unique_ptr<LaneConnection> connection);

 private:
  // A new connection, authenticated where there is a token.
  absl::StatusOr<std::unique_ptr<LaneConnection>> Open(const std::string& address);
  // A new connection, its preamble (lane::kMagic) answered in kind.
  absl::StatusOr<std::unique_ptr<LaneConnection>> Connect(const std::string& address);
  // A connected socket to `address` that has sent the preamble: as is, or
  // after a TLS handshake.
  absl::StatusOr<std::unique_ptr<LaneConnection>> ConnectWithPreamble(
      const std::string& address) const;
  // Sends the AUTH frame and reads the server's STATUS.
  absl::Status Authenticate(LaneConnection& connection) const;

  const std::string setting_;
  const std::string grpc_address_;
  const absl::Duration timeout_;
  const uint64_t max_payload_;
  const std::string token_;
  const absl::StatusOr<std::shared_ptr<const lane::TlsContext>> tls_;
  const std::string tls_server_name_;
  const std::optional<lane::Keepalive> keepalive_;  // TCP keepalive of each connection
  std::function<absl::StatusOr<std::string>()> ask_server_;
  absl::Mutex mutex_;
  std::optional<std::string> address_ ABSL_GUARDED_BY(mutex_);  // resolved; "" when off
  std::vector<std::unique_ptr<LaneConnection>> idle_ ABSL_GUARDED_BY(mutex_);
};

// An Update call on the lane, for requests of `cache_id`.
std::unique_ptr<UpdateTransport> OpenLaneUpdate(LanePool& pool, std::string cache_id);

// Fetch calls on the lane: each chunk handed on as the bytes of its frame
// (LaneFetch).
std::unique_ptr<FetchTransport> LaneFetchTransport(LanePool& pool);

// A Fetch call on the lane: each chunk's FetchResponse bytes to `on_chunk`
// (valid during the call), in order, until it fails. Retried once on a fresh
// connection when a kept one turns out closed before any chunk arrived (a
// Fetch is safe to repeat).
absl::Status LaneFetch(LanePool& pool, const v1::FetchRequest& request,
                       const std::function<absl::Status(absl::Span<const std::byte>)>& on_chunk);

}  // namespace kvcache::internal
