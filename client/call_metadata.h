// Metadata on every call of a channel, added by a client interceptor: the
// bearer token (`authorization: Bearer <token>`; gRPC's own call credentials
// are sent only over secure channels, and the token must reach a plaintext
// loopback server too), and the replica the calls are for
// (`x-kvcache-replica: <name>`, which a proxy in front of a fleet routes by:
// docker/haproxy.cfg).
#pragma once

#include <grpcpp/support/client_interceptor.h>

#include <memory>
#include <string>

namespace kvcache::internal {

inline constexpr char kReplicaHeader[] = "x-kvcache-replica";

// Adds `key: value` to every call's initial metadata.
std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface> FixedMetadataInterceptors(
    std::string key, std::string value);

inline std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>
BearerTokenInterceptors(const std::string& token) {
  return FixedMetadataInterceptors("authorization", "Bearer " + token);
}

}  // namespace kvcache::internal
