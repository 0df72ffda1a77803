#include "service/grpc/status_mapping.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace kvcache::service {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status UnparsableRequest(absl::string_view type) {
  return absl::InvalidArgumentError(
      absl::StrCat("request: not a valid ", type,
                   " (bytes that are not protobuf, or a string field that is not UTF-8)"));
}

}  // namespace kvcache::service
