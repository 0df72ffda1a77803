// Device listing and selection, memory types, and the status mapping.
#include "gpu/device.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "gmock/gmock.h"
#include "gpu/device_selection.h"
#include "gtest/gtest.h"
#include "support/gpu_test_base.h"

namespace kvcache::gpu {
namespace {

using ::testing::HasSubstr;
using testing::TransferPath;

DeviceDescription Fake(uint32_t index, std::string name, std::string type,
                       uint32_t api_version = VK_API_VERSION_1_3) {
  return {index, std::move(name), std::move(type), api_version};
}

const std::vector<DeviceDescription> kFakeDevices = {
    Fake(0, "llvmpipe (LLVM 15.0.6, 256 bits)", "cpu"),
    Fake(1, "Intel(R) UHD Graphics 630", "integrated"),
    Fake(2, "NVIDIA GeForce RTX 4090", "discrete"),
    Fake(3, "Old Discrete", "discrete", VK_API_VERSION_1_1),
};

TEST(SelectDeviceTest, EmptySelectorPrefersDiscreteThenIntegratedThenCpu) {
  EXPECT_EQ(SelectDevice(kFakeDevices, "").value(), 2u);
  EXPECT_EQ(SelectDevice({kFakeDevices[0], kFakeDevices[1]}, "").value(), 1u);
  EXPECT_EQ(SelectDevice({kFakeDevices[0]}, "").value(), 0u);
  EXPECT_EQ(SelectDevice({Fake(0, "a", "other"), Fake(1, "b", "virtual")}, "").value(), 1u);
}

TEST(SelectDeviceTest, EmptySelectorSkipsDevicesOlderThanVulkan12) {
  EXPECT_EQ(SelectDevice({kFakeDevices[3], kFakeDevices[0]}, "").value(), 1u);
}

TEST(SelectDeviceTest, DigitsPickByIndex) {
  EXPECT_EQ(SelectDevice(kFakeDevices, "0").value(), 0u);
  EXPECT_EQ(SelectDevice(kFakeDevices, "3").value(), 3u);
  EXPECT_EQ(SelectDevice(kFakeDevices, "4").status().code(), absl::StatusCode::kNotFound);
}

TEST(SelectDeviceTest, OtherSelectorsMatchNameSubstringIgnoringCase) {
  EXPECT_EQ(SelectDevice(kFakeDevices, "rtx").value(), 2u);
  EXPECT_EQ(SelectDevice(kFakeDevices, "LLVMPIPE").value(), 0u);
  const absl::Status missing = SelectDevice(kFakeDevices, "radeon").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("radeon"));
}

TEST(DeviceTest, ListFindsLavapipe) {
  const auto devices = Device::List();
  ASSERT_TRUE(devices.ok()) << devices.status();
  ASSERT_FALSE(devices->empty());
  bool found_cpu = false;
  for (const DeviceDescription& device : *devices) found_cpu |= device.type == "cpu";
  // The setup installs lavapipe; a GPU machine that runs carried test binaries
  // may have only its GPU's driver.
  if (!found_cpu && devices->front().type != "cpu") {
    GTEST_SKIP() << "no lavapipe here, only " << devices->front().name;
  }
  EXPECT_TRUE(found_cpu) << "lavapipe (mesa-vulkan-drivers) should be installed";
}

absl::StatusOr<std::unique_ptr<Device>> CreateWithSelector(std::string selector) {
  DeviceOptions options;
  options.selector = std::move(selector);
  return Device::Create(options);
}

TEST(DeviceTest, CreatesBySelectorKinds) {
  const auto devices = Device::List();
  ASSERT_TRUE(devices.ok()) << devices.status();
  auto automatic = CreateWithSelector("");
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  EXPECT_EQ((*automatic)->description().index, SelectDevice(*devices, "").value());
  auto by_index = CreateWithSelector("0");
  ASSERT_TRUE(by_index.ok()) << by_index.status();
  EXPECT_EQ((*by_index)->description().name, (*devices)[0].name);
  // By a part of the last device's name in other case (lavapipe's "llvmpipe
  // (LLVM ...)" here, a GPU's name on a GPU machine).
  const DeviceDescription& last = devices->back();
  const std::string part = absl::AsciiStrToUpper(last.name.substr(0, 6));
  auto by_name = CreateWithSelector(part);
  ASSERT_TRUE(by_name.ok()) << by_name.status();
  EXPECT_EQ((*by_name)->description().index, SelectDevice(*devices, part).value());
  EXPECT_THAT(absl::AsciiStrToUpper((*by_name)->description().name), HasSubstr(part));
  EXPECT_GE((*by_name)->description().api_version, VK_API_VERSION_1_2);
}

TEST(DeviceTest, UnknownSelectorIsNotFoundNamingIt) {
  const auto device = CreateWithSelector("no-such-gpu-anywhere");
  EXPECT_EQ(device.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(device.status().message(), HasSubstr("no-such-gpu-anywhere"));
  EXPECT_EQ(CreateWithSelector("999").status().code(), absl::StatusCode::kNotFound);
}

TEST(DeviceTest, TestDevicesTakeTheirTransferPaths) {
  Device& direct = testing::TestDevice(TransferPath::kDirect);
  if (direct.description().type == "cpu") {
    EXPECT_TRUE(direct.direct_host_access());
  }
  EXPECT_FALSE(testing::TestDevice(TransferPath::kStagingRegions).direct_host_access());
  Device& shader = testing::TestDevice(TransferPath::kStagingShader);
  EXPECT_FALSE(shader.direct_host_access());
  EXPECT_EQ(shader.options().copy_engine, CopyEngine::kComputeShader);
  EXPECT_TRUE(shader.options().enable_validation);
  EXPECT_GE(shader.max_storage_buffer_range(), uint64_t{1} << 27);
  Device& mapped_writes = testing::TestDevice(TransferPath::kMappedWrites);
  EXPECT_FALSE(mapped_writes.direct_host_access());
  if (direct.direct_host_access() || mapped_writes.mapped_writes()) {
    EXPECT_TRUE(mapped_writes.mapped_writes());
    EXPECT_STREQ(mapped_writes.transfer_path_name(), "mapped writes");
  }
  EXPECT_STREQ(shader.transfer_path_name(), "staging");
}

TEST(DeviceTest, FindsMemoryTypes) {
  const Device& device = testing::TestDevice(TransferPath::kDirect);
  const auto host = device.FindMemoryType(~0u, vk::MemoryPropertyFlagBits::eHostVisible,
                                          vk::MemoryPropertyFlagBits::eHostCached);
  EXPECT_TRUE(host.ok()) << host.status();
  const auto none = device.FindMemoryType(0u, vk::MemoryPropertyFlagBits::eDeviceLocal, {});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
}

using Flag = vk::MemoryPropertyFlagBits;
constexpr vk::MemoryPropertyFlags kBar =
    Flag::eDeviceLocal | Flag::eHostVisible | Flag::eHostCoherent;
constexpr vk::DeviceSize kGiB = vk::DeviceSize{1} << 30;

// A memory table of `heaps` (size, device-local) and `types` (flags, heap).
vk::PhysicalDeviceMemoryProperties MemoryTable(
    std::vector<std::pair<vk::DeviceSize, bool>> heaps,
    std::vector<std::pair<vk::MemoryPropertyFlags, uint32_t>> types) {
  vk::PhysicalDeviceMemoryProperties memory;
  memory.memoryHeapCount = heaps.size();
  for (size_t i = 0; i < heaps.size(); ++i) {
    memory.memoryHeaps[i].size = heaps[i].first;
    if (heaps[i].second) memory.memoryHeaps[i].flags = vk::MemoryHeapFlagBits::eDeviceLocal;
  }
  memory.memoryTypeCount = types.size();
  for (size_t i = 0; i < types.size(); ++i) {
    memory.memoryTypes[i] = vk::MemoryType(types[i].first, types[i].second);
  }
  return memory;
}

// Shaped as an H200 with resizable BAR reports it: device-local, host types,
// then the BAR type on the large heap. Pages map only there, uncached.
TEST(HostMappablePageTypesTest, ResizableBarIsMappedForWritesOnly) {
  const auto memory =
      MemoryTable({{140 * kGiB, true}, {128 * kGiB, false}},
                  {{Flag::eDeviceLocal, 0},
                   {Flag::eHostVisible | Flag::eHostCoherent, 1},
                   {Flag::eHostVisible | Flag::eHostCoherent | Flag::eHostCached, 1},
                   {kBar, 0}});
  EXPECT_EQ(HostMappablePageTypes(memory, /*cached=*/false), 1u << 3);
  EXPECT_EQ(HostMappablePageTypes(memory, /*cached=*/true), 0u);
}

// A discrete GPU without resizable BAR shows its BAR as a 256 MiB heap, and
// may list that type first: pages never map there.
TEST(HostMappablePageTypesTest, SmallBarWindowIsNeverUsed) {
  const auto memory = MemoryTable(
      {{256 << 20, true}, {24 * kGiB, true}, {64 * kGiB, false}},
      {{kBar, 0}, {Flag::eDeviceLocal, 1}, {Flag::eHostVisible | Flag::eHostCoherent, 2}});
  EXPECT_EQ(HostMappablePageTypes(memory, /*cached=*/false), 0u);
  EXPECT_EQ(HostMappablePageTypes(memory, /*cached=*/true), 0u);
}

// The case the mask is for: a 256 MiB BAR type listed before the large BAR
// of the same GPU. Only the large one may hold pages.
TEST(HostMappablePageTypesTest, ASmallBarListedFirstIsPassedOver) {
  const auto memory = MemoryTable({{256 << 20, true}, {80 * kGiB, true}, {64 * kGiB, false}},
                                  {{kBar, 0},
                                   {Flag::eDeviceLocal, 1},
                                   {Flag::eHostVisible | Flag::eHostCoherent, 2},
                                   {kBar, 1}});
  EXPECT_EQ(HostMappablePageTypes(memory, /*cached=*/false), 1u << 3);
}

// Unified memory (lavapipe, integrated GPUs): every cached type on the one
// heap qualifies, for reads and for writes.
TEST(HostMappablePageTypesTest, UnifiedMemoryIsMappedBothWays) {
  const auto memory = MemoryTable(
      {{16 * kGiB, true}}, {{Flag::eDeviceLocal, 0}, {kBar, 0}, {kBar | Flag::eHostCached, 0}});
  EXPECT_EQ(HostMappablePageTypes(memory, /*cached=*/false), (1u << 1) | (1u << 2));
  EXPECT_EQ(HostMappablePageTypes(memory, /*cached=*/true), 1u << 2);
}

// The test devices keep to the types their transfer path was chosen by.
TEST(DeviceTest, HostMappedPagesUseOnlyTheChosenTypes) {
  for (TransferPath path : testing::kAllTransferPaths) {
    const Device& device = testing::TestDevice(path);
    const vk::PhysicalDeviceMemoryProperties memory =
        device.physical_device().getMemoryProperties();
    const uint32_t chosen = device.host_mapped_page_types();
    SCOPED_TRACE(device.transfer_path_name());
    if (device.direct_host_access()) {
      EXPECT_EQ(chosen, HostMappablePageTypes(memory, true));
    } else if (device.mapped_writes()) {
      EXPECT_EQ(chosen, HostMappablePageTypes(memory, false));
    } else {
      EXPECT_EQ(chosen, 0u);
    }
  }
}

// The layer must be live, or "no validation messages" would prove nothing.
TEST(DeviceTest, RecordsValidationMessages) {
  DeviceOptions options;
  options.enable_validation = true;
  auto device = Device::Create(options);
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ((*device)->validation_message_count(), 0u);
  // Usage 0 breaks VUID-VkBufferCreateInfo-usage-requiredbitmask; drivers cope.
  vk::raii::Buffer buffer((*device)->device(), vk::BufferCreateInfo({}, 64, {}));
  EXPECT_GE((*device)->validation_message_count(), 1u);
  ASSERT_FALSE((*device)->validation_messages().empty());
  EXPECT_THAT((*device)->validation_messages()[0], HasSubstr("usage"));
}

TEST(VkStatusTest, MapsResults) {
  EXPECT_TRUE(VkStatus(vk::Result::eSuccess, "x").ok());
  EXPECT_EQ(VkStatus(vk::Result::eErrorOutOfDeviceMemory, "x").code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(VkStatus(vk::Result::eErrorOutOfHostMemory, "x").code(),
            absl::StatusCode::kResourceExhausted);
  const absl::Status lost = VkStatus(vk::Result::eErrorDeviceLost, "submit copies");
  EXPECT_EQ(lost.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(lost.message(), HasSubstr("submit copies"));
}

TEST(VkStatusTest, VkTryTurnsExceptionsIntoStatuses) {
  const absl::Status status =
      VkTry("allocate", []() -> absl::Status { throw vk::OutOfDeviceMemoryError("test"); });
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("allocate"));
}

}  // namespace
}  // namespace kvcache::gpu
