// A router's view of a replica's KV events (kvcached --kv_events_replay_endpoint):
// the batches the replica still buffers, asked for as vLLM's subscribers ask
// (the first sequence wanted, 8 bytes big-endian; the answer is a [sequence,
// payload] message per batch, then [-1, empty]), from a DEALER socket.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvcache {

struct KvEventBatch {
  uint64_t sequence = 0;
  std::string json;  // the msgpack payload as JSON: [ts, [event...], rank]
  // A line per event: "#SEQ TYPE blocks=N tokens=M parent=HASH|none
  // hashes=FIRST..LAST" (hashes in hex), for either of vLLM's forms.
  std::vector<std::string> summary;
};

// A replica whose KV event sockets speak CURVE (kvcached
// --kv_events_curve_key_file): its public key, and this subscriber's pair,
// whose public key the replica lists. All Z85; empty server_key: plaintext.
struct KvEventCurve {
  std::string server_key;
  std::string public_key;
  std::string secret_key;
};

// UNAVAILABLE when no answer comes within `timeout` (also what a replica
// that does not admit this subscriber's key looks like); INVALID_ARGUMENT
// for a malformed answer.
absl::StatusOr<std::vector<KvEventBatch>> ReplayKvEvents(const std::string& endpoint, uint64_t from,
                                                         absl::Duration timeout,
                                                         const KvEventCurve& curve = {});

}  // namespace kvcache
