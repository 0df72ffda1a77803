#include "service/lane/lane_session.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "service/tokens_file.h"

namespace kvcache::service {
namespace {

constexpr size_t kChunkBatchBytes = 512 << 10;
// A LaneAuth of the longest token the tokens file takes: its tag and length first.
static_assert(kMaxTokenBytes + 1 + 2 <= lane::kMaxAuthFrameBytes,
              "an AUTH frame must hold the longest token");
// Acknowledgements queued before they go out even with more frames waiting
// (about 1 KiB).
constexpr int kMostUnsentAcks = 64;

}  // namespace

LaneSession::LaneSession(Tenants& tenants, int fd, uint64_t max_message_bytes,
                         lane::TlsSession* tls)
    : tenants_(tenants), reader_(fd, max_message_bytes, tls), writer_(fd, tls) {
  if (tenants_.authenticates()) reader_.set_header_check(&LaneSession::CheckOpeningFrame);
}

absl::Status LaneSession::CheckOpeningFrame(const lane::FrameHeader& header) {
  if (header.kind != v1::LANE_FRAME_AUTH) {
    return absl::UnauthenticatedError(
        "data lane: the server has tenants; the first frame must be AUTH with a bearer token");
  }
  if (header.length > lane::kMaxAuthFrameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("data lane: an AUTH frame of ", header.length,
                     " bytes is over the limit of ", lane::kMaxAuthFrameBytes, " (one bearer token)"));
  }
  return absl::OkStatus();
}

// Any other opening, another lane version's preamble included, is closed
// unanswered, as a stranger's is (DataLane logs why): a peer that speaks
// another protocol would not read a STATUS frame.
absl::Status LaneSession::CheckPreamble(absl::Span<const std::byte> magic) {
  if (std::memcmp(magic.data(), lane::kMagic, sizeof(lane::kMagic)) == 0) return absl::OkStatus();
  const absl::string_view opened(reinterpret_cast<const char*>(magic.data()), magic.size());
  return absl::InvalidArgumentError(absl::StrCat(
      "data lane: the connection opened with \"", absl::CHexEscape(opened), "\", not the preamble ",
      absl::string_view(lane::kMagic, sizeof(lane::kMagic)), " (the only lane version served)"));
}

absl::Status LaneSession::Run() {
  const absl::Status status = Serve();
  ReportBytes();
  admitted_ = Admitted();  // the tenant's connection count drops as the client sees the end
  return status;
}

