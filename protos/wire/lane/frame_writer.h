// Writing the data lane's frames to a blocking socket.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"
#include "wire/lane/tls.h"

namespace kvcache::lane {

// Frames queued for sending; Send writes them all in one system call where
// it can. Parts added by reference must stay unchanged until Send returns.
class FrameWriter {
 public:
  // With `tls` (which must outlive the writer) the socket carries TLS
  // records: where the kernel encrypts them, sends are as in plaintext; else
  // OpenSSL writes.
  explicit FrameWriter(int fd, TlsSession* tls = nullptr)
      : fd_(fd), tls_(tls != nullptr && !tls->kernel_sends() ? tls : nullptr) {}

  // A frame whose payload is `message`, serialized into the writer's buffer.
  void AddMessage(v1::LaneFrameKind kind, const google::protobuf::MessageLite& message);
  // A frame's header, its payload to follow as `length` bytes of Add* calls.
  void AddHeader(v1::LaneFrameKind kind, uint32_t length);
  // Bytes copied into the writer's buffer.
  void AddCopy(absl::Span<const std::byte> bytes);
  // Bytes sent from where they lie.
  void AddReference(absl::Span<const std::byte> bytes);
  bool empty() const { return parts_.empty(); }
  // Writes everything queued, then forgets it.
  absl::Status Send();
  // Bytes the socket took since the writer was made (plaintext bytes, with TLS).
  uint64_t bytes_sent() const { return bytes_sent_; }

 private:
  struct Part {
    bool owned;        // in owned_ at [offset, offset + size), else at data
    size_t offset;
    const std::byte* data;
    size_t size;
  };

  // Send's writes where OpenSSL encrypts: small parts gathered into records
  // of up to a record's plaintext, large ones written where they lie.
  absl::Status SendThroughTls(absl::Span<const iovec> iov);

  int fd_;
  TlsSession* tls_;  // null for plaintext and where the kernel encrypts
  std::string owned_;
  std::string gathered_;  // SendThroughTls's small parts, kept to spare an allocation
  std::vector<Part> parts_;
  std::vector<iovec> iov_;  // Send's, kept to spare an allocation per send
  uint64_t bytes_sent_ = 0;
};

}  // namespace kvcache::lane
