#include "gpu/device.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <optional>
#include <utility>

#include "absl/memory/memory.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/log.h"
#include "core/status_macros.h"
#include "gpu/device_selection.h"

// Copy engine default: CopyEngine::kCopyRegions. Measured by bench/gpu_copy_bench
// on lavapipe (2 cores), vkCmdCopyBuffer regions move staged bytes at memcpy
// speed while the compute shader (copy_runs.comp) runs at roughly half that; on
// discrete GPUs the copy regions use the DMA engines and leave the SMs free.
// The shader engine stays for devices where dispatches beat copies, and so the
// compute pipeline path is exercised in CI.

namespace kvcache::gpu {

constexpr char kValidationLayer[] = "VK_LAYER_KHRONOS_validation";

// Every validation warning/error, recorded from the debug-utils callback, which
// the layer may invoke from any thread that calls into Vulkan.
struct Device::ValidationSink {
  // Messages past this many are counted but not kept.
  static constexpr size_t kMaxKeptMessages = 256;

  void Record(std::string message) {
    count.fetch_add(1, std::memory_order_relaxed);
    LogWarning("vulkan validation: %s", message);
    absl::MutexLock lock(&mutex);
    if (messages.size() < kMaxKeptMessages) messages.push_back(std::move(message));
  }

  std::atomic<uint64_t> count{0};
  mutable absl::Mutex mutex;
  std::vector<std::string> messages ABSL_GUARDED_BY(mutex);
};

namespace {

VKAPI_ATTR VkBool32 VKAPI_CALL OnValidationMessage(VkDebugUtilsMessageSeverityFlagBitsEXT severity,
                                                   VkDebugUtilsMessageTypeFlagsEXT types,
                                                   const VkDebugUtilsMessengerCallbackDataEXT* data,
                                                   void* user_data) {
  auto* sink = static_cast<Device::ValidationSink*>(user_data);
  const char* id = data->pMessageIdName != nullptr ? data->pMessageIdName : "";
  const char* text = data->pMessage != nullptr ? data->pMessage : "";
  sink->Record(absl::StrCat(
      severity >= VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT ? "error " : "warning ", id, ": ",
      text));
  return VK_FALSE;  // Never abort the call that triggered the message.
}

vk::DebugUtilsMessengerCreateInfoEXT MessengerInfo(Device::ValidationSink* sink) {
  using Severity = vk::DebugUtilsMessageSeverityFlagBitsEXT;
  using Type = vk::DebugUtilsMessageTypeFlagBitsEXT;
  return vk::DebugUtilsMessengerCreateInfoEXT(
      {}, Severity::eWarning | Severity::eError,
      Type::eGeneral | Type::eValidation | Type::ePerformance, &OnValidationMessage, sink);
}

// vk::raii::Context dlopens libvulkan.so.1 and throws std::runtime_error if it
// cannot; that is a missing package, not a Vulkan error.
absl::Status CreateContext(std::unique_ptr<vk::raii::Context>& context) {
  try {
    context = std::make_unique<vk::raii::Context>();
  } catch (const std::exception& error) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load the Vulkan loader (install libvulkan1): ", error.what()));
  }
  if (context->enumerateInstanceVersion() < VK_API_VERSION_1_2) {
    return absl::FailedPreconditionError("the Vulkan loader is older than 1.2");
  }
  return absl::OkStatus();
}

absl::Status RequireValidationLayer(const vk::raii::Context& context) {
  for (const vk::LayerProperties& layer : context.enumerateInstanceLayerProperties()) {
    if (std::string_view(layer.layerName) == kValidationLayer) return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      kValidationLayer, " is not installed; install the vulkan-validationlayers package"));
}

std::string VersionString(uint32_t version) {
  return absl::StrFormat("%u.%u.%u", VK_API_VERSION_MAJOR(version), VK_API_VERSION_MINOR(version),
                         VK_API_VERSION_PATCH(version));
}

std::vector<DeviceDescription> Describe(const vk::raii::PhysicalDevices& physical_devices) {
  std::vector<DeviceDescription> descriptions;
  for (uint32_t i = 0; i < physical_devices.size(); ++i) {
    const vk::PhysicalDeviceProperties properties = physical_devices[i].getProperties();
    descriptions.push_back({i, std::string(properties.deviceName.data()),
                            DeviceTypeName(properties.deviceType), properties.apiVersion});
  }
  return descriptions;
}

}  // namespace

