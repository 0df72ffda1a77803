#include "lane_client.h"

#include <sys/socket.h>

#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "fetch_view.h"
#include "update_encoding.h"
#include "wire/net/address.h"

namespace kvcache::internal {
namespace {

// The host of a lane address that lane::Connect took (so it parses), an
// IPv6 one without brackets: the name its TLS certificate must carry.
std::string HostOf(const std::string& address) {
  absl::StatusOr<net::HostPort> parsed =
      net::ParseHostPort(address, "data lane address", net::AddressUse::kConnect);
  return parsed.ok() ? parsed->host : address;
}

// A lane address the server gave with a wildcard host ("listen on all")
// means the host the client already reaches it at. Where the gRPC target
// names no host:port (a unix socket, a resolver's scheme) it stays as it is,
// and lane::Connect refuses the wildcard: calls go over gRPC.
std::string Reachable(const std::string& lane_address, const std::string& grpc_address) {
  absl::StatusOr<net::HostPort> lane =
      net::ParseHostPort(lane_address, "data lane address", net::AddressUse::kListen);
  if (!lane.ok() || !net::IsWildcardHost(lane->host)) return lane_address;
  absl::StatusOr<net::HostPort> server =
      net::ParseHostPort(grpc_address, "address", net::AddressUse::kConnect);
  if (!server.ok()) return lane_address;
  return net::HostPort{server->host, lane->port}.ToString();
}

// Sends between two looks for acknowledgements (LaneUpdate).
constexpr int kWritesPerAckPoll = 8;

// A connection that ended without its STATUS frame.
absl::Status Lost(const absl::Status& status) {
  if (absl::IsOutOfRange(status)) {
    return absl::UnavailableError("data lane: the server closed the connection");
  }
  return status;
}

// The acknowledgements are read by the writing thread itself: every
// kWritesPerAckPoll sends, those that have arrived (without waiting); at
// Finish, the rest; and by acknowledged_count's caller. The server batches
// them, so a look after each send would mostly find none and cost the
// client, the busier side on loopback, a system call per message; a few
// sends' worth is far below what the socket buffers, so the server never
// blocks on them. A reader thread of its own would contend with the writer
// for the socket's lock and cost a wake-up per acknowledgement (a fifth of
// the client's time at 64 KiB per message, in perf).
class LaneUpdate final : public UpdateTransport {
 public:
  LaneUpdate(LanePool& pool, absl::StatusOr<std::unique_ptr<LaneConnection>> connection,
             std::string cache_id)
      : pool_(pool), cache_id_(std::move(cache_id)) {
    if (connection.ok()) {
      connection_ = *std::move(connection);
      shared_session_ = connection_->tls != nullptr;
    } else {
      absl::MutexLock lock(&mutex_);
      End(connection.status(), false);
    }
  }

  bool Write(const LayerUpdate& update, const std::shared_ptr<const void>*) override {
    // The kernel has copied the tensors when the send returns: no owner needed.
    if (write_error_.has_value()) return false;
    {
      absl::MutexLock lock(&mutex_);
      if (ended_) return false;
    }
    const std::vector<UpdateRun> runs = FrameUpdate(cache_id_, update);
    uint64_t bytes = 0;
    for (const UpdateRun& run : runs) bytes += run.framing.size() + run.data.size();
    if (bytes > UINT32_MAX) {
      write_error_ = absl::InvalidArgumentError(absl::StrCat(
          "UpdateRequest: ", bytes, " bytes is over the data lane's 4 GiB frame"));
      return false;
    }
    lane::FrameWriter& writer = connection_->writer;
    writer.AddHeader(v1::LANE_FRAME_UPDATE, static_cast<uint32_t>(bytes));
    for (const UpdateRun& run : runs) {
      writer.AddCopy(absl::MakeConstSpan(reinterpret_cast<const std::byte*>(run.framing.data()),
                                         run.framing.size()));
      writer.AddReference(run.data);
    }
    if (absl::Status sent = Send(); !sent.ok()) {
      write_error_ = sent;
      send_failed_ = true;
      return false;
    }
    ++frames_sent_;
    if (++writes_since_ack_poll_ < kWritesPerAckPoll) return true;
    writes_since_ack_poll_ = 0;
    absl::MutexLock lock(&mutex_);
    ReadAcks(/*wait=*/false);
    return !ended_;
  }

