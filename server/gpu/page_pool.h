// The page pool: device memory cut into fixed-size pages with reference counts.
//
//   slab 0 (one VkBuffer)               slab 1                      (allocated lazily,
//   +--------+--------+-----+--------+  +--------+-----+--------+    up to the budget)
//   | page 0 | page 1 | ... | page k |  | page k+1 ... | page 2k+1|
//   +--------+--------+-----+--------+  +--------+-----+--------+
//   PageId p lives in slab p / pages_per_slab at byte (p % pages_per_slab) * page_bytes.
//
// All page metadata (reference counts, the free-list stack) is allocated up front
// for budget_bytes / page_bytes pages; Allocate and Release are O(1) per page.
// The pool knows nothing of tokens, layers or caches: it moves bytes in and out
// of pages and counts who holds them. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/disk_budget.h"
#include "gpu/device_options.h"
#include "gpu/page_id.h"

namespace kvcache::gpu {

// How the pool's refusals for want of pages begin (Allocate and Promote).
inline constexpr char kPoolExhausted[] = "page pool budget exhausted (pool_bytes)";

// Where a page's bytes are. Only device pages can be read, written or copied;
// the others wait in a lower tier until Promote brings them back.
enum class Tier { kDevice, kHost, kDisk };

// Where quantized pages are packed and unpacked (gpu/quantizer.h).
enum class QuantKernel {
  kAuto,    // native CPU kernels on a CPU device (lavapipe) with host-mapped
            // pages, where they run ~30x faster than the shaders; shaders elsewhere
  kShader,  // the compute shaders, on any device
  kHost,    // the native CPU kernels; needs host-mapped pages (the direct path)
};

struct PoolOptions {
  uint64_t page_bytes = 64 << 10;
  // The most device memory the pool may hold, in bytes (rounded down to pages).
  uint64_t budget_bytes = uint64_t{1} << 30;
  // Size of one VkBuffer slab; clamped to the device's maxStorageBufferRange and
  // rounded down to a multiple of page_bytes.
  uint64_t slab_bytes = 64 << 20;
  QuantKernel quantize_kernel = QuantKernel::kAuto;
  // Lower tiers for evicted pages (Evict): host memory, then a scratch file.
  // Zero bytes (or an empty path): no such tier.
  uint64_t host_bytes = 0;
  std::string disk_path;  // created (truncated) at start, removed at the end
  uint64_t disk_bytes = 0;
  // Shared with others who write to the same disk (saved files), charged a
  // page per disk slot in use; null: disk_bytes alone bounds the tier.
  DiskBudget* disk_budget = nullptr;
};

// Accounts: who pages are charged to (a tenant each). A page is charged to
// the account of the view that allocated it (PagePool::ForAccount), in
// whichever tier it is, until it is freed. Account 0, the pool's own view,
// has no limits.
using AccountId = uint16_t;
inline constexpr AccountId kPoolAccount = 0;

// Most pages an account may hold in each tier; 0: no limit of its own.
struct AccountLimits {
  uint32_t device_pages = 0;
  uint32_t host_pages = 0;
  uint32_t disk_pages = 0;
};

struct AccountUsage {
  uint32_t device_pages = 0;
  uint32_t host_pages = 0;
  uint32_t disk_pages = 0;
  AccountLimits limits;
};

// What an Allocate past its account's device limit says, after the quota's
// name (max_device_bytes, as the tokens file calls it).
inline constexpr char kAccountExhausted[] = "the tenant's device quota is used up";

// Copies `bytes` bytes from host memory into page `page` at byte `offset`.
struct WriteRun {
  PageId page;
  uint64_t offset;
  const void* src;
  uint64_t bytes;
};

// Copies `bytes` bytes out of page `page` at byte `offset` into host memory.
struct ReadRun {
  PageId page;
  uint64_t offset;
  void* dst;
  uint64_t bytes;
};

// Copies bytes [offset, offset + bytes) of page `src` to the same range of `dst`.
struct PageCopy {
  PageId src;
  PageId dst;
  uint64_t offset;
  uint64_t bytes;
};

// Copies `bytes` bytes of page `src` at `src_offset` to page `dst` at
// `dst_offset`: moving tokens between pages whose layouts differ (a row of a
// batch changing places, a position changing slots).
struct PageMove {
  PageId src;
  uint64_t src_offset;
  PageId dst;
  uint64_t dst_offset;
  uint64_t bytes;
};

struct PoolStats {
  uint64_t page_bytes;
  uint32_t max_pages;       // budget_bytes / page_bytes
  uint32_t used_pages;      // device pages with a reference count above zero
  uint32_t peak_used_pages = 0;  // the most used_pages has been
  uint32_t backed_pages;    // pages whose slab has been allocated
  uint32_t slabs;
  // Lower tiers, in pages: held, and the most they hold.
  uint32_t host_pages = 0;
  uint32_t max_host_pages = 0;
  uint32_t disk_pages = 0;
  uint32_t max_disk_pages = 0;
  // Pages moved, since the pool was made: device to host or disk (evictions),
  // host to disk (demotions), and back to the device (promotions).
  uint64_t evictions = 0;
  uint64_t demotions = 0;
  uint64_t promotions_from_host = 0;
  uint64_t promotions_from_disk = 0;
};

// Quantized pages (gpu/quantizer.h).
struct QuantizeJob;
struct DequantizeJob;

class PagePool {
 public:
  static absl::StatusOr<std::unique_ptr<PagePool>> Create(Device& device, const PoolOptions& options);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // A view of this pool whose allocations are charged to `account`, held
  // within `limits`: Allocate past the device limit is RESOURCE_EXHAUSTED
  // naming it, and Evict and Promote keep each page's account within its
  // host, disk and device limits. Everything else (pages, tiers, stats) is
  // the pool's, shared. `account` is the caller's to keep unique.
  std::unique_ptr<PagePool> ForAccount(AccountId account, const AccountLimits& limits);
  // What this view's account holds per tier, and its limits.
  AccountUsage account_usage() const;

