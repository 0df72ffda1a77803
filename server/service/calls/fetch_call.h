// One Fetch call, whichever transport carries it: the plan (the cache's
// state, frozen, and the chunks cut from it), each chunk in the form its
// transport frames, and the final status. The gRPC reactor and the data lane
// only move the bytes; every rule about the call lives here.
//
// The transport pulls:
//
//   FetchCall call(handlers, request);
//   while (call.has_next()) {
//     if (!call.next_is_tokens())        -> FillNext(message)   (packed, state)
//     else if (call.MappedNext(pieces))  -> NextFraming() + pieces of mapped pages
//     else                               -> ReadNext(buffer of NextFraming().size())
//   }
//   status = call.Finish(why_the_transport_stopped);   // pages let go first
//
// A chunk of keys and values is protobuf's encoding of a FetchResponse (its
// framing, FetchChunkFraming, around the tensors' data), so a transport can
// send it from the pages it lies in, or have it read into a buffer of its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"
#include "service/handlers.h"
#include "service/tenants.h"

namespace kvcache::service {

// A FetchResponse of keys and values as protobuf encodes it, every byte but
// the tensors' data, which go where protobuf would put them: `header` (every
// field but the data) in protobuf's field order, with room for the data.
class FetchChunkFraming {
 public:
  FetchChunkFraming(const v1::FetchResponse& header, uint64_t key_bytes, uint64_t value_bytes);

  size_t size() const { return size_; }
  size_t keys_offset() const { return keys_offset_; }
  size_t values_offset() const { return values_offset_; }
  uint64_t key_bytes() const { return key_bytes_; }
  uint64_t value_bytes() const { return value_bytes_; }
  // Writes the framing into out[0, size()), leaving the data's bytes as they are.
  void Write(uint8_t* out) const;
  // The framing before the keys' data, and between the keys' and the values'.
  absl::Span<const std::byte> head() const { return AsBytes(head_); }
  absl::Span<const std::byte> middle() const { return AsBytes(middle_); }

 private:
  static absl::Span<const std::byte> AsBytes(const std::string& s) {
    return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
  }

  uint64_t key_bytes_;
  uint64_t value_bytes_;
  std::string head_;    // the scalars, then the keys' field prefix and Tensor header
  std::string middle_;  // the values' field prefix and Tensor header
  size_t keys_offset_ = 0;
  size_t values_offset_ = 0;
  size_t size_ = 0;
};

class FetchCall {
 public:
  // Plans `request`. One that cannot be planned, or did not parse (an
  // error in place of the request), makes a call with no chunks whose
  // Finish says why. `caller`: the admission the call runs under, asked
  // before planning and before each chunk whether its token still holds
  // (null: nothing to ask); it must outlive the call.
  FetchCall(Handlers& handlers, const absl::StatusOr<v1::FetchRequest>& request,
            const Admitted* caller = nullptr);
  FetchCall(const FetchCall&) = delete;
  FetchCall& operator=(const FetchCall&) = delete;

  // Whether a chunk is left to send: none once one failed or Finish ran,
  // nor once the caller's token was revoked (the call then ends
  // UNAUTHENTICATED: a chunk's bytes never go to a revoked caller).
  bool has_next();
  // Whether the next chunk is keys and values (NextFraming, MappedNext,
  // ReadNext), else a message of its own (FillNext).
  bool next_is_tokens() const;
  // The bytes of all the chunks' encodings, each with `framing_bytes` of the
  // transport's own added, where every chunk is keys and values (whose sizes
  // are known before their data is read); nullopt otherwise.
  std::optional<uint64_t> TokenChunksBytes(uint64_t framing_bytes);
  // The next chunk's framing (keys and values only); valid until Finish.
  const FetchChunkFraming& NextFraming();
  // Where the next chunk's data lies in pages, valid until Finish, and moves
  // past it; false, staying, where the data must be read (ReadNext).
  bool MappedNext(engine::KvMappedPieces& out);
  // Writes the next chunk's encoding, framing and data, into `out`
  // (NextFraming().size() bytes) and moves past it. A failure ends the call.
  absl::Status ReadNext(absl::Span<std::byte> out);
  // The next chunk as a message (any form) and moves past it. A failure ends
  // the call.
  absl::Status FillNext(v1::FetchResponse& out);

  // Ends the call and returns its status: the failure that ended it, else
  // `transport` (OK, or why the transport stopped sending). The plan's page
  // references are let go BEFORE the status is returned: a client that frees
  // the cache on seeing the status must find every page back in the pool.
  absl::Status Finish(const absl::Status& transport = absl::OkStatus());

 private:
  const FetchChunkFraming& FramingAt(size_t index);
  // Records the first failure; the call sends nothing after it.
  absl::Status Fail(absl::Status status);

  // Whether a chunk is left, asking no one.
  bool pending() const { return status_.ok() && next_ < plan_.chunks.size(); }

  Handlers& handlers_;
  const Admitted* caller_;
  FetchPlan plan_;
  size_t next_ = 0;
  // Framings of the chunks, made once each when first asked for.
  std::vector<std::optional<FetchChunkFraming>> framings_;
  absl::Status status_;
};

}  // namespace kvcache::service
