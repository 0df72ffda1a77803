// What the server records about every gRPC call, in one server interceptor,
// so that every method (health and reflection too) and every way a call ends
// (refused, cancelled, failed) is seen the same, with the code the client saw:
//
// - its request id: the client's `x-request-id` metadata where it is 1-64 of
//   [A-Za-z0-9._:-], else one made here; sent back as trailing metadata
//   `x-request-id` and named in the call's log lines;
// - a log line (event "rpc_failed") for every INTERNAL status, and with
//   access_log one (event "rpc") for every call: request_id, method, code,
//   duration_ms, peer;
// - its count and latency for Prometheus:
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
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/server_interceptor.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvcache::service {

struct RpcObserverOptions {
  // Full names ("/pkg.Service/Method") of methods besides KvCacheService's
  // that the server registers.
  std::vector<std::string> extra_methods;
  bool access_log = false;
};

class RpcObserver {
 public:
  RpcObserver(prometheus::Registry& registry, RpcObserverOptions options);

  // For grpc::ServerBuilder::experimental().SetInterceptorCreators; the
  // factory refers to this object, which must outlive the server.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory();

  // The index of `full_method` ("/pkg.Service/Method") among the known
  // methods; the last index is "unknown".
  size_t MethodIndex(const char* full_method) const;
  // The request type of KvCacheService's method `method` when it takes one
  // request (not a stream of them); null otherwise.
  const google::protobuf::Descriptor* SingleRequestType(size_t method) const {
    return method < single_request_types_.size() ? single_request_types_[method] : nullptr;
  }
  // A call's end: counted, and logged where it should be.
  void Finished(size_t method, const grpc::Status& status, double seconds,
                const std::string& request_id, const grpc::ServerContextBase& context);
  // Calls gRPC has made and not yet destroyed: every call, admitted or
  // refused, from its arrival until gRPC is done with it (health Watch and
  // reflection streams aside: they last as long as their clients want).
  uint32_t calls_in_flight() const { return calls_in_flight_.load(); }

 private:
  static constexpr size_t kCodes = 17;  // grpc::StatusCode OK..UNAUTHENTICATED
  struct Series {
    std::atomic<prometheus::Counter*> handled{nullptr};
    std::atomic<prometheus::Histogram*> duration{nullptr};
  };
  // Made on a call's first use, under mutex_; then read without it.
  Series& SeriesFor(size_t method, grpc::StatusCode code);

  const bool access_log_;
  prometheus::Family<prometheus::Counter>& handled_;
  prometheus::Family<prometheus::Histogram>& duration_;
  std::vector<std::string> labels_;                        // by method index
  std::vector<const google::protobuf::Descriptor*> single_request_types_;  // by method index
  absl::flat_hash_map<std::string, size_t> by_full_name_;  // "/pkg.Service/Method"
  std::unique_ptr<std::array<Series, kCodes>[]> series_;   // [method][code]
  absl::Mutex mutex_;
  std::atomic<uint32_t> calls_in_flight_{0};

  friend class CallCount;
};

}  // namespace kvcache::service
