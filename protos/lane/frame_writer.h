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

namespace kvcache::lane {

// Frames queued for sending; Send writes them all in one system call where
// it can. Parts added by reference must stay unchanged until Send returns.
class FrameWriter {
 public:
  explicit FrameWriter(int fd) : fd_(fd) {}

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
  // Bytes the socket took since the writer was made.
  uint64_t bytes_sent() const { return bytes_sent_; }

 private:
  struct Part {
    bool owned;        // in owned_ at [offset, offset + size), else at data
    size_t offset;
    const std::byte* data;
    size_t size;
  };

  int fd_;
  std::string owned_;
  std::vector<Part> parts_;
  std::vector<iovec> iov_;  // Send's, kept to spare an allocation per send
  uint64_t bytes_sent_ = 0;
};

}  // namespace kvcache::lane
