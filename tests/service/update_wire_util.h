// Builders for the UpdateRequest wire-parser tests: random requests, random
// (but valid) encodings of them that protobuf's serialiser never produces
// (fields reordered, shapes packed or not, unknown fields between or not), messages
// cut into pieces at random, and a view turned back into a message so it can
// be compared with protobuf's own parse.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"
#include "service/update_view.h"

namespace kvcache::testing {

// Wire-format pieces: a varint, a tag, whole fields.
std::string Varint(uint64_t value);
std::string WireTag(uint32_t field, int wire_type);
std::string VarintField(uint32_t field, uint64_t value);
std::string BytesField(uint32_t field, const std::string& body);

// A request with each field present or not at random, and random contents:
// ASCII cache ids, any layer, dtypes in and out of the enum, shapes of any
// rank and size, data of up to `max_data` bytes.
v1::UpdateRequest RandomUpdateRequest(std::mt19937_64& rng, uint64_t max_data = 3000);

// Whether RandomEncoding puts fields the schema lacks (up to two per
// message, of every skippable wire type) between the known ones.
enum class UnknownFields { kNone, kSome };

// An encoding of `request` that protobuf parses to `request`, drawn at
// random: fields in any order, scalars equal to 0 sometimes written out,
// shapes packed, unpacked or both.
std::string RandomEncoding(const v1::UpdateRequest& request, std::mt19937_64& rng,
                           UnknownFields unknown = UnknownFields::kNone);
// A field of `number` of a random skippable wire type.
std::string UnknownField(uint32_t number, std::mt19937_64& rng);

// `bytes` cut at up to `max_cuts` random places (pieces may be empty).
std::vector<std::string> RandomPieces(const std::string& bytes, std::mt19937_64& rng,
                                      int max_cuts = 40);
std::vector<absl::Span<const std::byte>> Spans(const std::vector<std::string>& pieces);

// The message `view` describes (tensors' data gathered).
v1::UpdateRequest Rebuild(const service::UpdateView& view);

// Empty if `actual` (a Rebuild) holds what protobuf parsed into `expected`,
// else a description of the differences. The presence of the state's tensors
// is not compared: a view has no such thing (an absent tensor reads as empty).
std::string Differences(v1::UpdateRequest expected, const v1::UpdateRequest& actual);

// Whether every piece of every tensor's data in `view` lies inside one of `pieces`.
bool PointsInto(const service::UpdateView& view, const std::vector<std::string>& pieces);

}  // namespace kvcache::testing
