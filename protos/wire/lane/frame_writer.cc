#include "wire/lane/frame_writer.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <climits>

#include "wire/lane/frame.h"
#include "wire/lane/socket.h"

namespace kvcache::lane {

void FrameWriter::AddMessage(v1::LaneFrameKind kind, const google::protobuf::MessageLite& message) {
  const size_t length = message.ByteSizeLong();
  AddHeader(kind, static_cast<uint32_t>(length));
  const size_t at = owned_.size();
  owned_.resize(at + length);
  message.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(owned_.data() + at));
  parts_.back().size += length;  // AddHeader's part, owned and just before
}

void FrameWriter::AddHeader(v1::LaneFrameKind kind, uint32_t length) {
  std::byte header[kHeaderBytes];
  EncodeHeader({.length = length, .kind = kind}, header);
  AddCopy(header);
}

void FrameWriter::AddCopy(absl::Span<const std::byte> bytes) {
  const size_t at = owned_.size();
  owned_.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  // Adjacent copies form one part (many acknowledgements, one iovec).
  if (!parts_.empty() && parts_.back().owned &&
      parts_.back().offset + parts_.back().size == at) {
    parts_.back().size += bytes.size();
    return;
  }
  parts_.push_back({.owned = true, .offset = at, .data = nullptr, .size = bytes.size()});
}

void FrameWriter::AddReference(absl::Span<const std::byte> bytes) {
  if (bytes.empty()) return;
  parts_.push_back({.owned = false, .offset = 0, .data = bytes.data(), .size = bytes.size()});
}

absl::Status FrameWriter::Send() {
  std::vector<iovec>& iov = iov_;
  iov.clear();
  for (const Part& part : parts_) {
    const std::byte* data = part.owned ? reinterpret_cast<const std::byte*>(owned_.data()) + part.offset
                                       : part.data;
    iov.push_back({const_cast<std::byte*>(data), part.size});
  }
  // Forgotten on every way out; owned_ only after the sends, which read it.
  parts_.clear();
  struct ClearOnExit {
    std::string& owned;
    ~ClearOnExit() { owned.clear(); }
  } clear_on_exit{owned_};
  if (tls_ != nullptr) return SendThroughTls(iov);
  size_t first = 0;
  while (first < iov.size()) {
    msghdr message{};
    message.msg_iov = iov.data() + first;
    message.msg_iovlen = std::min<size_t>(iov.size() - first, IOV_MAX);
    const ssize_t sent = sendmsg(fd_, &message, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      return SocketError("send");
    }
    bytes_sent_ += static_cast<uint64_t>(sent);
    // Skip what went out; the first part left may have gone partly.
    size_t left = static_cast<size_t>(sent);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<std::byte*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return absl::OkStatus();
}

absl::Status FrameWriter::SendThroughTls(absl::Span<const iovec> iov) {
  constexpr size_t kRecordPlaintext = 16 << 10;  // TLS's largest record
  gathered_.clear();
  const auto flush = [&]() -> absl::Status {
    if (gathered_.empty()) return absl::OkStatus();
    absl::Status status = tls_->Write(absl::MakeConstSpan(
        reinterpret_cast<const std::byte*>(gathered_.data()), gathered_.size()));
    if (status.ok()) bytes_sent_ += gathered_.size();
    gathered_.clear();
    return status;
  };
  for (const iovec& part : iov) {
    const auto* data = static_cast<const std::byte*>(part.iov_base);
    if (part.iov_len < kRecordPlaintext) {
      gathered_.append(reinterpret_cast<const char*>(data), part.iov_len);
      if (gathered_.size() < kRecordPlaintext) continue;
      if (absl::Status status = flush(); !status.ok()) return status;
      continue;
    }
    if (absl::Status status = flush(); !status.ok()) return status;
    if (absl::Status status = tls_->Write({data, part.iov_len}); !status.ok()) return status;
    bytes_sent_ += part.iov_len;
  }
  return flush();
}

}  // namespace kvcache::lane
