#include "engine/layers/recurrent_layer.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "engine/layers/token_store.h"

namespace kvcache::engine {
namespace {

// Splits the state stream's bytes [stream_offset, stream_offset + size) at page
// ends: visit(page index, offset in that page, bytes into the range, bytes).
template <typename Visit>
void ForEachPagePart(uint64_t page_bytes, uint64_t stream_offset, uint64_t size, Visit&& visit) {
  for (uint64_t done = 0; done < size;) {
    const uint64_t at = stream_offset + done;
    const uint64_t take = std::min(size - done, page_bytes - at % page_bytes);
    visit(at / page_bytes, at % page_bytes, done, take);
    done += take;
  }
}

// Runs writing `source` into `pages` from stream byte `stream_offset` on.
void AddWriteRuns(const std::vector<gpu::PageId>& pages, uint64_t page_bytes,
                  uint64_t stream_offset, const TensorBytes& source,
                  std::vector<gpu::WriteRun>& runs) {
  source.ForEachPart(0, source.size(), [&](absl::Span<const std::byte> part) {
    ForEachPagePart(page_bytes, stream_offset, part.size(),
                    [&](uint64_t page, uint64_t in_page, uint64_t done, uint64_t bytes) {
                      runs.push_back({pages[page], in_page, part.data() + done, bytes});
                    });
    stream_offset += part.size();
  });
}

void AddReadRuns(const PageTable& pages, uint64_t page_bytes, uint64_t stream_offset,
                 absl::Span<std::byte> out, std::vector<gpu::ReadRun>& runs) {
  ForEachPagePart(page_bytes, stream_offset, out.size(),
                  [&](uint64_t page, uint64_t in_page, uint64_t done, uint64_t bytes) {
                    runs.push_back({pages.Get(page), in_page, out.data() + done, bytes});
                  });
}

absl::Status SizeMismatch(const char* field, uint64_t got, const std::string& shape,
                          uint64_t want) {
  return absl::InvalidArgumentError(
      absl::StrFormat("%s: %d bytes, but %s is %d bytes", field, got, shape, want));
}

absl::Status NoTokens() {
  return absl::InvalidArgumentError(
      "keys: a recurrent layer holds a state, not tokens; read its state instead");
}

}  // namespace

uint64_t StateGeometry::conv_bytes() const {
  return uint64_t{batch} * kind.conv_tail * kind.conv_dim * elem_bytes;
}

uint64_t StateGeometry::delta_bytes() const {
  return uint64_t{batch} * kind.num_v_heads * kind.head_v_dim * kind.head_k_dim * elem_bytes;
}

uint64_t StateGeometry::pages() const {
  return (conv_bytes() + delta_bytes() + page_bytes - 1) / page_bytes;
}

absl::Status RecurrentSnapshot::Read(TokenRange, const KvOutput&) const { return NoTokens(); }

absl::Status RecurrentSnapshot::ReadState(const StateOutput& out) const {
  if (out.conv.size() != geometry_.conv_bytes() || out.delta.size() != geometry_.delta_bytes()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "state: read buffers of %d and %d bytes for a conv state of %d and a delta state of %d",
        out.conv.size(), out.delta.size(), geometry_.conv_bytes(), geometry_.delta_bytes()));
  }
  if (pages_.CountPages() == 0) {  // no state yet: zeros, as ollama's ensure() makes them
    std::memset(out.conv.data(), 0, out.conv.size());
    std::memset(out.delta.data(), 0, out.delta.size());
    return absl::OkStatus();
  }
  std::vector<gpu::ReadRun> runs;
  AddReadRuns(pages_, geometry_.page_bytes, 0, out.conv, runs);
  AddReadRuns(pages_, geometry_.page_bytes, geometry_.conv_bytes(), out.delta, runs);
  return pages_.pool()->Read(runs);
}

uint64_t RecurrentSnapshot::size_bytes() const { return PoolBytes(pages_); }

// ollama recurrentSnapshot is self-contained: the child supersedes the parent.
absl::StatusOr<LayerSnapshotPtr> RecurrentSnapshot::MergedWith(const LayerSnapshot& child) const {
  if (dynamic_cast<const RecurrentSnapshot*>(&child) == nullptr) {
    return absl::FailedPreconditionError("child is not a recurrent-layer snapshot");
  }
  return child.shared_from_this();
}

// No state exists at an intermediate position: the parent gets none.
absl::StatusOr<std::pair<LayerSnapshotPtr, LayerSnapshotPtr>> RecurrentSnapshot::SplitAt(
    uint64_t) const {
  return std::make_pair(LayerSnapshotPtr(), shared_from_this());
}

absl::Status RecurrentLayer::Update(const KvInput&) {
  return absl::InvalidArgumentError(absl::StrFormat(
      "keys: layer %d is recurrent; send its state (conv_state, delta_state), not keys and "
      "values",
      index_));
}

