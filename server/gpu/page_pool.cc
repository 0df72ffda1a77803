// PagePool = PageAllocator (slabs, counts, free list) + one of two transfer paths:
//
//   direct  (Device::direct_host_access): slabs are persistently mapped, so
//           Write / Read / Copy are memcpy into, out of and between pages.
//   staged  (device-local slabs): StagedTransfer moves the bytes through a
//           staging ring with vkCmdCopyBuffer or the copy_runs shader.
//   mapped writes (Device::mapped_writes): slabs mapped but uncached, so
//           Write is memcpy into pages and the rest goes through the ring.
#include "gpu/page_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/status_macros.h"
#include "gpu/page_pool_impl.h"
#include "gpu/quantizer.h"
#include "gpu/shared_copies.h"

namespace kvcache::gpu {
namespace {

// Small pools get a ring no larger than themselves, but never a tiny one.
constexpr uint64_t kMinStagingRingBytes = 64 << 10;

uint64_t StagingRingBytes(const PagePlan& plan) {
  const uint64_t pool_bytes = uint64_t{plan.max_pages} * plan.page_bytes;
  return std::clamp(pool_bytes, kMinStagingRingBytes, StagedTransfer::kStagingRingBytes);
}

// Direct-path writes of runs this long use non-temporal (streaming) stores:
// pages being filled are not read back soon, so streaming spares the read for
// ownership of every line and keeps the writer's own buffers (the service's
// receive slices) in cache. On lavapipe it is at par with memcpy for Update
// traffic (bench/RESULTS.md). Shorter runs, such as a decode step's one token
// per head, keep memcpy and stay in cache.
constexpr uint64_t kStreamingRunBytes = 1024;

// How far ahead of the loads StreamingCopy prefetches its source. Runs start
// on a new 4 KiB page of the source each time, where the hardware prefetchers
// lose the stream; without this the copy waited on its loads and was slower
// than memcpy.
constexpr uint64_t kPrefetchAhead = 2048;

// memcpy whose 16-byte-aligned body goes around the caches. The stores are
// weakly ordered: call StreamingStoresDone before the pages are published.
void StreamingCopy(std::byte* dst, const std::byte* src, uint64_t bytes) {
#if defined(__SSE2__)
  const uint64_t misaligned = reinterpret_cast<uintptr_t>(dst) % 16;
  const uint64_t head = std::min<uint64_t>(bytes, misaligned == 0 ? 0 : 16 - misaligned);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  bytes -= head;
  const uint64_t body = bytes & ~uint64_t{63};
  for (uint64_t i = 0; i < body; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(src + i) + kPrefetchAhead, _MM_HINT_T0);
    const auto* in = reinterpret_cast<const __m128i*>(src + i);
    auto* out = reinterpret_cast<__m128i*>(dst + i);
    const __m128i a = _mm_loadu_si128(in), b = _mm_loadu_si128(in + 1),
                  c = _mm_loadu_si128(in + 2), d = _mm_loadu_si128(in + 3);
    _mm_stream_si128(out, a);
    _mm_stream_si128(out + 1, b);
    _mm_stream_si128(out + 2, c);
    _mm_stream_si128(out + 3, d);
  }
  std::memcpy(dst + body, src + body, bytes - body);
#else
  std::memcpy(dst, src, bytes);
#endif
}

// Orders the streaming stores before whatever the caller does next (releasing
// the cache's lock, which makes the pages readable by other threads).
void StreamingStoresDone() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace

absl::Status PagePool::Impl::CheckRange(absl::string_view call, size_t index, PageId page,
                                        uint64_t offset, uint64_t bytes) const {
  if (!pages.IsBacked(page)) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, "[", index, "]: page ", page, " is not a device page of this pool"));
  }
  const uint64_t page_bytes = pages.plan().page_bytes;
  if (offset > page_bytes || bytes > page_bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat(call, "[", index, "]: bytes [", offset, ", ",
                                                   offset + bytes, ") cross the end of the ",
                                                   page_bytes, "-byte page ", page));
  }
  return absl::OkStatus();
}

