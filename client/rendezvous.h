// Rendezvous (highest random weight) hashing: every key ranks all replicas,
// and its owner is the first of its ranking that is up. Removing a replica
// moves only the keys it owned, adding one takes about 1/n of the keys, and
// clients agree on the ranking without talking to each other, since it is a
// function of the key and the replicas' names alone (not their addresses,
// which change when a pod moves).
//
// The score of (key, replica) is XXH3-64 of the key, seeded with XXH3-64 of
// the replica's name; both are fixed by xxHash's specification, so a client
// in another language ranks the same way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvcache {

uint64_t RendezvousScore(absl::string_view key, absl::string_view replica_name);

// Indexes into `replica_names`, highest score first (ties: lower index first).
std::vector<size_t> RendezvousOrder(absl::string_view key,
                                    absl::Span<const std::string> replica_names);

}  // namespace kvcache
