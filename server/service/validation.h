// Request checks the service makes before the engine sees anything. Every
// error is INVALID_ARGUMENT and names the field ("keys.shape[2]").
#pragma once

#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cache_spec.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache::service {

absl::Status RequireId(absl::string_view field, const std::string& id);

// Checks keys [B, H, L, Dk] and values [B, H, L, Dv] of `layer` against `spec`
// (dtype, every dimension, and the data length) and returns L.
absl::StatusOr<uint64_t> CheckKvTensors(const engine::CacheSpec& spec, uint32_t layer,
                                        const v1::Tensor& keys, const v1::Tensor& values);

}  // namespace kvcache::service
