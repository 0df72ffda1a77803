// Request checks the service makes before the engine sees anything. Every
// error is INVALID_ARGUMENT and names the field ("keys.shape[2]").
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/layers/cache_spec.h"
#include "service/update_view.h"

namespace kvcache::service {

// An id the request must carry, at most kMaxIdBytes (core/client_text.h).
absl::Status RequireId(absl::string_view field, const std::string& id);
// An id the request may leave empty, at most kMaxIdBytes.
absl::Status CheckIdLength(absl::string_view field, absl::string_view id);

// `layer` is one of the spec's.
absl::Status CheckLayerIndex(const engine::CacheSpec& spec, uint32_t layer);

// An update of attention layer request.layer (in range): keys [B, H, L, Dk]
// and values [B, H, L, Dv] (dtype, every dimension, and the data length), and
// no state. Returns L.
absl::StatusOr<uint64_t> CheckKvUpdate(const engine::CacheSpec& spec, const UpdateView& request);

// An update of recurrent layer request.layer (in range): a state whose
// conv_state is [B, conv_tail, conv_dim] and delta_state [B, num_v_heads,
// head_v_dim, head_k_dim], in the cache dtype; no keys or values.
absl::Status CheckStateUpdate(const engine::CacheSpec& spec, const UpdateView& request);

}  // namespace kvcache::service
