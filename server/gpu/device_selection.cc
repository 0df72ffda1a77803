#include "gpu/device_selection.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"

namespace kvcache::gpu {

std::string DeviceTypeName(vk::PhysicalDeviceType type) {
  switch (type) {
    case vk::PhysicalDeviceType::eDiscreteGpu: return "discrete";
    case vk::PhysicalDeviceType::eIntegratedGpu: return "integrated";
    case vk::PhysicalDeviceType::eVirtualGpu: return "virtual";
    case vk::PhysicalDeviceType::eCpu: return "cpu";
    default: return "other";
  }
}

int DeviceTypeRank(std::string_view type_name) {
  static constexpr std::string_view kBestFirst[] = {"discrete", "integrated", "virtual", "cpu"};
  const auto* found = std::find(std::begin(kBestFirst), std::end(kBestFirst), type_name);
  return static_cast<int>(found - std::begin(kBestFirst));
}

namespace {

bool IsAllDigits(std::string_view text) {
  return !text.empty() && std::all_of(text.begin(), text.end(), absl::ascii_isdigit);
}

absl::Status NoDeviceMatches(std::string_view selector, size_t device_count) {
  return absl::NotFoundError(absl::StrFormat(
      "no Vulkan device matches selector \"%s\" (%u devices present)", selector, device_count));
}

}  // namespace

absl::StatusOr<uint32_t> SelectDevice(const std::vector<DeviceDescription>& devices,
                                      std::string_view selector) {
  if (devices.empty()) return absl::NotFoundError("no Vulkan devices present");
  if (selector.empty()) {
    // Devices too old for kvcached (Vulkan < 1.2) rank after every usable one.
    auto rank = [](const DeviceDescription& d) {
      return std::pair(d.api_version < VK_API_VERSION_1_2, DeviceTypeRank(d.type));
    };
    auto best = std::min_element(devices.begin(), devices.end(),
                                 [&](const auto& a, const auto& b) { return rank(a) < rank(b); });
    return static_cast<uint32_t>(best - devices.begin());
  }
  if (IsAllDigits(selector)) {
    uint32_t index = 0;
    if (absl::SimpleAtoi(std::string(selector), &index) && index < devices.size()) return index;
    return NoDeviceMatches(selector, devices.size());
  }
  const std::string lowered = absl::AsciiStrToLower(std::string(selector));
  for (uint32_t i = 0; i < devices.size(); ++i) {
    if (absl::StrContains(absl::AsciiStrToLower(devices[i].name), lowered)) return i;
  }
  return NoDeviceMatches(selector, devices.size());
}

}  // namespace kvcache::gpu
