// One layer's part of a speculation (engine/speculation/speculation.h): what the drafted
// tokens did to it, and how a commit keeps the accepted ones. Each layer makes
// its own (Layer::MakeDraft):
//
//   attention layers (standard, quantized, chunked, rotating): the drafted
//     tokens are staged past the layer's offset (engine/layers/staged_append.h), in
//     the live layer itself, so a commit writes nothing: the offset moves (and
//     a rotating layer evicts, a chunked one trims its front, as one Update of
//     the accepted tokens would). Isolated: staged in a copy of the layer that
//     shares its pages, so the live layer is never touched.
//   recurrent layers (recurrent_draft.cc): each drafted state goes into fresh
//     pages of a copy of the layer and is recorded with the offset it
//     reaches; a commit of n adopts the state recorded at committed + n
//     (ollama snapshots a recurrent state per drafted token for the same
//     reason: a state cannot be cut back). No state recorded there:
//     FAILED_PRECONDITION.
//
// Destroying a draft ends it: what only it holds (staged pages past the
// offset, recorded states) is released. After Commit(n) that drops the
// drafted tokens past n.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/layers/layer.h"

namespace kvcache::engine {

class LayerDraft {
 public:
  virtual ~LayerDraft() = default;
  // Tokens drafted so far (recurrent: the advances of its drafted states).
  virtual uint64_t drafted() const = 0;
  // Attention layers: drafts kv's tokens. Recurrent: INVALID_ARGUMENT, as Update.
  virtual absl::Status Update(const KvInput& kv) = 0;
  // Recurrent layers: drafts a state. Attention: INVALID_ARGUMENT, as UpdateState.
  virtual absl::Status UpdateState(const StateInput& state) = 0;
  // The layer with its drafted tokens (committed + drafted), for reading;
  // null when it holds nothing, as Layer::Snapshot(0).
  virtual absl::StatusOr<LayerSnapshotPtr> Freeze() const = 0;
  // FAILED_PRECONDITION when the layer cannot keep exactly `accepted`
  // (<= drafted()) drafted tokens. Changes nothing.
  virtual absl::Status CheckCommit(uint64_t accepted) const = 0;
  // Keeps the first `accepted` drafted tokens in the live layer (nothing when
  // isolated). Only after CheckCommit passed; cannot fail.
  virtual void Commit(uint64_t accepted) = 0;
};


}  // namespace kvcache::engine
