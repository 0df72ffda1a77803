// The speculation RPCs (ollama BeginSpeculation / Commit(n)): check the ids,
// hand over to the engine (engine/speculation/speculation.h has the semantics), describe
// the result. Drafted updates and reads go through Update and Fetch.
#include "core/status_macros.h"
#include "service/convert.h"
#include "service/handlers.h"
#include "service/validation.h"

namespace kvcache::service {

absl::Status Handlers::BeginSpeculation(const v1::BeginSpeculationRequest& request,
                                        v1::BeginSpeculationResponse* response) {
  RETURN_IF_ERROR(RequireId("cache_id", request.cache_id()));
  ASSIGN_OR_RETURN(engine::SpeculationInfo info,
                   engine_.BeginSpeculation(request.cache_id(), request.isolated()));
  response->set_speculation_id(info.speculation_id);
  response->set_offset(info.committed_offset);
  return absl::OkStatus();
}

absl::Status Handlers::CommitSpeculation(const v1::CommitSpeculationRequest& request,
                                         v1::CacheInfo* response) {
  RETURN_IF_ERROR(RequireId("speculation_id", request.speculation_id()));
  ASSIGN_OR_RETURN(engine::CacheInfo info,
                   engine_.CommitSpeculation(request.speculation_id(), request.accepted()));
  ToProto(info, response);
  return absl::OkStatus();
}

absl::Status Handlers::AbortSpeculation(const v1::AbortSpeculationRequest& request,
                                        v1::CacheInfo* response) {
  RETURN_IF_ERROR(RequireId("speculation_id", request.speculation_id()));
  ASSIGN_OR_RETURN(engine::CacheInfo info, engine_.AbortSpeculation(request.speculation_id()));
  ToProto(info, response);
  return absl::OkStatus();
}

}  // namespace kvcache::service
