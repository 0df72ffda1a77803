#include "engine/speculation/speculation.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"

namespace kvcache::engine {
namespace {

absl::Status InLayer(size_t layer, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("layer ", layer, ": ", status.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Speculation>> Speculation::Begin(Cache& cache, std::string id,
                                                                 bool isolated) {
  absl::StatusOr<uint64_t> offset = cache.CommonOffset();
  if (!offset.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cache_id: a speculation starts from a whole step; ", offset.status().message()));
  }
  std::unique_ptr<Speculation> speculation(new Speculation(cache, std::move(id), isolated, *offset));
  for (size_t i = 0; i < cache.num_layers(); ++i) {
    absl::StatusOr<std::unique_ptr<LayerDraft>> draft = cache.mutable_layer(i).MakeDraft(isolated);
    if (!draft.ok()) return InLayer(i, draft.status());
    speculation->drafts_.push_back(*std::move(draft));
  }
  return speculation;
}

std::vector<uint64_t> Speculation::layer_offsets() const {
  std::vector<uint64_t> offsets;
  for (size_t i = 0; i < drafts_.size(); ++i) offsets.push_back(layer_offset(i));
  return offsets;
}

absl::Status Speculation::Update(uint32_t layer, const KvInput& kv) {
  return drafts_[layer]->Update(kv);
}

absl::Status Speculation::UpdateState(uint32_t layer, const StateInput& state) {
  return drafts_[layer]->UpdateState(state);
}

absl::StatusOr<CacheSnapshotPtr> Speculation::Freeze(const std::string& cache_id) const {
  auto frozen = std::make_shared<CacheSnapshot>();
  frozen->cache_id = cache_id;
  frozen->spec = cache_.spec();
  for (size_t i = 0; i < drafts_.size(); ++i) {
    ASSIGN_OR_RETURN(LayerSnapshotPtr part, drafts_[i]->Freeze());
    frozen->to = std::max(frozen->to, layer_offset(i));
    frozen->layers.push_back(std::move(part));
  }
  return frozen;
}

absl::StatusOr<uint64_t> Speculation::CommonDrafted() const {
  const uint64_t first = drafts_[0]->drafted();
  for (size_t i = 1; i < drafts_.size(); ++i) {
    if (drafts_[i]->drafted() != first) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "drafted layers are out of step: layer 0 has drafted %d tokens, layer %d %d; finish "
          "the step (draft every layer) first",
          first, i, drafts_[i]->drafted()));
    }
  }
  return first;
}

// Every check before any layer changes: a commit is all layers or none. An
// `accepted` no layer reached is malformed whatever the layers' steps are, so
// it is named first.
absl::Status Speculation::Commit(uint64_t accepted) {
  uint64_t most_drafted = 0;
  for (const auto& draft : drafts_) most_drafted = std::max(most_drafted, draft->drafted());
  if (accepted > most_drafted) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "accepted: %d is more than the %d tokens drafted", accepted, most_drafted));
  }
  RETURN_IF_ERROR(CommonDrafted().status());
  for (size_t i = 0; i < drafts_.size(); ++i) {
    if (absl::Status status = drafts_[i]->CheckCommit(accepted); !status.ok()) {
      return InLayer(i, status);
    }
  }
  for (const auto& draft : drafts_) draft->Commit(accepted);
  return absl::OkStatus();
}

}  // namespace kvcache::engine
