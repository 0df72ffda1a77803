// One data-lane connection (kvcache.proto, LaneFrameKind): its calls, one
// after another, on one thread. Update messages are read, applied and
// acknowledged where they arrive, with no hand-off between threads; the
// acknowledgements of all messages already buffered go out in one write.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "lane/frame.h"
#include "lane/frame_reader.h"
#include "lane/frame_writer.h"
#include "service/handlers.h"
#include "service/wire_format.h"

namespace kvcache::service {

class LaneSession {
 public:
  LaneSession(Handlers& handlers, int fd, uint64_t max_message_bytes);

  // Serves the connection until the client closes it, breaks the protocol,
  // or the socket is shut down; returns why it ended (OUT_OF_RANGE: the
  // client closed it between calls).
  absl::Status Run();
  // Whether a call (an Update stream or a Fetch) is under way.
  bool in_call() const { return in_call_.load(std::memory_order_acquire); }

 private:
  // One frame of the client's; an error ends the connection.
  absl::Status OnFrame(const lane::Frame& frame);
  void OnUpdate(absl::Span<const std::byte> payload);
  absl::Status OnFetch(absl::Span<const std::byte> payload);
  // Plans the Fetch and sends its chunks; the plan's pages are let go on return.
  absl::Status SendPlannedFetch(const v1::FetchRequest& request, bool& announced);
  // The Fetch's chunks, written one at a time; `announced`: their length
  // went first (FETCH_LENGTH).
  absl::Status SendChunks(const FetchPlan& plan, bool& announced);
  // The bytes of the plan's FETCH_CHUNK frames; 0 where a chunk's size is
  // only known once it is filled (not keys and values).
  uint64_t ChunkFrameBytes(const FetchPlan& plan) const;
  FetchChunkFraming FramingOf(const FetchPlan& plan, size_t index) const;
  void QueueStatus(const absl::Status& status);
  void SetInCall(bool in_call) { in_call_.store(in_call, std::memory_order_release); }

  Handlers& handlers_;
  int fd_;
  lane::FrameReader reader_;
  lane::FrameWriter writer_;
  KnownSpec known_spec_;  // of the cache last written to
  v1::UpdateRequest parsed_;  // protobuf's parse, when update_parser.h leaves it one
  // Fetch chunks' frames, read from pages straight into it; reused.
  std::unique_ptr<std::byte[]> chunk_buffer_;
  size_t chunk_buffer_capacity_ = 0;
  std::atomic<bool> in_call_{false};
  bool updating_ = false;    // an Update call is open (UPDATE frames seen, no UPDATE_END yet)
  bool discarding_ = false;  // it failed: its frames are skipped until UPDATE_END
  bool announces_lengths_ = false;  // the client opened with KVLANE02
  bool broke_announcement_ = false;  // a Fetch failed after its FETCH_LENGTH
};

}  // namespace kvcache::service
