#include "engine/page_table.h"

#include <algorithm>

namespace kvcache::engine {

using gpu::kNoPage;
using gpu::PageId;

struct PageTable::Chunk {
  explicit Chunk(gpu::PagePool* pool) : pool(pool) { pages.fill(kNoPage); }
  ~Chunk() {
    for (PageId page : pages) {
      if (page != kNoPage) pool->Release(page);
    }
  }
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;

  gpu::PagePool* pool;
  std::array<PageId, kChunkPages> pages;
  uint32_t count = 0;
};

PageId PageTable::Get(uint64_t index) const {
  const uint64_t c = index / kChunkPages;
  if (c >= chunks_.size() || !chunks_[c]) return kNoPage;
  return chunks_[c]->pages[index % kChunkPages];
}

bool PageTable::Exclusive(uint64_t index) const {
  const uint64_t c = index / kChunkPages;
  const PageId page = Get(index);
  return page != kNoPage && chunks_[c].use_count() == 1 && pool_->RefCount(page) == 1;
}

PageTable::ChunkPtr PageTable::PartialCopy(const ChunkPtr& source, uint64_t begin,
                                           uint64_t end) const {
  auto copy = std::make_shared<Chunk>(pool_);
  for (uint64_t slot = begin; slot < end; ++slot) {
    const PageId page = source->pages[slot];
    if (page == kNoPage) continue;
    pool_->Retain(page);
    copy->pages[slot] = page;
    ++copy->count;
  }
  return copy;
}

PageTable::Chunk& PageTable::MutableChunk(uint64_t chunk_index) {
  if (chunk_index >= chunks_.size()) chunks_.resize(chunk_index + 1);
  ChunkPtr& chunk = chunks_[chunk_index];
  if (!chunk) {
    chunk = std::make_shared<Chunk>(pool_);
  } else if (chunk.use_count() > 1) {
    chunk = PartialCopy(chunk, 0, kChunkPages);
  }
  return *chunk;
}

void PageTable::Set(uint64_t index, PageId page) {
  if (page == kNoPage && Get(index) == kNoPage) return;
  Chunk& chunk = MutableChunk(index / kChunkPages);
  PageId& slot = chunk.pages[index % kChunkPages];
  if (slot != kNoPage) {
    pool_->Release(slot);
    --chunk.count;
  }
  slot = page;
  if (page != kNoPage) ++chunk.count;
}

void PageTable::Truncate(uint64_t count) {
  const uint64_t keep_chunks = (count + kChunkPages - 1) / kChunkPages;
  if (chunks_.size() > keep_chunks) chunks_.resize(keep_chunks);
  for (uint64_t index = count; index < keep_chunks * kChunkPages; ++index) Set(index, kNoPage);
  while (!chunks_.empty() && (!chunks_.back() || chunks_.back()->count == 0)) chunks_.pop_back();
}

uint64_t PageTable::CountPages() const {
  uint64_t total = 0;
  for (const ChunkPtr& chunk : chunks_) total += chunk ? chunk->count : 0;
  return total;
}

namespace {
// True when `pages` has no page outside slots [begin, end).
bool EmptyOutside(const std::array<PageId, PageTable::kChunkPages>& pages, uint64_t begin,
                  uint64_t end) {
  for (uint64_t slot = 0; slot < PageTable::kChunkPages; ++slot) {
    if ((slot < begin || slot >= end) && pages[slot] != kNoPage) return false;
  }
  return true;
}
}  // namespace

PageTable PageTable::Slice(uint64_t first, uint64_t last) const {
  PageTable out(pool_);
  last = std::min<uint64_t>(last, chunks_.size() * kChunkPages);
  if (first >= last) return out;
  out.chunks_.resize((last + kChunkPages - 1) / kChunkPages);
  for (uint64_t c = first / kChunkPages; c < out.chunks_.size(); ++c) {
    const ChunkPtr& chunk = chunks_[c];
    if (!chunk) continue;
    const uint64_t begin = std::max(first, c * kChunkPages) - c * kChunkPages;
    const uint64_t end = std::min(last, (c + 1) * kChunkPages) - c * kChunkPages;
    // Share the chunk when it holds nothing outside the range (the usual case:
    // a table's last chunk), else copy the part inside.
    const bool whole = (begin == 0 && end == kChunkPages) || EmptyOutside(chunk->pages, begin, end);
    out.chunks_[c] = whole ? chunk : PartialCopy(chunk, begin, end);
  }
  return out;
}

PageTable PageTable::Join(const PageTable& lower, const PageTable& upper, uint64_t split) {
  PageTable out = upper.Slice(split, upper.chunks_.size() * kChunkPages);
  const PageTable below = lower.Slice(0, split);
  if (out.chunks_.size() < below.chunks_.size()) out.chunks_.resize(below.chunks_.size());
  for (uint64_t c = 0; c < below.chunks_.size(); ++c) {
    const ChunkPtr& low = below.chunks_[c];
    if (!low) continue;
    if (!out.chunks_[c]) {
      out.chunks_[c] = low;
      continue;
    }
    // The one chunk straddling `split`: merge the lower slots into a private copy.
    Chunk& merged = out.MutableChunk(c);
    for (uint64_t slot = 0; slot < kChunkPages; ++slot) {
      if (low->pages[slot] == kNoPage) continue;
      out.pool_->Retain(low->pages[slot]);
      merged.pages[slot] = low->pages[slot];
      ++merged.count;
    }
  }
  return out;
}

}  // namespace kvcache::engine