  void CollectAcks() override {
    absl::MutexLock lock(&mutex_);
    if (finished_) return;
    if (!shared_session_) return ReadAcks(/*wait=*/false);
    // The writer is sending: it looks for them itself after a few sends.
    if (!session_mutex_.TryLock()) return;
    ReadAcks(/*wait=*/false);
    session_mutex_.Unlock();
  }

  absl::Status Finish() override {
    if (connection_ == nullptr) {
      absl::MutexLock lock(&mutex_);
      finished_ = true;
      return end_;
    }
    if (frames_sent_ == 0 && !send_failed_) return FinishUnsent();
    if (!write_error_.has_value()) {
      connection_->writer.AddHeader(v1::LANE_FRAME_UPDATE_END, 0);
      if (absl::Status sent = Send(); !sent.ok()) write_error_ = sent;
    }
    // Without UPDATE_END sent the server will not answer: read what it sent.
    if (write_error_.has_value()) shutdown(connection_->fd.get(), SHUT_WR);
    absl::MutexLock lock(&mutex_);
    ReadAcks(/*wait=*/true);
    finished_ = true;
    // The server's own answer first: it explains a broken send.
    if (!clean_end_ && write_error_.has_value()) return *write_error_;
    if (clean_end_ && !write_error_.has_value()) {
      connection_->reused = true;
      pool_.Give(std::move(connection_));
    }
    return end_;
  }

  void Cancel() override {
    if (connection_ == nullptr) return;
    write_error_ = absl::CancelledError("the Update stream was abandoned");
    shutdown(connection_->fd.get(), SHUT_RDWR);
  }

 private:
  // Sends what the writer holds. An OpenSSL session must not read on one
  // thread (CollectAcks) while it writes on another; the kernel's sockets,
  // plaintext or kernel TLS, may.
  absl::Status Send() {
    if (!shared_session_) return connection_->writer.Send();
    absl::MutexLock lock(&session_mutex_);
    return connection_->writer.Send();
  }

  // A call that sent no frame. Empty, it is OK with no acknowledgements, as
  // over gRPC: the lane has no call without an UPDATE frame (a lone
  // UPDATE_END is a protocol error), so nothing goes out. Refused before its
  // first frame (over 4 GiB), it answers that. The connection goes back to
  // the pool unless a look for acknowledgements found it closed.
  absl::Status FinishUnsent() {
    absl::MutexLock lock(&mutex_);
    finished_ = true;
    if (ended_) return end_;
    pool_.Give(std::move(connection_));
    return write_error_.value_or(absl::OkStatus());
  }

  // Takes the acknowledgements that have arrived (wait: all, until the
  // call's STATUS or the connection's end).
  void ReadAcks(bool wait) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    v1::UpdateResponse ack;
    while (!ended_) {
      absl::StatusOr<std::optional<lane::Frame>> polled;
      if (wait) {
        absl::StatusOr<lane::Frame> frame = connection_->reader.Next();
        polled = frame.ok() ? absl::StatusOr<std::optional<lane::Frame>>(*frame) : frame.status();
      } else {
        polled = connection_->reader.Poll();
      }
      if (!polled.ok()) return End(Lost(polled.status()), false);
      if (!polled->has_value()) return;
      const auto& [header, payload] = **polled;
      if (header.kind == v1::LANE_FRAME_UPDATE_ACK &&
          ack.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
        AddAck(ack);
        continue;
      }
      v1::LaneStatus status;
      if (header.kind == v1::LANE_FRAME_STATUS &&
          status.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
        return End(lane::StatusFromLane(status), true);
      }
      return End(absl::DataLossError(absl::StrCat("data lane: an unreadable frame of kind ",
                                                  header.kind, " in an Update call")),
                 false);
    }
  }

  void End(absl::Status status, bool clean) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    end_ = std::move(status);
    clean_end_ = clean;
    ended_ = true;
  }

  LanePool& pool_;
  std::string cache_id_;
  std::unique_ptr<LaneConnection> connection_;
  // The reading side: the writer's thread and acknowledged_count's callers.
  absl::Mutex mutex_;
  absl::Status end_ ABSL_GUARDED_BY(mutex_);
  bool clean_end_ ABSL_GUARDED_BY(mutex_) = false;
  bool ended_ ABSL_GUARDED_BY(mutex_) = false;  // the call's STATUS, or the connection's end, was read
  bool finished_ ABSL_GUARDED_BY(mutex_) = false;
  bool shared_session_ = false;  // the connection runs TLS: reads and writes take session_mutex_
  // Held by the writer while it sends and by CollectAcks while it reads
  // (always after mutex_, and only tried).
  absl::Mutex session_mutex_;
  std::optional<absl::Status> write_error_;  // the writer's own
  int writes_since_ack_poll_ = 0;
  uint64_t frames_sent_ = 0;
  bool send_failed_ = false;  // a send failed: the connection is unusable
};