// Pages can live in host-mapped memory of a DEVICE_LOCAL | HOST_VISIBLE |
// HOST_COHERENT type (HOST_CACHED too when `cached`) on a heap as large as the
// largest device-local heap. Cached: lavapipe and integrated GPUs, whose
// pages are read and written through the mapping. Uncached: resizable-BAR
// discrete GPUs, whose BAR the CPU writes fast (11-13 GB/s on an H200) but
// reads one bus transaction at a time (58 MB/s there, against 6 GB/s through
// the staging ring), so their pages are written through the mapping and read
// through the ring. A GPU with a 256 MiB BAR window uses the ring both ways:
// its BAR type is never among these, even where it is the first such type.
uint32_t HostMappablePageTypes(const vk::PhysicalDeviceMemoryProperties& memory, bool cached) {
  vk::MemoryPropertyFlags flags = vk::MemoryPropertyFlagBits::eDeviceLocal |
                                  vk::MemoryPropertyFlagBits::eHostVisible |
                                  vk::MemoryPropertyFlagBits::eHostCoherent;
  if (cached) flags |= vk::MemoryPropertyFlagBits::eHostCached;
  vk::DeviceSize largest_device_heap = 0;
  for (uint32_t i = 0; i < memory.memoryHeapCount; ++i) {
    if (memory.memoryHeaps[i].flags & vk::MemoryHeapFlagBits::eDeviceLocal) {
      largest_device_heap = std::max(largest_device_heap, memory.memoryHeaps[i].size);
    }
  }
  uint32_t types = 0;
  for (uint32_t i = 0; i < memory.memoryTypeCount; ++i) {
    const vk::MemoryType& type = memory.memoryTypes[i];
    if ((type.propertyFlags & flags) == flags &&
        memory.memoryHeaps[type.heapIndex].size >= largest_device_heap) {
      types |= 1u << i;
    }
  }
  return types;
}

absl::StatusOr<std::vector<DeviceDescription>> Device::List() {
  std::vector<DeviceDescription> descriptions;
  RETURN_IF_ERROR(VkTry("list Vulkan devices", [&]() -> absl::Status {
    std::unique_ptr<vk::raii::Context> context;
    RETURN_IF_ERROR(CreateContext(context));
    const vk::ApplicationInfo app("kvcached", 1, "kvcached", 1, VK_API_VERSION_1_2);
    const vk::raii::Instance instance(*context, vk::InstanceCreateInfo({}, &app));
    descriptions = Describe(vk::raii::PhysicalDevices(instance));
    return absl::OkStatus();
  }));
  return descriptions;
}

absl::StatusOr<std::unique_ptr<Device>> Device::Create(const DeviceOptions& options) {
  auto device = absl::WrapUnique(new Device());
  device->options_ = options;
  RETURN_IF_ERROR(VkTry("create Vulkan instance", [&] { return device->InitInstance(); }));
  RETURN_IF_ERROR(VkTry("pick Vulkan device", [&] { return device->PickPhysicalDevice(); }));
  RETURN_IF_ERROR(VkTry("create Vulkan device", [&] { return device->InitLogicalDevice(); }));
  LogInfo("Vulkan device %u: %s (%s, Vulkan %s), transfers: %s", device->description_.index,
          device->description_.name, device->description_.type,
          VersionString(device->description_.api_version), device->transfer_path_name());
  return device;
}

const char* Device::transfer_path_name() const {
  if (direct_host_access_) return "direct";
  return mapped_writes_ ? "mapped writes" : "staging";
}

absl::Status Device::InitInstance() {
  RETURN_IF_ERROR(CreateContext(context_));
  std::vector<const char*> layers;
  std::vector<const char*> extensions;
  if (options_.enable_validation) {
    RETURN_IF_ERROR(RequireValidationLayer(*context_));
    layers.push_back(kValidationLayer);
    extensions.push_back(VK_EXT_DEBUG_UTILS_EXTENSION_NAME);
    validation_ = std::make_unique<ValidationSink>();
  }
  const vk::ApplicationInfo app("kvcached", 1, "kvcached", 1, VK_API_VERSION_1_2);
  vk::InstanceCreateInfo instance_info({}, &app, layers, extensions);
  // Chained into the create info, the messenger also reports on vkCreateInstance
  // and vkDestroyInstance themselves.
  const vk::DebugUtilsMessengerCreateInfoEXT messenger_info = MessengerInfo(validation_.get());
  if (validation_) instance_info.pNext = &messenger_info;
  instance_ = std::make_unique<vk::raii::Instance>(*context_, instance_info);
  if (validation_) {
    messenger_ = std::make_unique<vk::raii::DebugUtilsMessengerEXT>(*instance_, messenger_info);
  }
  return absl::OkStatus();
}

