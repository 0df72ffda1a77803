#include "gpu/quant_kernels.h"

#if defined(KVCACHED_X86_QUANT_KERNELS)
#include <cpuid.h>
#endif

namespace kvcache::gpu {

#if defined(KVCACHED_X86_QUANT_KERNELS)
namespace {
// From CPUID leaf 1: clang's __builtin_cpu_supports does not know "f16c".
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
}  // namespace
#endif

bool CpuRuns(QuantIsa isa) {
  switch (isa) {
    case QuantIsa::kPortable:
      return true;
#if defined(KVCACHED_X86_QUANT_KERNELS)
    case QuantIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && CpuHasF16c();
    case QuantIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#endif
    default:
      return false;
  }
}

QuantIsa BestQuantIsa() {
  static const QuantIsa best = CpuRuns(QuantIsa::kAvx512) ? QuantIsa::kAvx512
                               : CpuRuns(QuantIsa::kAvx2) ? QuantIsa::kAvx2
                                                          : QuantIsa::kPortable;
  return best;
}

std::string_view QuantIsaName(QuantIsa isa) {
  switch (isa) {
    case QuantIsa::kPortable: return "portable";
    case QuantIsa::kAvx2: return "avx2";
    case QuantIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

void QuantizeGroups(QuantIsa isa, const QuantFormat& format, const std::byte* values,
                    uint64_t groups, const QuantPlanes& out) {
  switch (isa) {
#if defined(KVCACHED_X86_QUANT_KERNELS)
    case QuantIsa::kAvx512:
      return quant_kernels::QuantizeAvx512(format, values, groups, out);
    case QuantIsa::kAvx2:
      return quant_kernels::QuantizeAvx2(format, values, groups, out);
#endif
    default:
      return quant_kernels::QuantizePortable(format, values, groups, out);
  }
}

void DequantizeGroups(QuantIsa isa, const QuantFormat& format, const ConstQuantPlanes& in,
                      uint64_t groups, std::byte* values) {
  switch (isa) {
#if defined(KVCACHED_X86_QUANT_KERNELS)
    case QuantIsa::kAvx512:
      return quant_kernels::DequantizeAvx512(format, in, groups, values);
    case QuantIsa::kAvx2:
      return quant_kernels::DequantizeAvx2(format, in, groups, values);
#endif
    default:
      return quant_kernels::DequantizePortable(format, in, groups, values);
  }
}

}  // namespace kvcache::gpu
