#include "engine/layers/page_table.h"

#include <algorithm>

#include "engine/layers/host_bytes.h"

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

  // Installs `page` (kNoPage: clears) at `slot`, keeping count and used.
  void Put(uint64_t slot, PageId page) {
    const uint64_t bit = uint64_t{1} << (slot % 64);
    if (pages[slot] != kNoPage) {
      --count;
      used[slot / 64] &= ~bit;
    }
    pages[slot] = page;
    if (page != kNoPage) {
      ++count;
      used[slot / 64] |= bit;
    }
  }
  // Bits [lo, hi) of a word, lo <= hi <= 64. (Shifting a 64-bit word by 64
  // is undefined, so the full and the empty ranges are their own cases.)
  static uint64_t Bits(uint64_t lo, uint64_t hi) {
    if (hi - lo == 64) return ~uint64_t{0};
    if (hi == lo) return 0;
    return ((uint64_t{1} << (hi - lo)) - 1) << lo;
  }
  // True when no slot outside [begin, end) holds a page: two word tests, so
  // a slice (every snapshot, frozen snapshot and restore) need not scan the chunk.
  bool EmptyOutside(uint64_t begin, uint64_t end) const {
    for (uint64_t word = 0; word < 2; ++word) {
      const uint64_t lo = std::clamp<uint64_t>(begin, word * 64, word * 64 + 64) - word * 64;
      const uint64_t hi = std::clamp<uint64_t>(end, word * 64, word * 64 + 64) - word * 64;
      if ((used[word] & ~Bits(lo, hi)) != 0) return false;
    }
    return true;
  }

  gpu::PagePool* pool;
  std::array<PageId, kChunkPages> pages;
  uint32_t count = 0;
  std::array<uint64_t, 2> used{};  // bit s: pages[s] holds a page
};
static_assert(PageTable::kChunkPages == 128, "Chunk::used has one bit per slot");

uint64_t PageTable::ChunkHostBytes() { return HeapBlockBytes(kSharedCountBytes + sizeof(Chunk)); }

void PageTable::ForEachChunk(
    absl::FunctionRef<void(const void*, long, absl::Span<const PageId>)> visit) const {
  for (const ChunkPtr& chunk : chunks_) {
    if (chunk != nullptr) visit(chunk.get(), chunk.use_count(), chunk->pages);
  }
}

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

bool PageTable::SharedOnlyWith(uint64_t index, const PageTable& other) const {
  const PageId page = Get(index);
  if (page == kNoPage || other.Get(index) != page) return false;
  const ChunkPtr& mine = chunks_[index / kChunkPages];
  const ChunkPtr& theirs = other.chunks_[index / kChunkPages];
  // One chunk (one reference) shared by the two tables, or one chunk each.
  if (mine == theirs) return mine.use_count() == 2 && pool_->RefCount(page) == 1;
  return mine.use_count() == 1 && theirs.use_count() == 1 && pool_->RefCount(page) == 2;
}

PageTable::ChunkPtr PageTable::PartialCopy(const ChunkPtr& source, uint64_t begin,
                                           uint64_t end) const {
  auto copy = std::make_shared<Chunk>(pool_);
  for (uint64_t slot = begin; slot < end; ++slot) {
    const PageId page = source->pages[slot];
    if (page == kNoPage) continue;
    pool_->Retain(page);
    copy->Put(slot, page);
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
  const uint64_t slot = index % kChunkPages;
  if (chunk.pages[slot] != kNoPage) pool_->Release(chunk.pages[slot]);
  chunk.Put(slot, page);
}

void PageTable::Truncate(uint64_t count) {
  const uint64_t keep_chunks = (count + kChunkPages - 1) / kChunkPages;
  if (chunks_.size() > keep_chunks) chunks_.resize(keep_chunks);
  // The last chunk kept may hold pages at or past `count` (a restore
  // truncates on every call, mostly finding none).
  const uint64_t last = keep_chunks == 0 ? 0 : keep_chunks - 1;
  const uint64_t first_cut = count - last * kChunkPages;
  if (last < chunks_.size() && chunks_[last] && !chunks_[last]->EmptyOutside(0, first_cut)) {
    for (uint64_t index = count; index < keep_chunks * kChunkPages; ++index) Set(index, kNoPage);
  }
  while (!chunks_.empty() && (!chunks_.back() || chunks_.back()->count == 0)) chunks_.pop_back();
}

uint64_t PageTable::CountPages() const {
  uint64_t total = 0;
  for (const ChunkPtr& chunk : chunks_) total += chunk ? chunk->count : 0;
  return total;
}

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
    const bool whole = (begin == 0 && end == kChunkPages) || chunk->EmptyOutside(begin, end);
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
      merged.Put(slot, low->pages[slot]);
    }
  }
  return out;
}

}  // namespace kvcache::engine
