// vLLM's KV-event wire format (vllm/distributed/kv_events.py), so that the
// routers written for vLLM (NVIDIA Dynamo, llm-d, Mooncake's Conductor,
// AIBrix) index kvcached's prefixes with their existing code.
//
// A batch is msgspec's encoding of KVEventBatch: a msgpack array
// [ts (float64 seconds), [event...], data_parallel_rank]. Each event is either
//   kMap    a map whose "type" key names its class, then its fields by name:
//           vLLM since its PR #42892 (mid 2026), and what every consumer
//           above now reads;
//   kArray  a positional array, the class name first: older vLLM
//           (array_like=True), for consumers pinned to it.
// Fields, as vLLM declares them (those it omits when unset are left out):
//   BlockStored   block_hashes, parent_block_hash, token_ids, block_size,
//                 lora_id, medium (and lora_name in the map form)
//   BlockRemoved  block_hashes, medium
//   AllBlocksCleared  none
// Block hashes are unsigned 64-bit integers; medium is "GPU", the tier vLLM's
// own cache names (kvcached's lower tiers come back transparently).
#pragma once

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/prefix/prefix_blocks.h"

namespace kvcache {

enum class KvEventFormat { kMap, kArray };

std::string EncodeKvEventBatch(absl::Time ts, absl::Span<const engine::BlockEvent> events,
                               KvEventFormat format, uint32_t block_size);

}  // namespace kvcache