absl::Status PagePool::Impl::Write(absl::Span<const WriteRun> runs) {
  for (size_t i = 0; i < runs.size(); ++i) {
    RETURN_IF_ERROR(CheckRange("Write", i, runs[i].page, runs[i].offset, runs[i].bytes));
  }
  if (pages.host_mapped()) {
    CopyRunsInBatches(
        runs.size(), [&](size_t i) { return runs[i].bytes; },
        [&](size_t begin, size_t end) {
          bool streamed = false;
          for (const WriteRun& run : runs.subspan(begin, end - begin)) {
            std::byte* dst = pages.Locate(run.page).host + run.offset;
            const auto* src = static_cast<const std::byte*>(run.src);
            if (run.bytes >= kStreamingRunBytes) {
              StreamingCopy(dst, src, run.bytes);
              streamed = true;
            } else if (run.bytes > 0) {
              std::memcpy(dst, src, run.bytes);
            }
          }
          // Uncached mappings (mapped writes) are write-combined: even plain
          // stores wait in the CPU's buffers until a fence, and the GPU may
          // read the pages as soon as the caller's lock is released.
          if (streamed || staged_ != nullptr) StreamingStoresDone();
        });
    return absl::OkStatus();
  }
  std::vector<HostToDevice> writes;
  writes.reserve(runs.size());
  for (const WriteRun& run : runs) {
    writes.push_back(
        {static_cast<const std::byte*>(run.src), SliceOf(run.page, run.offset, run.bytes)});
  }
  return staged_->Write(writes);
}

absl::Status PagePool::Impl::Read(absl::Span<const ReadRun> runs) {
  for (size_t i = 0; i < runs.size(); ++i) {
    RETURN_IF_ERROR(CheckRange("Read", i, runs[i].page, runs[i].offset, runs[i].bytes));
  }
  if (staged_ == nullptr) {
    CopyRunsInBatches(
        runs.size(), [&](size_t i) { return runs[i].bytes; },
        [&](size_t begin, size_t end) {
          for (const ReadRun& run : runs.subspan(begin, end - begin)) {
            if (run.bytes == 0) continue;
            std::memcpy(run.dst, pages.Locate(run.page).host + run.offset, run.bytes);
          }
        });
    return absl::OkStatus();
  }
  std::vector<DeviceToHost> reads;
  reads.reserve(runs.size());
  for (const ReadRun& run : runs) {
    reads.push_back({SliceOf(run.page, run.offset, run.bytes), static_cast<std::byte*>(run.dst)});
  }
  return staged_->Read(reads);
}

absl::Status PagePool::Impl::Mapped(absl::Span<const ReadRun> runs,
                                    std::vector<absl::Span<const std::byte>>& pieces) {
  if (staged_ != nullptr) {
    return absl::FailedPreconditionError("pages are not host-visible (the staging path)");
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    RETURN_IF_ERROR(CheckRange("Mapped", i, runs[i].page, runs[i].offset, runs[i].bytes));
  }
  const size_t first = pieces.size();
  for (const ReadRun& run : runs) {
    std::byte* host = pages.Locate(run.page).host;
    if (host == nullptr) {
      pieces.resize(first);
      return absl::FailedPreconditionError("pages are not host-mapped");
    }
    pieces.emplace_back(host + run.offset, run.bytes);
  }
  return absl::OkStatus();
}

absl::Status PagePool::Impl::Copy(absl::Span<const PageCopy> copies) {
  for (size_t i = 0; i < copies.size(); ++i) {
    RETURN_IF_ERROR(CheckRange("Copy", i, copies[i].src, copies[i].offset, copies[i].bytes));
    RETURN_IF_ERROR(CheckRange("Copy", i, copies[i].dst, copies[i].offset, copies[i].bytes));
  }
  if (staged_ != nullptr) return CopyStaged(copies);
  for (const PageCopy& copy : copies) {
    if (copy.src == copy.dst || copy.bytes == 0) continue;  // A page onto itself: no-op.
    std::memcpy(pages.Locate(copy.dst).host + copy.offset,
                pages.Locate(copy.src).host + copy.offset, copy.bytes);
  }
  return absl::OkStatus();
}

