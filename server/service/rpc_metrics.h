// Counts and latencies of every gRPC call by method and status code, taken
// by a server interceptor so that every method (health and reflection too)
// and every way a call ends (refused, cancelled, failed) is counted the same,
// with the code the client saw.
//
//   kvcached_rpc_handled_total{method, code}
//   kvcached_rpc_duration_seconds{method, code}  (histogram, from the call's
//       start to its status being sent)
//
// `method` is "CreateCache" for kvcache.v1.KvCacheService's methods and the
// full name ("grpc.health.v1.Health/Check") for the others the server
// registers; a name the server does not know is "unknown", so a client
// cannot grow the label set.
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/support/server_interceptor.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvcache::service {

class RpcMetrics {
 public:
  // `extra_methods`: full names ("/pkg.Service/Method") of methods besides
  // KvCacheService's that the server registers.
  RpcMetrics(prometheus::Registry& registry, const std::vector<std::string>& extra_methods);

  // For grpc::ServerBuilder::experimental().SetInterceptorCreators; the
  // factory refers to this object, which must outlive the server.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

  // The index of `full_method` ("/pkg.Service/Method") among the known
  // methods; the last index is "unknown".
  size_t MethodIndex(const char* full_method) const;
  void Record(size_t method, grpc::StatusCode code, double seconds);

 private:
  static constexpr size_t kCodes = 17;  // grpc::StatusCode OK..UNAUTHENTICATED
  struct Series {
    std::atomic<prometheus::Counter*> handled{nullptr};
    std::atomic<prometheus::Histogram*> duration{nullptr};
  };
  // Made on a call's first use, under mutex_; then read without it.
  Series& SeriesFor(size_t method, grpc::StatusCode code);

  prometheus::Family<prometheus::Counter>& handled_;
  prometheus::Family<prometheus::Histogram>& duration_;
  std::vector<std::string> labels_;                        // by method index
  absl::flat_hash_map<std::string, size_t> by_full_name_;  // "/pkg.Service/Method"
  std::unique_ptr<std::array<Series, kCodes>[]> series_;   // [method][code]
  absl::Mutex mutex_;
};

}  // namespace kvcache::service
