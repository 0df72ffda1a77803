// One handler per RPC: validate, call the engine, fill the response. No gRPC
// types beyond the generated messages, so they are tested without a network;
// the callback service (kv_cache_service.h) only moves messages and maps
// statuses.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "kvcache/v1/kvcache.pb.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/string_view.h"
#include "service/request_log.h"
#include "service/unary_rpcs.h"
#include "service/update_view.h"

namespace kvcache::service {

struct ServiceOptions {
  // A Fetch chunk aims at this many K+V bytes when the client sets no token cap.
  uint64_t fetch_chunk_bytes = 1 << 20;
  // The largest message either side may send; chunks stay below it.
  uint64_t max_message_bytes = 64 << 20;
  // Reported by GetStats.
  std::string device_name;
  std::string transfer_path;
  // host:port of the data lane (data_lane.h); empty when it is off.
  std::string data_lane_address;
  // kvcached --replica_name; empty when it has none.
  std::string replica_name;
  // How long and how many answers are kept for requests sent again with
  // their request_id (request_log.h).
  RequestLogLimits request_log;
};

// What a Fetch sends: the state it reads, frozen, and the chunks to cut from it.
struct FetchPlan {
  // What a chunk carries: keys and values, a quantized layer's stored form
  // (FetchRequest.packed), or a recurrent layer's state.
  enum class Form { kTokens, kPacked, kState };
  struct Chunk {
    uint32_t layer;
    engine::TokenRange range;
    Form form = Form::kTokens;
  };
  std::shared_ptr<const engine::CacheSnapshot> snapshot;
  std::vector<Chunk> chunks;
};

// The spec of the cache an Update stream last wrote to.
struct KnownSpec {
  uint64_t layout_id = 0;  // engine::Cache::layout_id() of `spec`; 0: none yet
  engine::CacheSpec spec;
};

class Handlers {
 public:
  Handlers(engine::Engine& engine, ServiceOptions options);

  const ServiceOptions& options() const { return options_; }

  // Every unary RPC's handler (unary_rpcs.h): handlers.cc, batch_handlers.cc
  // (batches), speculation_handlers.cc (speculative decoding),
  // file_handlers.cc (prompt-cache files).
#define KV_DECLARE_HANDLER(Name, Request, Response) \
  absl::Status Name(const v1::Request& request, v1::Response* response);
  KV_FOR_EACH_UNARY_RPC(KV_DECLARE_HANDLER)
#undef KV_DECLARE_HANDLER

  // Runs a unary RPC's handler. A request that carries a request_id is run
  // once: sent again with that id it gets the first run's answer
  // (request_log.h). Every unary call goes through here.
  template <typename Request, typename Response>
  absl::Status Answer(absl::Status (Handlers::*handler)(const Request&, Response*),
                      absl::string_view method, const Request& request, Response* response) {
    if constexpr (requires { request.request_id(); }) {
      if (!request.request_id().empty()) {
        Request without_id = request;
        without_id.clear_request_id();
        return AnswerOnce(method, request.request_id(), without_id, /*payload=*/{}, response,
                          [&] { return (this->*handler)(request, response); });
      }
    }
    return (this->*handler)(request, response);
  }
  // Answer's half for a request with a request_id; `without_id` is the
  // request with its id cleared, and `payload` what else belongs to it (an
  // ImportSnapshot stream's file), to tell a retry from another request.
  absl::Status AnswerOnce(absl::string_view method, const std::string& request_id,
                          const google::protobuf::Message& without_id, absl::string_view payload,
                          google::protobuf::Message* response, absl::FunctionRef<absl::Status()> run);
  // AnswerOnce's two halves, for a call answered later than its handler
  // returns (PullSnapshot's reactor): the earlier answer to send again, or
  // nullopt to run the call and then FinishOnce with the same id.
  absl::StatusOr<std::optional<std::string>> BeginOnce(absl::string_view method,
                                                       const std::string& request_id,
                                                       const google::protobuf::Message& without_id,
                                                       absl::string_view payload = {});
  void FinishOnce(const std::string& request_id, const absl::Status& status,
                  const google::protobuf::Message& response);
  RequestLogCounts RequestLogCountsNow() { return request_log_.Counts(absl::Now()); }

