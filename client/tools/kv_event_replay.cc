#include "tools/kv_event_replay.h"

#include <array>
#include <iterator>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvcache {
namespace {

uint64_t FromBigEndian(const zmq::message_t& frame) {
  uint64_t value = 0;
  for (size_t i = 0; i < frame.size(); ++i) value = value << 8 | frame.data<uint8_t>()[i];
  return value;
}

std::string Hex(const nlohmann::json& hash) {
  return hash.is_number_unsigned() ? absl::StrCat(absl::Hex(hash.get<uint64_t>())) : hash.dump();
}

// vLLM's map form names fields; its older array form places them.
const nlohmann::json& Field(const nlohmann::json& event, const char* name, size_t place) {
  static const nlohmann::json kNull;
  if (event.is_object()) return event.contains(name) ? event.at(name) : kNull;
  return event.is_array() && place < event.size() ? event.at(place) : kNull;
}

std::string Summary(uint64_t sequence, const nlohmann::json& event) {
  const nlohmann::json& type = Field(event, "type", 0);
  std::string line =
      absl::StrCat("#", sequence, " ", type.is_string() ? type.get<std::string>() : "?");
  const nlohmann::json& hashes = Field(event, "block_hashes", 1);
  if (!hashes.is_array()) return line;
  absl::StrAppend(&line, " blocks=", hashes.size());
  if (const nlohmann::json& tokens = Field(event, "token_ids", 3); tokens.is_array()) {
    const nlohmann::json& parent = Field(event, "parent_block_hash", 2);
    absl::StrAppend(&line, " tokens=", tokens.size(),
                    " parent=", parent.is_null() ? "none" : Hex(parent));
  }
  if (!hashes.empty()) {
    absl::StrAppend(&line, " hashes=", Hex(hashes.front()),
                    hashes.size() > 1 ? absl::StrCat("..", Hex(hashes.back())) : "");
  }
  return line;
}

}  // namespace

absl::StatusOr<std::vector<KvEventBatch>> ReplayKvEvents(const std::string& endpoint, uint64_t from,
                                                         absl::Duration timeout,
                                                         const KvEventCurve& curve) {
  std::vector<KvEventBatch> batches;
  try {
    zmq::context_t context;
    // A DEALER reads every batch of the answer; a REQ socket reads one.
    zmq::socket_t request(context, zmq::socket_type::dealer);
    request.set(zmq::sockopt::linger, 0);
    request.set(zmq::sockopt::rcvtimeo, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
    if (!curve.server_key.empty()) {
      request.set(zmq::sockopt::curve_serverkey, curve.server_key);
      request.set(zmq::sockopt::curve_publickey, curve.public_key);
      request.set(zmq::sockopt::curve_secretkey, curve.secret_key);
    }
    request.connect(endpoint);
    std::string start(8, '\0');
    for (int i = 7; i >= 0; --i, from >>= 8) start[i] = static_cast<char>(from & 0xff);
    const std::array<zmq::const_buffer, 2> ask = {zmq::const_buffer(), zmq::buffer(start)};
    (void)zmq::send_multipart(request, ask);
    while (true) {
      std::vector<zmq::message_t> frames;  // "", sequence, payload
      if (!zmq::recv_multipart(request, std::back_inserter(frames))) {
        return absl::UnavailableError(absl::StrCat("kv_events_replay: no answer from ", endpoint,
                                                   " in ", absl::FormatDuration(timeout)));
      }
      if (frames.size() != 3) {
        return absl::InvalidArgumentError("kv_events_replay: an answer not of 3 frames");
      }
      if (frames[2].size() == 0) return batches;  // the end marker
      const nlohmann::json batch = nlohmann::json::from_msgpack(
          frames[2].data<uint8_t>(), frames[2].data<uint8_t>() + frames[2].size());
      KvEventBatch decoded{.sequence = FromBigEndian(frames[1]), .json = batch.dump()};
      if (batch.is_array() && batch.size() >= 2 && batch[1].is_array()) {
        for (const nlohmann::json& event : batch[1]) {
          decoded.summary.push_back(Summary(decoded.sequence, event));
        }
      }
      batches.push_back(std::move(decoded));
    }
  } catch (const zmq::error_t& error) {
    return absl::UnavailableError(absl::StrCat("kv_events_replay: ", endpoint, ": ", error.what()));
  } catch (const nlohmann::json::exception& error) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_events_replay: not msgpack: ", error.what()));
  }
}

}  // namespace kvcache
