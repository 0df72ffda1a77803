#include "reference_recurrent.h"

#include <cstdlib>
#include <iostream>
#include <variant>

namespace kvcache::testing {
namespace {

void RecurrentCheck(bool condition, const char* what) {
  if (!condition) {
    std::cerr << "recurrent reference invariant violated: " << what << "\n";
    std::abort();
  }
}

const engine::RecurrentKind& KindOf(const engine::CacheSpec& spec, size_t layer) {
  const auto* kind = std::get_if<engine::RecurrentKind>(&spec.layers[layer].kind);
  RecurrentCheck(kind != nullptr, "state sizes of a layer that is not recurrent");
  return *kind;
}

}  // namespace

std::unique_ptr<RefLayer> RefRecurrentLayer::Clone() const {
  return std::make_unique<RefRecurrentLayer>(*this);
}

void RefRecurrentLayer::Update(std::vector<RefToken>) {
  RecurrentCheck(false, "keys and values sent to a recurrent layer");
}

void RefRecurrentLayer::UpdateState(RefState state, uint64_t advance) {
  state_ = std::move(state);
  offset_ += advance;
}

uint64_t RefRecurrentLayer::Trim(uint64_t) {
  RecurrentCheck(false, "trim of a recurrent layer");
  return 0;
}

RefLayerSnapshotPtr RefRecurrentLayer::Snapshot(uint64_t from) const {
  if (!state_.has_value()) return nullptr;
  auto snapshot = std::make_shared<RefLayerSnapshot>();
  snapshot->from = from;
  snapshot->to = offset_;
  snapshot->state = state_;
  return snapshot;
}

bool RefRecurrentLayer::Restore(const RefLayerSnapshot* snapshot, uint64_t target) {
  if (snapshot == nullptr) return target == offset_;
  if (target != snapshot->to) return false;
  state_ = snapshot->state;
  offset_ = snapshot->to;
  return true;
}

RefLayerSnapshotPtr RefRecurrentLayer::Merge(const RefLayerSnapshotPtr& /*parent*/,
                                             const RefLayerSnapshotPtr& child) const {
  return child;
}

std::pair<RefLayerSnapshotPtr, RefLayerSnapshotPtr> RefRecurrentLayer::Split(
    const RefLayerSnapshotPtr& snapshot, uint64_t /*at*/) const {
  return {nullptr, snapshot};
}

uint64_t ConvStateBytes(const engine::CacheSpec& spec, size_t layer) {
  const engine::RecurrentKind& k = KindOf(spec, layer);
  return uint64_t{spec.batch_size} * k.conv_tail * k.conv_dim * DTypeSize(spec.dtype);
}

uint64_t DeltaStateBytes(const engine::CacheSpec& spec, size_t layer) {
  const engine::RecurrentKind& k = KindOf(spec, layer);
  return uint64_t{spec.batch_size} * k.num_v_heads * k.head_v_dim * k.head_k_dim *
         DTypeSize(spec.dtype);
}

RefState ZeroState(const engine::CacheSpec& spec, size_t layer) {
  return RefState{.conv = std::vector<std::byte>(ConvStateBytes(spec, layer)),
                  .delta = std::vector<std::byte>(DeltaStateBytes(spec, layer))};
}

}  // namespace kvcache::testing
