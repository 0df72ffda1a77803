#include "service/lane_session.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "service/update_parser.h"
#include "service/wire_format.h"

namespace kvcache::service {
namespace {

constexpr size_t kChunkBatchBytes = 512 << 10;

// The request parsed from its frame: from the frame's bytes where
// update_parser.h can, else by protobuf into `fallback`.
absl::Status ParseUpdate(absl::Span<const std::byte> payload, v1::UpdateRequest& fallback,
                         UpdateView& view) {
  const absl::Span<const std::byte> pieces[] = {payload};
  if (ParseUpdateRequest(pieces, view)) return absl::OkStatus();
  view = UpdateView();
  if (!fallback.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return absl::InvalidArgumentError(
        "UpdateRequest: malformed (not the wire format of kvcache.v1.UpdateRequest)");
  }
  view = ViewOf(fallback);
  return absl::OkStatus();
}

}  // namespace

LaneSession::LaneSession(Handlers& handlers, int fd, uint64_t max_message_bytes)
    : handlers_(handlers), fd_(fd), reader_(fd, max_message_bytes), writer_(fd) {}

absl::Status LaneSession::Run() {
  ASSIGN_OR_RETURN(absl::Span<const std::byte> magic, reader_.ReadRaw(sizeof(lane::kMagic)));
  const auto opened_with = [&](const char (&preamble)[sizeof(lane::kMagic)]) {
    return std::memcmp(magic.data(), preamble, sizeof(preamble)) == 0;
  };
  announces_lengths_ = opened_with(lane::kMagic);
  if (!announces_lengths_ && !opened_with(lane::kMagicV1)) {
    return absl::InvalidArgumentError(
        "data lane: the connection did not open with KVLANE02 or KVLANE01");
  }
  if (announces_lengths_) {  // the client waits for this before its first call
    writer_.AddCopy(magic);
    RETURN_IF_ERROR(writer_.Send());
  }
  while (true) {
    // Acknowledge what is applied before waiting for more.
    if (!writer_.empty() && !reader_.HasBufferedFrame()) RETURN_IF_ERROR(writer_.Send());
    absl::StatusOr<lane::Frame> frame = reader_.Next();
    if (!frame.ok()) {
      // A frame too long is answered; a closed or failed socket is not.
      if (absl::IsInvalidArgument(frame.status())) {
        QueueStatus(frame.status());
        (void)writer_.Send();
      } else if (!writer_.empty()) {
        (void)writer_.Send();  // acknowledgements of what was applied
      }
      return frame.status();
    }
    if (absl::Status status = OnFrame(*frame); !status.ok()) {
      QueueStatus(status);
      (void)writer_.Send();
      return status;
    }
    if (broke_announcement_) {
      // The client waits for the announced bytes; only the connection's end wakes it.
      return absl::AbortedError(
          "data lane: a Fetch failed after announcing its length; closed its connection");
    }
  }
}

absl::Status LaneSession::OnFrame(const lane::Frame& frame) {
  switch (frame.header.kind) {
    case v1::LANE_FRAME_UPDATE:
      updating_ = true;
      SetInCall(true);
      if (!discarding_) OnUpdate(frame.payload);
      return absl::OkStatus();
    case v1::LANE_FRAME_UPDATE_END:
      if (!updating_) {
        return absl::InvalidArgumentError("data lane: UPDATE_END outside an Update call");
      }
      if (!discarding_) QueueStatus(absl::OkStatus());
      updating_ = discarding_ = false;
      SetInCall(false);
      return absl::OkStatus();
    case v1::LANE_FRAME_FETCH:
      if (updating_) {
        return absl::InvalidArgumentError("data lane: FETCH inside an Update call (no UPDATE_END)");
      }
      SetInCall(true);
      RETURN_IF_ERROR(writer_.Send());
      RETURN_IF_ERROR(OnFetch(frame.payload));
      SetInCall(false);
      return absl::OkStatus();
    default:
      if (frame.header.kind < 0) {
        return absl::InvalidArgumentError(
            "data lane: a frame header's reserved bytes (5 to 7) are not zero, so its kind is unknown");
      }
      return absl::InvalidArgumentError(
          absl::StrCat("data lane: frame kind ", frame.header.kind, " is not a request"));
  }
}

void LaneSession::OnUpdate(absl::Span<const std::byte> payload) {
  UpdateView view;
  v1::UpdateResponse ack;
  absl::Status status = ParseUpdate(payload, parsed_, view);
  if (status.ok()) status = handlers_.Update(view, &known_spec_, &ack);
  if (status.ok()) {
    writer_.AddMessage(v1::LANE_FRAME_UPDATE_ACK, ack);
  } else {
    QueueStatus(status);
    discarding_ = true;
  }
  parsed_.Clear();
}

absl::Status LaneSession::OnFetch(absl::Span<const std::byte> payload) {
  v1::FetchRequest request;
  if (!request.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    QueueStatus(absl::InvalidArgumentError(
        "FetchRequest: malformed (not the wire format of kvcache.v1.FetchRequest)"));
    return writer_.Send();
  }
  bool announced = false;
  const absl::Status status = SendPlannedFetch(request, announced);
  // A socket that failed cannot carry the status either.
  if (absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status)) return status;
  broke_announcement_ = announced && !status.ok();
  QueueStatus(status);
  return writer_.Send();
}

