#include "service/rpc_metrics.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/descriptor.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvcache::service {
namespace {

using grpc::experimental::InterceptionHookPoints;

// Seconds, from 100 µs (a metadata call on loopback) to 100 s (a long Update
// stream or a large file): roughly three buckets a decade.
const prometheus::Histogram::BucketBoundaries& DurationBuckets() {
  static const auto* const buckets = new prometheus::Histogram::BucketBoundaries{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
      0.1,    0.25,    0.5,    1,     2.5,    5,     10,   25,    100};
  return *buckets;
}

const char* CodeName(grpc::StatusCode code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  const auto index = static_cast<size_t>(code);
  return index < std::size(kNames) ? kNames[index] : "UNKNOWN";
}

// One per call: the clock starts when gRPC makes it (the call has arrived)
// and stops when the status goes out.
class CallTimer final : public grpc::experimental::Interceptor {
 public:
  CallTimer(RpcMetrics& metrics, size_t method)
      : metrics_(metrics), method_(method), started_(absl::Now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      metrics_.Record(method_, methods->GetSendStatus().error_code(),
                      absl::ToDoubleSeconds(absl::Now() - started_));
    }
    methods->Proceed();
  }

 private:
  RpcMetrics& metrics_;
  const size_t method_;
  const absl::Time started_;
};

class CallTimerFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallTimerFactory(RpcMetrics& metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new CallTimer(metrics_, metrics_.MethodIndex(info->method()));
  }

 private:
  RpcMetrics& metrics_;
};

}  // namespace

RpcMetrics::RpcMetrics(prometheus::Registry& registry,
                       const std::vector<std::string>& extra_methods)
    : handled_(prometheus::BuildCounter()
                   .Name("kvcached_rpc_handled_total")
                   .Help("gRPC calls finished, by method and status code")
                   .Register(registry)),
      duration_(prometheus::BuildHistogram()
                    .Name("kvcached_rpc_duration_seconds")
                    .Help("gRPC call duration from its arrival to its status, by method and code")
                    .Register(registry)) {
  const google::protobuf::ServiceDescriptor* service =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          v1::KvCacheService::service_full_name());
  for (int i = 0; i < service->method_count(); ++i) {
    const std::string& name = service->method(i)->name();
    by_full_name_.emplace(absl::StrCat("/", service->full_name(), "/", name), labels_.size());
    labels_.push_back(name);
  }
  for (const std::string& full_name : extra_methods) {
    by_full_name_.emplace(full_name, labels_.size());
    labels_.push_back(absl::StartsWith(full_name, "/") ? full_name.substr(1) : full_name);
  }
  labels_.push_back("unknown");
  series_ = std::make_unique<std::array<Series, kCodes>[]>(labels_.size());
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
RpcMetrics::InterceptorFactory() {
  return std::make_unique<CallTimerFactory>(*this);
}

size_t RpcMetrics::MethodIndex(const char* full_method) const {
  if (full_method == nullptr) return labels_.size() - 1;
  const auto found = by_full_name_.find(absl::string_view(full_method));
  return found == by_full_name_.end() ? labels_.size() - 1 : found->second;
}

RpcMetrics::Series& RpcMetrics::SeriesFor(size_t method, grpc::StatusCode code) {
  const size_t code_index = static_cast<size_t>(code) < kCodes ? static_cast<size_t>(code)
                                                               : size_t{grpc::StatusCode::UNKNOWN};
  Series& series = series_[method][code_index];
  if (series.duration.load(std::memory_order_acquire) != nullptr) return series;
  absl::MutexLock lock(&mutex_);
  if (series.duration.load(std::memory_order_relaxed) == nullptr) {
    const prometheus::Labels labels = {
        {"method", labels_[method]}, {"code", CodeName(static_cast<grpc::StatusCode>(code_index))}};
    series.handled.store(&handled_.Add(labels), std::memory_order_relaxed);
    series.duration.store(&duration_.Add(labels, DurationBuckets()), std::memory_order_release);
  }
  return series;
}

void RpcMetrics::Record(size_t method, grpc::StatusCode code, double seconds) {
  Series& series = SeriesFor(method, code);
  series.handled.load(std::memory_order_relaxed)->Increment();
  series.duration.load(std::memory_order_relaxed)->Observe(seconds);
}

}  // namespace kvcache::service
