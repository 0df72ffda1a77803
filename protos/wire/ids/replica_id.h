// Ids that name their owner: where kvcached runs as one replica of a fleet
// (kvcached --replica_name), every cache, snapshot and speculation id it makes
// is "<replica name>:<32 hex digits>", so a client of many replicas sends
// each call straight to the replica that holds what it names, with no lookup
// (client/sharded_client.h). Part of the wire contract, so shared by the
// server, which makes the ids, and the client, which reads them.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvcache::ids {

inline constexpr char kReplicaSeparator = ':';
// A DNS label's length: a StatefulSet pod's name is the usual replica name.
inline constexpr size_t kMaxReplicaNameBytes = 63;

// OK if `name` can name a replica: 1 to 63 letters, digits, '-', '_' or '.'
// (never the separator, so an id splits one way only). `field` names the
// flag or option in the status.
inline absl::Status CheckReplicaName(absl::string_view name, absl::string_view field) {
  if (name.empty() || name.size() > kMaxReplicaNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": a replica name has 1 to ", kMaxReplicaNameBytes, " characters, not ",
        name.size()));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": a replica name has only letters, digits, '-', '_' and '.'"));
    }
  }
  return absl::OkStatus();
}

// What ids made by replica `name` begin with.
inline std::string IdPrefix(absl::string_view name) {
  return absl::StrCat(name, absl::string_view(&kReplicaSeparator, 1));
}

// The replica an id names: the text before its last separator; "" when it
// has none (an id of a server run without a replica name).
inline absl::string_view ReplicaOf(absl::string_view id) {
  const size_t separator = id.rfind(kReplicaSeparator);
  return separator == absl::string_view::npos ? absl::string_view() : id.substr(0, separator);
}

}  // namespace kvcache::ids
