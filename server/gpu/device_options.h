// What kvcached asks of its Vulkan device, and how it describes one: plain
// structs without Vulkan's headers, so that code above gpu/ (the engine, the
// server's configuration, tests) can name a device without parsing
// vulkan_raii.hpp, which costs seconds per translation unit.
#pragma once

#include <cstdint>
#include <string>

namespace kvcache::gpu {

class Device;  // gpu/device.h

// How the staging path moves bytes between staging memory and pages. Measured in
// bench/gpu_copy_bench; the faster one is the default (see device.cc): copy
// regions, several times faster than the shader on lavapipe.
enum class CopyEngine { kCopyRegions, kComputeShader };

struct DeviceOptions {
  // "" picks the best device: discrete GPU, then integrated, then virtual, then
  // CPU (lavapipe). Digits pick by index in enumeration order; anything else
  // picks the first device whose name contains it (case-insensitive).
  std::string selector;
  // Loads VK_LAYER_KHRONOS_validation and counts its messages (tests turn it on).
  bool enable_validation = false;
  // Where device memory is host-visible, pages are written straight through a
  // mapping. This forces the staging ring + transfer commands that discrete
  // GPUs need, so CI exercises that path on lavapipe too.
  bool force_staging = false;
  // Reads pages through the staging ring even where they are mapped with host
  // caching (writes still go through the mapping): what a resizable-BAR GPU
  // does, so CI exercises that path on lavapipe too.
  bool stage_reads = false;
  CopyEngine copy_engine = CopyEngine::kCopyRegions;
};

struct DeviceDescription {
  uint32_t index;
  std::string name;
  std::string type;  // "discrete", "integrated", "virtual", "cpu", "other"
  uint32_t api_version;
};

}  // namespace kvcache::gpu