absl::Status Device::PickPhysicalDevice() {
  vk::raii::PhysicalDevices physical_devices(*instance_);
  const std::vector<DeviceDescription> descriptions = Describe(physical_devices);
  ASSIGN_OR_RETURN(const uint32_t index, SelectDevice(descriptions, options_.selector));
  description_ = descriptions[index];
  if (description_.api_version < VK_API_VERSION_1_2) {
    return absl::FailedPreconditionError(
        absl::StrCat("Vulkan device \"", description_.name, "\" supports Vulkan ",
                     VersionString(description_.api_version), "; kvcached needs 1.2 or later"));
  }
  physical_device_ = std::make_unique<vk::raii::PhysicalDevice>(std::move(physical_devices[index]));
  max_storage_buffer_range_ = physical_device_->getProperties().limits.maxStorageBufferRange;
  const vk::PhysicalDeviceMemoryProperties memory = physical_device_->getMemoryProperties();
  const uint32_t mappable =
      options_.force_staging ? 0 : HostMappablePageTypes(memory, /*cached=*/false);
  const uint32_t readable =
      options_.force_staging || options_.stage_reads ? 0 : HostMappablePageTypes(memory, true);
  direct_host_access_ = readable != 0;
  mapped_writes_ = mappable != 0 && !direct_host_access_;
  host_mapped_page_types_ = direct_host_access_ ? readable : mapped_writes_ ? mappable : 0;
  return absl::OkStatus();
}

// One queue from the first family with compute; every compute queue also
// accepts transfer commands (the spec makes the transfer bit implicit there).
absl::Status Device::InitLogicalDevice() {
  const std::vector<vk::QueueFamilyProperties> families =
      physical_device_->getQueueFamilyProperties();
  uint32_t family = 0;
  while (family < families.size() && !(families[family].queueFlags & vk::QueueFlagBits::eCompute)) {
    ++family;
  }
  if (family == families.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("Vulkan device \"", description_.name, "\" has no compute queue"));
  }
  const float priority = 1.0f;
  const vk::DeviceQueueCreateInfo queue_info({}, family, 1, &priority);
  device_ =
      std::make_unique<vk::raii::Device>(*physical_device_, vk::DeviceCreateInfo({}, queue_info));
  queue_ = std::make_unique<vk::raii::Queue>(*device_, family, 0);
  queue_family_ = family;
  return absl::OkStatus();
}

Device::~Device() {
  if (device_ == nullptr) return;
  try {
    device_->waitIdle();  // Destruction is the one place a whole-device wait is right.
  } catch (const vk::SystemError& error) {
    LogError("vkDeviceWaitIdle while destroying the device: %s", error.what());
  }
}

uint64_t Device::validation_message_count() const {
  return validation_ ? validation_->count.load(std::memory_order_relaxed) : 0;
}

std::vector<std::string> Device::validation_messages() const {
  if (!validation_) return {};
  absl::MutexLock lock(&validation_->mutex);
  return validation_->messages;
}

absl::StatusOr<uint32_t> Device::FindMemoryType(uint32_t type_bits,
                                                vk::MemoryPropertyFlags required,
                                                vk::MemoryPropertyFlags preferred) const {
  const vk::PhysicalDeviceMemoryProperties memory = physical_device_->getMemoryProperties();
  std::optional<uint32_t> fallback;
  for (uint32_t i = 0; i < memory.memoryTypeCount; ++i) {
    const vk::MemoryPropertyFlags flags = memory.memoryTypes[i].propertyFlags;
    if (!(type_bits & (1u << i)) || (flags & required) != required) continue;
    if ((flags & preferred) == preferred) return i;
    if (!fallback) fallback = i;
  }
  if (fallback) return *fallback;
  return absl::FailedPreconditionError(
      absl::StrCat("Vulkan device \"", description_.name, "\" has no memory type with ",
                   vk::to_string(required), " among types 0x", absl::Hex(type_bits)));
}

absl::Status VkStatus(vk::Result result, std::string_view what) {
  if (result == vk::Result::eSuccess) return absl::OkStatus();
  const std::string message = absl::StrFormat("%s: %s", what, vk::to_string(result));
  if (result == vk::Result::eErrorOutOfHostMemory ||
      result == vk::Result::eErrorOutOfDeviceMemory) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

}  // namespace kvcache::gpu
