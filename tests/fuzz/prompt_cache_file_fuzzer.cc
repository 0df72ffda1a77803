// The prompt-cache file container (safetensors as mlx-lm writes it) as
// LoadSnapshot and ImportSnapshot meet it: any bytes are decoded with every
// structural check and the checksum when present. What decodes must also
// pass the upload check, decode the same in place, and survive being written
// again: the new file decodes to the same tensors and metadata.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/string_view.h"
#include "engine/files/safetensors.h"

namespace {

using kvcache::engine::PromptCacheFile;

bool SameFile(const PromptCacheFile& a, const PromptCacheFile& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (auto left = a.tensors.begin(), right = b.tensors.begin(); left != a.tensors.end();
       ++left, ++right) {
    const auto& [name, tensor] = *left;
    if (name != right->first || tensor.dtype != right->second.dtype ||
        tensor.shape != right->second.shape || tensor.data.size() != right->second.data.size() ||
        (tensor.data.size() > 0 &&
         std::memcmp(tensor.data.data(), right->second.data.data(), tensor.data.size()) != 0)) {
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto decoded = kvcache::engine::DecodeSafetensors(bytes);
  auto verified = kvcache::engine::VerifySafetensors(bytes);
  if (decoded.ok() != verified.ok()) std::abort();
  if (!decoded.ok()) return 0;
  auto in_place = kvcache::engine::DecodeSafetensorsInPlace(bytes, nullptr);
  if (!in_place.ok() || !SameFile(decoded->file, in_place->file)) std::abort();
  auto again = kvcache::engine::EncodeSafetensorsBytes(decoded->file);
  if (!again.ok()) return 0;  // e.g. a tensor without elements, which writes refuse
  auto reread = kvcache::engine::DecodeSafetensors(*again);
  if (!reread.ok() || !reread->checksum_verified || !SameFile(decoded->file, reread->file)) {
    std::abort();
  }
  return 0;
}
