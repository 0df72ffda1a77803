// The batch RPCs (mlx-lm BatchKVCache extract / filter / merge / extend): check
// the ids, hand over to the engine, describe the resulting cache.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "service/convert.h"
#include "service/handlers.h"
#include "service/validation.h"

namespace kvcache::service {

absl::Status Handlers::ExtractRow(const v1::ExtractRowRequest& request, v1::CacheInfo* response) {
  RETURN_IF_ERROR(RequireId("cache_id", request.cache_id()));
  ASSIGN_OR_RETURN(engine::CacheInfo info, engine_.ExtractRow(request.cache_id(), request.row()));
  ToProto(info, response);
  return absl::OkStatus();
}

absl::Status Handlers::FilterRows(const v1::FilterRowsRequest& request, v1::CacheInfo* response) {
  RETURN_IF_ERROR(RequireId("cache_id", request.cache_id()));
  const std::vector<uint32_t> rows(request.keep_rows().begin(), request.keep_rows().end());
  ASSIGN_OR_RETURN(engine::CacheInfo info, engine_.FilterRows(request.cache_id(), rows));
  ToProto(info, response);
  return absl::OkStatus();
}

absl::Status Handlers::MergeCaches(const v1::MergeCachesRequest& request,
                                   v1::CacheInfo* response) {
  if (request.cache_ids().empty()) {
    return absl::InvalidArgumentError("cache_ids: name at least one cache to merge");
  }
  for (int i = 0; i < request.cache_ids_size(); ++i) {
    RETURN_IF_ERROR(RequireId(absl::StrCat("cache_ids[", i, "]"), request.cache_ids(i)));
  }
  const std::vector<std::string> ids(request.cache_ids().begin(), request.cache_ids().end());
  ASSIGN_OR_RETURN(engine::CacheInfo info, engine_.MergeCaches(ids));
  ToProto(info, response);
  return absl::OkStatus();
}

absl::Status Handlers::ExtendCache(const v1::ExtendCacheRequest& request,
                                   v1::CacheInfo* response) {
  RETURN_IF_ERROR(RequireId("cache_id", request.cache_id()));
  RETURN_IF_ERROR(RequireId("other_id", request.other_id()));
  ASSIGN_OR_RETURN(engine::CacheInfo info,
                   engine_.ExtendCache(request.cache_id(), request.other_id()));
  ToProto(info, response);
  return absl::OkStatus();
}

}  // namespace kvcache::service
