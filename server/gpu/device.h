// A Vulkan device chosen for kvcached: instance, physical device, logical device
// and one compute/transfer queue guarded by its own mutex. Every VkResult becomes
// an absl::Status; every handle is RAII (vulkan_raii.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "gpu/device_options.h"

// vulkan_raii.hpp 1.3.239 requires exceptions: gpu/ catches vk::SystemError at
// each entry point (VkTry below) and returns an absl::Status instead.
#include <vulkan/vulkan_raii.hpp>

namespace kvcache::gpu {

// The memory types (a bit per index) where pages can live host-mapped:
// DEVICE_LOCAL | HOST_VISIBLE | HOST_COHERENT (and HOST_CACHED when `cached`)
// on a heap as large as the largest device-local heap.
uint32_t HostMappablePageTypes(const vk::PhysicalDeviceMemoryProperties& memory, bool cached);

class Device {
 public:
  static absl::StatusOr<std::vector<DeviceDescription>> List();
  static absl::StatusOr<std::unique_ptr<Device>> Create(const DeviceOptions& options);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const DeviceDescription& description() const { return description_; }
  const DeviceOptions& options() const { return options_; }
  // True when pool pages are written and read through a host mapping.
  bool direct_host_access() const { return direct_host_access_; }
  // True when pages are written through a host mapping but read through the
  // staging ring: device memory the host can map but not read fast (the
  // uncached BAR of a resizable-BAR GPU).
  bool mapped_writes() const { return mapped_writes_; }
  // The memory types (a bit per index) that host-mapped pages may use: those
  // that made the choice above, so a slab never lands in a small BAR window.
  uint32_t host_mapped_page_types() const { return host_mapped_page_types_; }
  // "direct", "mapped writes" or "staging".
  const char* transfer_path_name() const;
  uint64_t max_storage_buffer_range() const { return max_storage_buffer_range_; }

  // Validation-layer messages (warnings and errors) seen so far.
  uint64_t validation_message_count() const;
  std::vector<std::string> validation_messages() const;

  // Low-level access for gpu/ (the page pool and shader pipelines).
  const vk::raii::PhysicalDevice& physical_device() const { return *physical_device_; }
  const vk::raii::Device& device() const { return *device_; }
  const vk::raii::Queue& queue() const { return *queue_; }
  uint32_t queue_family() const { return queue_family_; }
  // Held while recording submissions to queue(): one mutex per queue.
  absl::Mutex& queue_mutex() const { return queue_mutex_; }
  // A memory type index with `required` flags (preferring `preferred` too).
  absl::StatusOr<uint32_t> FindMemoryType(uint32_t type_bits, vk::MemoryPropertyFlags required,
                                          vk::MemoryPropertyFlags preferred) const;

  struct ValidationSink;  // defined in device.cc

 private:
  Device() = default;
  // Create() in three steps, each run under VkTry.
  absl::Status InitInstance();
  absl::Status PickPhysicalDevice();
  absl::Status InitLogicalDevice();

  DeviceOptions options_;
  DeviceDescription description_;
  bool direct_host_access_ = false;
  bool mapped_writes_ = false;
  uint32_t host_mapped_page_types_ = 0;
  uint64_t max_storage_buffer_range_ = 0;
  uint32_t queue_family_ = 0;
  std::unique_ptr<ValidationSink> validation_;
  std::unique_ptr<vk::raii::Context> context_;
  std::unique_ptr<vk::raii::Instance> instance_;
  std::unique_ptr<vk::raii::DebugUtilsMessengerEXT> messenger_;
  std::unique_ptr<vk::raii::PhysicalDevice> physical_device_;
  std::unique_ptr<vk::raii::Device> device_;
  std::unique_ptr<vk::raii::Queue> queue_;
  mutable absl::Mutex queue_mutex_;
};

// Maps a VkResult to a status: OK for success, RESOURCE_EXHAUSTED for
// out-of-memory results, INTERNAL (naming `what`) for the rest.
absl::Status VkStatus(vk::Result result, std::string_view what);

// Runs `body` (which may throw vk::SystemError or return a Status) and turns any
// Vulkan exception into a status naming `what`.
template <typename Body>
absl::Status VkTry(std::string_view what, Body&& body) {
  try {
    return body();
  } catch (const vk::SystemError& error) {
    return VkStatus(static_cast<vk::Result>(error.code().value()), what);
  }
}

}  // namespace kvcache::gpu
