// absl::Status <-> grpc::Status, code for code (the two enums share values).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvcache::service {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace kvcache::service
