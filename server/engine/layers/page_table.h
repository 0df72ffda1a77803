// A layer's page table: page index i holds tokens [i*P, (i+1)*P). It is shared
// copy-on-write in chunks, so a snapshot of n pages costs n/128 pointer copies,
// not n reference-count updates:
//
//   table A: [chunk 0]--[chunk 1]--[chunk 2']      chunk = 128 PageIds, each holding
//                 \          \                     one pool reference to its pages
//   table B: [chunk 0]--[chunk 1]--[chunk 2]       (shared_ptr: shared by tables)
//
// A writer that finds its chunk shared clones it first (retaining its pages);
// a page whose pool count is above one is copied before it is written
// (Exclusive() tells the caller which case it is in).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/types/span.h"
#include "gpu/page_pool.h"

namespace kvcache::engine {

class PageTable {
 public:
  static constexpr uint64_t kChunkPages = 128;

  explicit PageTable(gpu::PagePool* pool) : pool_(pool) {}

  gpu::PagePool* pool() const { return pool_; }
  // gpu::kNoPage where no page is set.
  gpu::PageId Get(uint64_t index) const;
  // True when writing page `index` affects no other holder.
  bool Exclusive(uint64_t index) const;
  // True when page `index` is held by this table and `other` and no one else.
  bool SharedOnlyWith(uint64_t index, const PageTable& other) const;
  // Installs `page` (taking over one reference the caller holds) at `index`,
  // releasing the page that was there.
  void Set(uint64_t index, gpu::PageId page);
  // Releases every page at index >= `count`.
  void Truncate(uint64_t count);
  void Clear() { chunks_.clear(); }
  // Pages set, summed over chunks.
  uint64_t CountPages() const;
  // Host memory of one chunk, allocation overhead included.
  static uint64_t ChunkHostBytes();

  // Each chunk holding pages: an id for it (the same in every table that
  // shares it), how many tables share it now, and its slots (kNoPage where
  // empty). The eviction policy's view: which pages only snapshots hold.
  void ForEachChunk(
      absl::FunctionRef<void(const void* chunk, long tables, absl::Span<const gpu::PageId> pages)>
          visit) const;

  // A table holding only the pages at indices [first, last) of this one.
  PageTable Slice(uint64_t first, uint64_t last) const;
  // Indices below `split` from `lower`, the rest from `upper`.
  static PageTable Join(const PageTable& lower, const PageTable& upper, uint64_t split);

 private:
  struct Chunk;
  using ChunkPtr = std::shared_ptr<Chunk>;

  Chunk& MutableChunk(uint64_t chunk_index);
  // A chunk with `source`'s pages at slots [begin, end) and none elsewhere.
  ChunkPtr PartialCopy(const ChunkPtr& source, uint64_t begin, uint64_t end) const;

  gpu::PagePool* pool_;
  std::vector<ChunkPtr> chunks_;  // null: no pages in that chunk
};

}  // namespace kvcache::engine