absl::Status LaneSession::Serve() {
  ASSIGN_OR_RETURN(absl::Span<const std::byte> magic, reader_.ReadRaw(sizeof(lane::kMagic)));
  RETURN_IF_ERROR(CheckPreamble(magic));
  if (!tenants_.authenticates()) opened_.store(true, std::memory_order_release);
  writer_.AddCopy(magic);  // the client waits for this before its first call
  RETURN_IF_ERROR(writer_.Send());
  while (true) {
    absl::StatusOr<lane::Frame> frame = NextFrame();
    if (!frame.ok()) {
      // A frame refused from its header is answered; a closed or failed
      // socket is not.
      if (absl::IsInvalidArgument(frame.status()) || absl::IsUnauthenticated(frame.status())) {
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
    ReportBytes();
    if (revoked_) {
      if (!writer_.empty()) (void)writer_.Send();
      return absl::UnauthenticatedError(
          "data lane: the connection's token was revoked; closed its connection");
    }
    if (broke_announcement_) {
      // The client waits for the announced bytes; only the connection's end wakes it.
      return absl::AbortedError(
          "data lane: a Fetch failed after announcing its length; closed its connection");
    }
  }
}

void LaneSession::ReportBytes() {
  if (!admitted_.ok()) return;  // no tenant yet: the preamble and a refused AUTH count nowhere
  admitted_.CountReceived(Transport::kLane, reader_.bytes_received() - reported_received_);
  admitted_.CountSent(Transport::kLane, writer_.bytes_sent() - reported_sent_);
  reported_received_ = reader_.bytes_received();
  reported_sent_ = writer_.bytes_sent();
}

// What is applied is acknowledged before the session waits for more, but
// not while the client's next frame is already here: a client that streams
// its Updates gets their acknowledgements many to a send, and the session
// spends a send (and the client a wake-up) per batch, not per message. The
// look for that frame is the non-blocking read the session makes anyway. At
// most kMostUnsentAcks wait, so a client that is always ahead still sees
// them.
absl::StatusOr<lane::Frame> LaneSession::NextFrame() {
  if (writer_.empty()) {
    unsent_acks_ = 0;
    return reader_.Next();
  }
  if (unsent_acks_ < kMostUnsentAcks) {
    ASSIGN_OR_RETURN(std::optional<lane::Frame> arrived, reader_.Poll());
    if (arrived.has_value()) return *arrived;
  }
  RETURN_IF_ERROR(writer_.Send());
  unsent_acks_ = 0;
  return reader_.Next();
}

absl::Status LaneSession::OnFrame(const lane::Frame& frame) {
  const bool first = !saw_frame_;
  saw_frame_ = true;
  if (frame.header.kind == v1::LANE_FRAME_AUTH) {
    if (!first) {
      return absl::InvalidArgumentError("data lane: AUTH after the connection's first frame");
    }
    return OnAuth(frame.payload);
  }
  if (!admitted_.ok()) RETURN_IF_ERROR(AdmitWithoutToken());
  // A token revoked since the last frame: refused and the connection closed
  // (Serve), whatever the frame.
  RETURN_IF_ERROR(admitted_.StillAdmitted());
  switch (frame.header.kind) {
    case v1::LANE_FRAME_UPDATE:
      updating_ = true;
      SetInCall(true);
      OnUpdate(frame.payload);
      return absl::OkStatus();
    case v1::LANE_FRAME_UPDATE_END:
      if (!updating_) {
        return absl::InvalidArgumentError("data lane: UPDATE_END outside an Update call");
      }
      OnUpdateEnd();
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

absl::Status LaneSession::OnAuth(absl::Span<const std::byte> payload) {
  v1::LaneAuth auth;
  if (!auth.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    return absl::InvalidArgumentError(
        "LaneAuth: malformed (not the wire format of kvcache.v1.LaneAuth)");
  }
  ASSIGN_OR_RETURN(admitted_, tenants_.AdmitLane(auth.token()));
  reader_.set_header_check(nullptr);
  opened_.store(true, std::memory_order_release);
  update_.emplace(admitted_.handlers(), &admitted_);
  QueueStatus(absl::OkStatus());
  return writer_.Send();
}

absl::Status LaneSession::AdmitWithoutToken() {
  if (tenants_.authenticates()) {
    return absl::UnauthenticatedError(
        "data lane: the server has tenants; the first frame must be AUTH with a bearer token");
  }
  ASSIGN_OR_RETURN(admitted_, tenants_.AdmitLane(""));
  update_.emplace(admitted_.handlers(), &admitted_);
  return absl::OkStatus();
}

// A failed call's STATUS went out with its failure; its later frames are
// skipped until UPDATE_END.
void LaneSession::OnUpdate(absl::Span<const std::byte> payload) {
  if (update_->failed()) return;
  const absl::Span<const std::byte> pieces[] = {payload};
  const absl::StatusOr<EncodedAck> ack = update_->Apply(pieces);
  if (!ack.ok()) {
    QueueStatus(ack.status());
    revoked_ = absl::IsUnauthenticated(ack.status());
    return;
  }
  writer_.AddHeader(v1::LANE_FRAME_UPDATE_ACK, static_cast<uint32_t>(ack->bytes().size()));
  writer_.AddCopy(ack->bytes());
  ++unsent_acks_;
}

void LaneSession::OnUpdateEnd() {
  const bool answered = update_->failed();
  const absl::Status status = update_->Finish();
  if (!answered) QueueStatus(status);
  updating_ = false;
  SetInCall(false);
}

absl::Status LaneSession::OnFetch(absl::Span<const std::byte> payload) {
  absl::StatusOr<v1::FetchRequest> request = v1::FetchRequest();
  if (!request->ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    request = absl::InvalidArgumentError(
        "FetchRequest: malformed (not the wire format of kvcache.v1.FetchRequest)");
  }
  FetchCall call(admitted_.handlers(), request, &admitted_);
  bool announced = false;
  const absl::Status sent = SendChunks(call, announced);
  // The call's status comes after its pages are let go (FetchCall::Finish).
  const absl::Status status = call.Finish(sent);
  // A socket that failed cannot carry the status either.
  if (absl::IsUnavailable(sent) || absl::IsDeadlineExceeded(sent)) return sent;
  broke_announcement_ = announced && !status.ok();
  revoked_ = absl::IsUnauthenticated(status);
  QueueStatus(status);
  return writer_.Send();
}

// A chunk of keys and values goes out from the pages it lies in where they
// are host-mapped (the kernel's copy into the socket is the only one), else
// read into chunk_buffer_ first. Small chunks go out many to a send: up to
// kChunkBatchBytes of frames are queued before they are written. The
// chunks' length goes first where every chunk is keys and values (their
// sizes known before their data is read).
absl::Status LaneSession::SendChunks(FetchCall& call, bool& announced) {
  const std::optional<uint64_t> bytes = call.TokenChunksBytes(lane::kHeaderBytes);
  if (bytes.has_value() && *bytes > 0) {
    v1::LaneFetchLength length;
    length.set_chunk_frame_bytes(*bytes);
    writer_.AddMessage(v1::LANE_FRAME_FETCH_LENGTH, length);
    announced = true;
  }
  size_t queued = 0;  // bytes of frames queued in writer_
  size_t used = 0;    // bytes of chunk_buffer_ they use
  const auto flush = [&] {
    queued = used = 0;
    return writer_.empty() ? absl::OkStatus() : writer_.Send();
  };
  engine::KvMappedPieces pieces;
  while (call.has_next()) {
    if (!call.next_is_tokens()) {
      v1::FetchResponse chunk;
      if (!call.FillNext(chunk).ok()) break;
      writer_.AddMessage(v1::LANE_FRAME_FETCH_CHUNK, chunk);
      RETURN_IF_ERROR(flush());
      continue;
    }
    const FetchChunkFraming& framing = call.NextFraming();
    const size_t frame_bytes = lane::kHeaderBytes + framing.size();
    if (call.MappedNext(pieces)) {
      QueueMappedChunk(framing, pieces);
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
      if (!call.ReadNext({frame + lane::kHeaderBytes, framing.size()}).ok()) break;
      writer_.AddReference({frame, frame_bytes});
      used += frame_bytes;
    }
    queued += frame_bytes;
    if (queued >= kChunkBatchBytes) RETURN_IF_ERROR(flush());
  }
  return flush();  // also the chunks before a failed one
}

void LaneSession::QueueMappedChunk(const FetchChunkFraming& framing,
                                   const engine::KvMappedPieces& pieces) {
  writer_.AddHeader(v1::LANE_FRAME_FETCH_CHUNK, static_cast<uint32_t>(framing.size()));
  writer_.AddCopy(framing.head());
  for (absl::Span<const std::byte> piece : pieces.keys) writer_.AddReference(piece);
  writer_.AddCopy(framing.middle());
  for (absl::Span<const std::byte> piece : pieces.values) writer_.AddReference(piece);
}

void LaneSession::QueueStatus(const absl::Status& status) {
  writer_.AddMessage(v1::LANE_FRAME_STATUS, lane::LaneStatusOf(status));
  unsent_acks_ = kMostUnsentAcks;  // a call's end goes out at the next frame, not later
}

}  // namespace kvcache::service
