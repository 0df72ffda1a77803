// Credentials on every call of a channel: `authorization: Bearer <token>`
// metadata, added by a client interceptor. gRPC's own call credentials are
// sent only over secure channels; the token must reach a plaintext loopback
// server too.
#pragma once

#include <grpcpp/support/client_interceptor.h>

#include <memory>
#include <string>

namespace kvcache::internal {

std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface> BearerTokenInterceptors(
    std::string token);

}  // namespace kvcache::internal
