// One byte budget for everything kvcached keeps under --data_dir: saved
// prompt-cache files and the disk tier's evicted pages (--disk_bytes). Both
// charge it before they write, from any thread; a charge past the limit is
// refused whole.
#pragma once

#include <atomic>
#include <cstdint>

namespace kvcache {

class DiskBudget {
 public:
  // 0: no limit.
  explicit DiskBudget(uint64_t max_bytes) : max_bytes_(max_bytes) {}
  DiskBudget(const DiskBudget&) = delete;
  DiskBudget& operator=(const DiskBudget&) = delete;

  // Charges `bytes` unless that would pass the limit.
  bool TryCharge(uint64_t bytes) {
    uint64_t used = used_.load(std::memory_order_relaxed);
    do {
      if (max_bytes_ != 0 && (bytes > max_bytes_ || used > max_bytes_ - bytes)) return false;
    } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    return true;
  }
  // For bytes already on disk (files found at start): counted even past the limit.
  void Charge(uint64_t bytes) { used_.fetch_add(bytes, std::memory_order_relaxed); }
  void Credit(uint64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t max_bytes() const { return max_bytes_; }

 private:
  const uint64_t max_bytes_;
  std::atomic<uint64_t> used_{0};
};

}  // namespace kvcache