absl::Status RecurrentLayer::CheckState(const StateInput& state) const {
  const RecurrentKind& k = geometry_.kind;
  const uint32_t b = geometry_.batch;
  const uint32_t e = geometry_.elem_bytes;
  if (state.conv.size() != geometry_.conv_bytes()) {
    return SizeMismatch("state.conv_state", state.conv.size(),
                        absl::StrFormat("[B=%d, conv_tail=%d, conv_dim=%d] of %d-byte elements", b,
                                        k.conv_tail, k.conv_dim, e),
                        geometry_.conv_bytes());
  }
  if (state.delta.size() != geometry_.delta_bytes()) {
    return SizeMismatch("state.delta_state", state.delta.size(),
                        absl::StrFormat("[B=%d, Hv=%d, Dv=%d, Dk=%d] of %d-byte elements", b,
                                        k.num_v_heads, k.head_v_dim, k.head_k_dim, e),
                        geometry_.delta_bytes());
  }
  if (state.advance > std::numeric_limits<uint64_t>::max() - offset_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("state.advance: %d would overflow the offset %d", state.advance, offset_));
  }
  return absl::OkStatus();
}

// Fresh pages every time: snapshots keep the old ones, nothing is copied.
absl::Status RecurrentLayer::UpdateState(const StateInput& state) {
  RETURN_IF_ERROR(CheckState(state));
  gpu::PagePool& pool = *pages_.pool();
  std::vector<gpu::PageId> fresh;
  RETURN_IF_ERROR(pool.Allocate(static_cast<uint32_t>(geometry_.pages()), fresh));
  std::vector<gpu::WriteRun> runs;
  AddWriteRuns(fresh, geometry_.page_bytes, 0, state.conv, runs);
  AddWriteRuns(fresh, geometry_.page_bytes, geometry_.conv_bytes(), state.delta, runs);
  if (absl::Status status = pool.Write(runs); !status.ok()) {
    for (gpu::PageId page : fresh) pool.Release(page);
    return status;
  }
  PageTable replacement(&pool);
  for (uint64_t i = 0; i < fresh.size(); ++i) replacement.Set(i, fresh[i]);
  pages_ = std::move(replacement);
  offset_ += state.advance;
  return absl::OkStatus();
}

absl::Status RecurrentLayer::Read(TokenRange, const KvOutput&) const { return NoTokens(); }

absl::Status RecurrentLayer::CheckTrimmable() const {
  return absl::FailedPreconditionError(
      "a recurrent state holds every token it has seen and cannot drop some");
}

absl::StatusOr<LayerSnapshotPtr> RecurrentLayer::Snapshot(uint64_t from_offset) const {
  return std::make_shared<RecurrentSnapshot>(pages_, geometry_, from_offset, offset_);
}

absl::StatusOr<std::unique_ptr<Layer>> RecurrentLayer::Restored(const LayerSnapshot* snapshot,
                                                                uint64_t target) const {
  if (snapshot == nullptr) {
    if (target != offset_) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "a recurrent state cannot be rewound: it is at offset %d, the target is %d; restore "
          "a snapshot taken at the target instead",
          offset_, target));
    }
    return std::unique_ptr<Layer>(new RecurrentLayer(pages_, geometry_, index_, offset_));
  }
  const auto* snap = dynamic_cast<const RecurrentSnapshot*>(snapshot);
  if (snap == nullptr) return absl::FailedPreconditionError("snapshot is not of a recurrent layer");
  if (target < snap->to()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "target %d is before the recurrent snapshot's offset %d: its state already holds the "
        "tokens after the target",
        target, snap->to()));
  }
  if (target > snap->to()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "target %d is past the recurrent snapshot's offset %d: its state has not seen the "
        "tokens up to the target",
        target, snap->to()));
  }
  return std::unique_ptr<Layer>(new RecurrentLayer(snap->pages(), geometry_, index_, snap->to()));
}

void RecurrentLayer::AdoptState(const RecurrentSnapshot& snapshot) {
  pages_ = snapshot.pages();
  offset_ = snapshot.to();
}

absl::Status RecurrentLayer::Load(const LayerContents& contents) {
  if (offset_ != 0 || has_state()) {
    return absl::FailedPreconditionError("only an empty layer can be loaded");
  }
  if (contents.state == nullptr) {
    return absl::InvalidArgumentError("state: a recurrent layer is loaded from its state");
  }
  StateInput state = *contents.state;
  state.advance = contents.offset;
  return UpdateState(state);
}

void RecurrentLayer::Free() {
  pages_.Clear();
  offset_ = 0;
}

uint64_t RecurrentLayer::size_bytes() const { return PoolBytes(pages_); }

}  // namespace kvcache::engine
