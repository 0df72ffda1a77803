#include "engine/layers/layer_draft.h"

#include <utility>

#include "core/status_macros.h"
#include "engine/layers/staged_append.h"

namespace kvcache::engine {
namespace {

// Attention kinds: the drafted tokens are staged in `target`, the live layer or
// (isolated) `copy`, a layer sharing the live one's pages.
class AttentionDraft final : public LayerDraft {
 public:
  AttentionDraft(Layer& target, StagedAppend& staged, std::unique_ptr<Layer> copy)
      : target_(target), staged_(staged), copy_(std::move(copy)) {}
  // Releases the staged pages: all of them after an abort, those past the
  // accepted tokens after a commit (a copy's go with it).
  ~AttentionDraft() override { staged_.DropStaged(); }

  uint64_t drafted() const override { return drafted_; }
  absl::Status Update(const KvInput& kv) override {
    RETURN_IF_ERROR(staged_.Stage(drafted_, kv));
    drafted_ += kv.tokens;
    return absl::OkStatus();
  }
  // The base class's refusal, never a layer's own UpdateState: it must not
  // reach the live layer.
  absl::Status UpdateState(const StateInput& state) override {
    return target_.Layer::UpdateState(state);
  }
  absl::StatusOr<LayerSnapshotPtr> Freeze() const override {
    return staged_.FreezeStaged(drafted_);
  }
  absl::Status CheckCommit(uint64_t) const override { return absl::OkStatus(); }
  void Commit(uint64_t accepted) override {
    if (copy_ == nullptr && accepted > 0) staged_.Adopt(accepted);
  }

 private:
  Layer& target_;
  StagedAppend& staged_;
  std::unique_ptr<Layer> copy_;
  uint64_t drafted_ = 0;
};

}  // namespace

// Kinds that stage their tokens draft them in place (or in a copy).
absl::StatusOr<std::unique_ptr<LayerDraft>> Layer::MakeDraft(bool isolated) {
  StagedAppend* staged = staged_append();
  if (staged == nullptr) return absl::FailedPreconditionError("this layer kind cannot speculate");
  if (!isolated) return std::make_unique<AttentionDraft>(*this, *staged, nullptr);
  // A copy at the same offset shares every page; staging into it copies the
  // one page it shares with the live layer before writing.
  ASSIGN_OR_RETURN(std::unique_ptr<Layer> copy, Restored(nullptr, offset()));
  Layer& target = *copy;
  StagedAppend* copy_staged = target.staged_append();
  if (copy_staged == nullptr) return absl::InternalError("a copy of the layer cannot stage");
  return std::make_unique<AttentionDraft>(target, *copy_staged, std::move(copy));
}

}  // namespace kvcache::engine
