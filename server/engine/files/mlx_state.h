// A cache snapshot as an mlx-lm prompt cache (engine/files/prompt_cache.h), and a
// cache rebuilt from one: the same file loads in mlx-lm and here.
//
// Per layer (mlx-lm cache.py `state` / `meta_state` / class name), tensors
// "<i>.<k>" and meta "0.<i>.<k>":
//
//   standard: KVCache; keys, values [B,H,offset,D]; no meta
//   standard + left_padding: BatchKVCache; keys, values, offset [B] i32,
//       left_padding [B] i32; no meta
//   rotating: RotatingKVCache; keys, values as the raw ring buffer
//       [B,H,held,D]; keep, max_size, offset, _idx
//   quantized: QuantizedKVCache; "<i>.0.{0,1,2}" keys wq u32, scales, biases,
//       "<i>.1.*" values; offset, group_size, bits
//   chunked: ChunkedKVCache; keys, values [B,H,offset,D] (below);
//       chunk_size, start_position
//   rotating + left_padding: BatchRotatingKVCache; ring, offset, left_padding
//       (below); max_size, _offset, _idx, rotated
//   recurrent: ArraysCache; conv [B,conv_tail,conv_dim], delta [B,Hv,Dv,Dk];
//       no meta
//
// Decisions where mlx-lm leaves room:
// - A file is a whole cache: the snapshot must start at 0, and every layer
//   must hold something. mlx-lm cannot save an empty KVCache (its `state`
//   reads keys.shape of None) and safetensors rejects empty arrays, so a layer
//   at offset 0 or a recurrent layer with no state yet is FAILED_PRECONDITION.
// - Rotating: the ring in mlx-lm's own buffer order. With L tokens held and
//   _idx < L (the ring wrapped), buffer = sinks | newest (_idx - keep) | oldest
//   (L - _idx) of the window, i.e. temporal = [:keep] + [_idx:] + [keep:_idx].
// - Chunked: mlx-lm's `state` slices its buffer (which starts at
//   start_position) by `offset`, and loading sets offset = the tensors'
//   length. So the tensors hold `offset` rows: the held tokens [start, offset)
//   then start_position rows of zeros; loaded, offset = L and the held tokens
//   are rows [0, L - start_position).
// - Batch (mlx-lm BatchKVCache): `offset` and `left_padding` are int32 arrays
//   (mx.array of Python ints), offset[b] = _idx - left_padding[b], where _idx
//   is the cache's offset (positions count the padding).
// - Recurrent (ArraysCache of 2, as mlx-lm's gated-delta / Mamba models fill
//   it): [conv state [B, conv_kernel - 1, conv_dim], ssm state [B, Hv, Dv, Dk]],
//   the engine's own shapes. It records no offset: loaded, it takes the common
//   offset of the file's attention layers, or 1 in a file with none (a state
//   stands for at least one token; the true count is not in the file).
// - User metadata goes to "1.<key>"; the spec's model to "1.model" unless the
//   caller gave one. Loaded, "1.model" becomes the spec's model.
// - Batch rotating (mlx-lm BatchRotatingKVCache, keep 0): the ring as above;
//   offset[b] = _offset - left_padding[b] with the cache's own padding, but
//   the file's left_padding[b] is that padding less every token evicted from
//   the front (_offset - held), as mlx-lm decrements it; meta (max_size,
//   _offset, _idx, rotated) with rotated "True" exactly when a full ring has
//   evicted (mlx_batch_meta.h: mlx-lm reads "False" as True; harmless to the
//   buffer's order here, as a "False" ring is in temporal order and its roll
//   by _idx = L moves nothing).
// - Not written or read: CacheList; quantized and chunked layers in a cache
//   with left_padding have no mlx-lm batch form. FAILED_PRECONDITION.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/files/prompt_cache.h"
#include "engine/layers/cache.h"
#include "engine/layers/cache_spec.h"
#include "gpu/page_pool.h"

namespace kvcache::engine {

// The snapshot (from 0) as mlx-lm's save_prompt_cache would write the cache,
// with `user_metadata` as "1.<key>". FAILED_PRECONDITION saying why mlx-lm
// cannot hold it; INVALID_ARGUMENT for an empty user metadata key.
absl::StatusOr<PromptCacheFile> ToPromptCache(
    const CacheSnapshot& snapshot, const std::map<std::string, std::string>& user_metadata);

// A new cache in `pool` holding what `file` holds, its spec derived from the
// file (dtype, batch size, left padding, every layer's kind and dims, model
// from "1.model"). Everything mlx-lm's from_state checks, and what a hostile
// file could break, is INVALID_ARGUMENT naming the tensor or metadata key;
// FAILED_PRECONDITION for what mlx-lm can hold but this engine cannot. On
// error no page stays taken.
absl::StatusOr<std::unique_ptr<Cache>> CacheFromPromptCache(const PromptCacheFile& file,
                                                            const SpecLimits& limits,
                                                            gpu::PagePool& pool,
                                                            uint32_t page_tokens);

}  // namespace kvcache::engine
