#include "reference_speculation.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>

namespace kvcache::testing {
namespace {

void SpeculationCheck(bool condition, const char* what) {
  if (!condition) {
    std::cerr << "speculation reference invariant violated: " << what << "\n";
    std::abort();
  }
}

}  // namespace

RefSpeculation::RefSpeculation(const RefCache& live, bool isolated)
    : spec_(live.spec()), isolated_(isolated) {
  SpeculationCheck(live.CommonOffset().has_value(), "began on layers out of step");
  committed_ = *live.CommonOffset();
  for (size_t i = 0; i < live.num_layers(); ++i) {
    recurrent_.push_back(engine::IsRecurrent(live.spec().layers[i]));
    layers_.push_back(LayerDraft{.base = live.layer(i).Clone()});
  }
}

std::vector<uint64_t> RefSpeculation::layer_offsets() const {
  std::vector<uint64_t> offsets;
  for (const LayerDraft& draft : layers_) offsets.push_back(committed_ + draft.drafted);
  return offsets;
}

void RefSpeculation::Update(size_t layer, std::vector<RefToken> tokens) {
  SpeculationCheck(!recurrent_[layer], "tokens drafted on a recurrent layer");
  LayerDraft& draft = layers_[layer];
  draft.drafted += tokens.size();
  for (RefToken& token : tokens) draft.tokens.push_back(std::move(token));
}

void RefSpeculation::UpdateState(size_t layer, RefState state, uint64_t advance) {
  SpeculationCheck(recurrent_[layer], "a state drafted on an attention layer");
  LayerDraft& draft = layers_[layer];
  draft.drafted += advance;
  draft.states.push_back({committed_ + draft.drafted, std::move(state)});
}

std::vector<RefToken> RefSpeculation::DraftedTokens(size_t layer, uint64_t n) const {
  const std::vector<RefToken>& tokens = layers_[layer].tokens;
  SpeculationCheck(n <= tokens.size(), "fewer tokens drafted than asked for");
  return std::vector<RefToken>(tokens.begin(), tokens.begin() + n);
}

std::vector<RefToken> RefSpeculation::Fetch(size_t layer) const {
  const LayerDraft& draft = layers_[layer];
  if (draft.tokens.empty()) return draft.base->Fetch();
  std::unique_ptr<RefLayer> view = draft.base->Clone();
  view->Update(draft.tokens);
  return view->Fetch();
}

std::optional<RefState> RefSpeculation::FetchState(size_t layer) const {
  const LayerDraft& draft = layers_[layer];
  if (draft.states.empty()) return draft.base->FetchState();
  return draft.states.back().state;
}

// The latest one: a state that consumed no token replaces the one before it.
const RefState* RefSpeculation::StateAt(const LayerDraft& draft, uint64_t offset) const {
  const RefState* found = nullptr;
  for (const DraftedState& drafted : draft.states) {
    if (drafted.offset == offset) found = &drafted.state;
  }
  return found;
}

absl::StatusCode RefSpeculation::Commit(uint64_t accepted, RefCache& live) const {
  uint64_t most_drafted = 0;
  for (const LayerDraft& draft : layers_) most_drafted = std::max(most_drafted, draft.drafted);
  if (accepted > most_drafted) return absl::StatusCode::kInvalidArgument;
  for (const LayerDraft& draft : layers_) {
    if (draft.drafted != layers_[0].drafted) return absl::StatusCode::kFailedPrecondition;
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (recurrent_[i] && accepted > 0 && StateAt(layers_[i], committed_ + accepted) == nullptr) {
      return absl::StatusCode::kFailedPrecondition;
    }
  }
  if (isolated_ || accepted == 0) return absl::StatusCode::kOk;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerDraft& draft = layers_[i];
    if (recurrent_[i]) {
      live.UpdateState(i, *StateAt(draft, committed_ + accepted), accepted);
    } else {
      live.Update(i, std::vector<RefToken>(draft.tokens.begin(), draft.tokens.begin() + accepted));
    }
  }
  return absl::StatusCode::kOk;
}

}  // namespace kvcache::testing
