#include "service/status_mapping.h"

#include <string>

namespace kvcache::service {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

}  // namespace kvcache::service
