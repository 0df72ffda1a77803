// mlx affine quantization in native CPU code, for devices whose "GPU" is the
// CPU itself (lavapipe): there the pages are host memory, and the SPIR-V
// shaders (shaders/quantize.comp) run through llvmpipe, which executes each
// storage-buffer access as a loop over its SIMD lanes, about 30x slower than
// this code on the same cores. The arithmetic is the mlx CPU kernel's, step
// for step, so the packed words, scales and biases are bit-identical to the
// reference quantizer (tests/support/ref_quantizer.cc) and to the shaders.
//
// A group is `group_size` consecutive values; `groups` groups lie back to
// back in every plane:
//   values  groups * group_size values of format.dtype
//   wq      groups * group_size * bits / 32 uint32 words, little end first
//   scales  groups values of format.dtype
//   biases  groups values of format.dtype
// No alignment is required of any pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "gpu/quant_format.h"

namespace kvcache::gpu {

// Instruction sets the kernels are built for; each is bit-identical to the others.
enum class QuantIsa { kPortable, kAvx2, kAvx512 };

// The fastest one this CPU runs.
QuantIsa BestQuantIsa();
// Whether this CPU (and this build) runs `isa`.
bool CpuRuns(QuantIsa isa);
std::string_view QuantIsaName(QuantIsa isa);

struct QuantPlanes {
  std::byte* wq;
  std::byte* scales;
  std::byte* biases;
};

struct ConstQuantPlanes {
  const std::byte* wq;
  const std::byte* scales;
  const std::byte* biases;
};

// `format` must be valid (group_size 32/64/128, bits 4/8) and `isa` run here.
void QuantizeGroups(QuantIsa isa, const QuantFormat& format, const std::byte* values,
                    uint64_t groups, const QuantPlanes& out);
void DequantizeGroups(QuantIsa isa, const QuantFormat& format, const ConstQuantPlanes& in,
                      uint64_t groups, std::byte* values);

// One entry point per instruction set (quant_kernels_<isa>.cc, each compiled
// for its own target), behind the dispatch above.
namespace quant_kernels {
void QuantizePortable(const QuantFormat&, const std::byte*, uint64_t, const QuantPlanes&);
void DequantizePortable(const QuantFormat&, const ConstQuantPlanes&, uint64_t, std::byte*);
void QuantizeAvx2(const QuantFormat&, const std::byte*, uint64_t, const QuantPlanes&);
void DequantizeAvx2(const QuantFormat&, const ConstQuantPlanes&, uint64_t, std::byte*);
void QuantizeAvx512(const QuantFormat&, const std::byte*, uint64_t, const QuantPlanes&);
void DequantizeAvx512(const QuantFormat&, const ConstQuantPlanes&, uint64_t, std::byte*);
}  // namespace quant_kernels

}  // namespace kvcache::gpu
