// Builders of kvcache.v1 requests shared by the service tests.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kvcache/v1/kvcache.pb.h"

namespace kvcache::testing {

// A spec of `layers` standard layers (and, if window > 0, one rotating layer
// of that window with 4 sinks at the end).
v1::CacheSpec ProtoSpec(uint32_t standard_layers, uint32_t heads, uint32_t head_dim,
                        uint32_t window = 0, v1::DType dtype = v1::DTYPE_FLOAT16,
                        uint32_t batch = 1);

// A tensor of the given shape filled with random bytes.
v1::Tensor RandomTensor(v1::DType dtype, std::vector<uint64_t> shape, std::mt19937_64& rng);

// An update of `tokens` random tokens for `layer` of a cache of `spec`.
v1::UpdateRequest RandomUpdate(const std::string& cache_id, const v1::CacheSpec& spec,
                               uint32_t layer, uint64_t tokens, std::mt19937_64& rng);

}  // namespace kvcache::testing
