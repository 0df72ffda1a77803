// Client input inside status messages and logs. A status echoes what the
// caller sent so that they can see which id or name was wrong, but never
// more than a short prefix of it: a 200 KB id copied whole into a status
// would pass gRPC's metadata limit (the caller then sees RESOURCE_EXHAUSTED
// instead of the real answer), and bytes that are not text would garble it.
#pragma once

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace kvcache {

// The most bytes of an id the service accepts. Ids the server makes are 32
// hex digits; the rest leaves room for a prefix naming the replica.
inline constexpr size_t kMaxIdBytes = 128;
// The most bytes of client input a status message quotes.
inline constexpr size_t kMaxQuotedBytes = 64;

// `input` in double quotes, C-escaped, cut after kMaxQuotedBytes input bytes
// with the length that was cut: "abc…" (10240 bytes).
std::string Quoted(absl::string_view input);

}  // namespace kvcache