// What a server sent instead of answering KVLANE02: the STATUS of a server
// that refuses the connection (too many open), else something broken.
absl::Status Refusal(lane::FrameReader& reader, absl::Span<const std::byte> answer) {
  const lane::FrameHeader header = lane::DecodeHeader(answer.data());
  if (header.kind == v1::LANE_FRAME_STATUS && header.length <= (64 << 10)) {
    absl::StatusOr<absl::Span<const std::byte>> payload = reader.ReadRaw(header.length);
    v1::LaneStatus status;
    if (payload.ok() &&
        status.ParseFromArray(payload->data(), static_cast<int>(payload->size())) &&
        status.code() != 0) {
      return lane::StatusFromLane(status);
    }
  }
  return absl::DataLossError("data lane: the server answered KVLANE02 with other bytes");
}

// Why a KVLANE02 connection ended before its answer. Closed: the server
// speaks no lane of this version (another one, or TLS where the client has
// none). Else the read's own error, which under mutual TLS is the
// server's refusal (TLS 1.3 tells the client only at its first read).
absl::Status Unanswered(const absl::Status& status) {
  if (!absl::IsOutOfRange(status)) return status;
  return absl::UnavailableError(
      "data lane: the server closed the connection without answering its KVLANE02 preamble "
      "(not a lane of this version, or one that expects TLS)");
}

// A Fetch's FETCH_CHUNK frames against the length its server announced
// (FETCH_LENGTH; none: nothing to check).
class AnnouncedLength {
 public:
  absl::Status Announce(lane::FrameReader& reader, absl::Span<const std::byte> payload) {
    v1::LaneFetchLength length;
    if (announced_.has_value() || received_ > 0 ||
        !length.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      return absl::DataLossError("data lane: an unreadable or misplaced FETCH_LENGTH frame");
    }
    announced_ = length.chunk_frame_bytes();
    reader.Expect(*announced_);
    return absl::OkStatus();
  }
  absl::Status Count(absl::Span<const std::byte> payload) {
    received_ += lane::kHeaderBytes + payload.size();
    if (announced_.has_value() && received_ > *announced_) {
      return absl::DataLossError(absl::StrCat("data lane: the Fetch's chunks ran past the ",
                                              *announced_, " bytes its FETCH_LENGTH announced"));
    }
    return absl::OkStatus();
  }
  // At the STATUS: whether the server kept its word (else it closes the connection).
  bool kept() const { return !announced_.has_value() || received_ == *announced_; }

 private:
  std::optional<uint64_t> announced_;
  uint64_t received_ = 0;
};

// One attempt of LaneFetch on `connection`. `delivered`: some chunk reached
// on_chunk; `reusable`: the call ended as the protocol says, with its STATUS
// frame and every chunk it announced, so the connection can serve another.
absl::Status FetchOn(LaneConnection& connection, const v1::FetchRequest& request,
                     const std::function<absl::Status(absl::Span<const std::byte>)>& on_chunk,
                     bool& delivered, bool& reusable) {
  connection.writer.AddMessage(v1::LANE_FRAME_FETCH, request);
  if (absl::Status sent = connection.writer.Send(); !sent.ok()) return sent;
  AnnouncedLength length;
  while (true) {
    absl::StatusOr<lane::Frame> frame = connection.reader.Next();
    if (!frame.ok()) return Lost(frame.status());
    const auto& [header, payload] = *frame;
    if (header.kind == v1::LANE_FRAME_FETCH_LENGTH) {
      if (absl::Status announced = length.Announce(connection.reader, payload); !announced.ok()) {
        return announced;
      }
      continue;
    }
    if (header.kind == v1::LANE_FRAME_FETCH_CHUNK) {
      if (absl::Status counted = length.Count(payload); !counted.ok()) return counted;
      delivered = true;
      if (absl::Status taken = on_chunk(payload); !taken.ok()) return taken;
      continue;
    }
    v1::LaneStatus status;
    if (header.kind == v1::LANE_FRAME_STATUS &&
        status.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
      connection.reader.Expect(0);
      reusable = length.kept();
      return lane::StatusFromLane(status);
    }
    return absl::DataLossError(
        absl::StrCat("data lane: an unreadable frame of kind ", header.kind, " in a Fetch"));
  }
}

