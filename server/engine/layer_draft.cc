#include "engine/layer_draft.h"

#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "engine/recurrent_layer.h"
#include "engine/staged_append.h"

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
  absl::StatusOr<LayerSnapshotPtr> View() const override { return staged_.StagedView(drafted_); }
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

// Recurrent layers: `scratch`, a copy of the live layer, takes every drafted
// state (fresh pages each time); each is recorded with the offset it reaches.
class RecurrentDraft final : public LayerDraft {
 public:
  RecurrentDraft(RecurrentLayer& live, std::unique_ptr<Layer> scratch, bool isolated)
      : live_(live), scratch_(std::move(scratch)), committed_(live.offset()), isolated_(isolated) {}

  uint64_t drafted() const override { return scratch_->offset() - committed_; }
  absl::Status Update(const KvInput& kv) override { return scratch_->Update(kv); }
  absl::Status UpdateState(const StateInput& state) override;
  absl::StatusOr<LayerSnapshotPtr> View() const override { return scratch_->Snapshot(0); }
  absl::Status CheckCommit(uint64_t accepted) const override;
  void Commit(uint64_t accepted) override {
    if (!isolated_ && accepted > 0) live_.AdoptState(*Recorded(committed_ + accepted));
  }

 private:
  struct Record {
    uint64_t offset;
    std::shared_ptr<const RecurrentSnapshot> state;
  };
  // The state recorded at `offset`, or null.
  const RecurrentSnapshot* Recorded(uint64_t offset) const;

  RecurrentLayer& live_;
  std::unique_ptr<Layer> scratch_;
  const uint64_t committed_;
  const bool isolated_;
  std::vector<Record> records_;  // offsets strictly increasing
};

absl::Status RecurrentDraft::UpdateState(const StateInput& state) {
  RETURN_IF_ERROR(scratch_->UpdateState(state));
  // A recurrent layer's snapshot is always a RecurrentSnapshot of its pages.
  ASSIGN_OR_RETURN(LayerSnapshotPtr taken, scratch_->Snapshot(0));
  Record record{scratch_->offset(), std::static_pointer_cast<const RecurrentSnapshot>(taken)};
  // A state that consumed no token replaces the one recorded at that offset.
  if (!records_.empty() && records_.back().offset == record.offset) {
    records_.back() = std::move(record);
  } else {
    records_.push_back(std::move(record));
  }
  return absl::OkStatus();
}

const RecurrentSnapshot* RecurrentDraft::Recorded(uint64_t offset) const {
  for (const Record& record : records_) {
    if (record.offset == offset) return record.state.get();
  }
  return nullptr;
}

// Keeping no drafted token leaves the committed state (even if a state was
// drafted at the committed offset itself).
absl::Status RecurrentDraft::CheckCommit(uint64_t accepted) const {
  if (accepted == 0 || Recorded(committed_ + accepted) != nullptr) return absl::OkStatus();
  std::vector<uint64_t> offsets;
  for (const Record& record : records_) offsets.push_back(record.offset);
  return absl::FailedPreconditionError(absl::StrFormat(
      "no drafted state sits after %d accepted tokens (offset %d); the drafted states reach "
      "offsets [%s]: send one state per drafted token to commit any prefix",
      accepted, committed_ + accepted, absl::StrJoin(offsets, ", ")));
}

}  // namespace

absl::StatusOr<std::unique_ptr<LayerDraft>> MakeLayerDraft(Layer& live, bool isolated) {
  if (StagedAppend* staged = live.staged_append()) {
    if (!isolated) return std::make_unique<AttentionDraft>(live, *staged, nullptr);
    // A copy at the same offset shares every page; staging into it copies the
    // one page it shares with the live layer before writing.
    ASSIGN_OR_RETURN(std::unique_ptr<Layer> copy, live.Restored(nullptr, live.offset()));
    Layer& target = *copy;
    StagedAppend* copy_staged = target.staged_append();
    if (copy_staged == nullptr) return absl::InternalError("a copy of the layer cannot stage");
    return std::make_unique<AttentionDraft>(target, *copy_staged, std::move(copy));
  }
  if (auto* recurrent = dynamic_cast<RecurrentLayer*>(&live)) {
    ASSIGN_OR_RETURN(std::unique_ptr<Layer> scratch, live.Restored(nullptr, live.offset()));
    return std::make_unique<RecurrentDraft>(*recurrent, std::move(scratch), isolated);
  }
  return absl::FailedPreconditionError("this layer kind cannot speculate");
}

}  // namespace kvcache::engine
