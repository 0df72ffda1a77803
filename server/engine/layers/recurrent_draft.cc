// RecurrentLayer::MakeDraft: a recurrent layer's part of a speculation
// (engine/layers/layer_draft.h has the rules).
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "engine/layers/layer_draft.h"
#include "engine/layers/recurrent_layer.h"

namespace kvcache::engine {
namespace {

// Recurrent layers: `scratch`, a copy of the live layer, takes every drafted
// state (fresh pages each time); each is recorded with the offset it reaches.
class RecurrentDraft final : public LayerDraft {
 public:
  RecurrentDraft(RecurrentLayer& live, std::unique_ptr<Layer> scratch, bool isolated)
      : live_(live), scratch_(std::move(scratch)), committed_(live.offset()), isolated_(isolated) {}

  uint64_t drafted() const override { return scratch_->offset() - committed_; }
  absl::Status Update(const KvInput& kv) override { return scratch_->Update(kv); }
  absl::Status UpdateState(const StateInput& state) override;
  absl::StatusOr<LayerSnapshotPtr> Freeze() const override { return scratch_->Snapshot(0); }
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

absl::StatusOr<std::unique_ptr<LayerDraft>> RecurrentLayer::MakeDraft(bool isolated) {
  ASSIGN_OR_RETURN(std::unique_ptr<Layer> scratch, Restored(nullptr, offset()));
  return std::make_unique<RecurrentDraft>(*this, std::move(scratch), isolated);
}

}  // namespace kvcache::engine
