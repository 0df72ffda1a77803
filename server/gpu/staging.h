// The staging ring: one host-mapped buffer that bytes pass through between host
// memory and device-local pages, filled front to back and emptied (Reset) after
// each submission completes.
//
//   0                                    cursor                     capacity
//   +------+--+----------+--+-------------+---------------------------+
//   |run 0 |  | run 1    |  | run 2       |   free                    |
//   +------+--+----------+--+-------------+---------------------------+
//            ^ padding: each slice starts 16-byte aligned plus its phase, so
//              a slice and its device range agree mod 4 (see copy_pipeline.cc)
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "gpu/buffer.h"
#include "gpu/device.h"

namespace kvcache::gpu {

class StagingRing {
 public:
  // A region of the ring: [offset, offset + bytes).
  struct Slice {
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };

  static absl::StatusOr<std::unique_ptr<StagingRing>> Create(const Device& device, uint64_t bytes);

  // Up to `bytes` bytes (fewer when the ring is nearly full; none when it is
  // full) at an offset congruent to `phase` mod 4.
  Slice Reserve(uint64_t bytes, uint64_t phase);
  // Forgets every slice; only once the device is done with them.
  void Reset() { cursor_ = 0; }
  bool empty() const { return cursor_ == 0; }

  std::byte* data() const { return buffer_->mapped; }
  vk::Buffer buffer() const { return *buffer_->buffer; }
  uint64_t capacity() const { return buffer_->bytes; }

 private:
  explicit StagingRing(std::unique_ptr<Buffer> buffer) : buffer_(std::move(buffer)) {}

  std::unique_ptr<Buffer> buffer_;
  uint64_t cursor_ = 0;
};

}  // namespace kvcache::gpu
