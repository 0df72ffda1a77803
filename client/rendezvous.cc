#include "rendezvous.h"

#include <xxhash.h>

#include <algorithm>
#include <numeric>

namespace kvcache {

uint64_t RendezvousScore(absl::string_view key, absl::string_view replica_name) {
  const uint64_t seed = XXH3_64bits(replica_name.data(), replica_name.size());
  return XXH3_64bits_withSeed(key.data(), key.size(), seed);
}

std::vector<size_t> RendezvousOrder(absl::string_view key,
                                    absl::Span<const std::string> replica_names) {
  std::vector<uint64_t> scores(replica_names.size());
  for (size_t i = 0; i < replica_names.size(); ++i) {
    scores[i] = RendezvousScore(key, replica_names[i]);
  }
  std::vector<size_t> order(replica_names.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return scores[a] > scores[b]; });
  return order;
}

}  // namespace kvcache