absl::Status PagePool::Impl::Move(absl::Span<const PageMove> moves) {
  for (size_t i = 0; i < moves.size(); ++i) {
    RETURN_IF_ERROR(CheckRange("Move", i, moves[i].src, moves[i].src_offset, moves[i].bytes));
    RETURN_IF_ERROR(CheckRange("Move", i, moves[i].dst, moves[i].dst_offset, moves[i].bytes));
  }
  if (staged_ == nullptr) {
    for (const PageMove& move : moves) {
      if (move.bytes == 0) continue;
      std::memcpy(pages.Locate(move.dst).host + move.dst_offset,
                  pages.Locate(move.src).host + move.src_offset, move.bytes);
    }
    return absl::OkStatus();
  }
  std::vector<BufferCopy> copies;
  copies.reserve(moves.size());
  for (const PageMove& move : moves) {
    if (move.bytes == 0) continue;
    const BufferSlice src = SliceOf(move.src, move.src_offset, move.bytes);
    const BufferSlice dst = SliceOf(move.dst, move.dst_offset, move.bytes);
    copies.push_back({src.buffer, src.offset, dst.buffer, dst.offset, move.bytes});
  }
  return staged_->Copy(copies);
}

namespace {

// Byte ranges of pages touched by the copies of one submission.
class TouchedRanges {
 public:
  bool Overlaps(PageId page, uint64_t begin, uint64_t end) const {
    auto it = ranges_.find(page);
    if (it == ranges_.end()) return false;
    for (const auto& [b, e] : it->second) {
      if (begin < e && b < end) return true;
    }
    return false;
  }
  void Add(PageId page, uint64_t begin, uint64_t end) { ranges_[page].emplace_back(begin, end); }
  void Clear() { ranges_.clear(); }

 private:
  absl::flat_hash_map<PageId, std::vector<std::pair<uint64_t, uint64_t>>> ranges_;
};

}  // namespace

// The copies of one submission run in any order (and concurrently, with the
// shader), so a copy that touches bytes an earlier copy of the list wrote, or
// writes bytes an earlier one read, starts a new submission: the result is the
// same as running the list in order, like memcpy. Disjoint ranges of one page
// (a boundary page assembled from two sources) share a submission.
absl::Status PagePool::Impl::CopyStaged(absl::Span<const PageCopy> copies) {
  std::vector<BufferCopy> submission;
  TouchedRanges read, written;
  for (const PageCopy& copy : copies) {
    if (copy.src == copy.dst || copy.bytes == 0) continue;
    const uint64_t begin = copy.offset;
    const uint64_t end = copy.offset + copy.bytes;
    if (written.Overlaps(copy.src, begin, end) || written.Overlaps(copy.dst, begin, end) ||
        read.Overlaps(copy.dst, begin, end)) {
      RETURN_IF_ERROR(staged_->Copy(submission));
      submission.clear();
      read.Clear();
      written.Clear();
    }
    read.Add(copy.src, begin, end);
    written.Add(copy.dst, begin, end);
    const BufferSlice src = SliceOf(copy.src, copy.offset, copy.bytes);
    const BufferSlice dst = SliceOf(copy.dst, copy.offset, copy.bytes);
    submission.push_back({src.buffer, src.offset, dst.buffer, dst.offset, copy.bytes});
  }
  return staged_->Copy(submission);
}

