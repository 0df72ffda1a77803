// Holding a hand-written codec's declared fields against the schema: the
// codec lists, per message, the field numbers it reads or writes itself and
// those it deliberately leaves to protobuf; any other field of the schema
// (one added since the codec was written) makes these checks fail.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include "absl/types/span.h"

namespace kvcache::testing {

// Field numbers by message full name ("kvcache.v1.Tensor").
using FieldsByMessage = std::map<std::string, std::vector<int>>;

// Every field of `root` and, recursively, of the message types of the fields
// in `handled`, that neither `handled` nor `left_to_protobuf` names; every
// number they name that the schema lacks; and every message reached whose
// fields `handled` does not list. One line per finding; empty when the lists
// match the schema.
std::vector<std::string> UndeclaredFields(const google::protobuf::Descriptor& root,
                                          const FieldsByMessage& handled,
                                          const FieldsByMessage& left_to_protobuf = {});

// `message` with every field that `handled` lists for it (recursively into
// message fields) set to a value other than its default: scalars non-zero,
// strings and bytes non-empty, repeated fields two long, enums their last value.
void FillHandledFields(const FieldsByMessage& handled, google::protobuf::Message& message);

// The listed fields of `message` (recursively) that are not set or hold their
// default value; one line per field, empty when all are.
std::vector<std::string> UnsetHandledFields(const FieldsByMessage& handled,
                                            const google::protobuf::Message& message);

// Every field of `root` and, recursively, of the messages in it: for filling
// a message whole (fields added to the schema later included).
FieldsByMessage AllFields(const google::protobuf::Descriptor& root);

// `fields` as a vector, for building a FieldsByMessage from a codec's arrays.
inline std::vector<int> Numbers(absl::Span<const int> fields) {
  return {fields.begin(), fields.end()};
}

}  // namespace kvcache::testing
