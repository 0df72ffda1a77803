// Conversions between the wire and the reference model, shared by the handler
// tests and the end-to-end tests: engine specs as wire specs, and the Fetch
// forms that are not plain keys and values (server/service/fetch_forms.cc)
// read back into the reference model's terms: a quantized layer's packed
// chunks as the reference's packed tokens (reference_quantized.h), a
// recurrent state as a RefState; and the reference's stored tokens as a
// default Fetch returns them (quantized layers: dequantized).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/layers/cache_spec.h"
#include "kvcache/v1/kvcache.pb.h"
#include "reference_model.h"

namespace kvcache::testing {

// The wire form of an engine spec, built field by field (not by the service's
// own converter, so a converter bug shows as a mismatch), every kind and the
// left padding included.
v1::CacheSpec ToWireSpec(const engine::CacheSpec& spec);

// The chunks of one quantized layer fetched with `packed`, as the reference's
// packed tokens at their positions. INVALID_ARGUMENT naming the chunk and the
// field when a chunk's shapes, dtypes, group size, bits or sizes are not what
// layer `layer` of `spec` stores, or it carries keys, values or a state.
absl::StatusOr<std::vector<RefToken>> PackedTokensOf(const engine::CacheSpec& spec, uint32_t layer,
                                                     absl::Span<const v1::FetchResponse> chunks);

// A fetched RecurrentState of layer `layer` as a RefState, after checking its
// dtype and shapes (INVALID_ARGUMENT naming the field if not as specified).
absl::StatusOr<RefState> StateOf(const engine::CacheSpec& spec, uint32_t layer,
                                 const v1::RecurrentState& state);

// What a default Fetch returns for tokens the reference stores: quantized
// layers' packed tokens dequantized (the CPU reference dequantization, which
// the engine matches byte for byte); other layers' tokens unchanged.
std::vector<RefToken> AsFetched(const engine::CacheSpec& spec, uint32_t layer,
                                std::vector<RefToken> stored);

// The wire form of a reference state for layer `layer` of `spec`, in its dtype.
v1::RecurrentState ToWireState(const engine::CacheSpec& spec, uint32_t layer, const RefState& state,
                               uint64_t advance);

}  // namespace kvcache::testing