absl::StatusOr<std::unique_ptr<PagePool>> PagePool::Create(Device& device,
                                                           const PoolOptions& options) {
  ASSIGN_OR_RETURN(const PagePlan plan, PlanPages(device, options));
  if (options.quantize_kernel == QuantKernel::kHost && !device.direct_host_access()) {
    return absl::InvalidArgumentError(
        "quantize_kernel: the CPU kernels need host-mapped pages, and this device's are not "
        "(staging path)");
  }
  std::unique_ptr<StagedTransfer> staged;
  if (!device.direct_host_access()) {
    ASSIGN_OR_RETURN(staged, StagedTransfer::Create(device, device.options().copy_engine,
                                                    StagingRingBytes(plan)));
  }
  std::unique_ptr<DiskPageStore> disk;
  if (plan.max_disk_pages > 0) {
    ASSIGN_OR_RETURN(disk, DiskPageStore::Create(options.disk_path, plan.page_bytes));
  }
  return std::unique_ptr<PagePool>(
      new PagePool(std::make_shared<Impl>(device, plan, options.quantize_kernel, std::move(staged),
                                          std::move(disk), options.disk_budget),
                   kPoolAccount));
}

PagePool::PagePool(std::shared_ptr<Impl> impl, AccountId account)
    : impl_(std::move(impl)), account_(account) {}
PagePool::~PagePool() = default;

std::unique_ptr<PagePool> PagePool::ForAccount(AccountId account, const AccountLimits& limits) {
  impl_->pages.SetAccountLimits(account, limits);
  return std::unique_ptr<PagePool>(new PagePool(impl_, account));
}
AccountUsage PagePool::account_usage() const { return impl_->pages.Usage(account_); }

uint64_t PagePool::page_bytes() const {
  return impl_->pages.plan().page_bytes;
}
PoolStats PagePool::stats() const {
  return impl_->pages.stats();
}
bool PagePool::quantizes_on_host() const {
  return impl_->quantizer.on_host();
}
uint32_t PagePool::available_pages() const { return impl_->pages.available_pages(account_); }

absl::Status PagePool::Allocate(uint32_t count, std::vector<PageId>& out) {
  return impl_->pages.Allocate(count, out, account_);
}
void PagePool::Retain(PageId page) {
  impl_->pages.Retain(page);
}
void PagePool::Release(PageId page) {
  impl_->pages.Release(page);
}
uint32_t PagePool::RefCount(PageId page) const {
  return impl_->pages.RefCount(page);
}
bool PagePool::TryRetain(PageId page) { return impl_->pages.TryRetain(page); }
uint32_t PagePool::max_page_ids() const { return impl_->pages.max_ids(); }
uint64_t PagePool::refused_allocations() const { return impl_->pages.refused_allocations(); }
uint32_t PagePool::last_shortfall() const { return impl_->pages.last_shortfall(); }
PagePool::Refusals PagePool::RefusalsOnThisThread() {
  return PageAllocator::RefusalsOnThisThread();
}
Tier PagePool::Where(PageId page) const { return impl_->pages.Where(page); }
absl::StatusOr<uint32_t> PagePool::Evict(absl::Span<const PageId> pages) {
  return impl_->Evict(pages);
}
absl::Status PagePool::Promote(absl::Span<const PageId> pages) { return impl_->Promote(pages); }
uint64_t PagePool::eviction_epoch() const { return impl_->eviction_epoch(); }

absl::Status PagePool::Write(absl::Span<const WriteRun> runs) {
  return impl_->Write(runs);
}
absl::Status PagePool::Read(absl::Span<const ReadRun> runs) {
  return impl_->Read(runs);
}
absl::Status PagePool::Mapped(absl::Span<const ReadRun> runs,
                              std::vector<absl::Span<const std::byte>>& pieces) {
  return impl_->Mapped(runs, pieces);
}
absl::Status PagePool::Copy(absl::Span<const PageCopy> copies) {
  return impl_->Copy(copies);
}
absl::Status PagePool::Quantize(absl::Span<const QuantizeJob> jobs) {
  return impl_->quantizer.Quantize(jobs);
}
absl::Status PagePool::Dequantize(absl::Span<const DequantizeJob> jobs) {
  return impl_->quantizer.Dequantize(jobs);
}
absl::Status PagePool::Move(absl::Span<const PageMove> moves) {
  return impl_->Move(moves);
}

}  // namespace kvcache::gpu