  uint64_t page_bytes() const;
  PoolStats stats() const;
  // True when Quantize / Dequantize run the native CPU kernels (QuantKernel).
  bool quantizes_on_host() const;
  // Pages that Allocate could still hand out (free list plus unbacked
  // budget, and within the account's device limit).
  uint32_t available_pages() const;

  // Appends `count` fresh pages (reference count 1, contents undefined) to `out`.
  // All or nothing: RESOURCE_EXHAUSTED, and `out` unchanged, if the budget or the
  // device cannot back them.
  absl::Status Allocate(uint32_t count, std::vector<PageId>& out);
  // Allocate calls refused so far, and the pages the last one lacked: a
  // caller that can evict learns from them that the refusal was the pool's
  // and how much room to make.
  uint64_t refused_allocations() const;
  uint32_t last_shortfall() const;
  // The same, counted for the calling thread across every pool: what tells a
  // caller that the refusal it holds is its own call's, however many other
  // threads are refused meanwhile.
  struct Refusals {
    uint64_t count = 0;
    uint32_t last_shortfall = 0;
  };
  static Refusals RefusalsOnThisThread();
  void Retain(PageId page);
  // Drops one reference; the page returns to the free list at zero.
  void Release(PageId page);
  uint32_t RefCount(PageId page) const;
  // Retain unless the count is zero (the page freed meanwhile): false then.
  bool TryRetain(PageId page);
  // Ids run over every tier's pages: [0, max_page_ids()).
  uint32_t max_page_ids() const;

  // Tiers. Where a held page is now. Pages only move by Evict and Promote,
  // which run one at a time across the pool and every account's view of it
  // (an eviction for one tenant may demote a host page that another's
  // Promote is reading). The caller must not run them concurrently with any
  // read, write or copy of the pages they move (the engine's tier lock);
  // reference counting may go on meanwhile. Both keep page ids, counts and
  // bytes: the holders of a page see it move once, wherever it is shared.
  Tier Where(PageId page) const;
  // Moves device pages (distinct, least recently used first) to host memory,
  // making room there by moving its oldest pages to disk when it is full;
  // those host memory cannot hold at all go straight to disk. Stops where
  // neither tier has room; returns how many moved.
  absl::StatusOr<uint32_t> Evict(absl::Span<const PageId> pages);
  // Brings pages back to device memory, all or none: RESOURCE_EXHAUSTED
  // (nothing moved) unless the device has room for every one not there.
  absl::Status Promote(absl::Span<const PageId> pages);
  // Rises with every Evict that moved a page: a holder that saw all of its
  // pages on the device at epoch e knows they still are while it reads e.
  uint64_t eviction_epoch() const;

  // Bulk transfers. Each call completes before it returns (the bytes are in
  // device memory, or in host memory for Read). Runs never cross a page end
  // (INVALID_ARGUMENT, with nothing moved, if one would or names an unbacked
  // page). The ranges one Write or Read call touches must not overlap; Copy
  // behaves as if its copies ran one after another, in order.
  absl::Status Write(absl::Span<const WriteRun> runs);
  absl::Status Read(absl::Span<const ReadRun> runs);
  // Where the runs' bytes lie in host-mapped pages (ReadRun::dst unused), one
  // piece per run, appended to `pieces`: to send them without a copy. Valid
  // while the pages are held and unwritten. FAILED_PRECONDITION on the
  // staging path, whose device memory the host cannot see.
  absl::Status Mapped(absl::Span<const ReadRun> runs,
                      std::vector<absl::Span<const std::byte>>& pieces);
  absl::Status Copy(absl::Span<const PageCopy> copies);
  // mlx affine quantization on the device: rows of the jobs' tensors into
  // pages, and back (gpu/quantizer.h has the run layout and the checks).
  absl::Status Quantize(absl::Span<const QuantizeJob> jobs);
  absl::Status Dequantize(absl::Span<const DequantizeJob> jobs);
  // The moves of one call may run in any order: no destination range may
  // overlap another move's destination or any move's source.
  absl::Status Move(absl::Span<const PageMove> moves);

 private:
  class Impl;
  PagePool(std::shared_ptr<Impl> impl, AccountId account);
  std::shared_ptr<Impl> impl_;
  const AccountId account_;
};

}  // namespace kvcache::gpu
