// One data-lane connection (kvcache.proto, LaneFrameKind): the data lane's
// transport for the Update and Fetch calls (update_call.h, fetch_call.h),
// which own every rule about them; its calls run one after another, on one
// thread. Update messages are read, applied and acknowledged where they
// arrive, with no hand-off between threads; the acknowledgements of all
// messages already buffered go out in one write.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "service/calls/fetch_call.h"
#include "service/calls/update_call.h"
#include "service/handlers.h"
#include "service/tenants.h"
#include "wire/lane/frame.h"
#include "wire/lane/frame_reader.h"
#include "wire/lane/frame_writer.h"
#include "wire/lane/tls.h"

namespace kvcache::service {

class LaneSession {
 public:
  // Calls run for the tenant the connection authenticates as (tenants.h).
  // `tls`: the connection's TLS (null: plaintext), outliving the session.
  LaneSession(Tenants& tenants, int fd, uint64_t max_message_bytes,
              lane::TlsSession* tls = nullptr);

  // Serves the connection until the client closes it, breaks the protocol,
  // or the socket is shut down; returns why it ended (OUT_OF_RANGE: the
  // client closed it between calls).
  absl::Status Run();
  // Whether the client has shown it may stay: its preamble came and, where
  // the server has tenants, its AUTH was accepted.
  bool opened() const { return opened_.load(std::memory_order_acquire); }
  // Whether a call (an Update stream or a Fetch) is under way.
  bool in_call() const { return in_call_.load(std::memory_order_acquire); }

 private:
  // Run, until the connection's tenant is let go.
  absl::Status Serve();
  // The next frame of the client's, once the acknowledgements queued are
  // sent where it has to wait for it.
  absl::StatusOr<lane::Frame> NextFrame();
  // One frame of the client's; an error ends the connection.
  absl::Status OnFrame(const lane::Frame& frame);
  // An AUTH frame: the connection's tenant, answered by a STATUS.
  absl::Status OnAuth(absl::Span<const std::byte> payload);
  // OK where the connection opened with lane::kMagic, else why it is closed.
  static absl::Status CheckPreamble(absl::Span<const std::byte> magic);
  // Until the connection authenticates: only an AUTH frame of at most
  // lane::kMaxAuthFrameBytes is read, judged by its header alone.
  static absl::Status CheckOpeningFrame(const lane::FrameHeader& header);
  // The anonymous tenant's admission where the server has no tokens, else
  // UNAUTHENTICATED: a call came before an AUTH frame.
  absl::Status AdmitWithoutToken();
  void OnUpdate(absl::Span<const std::byte> payload);
  void OnUpdateEnd();
  absl::Status OnFetch(absl::Span<const std::byte> payload);
  // The call's chunks as FETCH_CHUNK frames; `announced`: their length went
  // first (FETCH_LENGTH). Returns only the socket's failures: a chunk's own
  // ends the call (FetchCall::Finish tells it).
  absl::Status SendChunks(FetchCall& call, bool& announced);
  // A chunk of keys and values sent from the pages it lies in.
  void QueueMappedChunk(const FetchChunkFraming& framing, const engine::KvMappedPieces& pieces);
  void QueueStatus(const absl::Status& status);
  // Adds the bytes moved since the last report to the tenant's counts.
  void ReportBytes();
  void SetInCall(bool in_call) { in_call_.store(in_call, std::memory_order_release); }

  Tenants& tenants_;
  Admitted admitted_;  // the connection's tenant, once a frame came
  uint64_t reported_received_ = 0;  // of reader_.bytes_received()
  uint64_t reported_sent_ = 0;      // of writer_.bytes_sent()
  bool saw_frame_ = false;
  lane::FrameReader reader_;
  lane::FrameWriter writer_;
  std::optional<UpdateCall> update_;  // the Update call under way, or the next one
  // Fetch chunks' frames, read from pages straight into it; reused.
  std::unique_ptr<std::byte[]> chunk_buffer_;
  size_t chunk_buffer_capacity_ = 0;
  std::atomic<bool> in_call_{false};
  std::atomic<bool> opened_{false};
  bool updating_ = false;  // an Update call is open (UPDATE frames seen, no UPDATE_END yet)
  int unsent_acks_ = 0;    // acknowledgements queued in writer_ (at most, once a STATUS is)
  bool broke_announcement_ = false;  // a Fetch failed after its FETCH_LENGTH
  bool revoked_ = false;  // a call was refused for a revoked token: the connection ends
};

}  // namespace kvcache::service