// A chunk as the lane delivered it: the bytes of its frame, parsed as asked.
class FrameChunk final : public ReceivedChunk {
 public:
  explicit FrameChunk(absl::Span<const std::byte> payload) : payload_(payload) {}

  absl::Status Take(v1::FetchResponse& out) override {
    return Parse(out) ? absl::OkStatus() : Unreadable();
  }

  absl::Status View(v1::FetchResponse& header, FetchChunkView& out) override {
    out.header = &header;
    if (ParseTokenChunk(payload_, header, out.keys, out.values)) return absl::OkStatus();
    // Packed and recurrent chunks: the whole message.
    if (!Parse(header)) return Unreadable();
    out.keys = BytesOf(header.keys().data());
    out.values = BytesOf(header.values().data());
    return absl::OkStatus();
  }

 private:
  bool Parse(v1::FetchResponse& out) const {
    return out.ParseFromArray(payload_.data(), static_cast<int>(payload_.size()));
  }
  static absl::Status Unreadable() {
    return absl::DataLossError("data lane: a Fetch chunk is not a FetchResponse");
  }

  absl::Span<const std::byte> payload_;
};

class LaneFetchCalls final : public FetchTransport {
 public:
  explicit LaneFetchCalls(LanePool& pool) : pool_(pool) {}

  absl::Status Fetch(const v1::FetchRequest& request, const ChunkSink& on_chunk) override {
    return LaneFetch(pool_, request, [&](absl::Span<const std::byte> payload) {
      FrameChunk chunk(payload);
      return on_chunk(chunk);
    });
  }

 private:
  LanePool& pool_;
};

}  // namespace

LanePool::LanePool(std::string setting, std::string grpc_address, absl::Duration timeout,
                   uint64_t max_payload, std::string token,
                   std::function<absl::StatusOr<std::string>()> ask_server,
                   absl::StatusOr<std::shared_ptr<const lane::TlsContext>> tls,
                   std::string tls_server_name, std::optional<lane::Keepalive> keepalive)
    : setting_(std::move(setting)),
      grpc_address_(std::move(grpc_address)),
      timeout_(timeout),
      max_payload_(max_payload),
      token_(std::move(token)),
      tls_(std::move(tls)),
      tls_server_name_(std::move(tls_server_name)),
      keepalive_(keepalive),
      ask_server_(std::move(ask_server)) {}

absl::StatusOr<std::unique_ptr<LaneConnection>> LanePool::ConnectWithPreamble(
    const std::string& address) const {
  const absl::string_view preamble(lane::kMagic, sizeof(lane::kMagic));
  if (!tls_.ok()) return tls_.status();
  if (keepalive_.has_value()) {
    if (absl::Status valid = keepalive_->Validate(); !valid.ok()) return valid;
  }
  const lane::TlsContext* tls = tls_->get();
  absl::StatusOr<int> fd = lane::Connect(address, timeout_, tls == nullptr ? preamble : "");
  if (!fd.ok()) return fd.status();
  lane::OwnedFd owned(*fd);
  if (keepalive_.has_value()) {
    if (absl::Status set = lane::SetKeepalive(owned.get(), *keepalive_); !set.ok()) return set;
  }
  std::unique_ptr<lane::TlsSession> session;
  if (tls != nullptr) {
    const std::string host = tls_server_name_.empty() ? HostOf(address) : tls_server_name_;
    absl::StatusOr<std::unique_ptr<lane::TlsSession>> made =
        lane::TlsSession::Connect(*tls, owned.get(), host);
    if (!made.ok()) return made.status();
    session = *std::move(made);
  }
  auto connection =
      std::make_unique<LaneConnection>(owned.release(), std::move(session), max_payload_);
  if (tls != nullptr) {
    connection->writer.AddCopy(
        {reinterpret_cast<const std::byte*>(preamble.data()), preamble.size()});
    if (absl::Status sent = connection->writer.Send(); !sent.ok()) return sent;
  }
  return connection;
}

absl::StatusOr<std::unique_ptr<LaneConnection>> LanePool::Open(const std::string& address) {
  absl::StatusOr<std::unique_ptr<LaneConnection>> connection = Connect(address);
  if (!connection.ok() || token_.empty()) return connection;
  if (absl::Status status = Authenticate(**connection); !status.ok()) return status;
  return connection;
}

