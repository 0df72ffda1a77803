// The client's FetchResponse fast path against protobuf's: whatever chunk it
// takes, protobuf must take too, with the same header fields and the keys'
// and values' bytes where the views point.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "fetch_view.h"
#include "google/protobuf/util/message_differencer.h"
#include "kvcache/v1/kvcache.pb.h"

namespace {

bool SameBytes(absl::Span<const std::byte> view, const std::string& bytes) {
  return view.size() == bytes.size() &&
         (bytes.empty() || std::memcmp(view.data(), bytes.data(), bytes.size()) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::Span<const std::byte> payload(reinterpret_cast<const std::byte*>(data), size);
  kvcache::v1::FetchResponse header;
  absl::Span<const std::byte> keys;
  absl::Span<const std::byte> values;
  if (!kvcache::internal::ParseTokenChunk(payload, header, keys, values)) return 0;
  kvcache::v1::FetchResponse expected;
  if (!expected.ParseFromArray(data, static_cast<int>(size))) std::abort();
  if (!SameBytes(keys, expected.keys().data()) || !SameBytes(values, expected.values().data())) {
    std::abort();
  }
  if (expected.has_keys()) expected.mutable_keys()->clear_data();
  if (expected.has_values()) expected.mutable_values()->clear_data();
  if (!google::protobuf::util::MessageDifferencer::Equals(expected, header)) std::abort();
  return 0;
}
