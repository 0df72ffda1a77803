#include "service/grpc/rpc_observer.h"

#include <grpcpp/server_context.h>

#include <algorithm>
#include <string_view>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/log.h"
#include "google/protobuf/descriptor.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/grpc/status_mapping.h"

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

constexpr char kRequestIdKey[] = "x-request-id";
constexpr size_t kMostRequestIdBytes = 64;

bool IsRequestIdChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == ':' ||
         c == '-';
}

// The client's id where it is safe to log and echo, else a new one: a
// client's bytes never reach a log line unchecked.
std::string RequestId(const grpc::ServerContextBase& context) {
  const auto found = context.client_metadata().find(kRequestIdKey);
  if (found != context.client_metadata().end()) {
    const absl::string_view id(found->second.data(), found->second.size());
    if (!id.empty() && id.size() <= kMostRequestIdBytes &&
        std::all_of(id.begin(), id.end(), IsRequestIdChar)) {
      return std::string(id);
    }
  }
  thread_local absl::BitGen bits;
  return absl::StrFormat("%016x", absl::Uniform<uint64_t>(bits));
}

// Streams that last as long as their clients want, answering a question at a
// time: nothing in them is left to drain when the server shuts down.
bool NeverDrains(std::string_view method) {
  return method == "/grpc.health.v1.Health/Watch" ||
         method == "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo" ||
         method == "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";
}

}  // namespace

// Counts a call in RpcObserver::calls_in_flight for the interceptor's life,
// except the streams that never drain.
class CallCount {
 public:
  CallCount(RpcObserver& observer, std::string_view method)
      : observer_(observer), counted_(!NeverDrains(method)) {
    if (counted_) observer_.calls_in_flight_.fetch_add(1);
  }
  ~CallCount() {
    if (counted_) observer_.calls_in_flight_.fetch_sub(1);
  }
  CallCount(const CallCount&) = delete;
  CallCount& operator=(const CallCount&) = delete;

 private:
  RpcObserver& observer_;
  const bool counted_;
};

namespace {

// One per call, made when the call arrives and destroyed when gRPC is done
// with it: the clock stops when the status goes out.
class CallInterceptor final : public grpc::experimental::Interceptor {
 public:
  CallInterceptor(RpcObserver& observer, grpc::experimental::ServerRpcInfo& info)
      : count_(observer, info.method() == nullptr ? "" : info.method()),
        observer_(observer),
        info_(info),
        method_(observer.MethodIndex(info.method())),
        started_(absl::Now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    // A single request gRPC could not parse arrives as no message at all (a
    // stream's end looks the same, so streams are left to their handlers).
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() == nullptr) {
      unparsed_ = observer_.SingleRequestType(method_);
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::ServerContextBase& context = *info_.server_context();
      const std::string request_id = RequestId(context);
      methods->GetSendTrailingMetadata()->emplace(kRequestIdKey, request_id);
      // grpc++ refuses such a request itself, UNIMPLEMENTED (callback unary
      // methods) or INTERNAL, with no message; it is the client's bytes that
      // are wrong, so say so.
      if (unparsed_ != nullptr && !methods->GetSendStatus().ok()) {
        methods->ModifySendStatus(ToGrpcStatus(UnparsableRequest(unparsed_->full_name())));
      }
      observer_.Finished(method_, methods->GetSendStatus(),
                         absl::ToDoubleSeconds(absl::Now() - started_), request_id, context);
    }
    methods->Proceed();
  }

 private:
  const CallCount count_;
  RpcObserver& observer_;
  grpc::experimental::ServerRpcInfo& info_;
  const size_t method_;
  const absl::Time started_;
  // The request's type when its bytes did not parse.
  const google::protobuf::Descriptor* unparsed_ = nullptr;
};

class CallInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CallInterceptorFactory(RpcObserver& observer) : observer_(observer) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new CallInterceptor(observer_, *info);
  }

 private:
  RpcObserver& observer_;
};

}  // namespace

RpcObserver::RpcObserver(prometheus::Registry& registry, RpcObserverOptions options)
    : access_log_(options.access_log),
      handled_(prometheus::BuildCounter()
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
    const google::protobuf::MethodDescriptor& method = *service->method(i);
    single_request_types_.push_back(method.client_streaming() ? nullptr : method.input_type());
  }
  for (const std::string& full_name : options.extra_methods) {
    by_full_name_.emplace(full_name, labels_.size());
    labels_.push_back(absl::StartsWith(full_name, "/") ? full_name.substr(1) : full_name);
  }
  labels_.push_back("unknown");
  series_ = std::make_unique<std::array<Series, kCodes>[]>(labels_.size());
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
RpcObserver::InterceptorFactory() {
  return std::make_unique<CallInterceptorFactory>(*this);
}

size_t RpcObserver::MethodIndex(const char* full_method) const {
  if (full_method == nullptr) return labels_.size() - 1;
  const auto found = by_full_name_.find(absl::string_view(full_method));
  return found == by_full_name_.end() ? labels_.size() - 1 : found->second;
}

RpcObserver::Series& RpcObserver::SeriesFor(size_t method, grpc::StatusCode code) {
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

void RpcObserver::Finished(size_t method, const grpc::Status& status, double seconds,
                           const std::string& request_id, const grpc::ServerContextBase& context) {
  Series& series = SeriesFor(method, status.error_code());
  series.handled.load(std::memory_order_relaxed)->Increment();
  series.duration.load(std::memory_order_relaxed)->Observe(seconds);
  const std::string duration_ms = absl::StrFormat("%.3f", seconds * 1e3);
  const char* code = CodeName(status.error_code());
  if (status.error_code() == grpc::StatusCode::INTERNAL) {
    LogEvent(LogLevel::kError, "rpc_failed",
             {{"request_id", request_id},
              {"method", labels_[method]},
              {"code", code},
              {"duration_ms", duration_ms},
              {"peer", context.peer()},
              {"message", status.error_message()}});
  } else if (access_log_) {
    LogEvent(LogLevel::kInfo, "rpc",
             {{"request_id", request_id},
              {"method", labels_[method]},
              {"code", code},
              {"duration_ms", duration_ms},
              {"peer", context.peer()}});
  }
}

}  // namespace kvcache::service