absl::Status LanePool::Authenticate(LaneConnection& connection) const {
  v1::LaneAuth auth;
  auth.set_token(token_);
  connection.writer.AddMessage(v1::LANE_FRAME_AUTH, auth);
  if (absl::Status sent = connection.writer.Send(); !sent.ok()) return sent;
  absl::StatusOr<lane::Frame> frame = connection.reader.Next();
  if (!frame.ok()) return frame.status();
  v1::LaneStatus status;
  if (frame->header.kind != v1::LANE_FRAME_STATUS ||
      !status.ParseFromArray(frame->payload.data(), static_cast<int>(frame->payload.size()))) {
    return absl::DataLossError("data lane: the server answered AUTH with other than a STATUS");
  }
  return lane::StatusFromLane(status);
}

absl::StatusOr<std::unique_ptr<LaneConnection>> LanePool::Connect(const std::string& address) {
  absl::StatusOr<std::unique_ptr<LaneConnection>> opened = ConnectWithPreamble(address);
  if (!opened.ok()) return opened.status();
  std::unique_ptr<LaneConnection> connection = *std::move(opened);
  absl::StatusOr<absl::Span<const std::byte>> answer =
      connection->reader.ReadRaw(sizeof(lane::kMagic));
  if (!answer.ok()) return Unanswered(answer.status());
  if (std::memcmp(answer->data(), lane::kMagic, sizeof(lane::kMagic)) != 0) {
    return Refusal(connection->reader, *answer);
  }
  return connection;
}

bool LanePool::enabled() {
  absl::MutexLock lock(&mutex_);
  if (address_.has_value()) return !address_->empty();
  if (setting_ != "auto") {
    address_ = setting_;
    return !address_->empty();
  }
  // "auto": the server's lane if it has one and it answers; else gRPC.
  absl::StatusOr<std::string> advertised = ask_server_();
  if (!advertised.ok()) return false;  // asked again next time
  address_ = advertised->empty() ? "" : Reachable(*advertised, grpc_address_);
  if (address_->empty()) return false;
  absl::StatusOr<std::unique_ptr<LaneConnection>> probe = Open(*address_);
  if (!probe.ok()) {
    address_ = "";
    return false;
  }
  idle_.push_back(*std::move(probe));
  return true;
}

absl::StatusOr<std::unique_ptr<LaneConnection>> LanePool::Take() {
  std::string address;
  {
    absl::MutexLock lock(&mutex_);
    while (!idle_.empty()) {
      std::unique_ptr<LaneConnection> connection = std::move(idle_.back());
      idle_.pop_back();
      // A kept connection the server has closed since (a restart, a
      // shutdown) reads as end of file; an Update must not start on one.
      // (Nor one with bytes waiting: between calls the server sends none,
      // unless a TLS alert as it goes.)
      // Nor one whose socket failed (a reset). Where OpenSSL holds bytes the
      // server sent, they are an alert or the end too.
      std::byte probe;
      const ssize_t peeked = recv(connection->fd.get(), &probe, 1, MSG_PEEK | MSG_DONTWAIT);
      const bool quiet = peeked < 0 && lane::WouldBlock(errno);
      if (!quiet || (connection->tls != nullptr && connection->tls->HasBuffered())) continue;
      return connection;
    }
    if (!address_.has_value() || address_->empty()) {
      return absl::FailedPreconditionError("data lane: off (ClientOptions::data_lane)");
    }
    address = *address_;
  }
  return Open(address);
}

void LanePool::Give(std::unique_ptr<LaneConnection> connection) {
  absl::MutexLock lock(&mutex_);
  idle_.push_back(std::move(connection));
}

std::unique_ptr<FetchTransport> LaneFetchTransport(LanePool& pool) {
  return std::make_unique<LaneFetchCalls>(pool);
}

std::unique_ptr<UpdateTransport> OpenLaneUpdate(LanePool& pool, std::string cache_id) {
  return std::make_unique<LaneUpdate>(pool, pool.Take(), std::move(cache_id));
}

absl::Status LaneFetch(LanePool& pool, const v1::FetchRequest& request,
                       const std::function<absl::Status(absl::Span<const std::byte>)>& on_chunk) {
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<std::unique_ptr<LaneConnection>> connection = pool.Take();
    if (!connection.ok()) return connection.status();
    bool delivered = false, reusable = false;
    const absl::Status status = FetchOn(**connection, request, on_chunk, delivered, reusable);
    const bool reused = (*connection)->reused;
    if (reusable) {
      (*connection)->reused = true;
      pool.Give(*std::move(connection));
    }
    // A kept connection the server closed since (a restart, an idle cut).
    if (!reusable && !delivered && reused && attempt == 0 && absl::IsUnavailable(status)) continue;
    return status;
  }
}

}  // namespace kvcache::internal
