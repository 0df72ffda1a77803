// What names a page of a PagePool: apart, so that plain job structs
// (quant_job.h) name pages without the pool's header.
#pragma once

#include <cstdint>

namespace kvcache::gpu {

using PageId = uint32_t;
inline constexpr PageId kNoPage = UINT32_MAX;

}  // namespace kvcache::gpu