// The plan pins the pages it reads; it is gone before the call's STATUS goes
// out, so a client that frees the cache next finds every page back.
absl::Status LaneSession::SendPlannedFetch(const v1::FetchRequest& request, bool& announced) {
  absl::StatusOr<FetchPlan> plan = handlers_.PlanFetch(request);
  if (!plan.ok()) return plan.status();
  return SendChunks(*plan, announced);
}

uint64_t LaneSession::ChunkFrameBytes(const FetchPlan& plan) const {
  uint64_t bytes = 0;
  for (size_t index = 0; index < plan.chunks.size(); ++index) {
    if (plan.chunks[index].form != FetchPlan::Form::kTokens) return 0;
    bytes += lane::kHeaderBytes + FramingOf(plan, index).size();
  }
  return bytes;
}

FetchChunkFraming LaneSession::FramingOf(const FetchPlan& plan, size_t index) const {
  v1::FetchResponse header;
  uint64_t key_bytes = 0, value_bytes = 0;
  handlers_.FetchChunkHeader(plan, index, &header, &key_bytes, &value_bytes);
  return FetchChunkFraming(header, key_bytes, value_bytes);
}

// A chunk of keys and values goes out from the pages it lies in where they
// are host-mapped (the kernel's copy into the socket is the only one), else
// read into chunk_buffer_ first. Small chunks go out many to a send: up to
// kChunkBatchBytes of frames are queued before they are written. On a
// KVLANE02 connection the chunks' length goes first where every chunk is
// keys and values (their sizes known before their data is read).
absl::Status LaneSession::SendChunks(const FetchPlan& plan, bool& announced) {
  if (announces_lengths_) {
    if (const uint64_t bytes = ChunkFrameBytes(plan); bytes > 0) {
      v1::LaneFetchLength length;
      length.set_chunk_frame_bytes(bytes);
      writer_.AddMessage(v1::LANE_FRAME_FETCH_LENGTH, length);
      announced = true;
    }
  }
  size_t queued = 0;  // bytes of frames queued in writer_
  size_t used = 0;    // bytes of chunk_buffer_ they use
  const auto flush = [&] {
    queued = used = 0;
    return writer_.empty() ? absl::OkStatus() : writer_.Send();
  };
  engine::KvViews views;
  for (size_t index = 0; index < plan.chunks.size(); ++index) {
    if (plan.chunks[index].form != FetchPlan::Form::kTokens) {
      v1::FetchResponse chunk;
      RETURN_IF_ERROR(handlers_.FillFetchChunk(plan, index, &chunk));
      writer_.AddMessage(v1::LANE_FRAME_FETCH_CHUNK, chunk);
      RETURN_IF_ERROR(flush());
      continue;
    }
    const FetchChunkFraming framing = FramingOf(plan, index);
    const uint64_t key_bytes = framing.key_bytes(), value_bytes = framing.value_bytes();
    const size_t frame_bytes = lane::kHeaderBytes + framing.size();
    if (handlers_.ViewFetchChunk(plan, index, views).ok()) {
      writer_.AddHeader(v1::LANE_FRAME_FETCH_CHUNK, static_cast<uint32_t>(framing.size()));
      writer_.AddCopy(framing.head());
      for (absl::Span<const std::byte> piece : views.keys) writer_.AddReference(piece);
      writer_.AddCopy(framing.middle());
      for (absl::Span<const std::byte> piece : views.values) writer_.AddReference(piece);
    } else {
      if (used + frame_bytes > chunk_buffer_capacity_) {
        RETURN_IF_ERROR(flush());
        if (frame_bytes > chunk_buffer_capacity_) {
          chunk_buffer_capacity_ = std::max(frame_bytes, kChunkBatchBytes);
          chunk_buffer_.reset(new std::byte[chunk_buffer_capacity_]);  // uninitialised
        }
      }
      std::byte* frame = chunk_buffer_.get() + used;
      lane::EncodeHeader({.length = static_cast<uint32_t>(framing.size()),
                          .kind = v1::LANE_FRAME_FETCH_CHUNK},
                         frame);
      std::byte* chunk = frame + lane::kHeaderBytes;
      framing.Write(reinterpret_cast<uint8_t*>(chunk));
      RETURN_IF_ERROR(handlers_.ReadFetchChunk(
          plan, index, {.keys = {chunk + framing.keys_offset(), key_bytes},
                        .values = {chunk + framing.values_offset(), value_bytes}}));
      writer_.AddReference({frame, frame_bytes});
      used += frame_bytes;
    }
    queued += frame_bytes;
    if (queued >= kChunkBatchBytes) RETURN_IF_ERROR(flush());
  }
  return flush();
}

void LaneSession::QueueStatus(const absl::Status& status) {
  writer_.AddMessage(v1::LANE_FRAME_STATUS, lane::LaneStatusOf(status));
}

}  // namespace kvcache::service
