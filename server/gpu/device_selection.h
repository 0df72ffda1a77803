// Picking one physical device from a list, by DeviceOptions::selector. Pure
// functions over DeviceDescription, so the ranking is testable without GPUs.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "gpu/device.h"

namespace kvcache::gpu {

// "discrete", "integrated", "virtual", "cpu" or "other".
std::string DeviceTypeName(vk::PhysicalDeviceType type);

// Lower is better: discrete 0, integrated 1, virtual 2, cpu 3, other 4.
int DeviceTypeRank(std::string_view type_name);

// The index into `devices` that `selector` names:
//   ""        the best type among Vulkan 1.2+ devices (ties: the first enumerated);
//   "0".."9"+ that enumeration index;
//   anything  the first device whose name contains it, ignoring case.
// NOT_FOUND naming the selector when nothing matches.
absl::StatusOr<uint32_t> SelectDevice(const std::vector<DeviceDescription>& devices,
                                      std::string_view selector);

}  // namespace kvcache::gpu
