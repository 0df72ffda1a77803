// absl::Status <-> grpc::Status, code for code (the two enums share values).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcache::service {

grpc::Status ToGrpcStatus(const absl::Status& status);

// A request whose bytes do not parse as `type` ("kvcache.v1.FetchRequest"):
// the client's fault, so INVALID_ARGUMENT (grpc++ itself answers such a
// request UNIMPLEMENTED or INTERNAL with no message).
absl::Status UnparsableRequest(absl::string_view type);

}  // namespace kvcache::service