  // One message of an Update stream: keys and values for an attention layer,
  // a state for a recurrent one. `known` (may be null) is the spec a stream
  // keeps between messages, so it is looked up once per cache: used when it
  // is the target cache's, else replaced by that one. With a speculation_id
  // the speculation is looked up first (NOT_FOUND naming speculation_id when
  // unknown, or when cache_id is set and not its cache); an empty cache_id
  // then means the speculation's cache.
  absl::Status Update(const UpdateView& request, KnownSpec* known, v1::UpdateResponse* response);
  absl::Status Update(const v1::UpdateRequest& request, KnownSpec* known,
                      v1::UpdateResponse* response);
  absl::StatusOr<FetchPlan> PlanFetch(const v1::FetchRequest& request);
  // The two file streams (file_handlers.cc): the whole file an
  // ExportSnapshot sends, and what an ImportSnapshot's bytes make, `options`
  // being its first message (its data ignored).
  absl::StatusOr<std::string> ExportFile(const v1::ExportSnapshotRequest& request);
  absl::Status ImportFile(const v1::ImportSnapshotRequest& options, absl::string_view bytes,
                          v1::LoadSnapshotResponse* response);
  // The largest file an ImportSnapshot takes: one whose state fills the pool,
  // plus the largest header mlx reads.
  uint64_t MaxImportBytes() const;
  absl::Status FillFetchChunk(const FetchPlan& plan, size_t index, v1::FetchResponse* response);
  // FillFetchChunk in two halves, so the Fetch stream can read the data
  // straight into its outgoing buffer: every field but the tensors' data, and
  // the data's sizes; then the data itself.
  void FetchChunkHeader(const FetchPlan& plan, size_t index, v1::FetchResponse* header,
                        uint64_t* key_bytes, uint64_t* value_bytes) const;
  absl::Status ReadFetchChunk(const FetchPlan& plan, size_t index,
                              const engine::KvOutput& out) const;
  // Where a chunk's data lies in pages, to send without a copy (valid while
  // `plan` lives); FAILED_PRECONDITION where it must be read (ReadFetchChunk).
  absl::Status MappedFetchChunk(const FetchPlan& plan, size_t index,
                                engine::KvMappedPieces& out) const;

 private:
  // An update checked against `spec` (of `cache_id`, the live cache or the
  // cache of request.speculation_id) and applied; the layer's new offset.
  absl::StatusOr<uint64_t> ApplyStateUpdate(const UpdateView& request,
                                            const engine::CacheSpec& spec,
                                            const std::string& cache_id);
  absl::StatusOr<uint64_t> ApplyKvUpdate(const UpdateView& request, const engine::CacheSpec& spec,
                                         const std::string& cache_id);
  uint64_t ChunkTokens(const engine::CacheSpec& spec, uint32_t layer, uint32_t requested) const;
  // The chunks of one layer (fetch_forms.cc).
  void PlanLayer(const v1::FetchRequest& request, uint32_t layer, uint64_t end,
                 FetchPlan& plan) const;
  absl::Status FillPackedChunk(const FetchPlan& plan, size_t index,
                               v1::FetchResponse* response) const;
  absl::Status FillStateChunk(const FetchPlan& plan, size_t index,
                              v1::FetchResponse* response) const;
  absl::Status CheckFetchLayers(const v1::FetchRequest& request, const engine::CacheSpec& spec,
                                std::vector<uint32_t>& layers) const;


  engine::Engine& engine_;
  const ServiceOptions options_;
  RequestLog request_log_;
};

}  // namespace kvcache::service
