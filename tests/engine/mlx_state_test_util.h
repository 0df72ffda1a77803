// Helpers for the prompt-cache tests (mlx_state_test.cc): plain models of
// mlx-lm's RotatingKVCache and of the chunked layer's start position, written
// from mlx-lm's cache.py and independent of the engine; a cache driven in the
// engine beside them; and what its prompt-cache file must then hold.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/files/prompt_cache.h"
#include "engine/layers/cache.h"
#include "gtest/gtest.h"
#include "reference_model.h"

namespace kvcache::testing {

// mlx-lm RotatingKVCache over token positions (-1: a zero-filled slot),
// step 256 as in mlx-lm: its buffer, offset and _idx after the same updates.
class MlxRotatingModel {
 public:
  MlxRotatingModel(uint64_t max_size, uint64_t keep) : max_size_(max_size), keep_(keep) {}
  void Update(uint64_t tokens);  // update_and_fetch of `tokens` new positions
  void Trim(uint64_t n);
  std::vector<int64_t> State() const;  // mlx-lm `state`: the buffer, sliced to offset
  uint64_t offset() const { return offset_; }
  uint64_t idx() const { return idx_; }
  // BatchRotatingKVCache's `rotated` (keep 0): set by a single-token update
  // that wraps, cleared by a multi-token one.
  bool rotated() const { return rotated_; }

 private:
  std::vector<int64_t> TemporalOrder() const;
  std::vector<int64_t> TrimFront(int64_t trim_size, const std::vector<int64_t>& v,
                                 const std::vector<int64_t>& append) const;
  void UpdateConcat(uint64_t tokens);
  void UpdateInPlace();

  uint64_t max_size_;
  uint64_t keep_;
  bool empty_ = true;
  std::vector<int64_t> buffer_;
  uint64_t offset_ = 0;
  uint64_t idx_ = 0;
  bool rotated_ = false;
};

// The K and V bytes written at each position of one attention layer.
class TokenHistory {
 public:
  explicit TokenHistory(const RefShape& shape) : shape_(shape) {}
  // kv [B, H, L, D] written at positions [offset, offset + L).
  void Write(uint64_t offset, const std::vector<std::byte>& keys,
             const std::vector<std::byte>& values, uint64_t tokens);
  // [B, H, positions.size(), D] keys (values: `values` true); -1 gives zeros.
  std::vector<std::byte> Gather(const std::vector<int64_t>& positions, bool values) const;

 private:
  RefShape shape_;
  std::vector<std::vector<std::byte>> keys_;  // per position: B*H rows
  std::vector<std::vector<std::byte>> values_;
};

// A cache in `engine` and, beside it, what mlx-lm would hold for each layer.
class MlxMirror {
 public:
  MlxMirror(engine::Engine& engine, const engine::CacheSpec& spec, uint64_t seed);
  const std::string& id() const { return id_; }
  uint64_t offset() const { return offset_; }
  // Every attention layer gets `tokens` new tokens; every recurrent one a
  // new state advancing by `tokens`.
  ::testing::AssertionResult Step(uint64_t tokens);
  // Engine::Trim; the models follow when it trims. Its result.
  absl::StatusOr<uint64_t> Trim(uint64_t n);
  // `file` holds exactly what mlx-lm's save_prompt_cache would write for the
  // cache now (quantized layers: the planes as `view` stores them).
  ::testing::AssertionResult FileMatches(const engine::PromptCacheFile& file,
                                         const engine::CacheSnapshot& view) const;

 private:
  ::testing::AssertionResult LayerMatches(const engine::PromptCacheFile& file,
                                          const engine::CacheSnapshot& view, uint32_t layer) const;
  template <typename KvMatch>
  ::testing::AssertionResult BatchRotatingMatches(const engine::PromptCacheFile& file,
                                                  uint32_t layer, const MlxRotatingModel& model,
                                                  const KvMatch& kv_match) const;

  engine::Engine& engine_;
  engine::CacheSpec spec_;
  std::string id_;
  std::mt19937_64 rng_;
  uint64_t offset_ = 0;
  std::vector<TokenHistory> history_;
  std::vector<std::optional<MlxRotatingModel>> rotating_;
  std::vector<uint64_t> chunk_start_;  // chunked layers' start positions
  std::vector<RefState> states_;       // recurrent layers' last states
};

// The tensor `key` has this dtype, shape and (when given) bytes.
::testing::AssertionResult TensorIs(const engine::PromptCacheFile& file, const std::string& key,
                                    engine::FileDType dtype, const std::vector<uint64_t>& shape,
                                    const std::vector<std::byte>* bytes = nullptr);
// Same tensors (dtype, shape, bytes) and metadata; names the first difference.
::testing::AssertionResult SameFile(const engine::PromptCacheFile& expected,
                                    const engine::PromptCacheFile& actual);
// Every layer of `actual` reads as `expected`'s does: ranges, bytes (packed
// planes for quantized layers, states for recurrent ones).
::testing::AssertionResult SameContents(const engine::CacheSnapshot& expected,
                                        const engine::CacheSnapshot& actual);

}  // namespace kvcache::testing
