#include "reference_chunked.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>

namespace kvcache::testing {
namespace {

void ChunkedCheck(bool condition, const char* what) {
  if (!condition) {
    std::cerr << "chunked reference invariant violated: " << what << "\n";
    std::abort();
  }
}

// The tokens of `tokens` at positions [begin, end), order kept.
std::vector<RefToken> Positions(const std::vector<RefToken>& tokens, uint64_t begin, uint64_t end) {
  std::vector<RefToken> out;
  for (const RefToken& token : tokens) {
    if (token.position >= begin && token.position < end) out.push_back(token);
  }
  return out;
}

bool HoldsPosition(const std::vector<RefToken>& tokens, uint64_t position) {
  return std::any_of(tokens.begin(), tokens.end(),
                     [&](const RefToken& token) { return token.position == position; });
}

}  // namespace

std::unique_ptr<RefLayer> RefChunkedLayer::Clone() const {
  return std::make_unique<RefChunkedLayer>(*this);
}

void RefChunkedLayer::MaybeTrimFront() {
  const uint64_t held = offset_ - start_position_;
  if (held < chunk_size_) return;
  start_position_ += held - chunk_size_;
  // keys[..., -chunk_size:, :] of the live part.
  buffer_ = std::vector<RefToken>(buffer_.begin() + (held - chunk_size_), buffer_.begin() + held);
}

void RefChunkedLayer::UpdateAndFetch(std::vector<RefToken> tokens) {
  const uint64_t prev = offset_ - start_position_;
  buffer_.resize(prev);  // writes land at [prev, end), over any stale entries
  for (RefToken& token : tokens) {
    token.position = offset_++;
    buffer_.push_back(std::move(token));
  }
}

void RefChunkedLayer::Update(std::vector<RefToken> tokens) {
  MaybeTrimFront();
  UpdateAndFetch(std::move(tokens));
}

std::vector<RefToken> RefChunkedLayer::Fetch() const {
  return std::vector<RefToken>(buffer_.begin(), buffer_.begin() + (offset_ - start_position_));
}

uint64_t RefChunkedLayer::Trim(uint64_t n) {
  n = std::min(offset_ - start_position_, n);
  offset_ -= n;
  return n;
}

RefLayerSnapshotPtr RefChunkedLayer::Snapshot(uint64_t from) const {
  if (offset_ <= from) return nullptr;
  auto snapshot = std::make_shared<RefLayerSnapshot>();
  snapshot->from = from;
  snapshot->to = offset_;
  snapshot->start = start_position_;
  snapshot->tokens = Positions(Fetch(), from, offset_);
  return snapshot;
}

std::vector<RefToken> RefChunkedLayer::FetchSnapshot(const RefLayerSnapshot& snapshot) const {
  return snapshot.tokens;
}

bool RefChunkedLayer::Restore(const RefLayerSnapshot* snapshot, uint64_t target) {
  if (snapshot == nullptr) {
    if (target > offset_ || target < start_position_) return false;
    offset_ = target;
    return true;
  }
  if (target > snapshot->to || target < snapshot->start) return false;
  std::vector<RefToken> held;
  if (snapshot->start < snapshot->from) {
    // The snapshot's chunk began below what it holds: the live cache must
    // still hold those tokens.
    if (start_position_ > snapshot->start || offset_ < snapshot->from) return false;
    held = Positions(Fetch(), snapshot->start, snapshot->from);
  }
  held.insert(held.end(), snapshot->tokens.begin(), snapshot->tokens.end());
  ChunkedCheck(held.size() == snapshot->to - snapshot->start, "rebuilt chunk length");
  buffer_ = std::move(held);
  start_position_ = snapshot->start;
  offset_ = snapshot->to;
  ChunkedCheck(Trim(offset_ - target) == snapshot->to - target, "trim to the target");
  return true;
}

bool RefChunkedLayer::CanMerge(const RefLayerSnapshotPtr& parent,
                               const RefLayerSnapshotPtr& child) const {
  if (parent == nullptr || child == nullptr) return false;
  const uint64_t needed = std::max(parent->from, child->start);
  return needed >= child->from || HoldsPosition(parent->tokens, needed);
}

RefLayerSnapshotPtr RefChunkedLayer::Merge(const RefLayerSnapshotPtr& parent,
                                           const RefLayerSnapshotPtr& child) const {
  ChunkedCheck(CanMerge(parent, child), "merge of snapshots that cannot merge");
  auto merged = std::make_shared<RefLayerSnapshot>();
  merged->from = parent->from;
  merged->to = child->to;
  merged->start = child->start;
  merged->tokens = Positions(parent->tokens, std::max(parent->from, child->start), child->from);
  merged->tokens.insert(merged->tokens.end(), child->tokens.begin(), child->tokens.end());
  return merged;
}

std::pair<RefLayerSnapshotPtr, RefLayerSnapshotPtr> RefChunkedLayer::Split(
    const RefLayerSnapshotPtr& snapshot, uint64_t at) const {
  if (snapshot == nullptr) return {nullptr, nullptr};
  if (at <= snapshot->from) return {nullptr, snapshot};
  if (at >= snapshot->to) return {snapshot, nullptr};
  auto child = std::make_shared<RefLayerSnapshot>(*snapshot);
  child->from = at;
  child->tokens = Positions(snapshot->tokens, at, snapshot->to);
  // The parent is the snapshot's state trimmed to `at`; a trim cannot go below
  // the start position, so below it there is no such state.
  if (snapshot->start > at) return {nullptr, child};
  auto parent = std::make_shared<RefLayerSnapshot>(*snapshot);
  parent->to = at;
  parent->tokens = Positions(snapshot->tokens, snapshot->from, at);
  return {parent, child};
}

}  // namespace kvcache::testing
