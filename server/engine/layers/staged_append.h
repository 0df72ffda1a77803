// What speculation (engine/speculation/speculation.h) needs of an attention layer: tokens
// written past its offset ("staged") that no reader of the layer sees, since
// its ranges, reads and snapshots (registered or frozen) all stop at the
// offset, until Adopt makes them the layer's own exactly as one Update of
// them would have:
//
//   positions   0 ............ offset-1 | offset ...... offset+staged-1
//               [ the layer's tokens    ] [ staged: drafted, unseen    ]
//
// Every attention kind keeps tokens in pages by absolute position, so staged
// tokens overwrite nothing the layer holds: a rotating layer's window is
// untouched until Adopt evicts what the adopted tokens push out, a chunked
// layer's front is trimmed only then. A standard layer's commit is just its
// offset moving (ollama speculativeKVCache.commit).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "engine/layers/layer.h"

namespace kvcache::engine {

class StagedAppend {
 public:
  virtual ~StagedAppend() = default;
  // Writes kv's tokens at positions [offset() + staged, ...), after the
  // `staged` tokens already there. INVALID_ARGUMENT as Update for a bad kv;
  // on error nothing changes.
  virtual absl::Status Stage(uint64_t staged, const KvInput& kv) = 0;
  // The layer as one Update of its first `staged` staged tokens would leave
  // it, for reading (null when that holds no position at all, as Snapshot(0)).
  virtual LayerSnapshotPtr FreezeStaged(uint64_t staged) const = 0;
  // The first `tokens` (>= 1) staged tokens become the layer's, as
  // Update(those tokens) would have made them; the rest stay staged.
  virtual void Adopt(uint64_t tokens) = 0;
  // Releases the pages that hold nothing but staged positions.
  virtual void DropStaged() = 0;
};

}  // namespace kvcache::engine
