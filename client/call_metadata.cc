#include "call_metadata.h"

#include <utility>

namespace kvcache::internal {
namespace {

class FixedMetadata final : public grpc::experimental::Interceptor {
 public:
  FixedMetadata(const std::string& key, const std::string& value) : key_(key), value_(value) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({key_, value_});
    }
    methods->Proceed();
  }

 private:
  // The factory's, which outlives the channel's calls.
  const std::string& key_;
  const std::string& value_;
};

class FixedMetadataFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  FixedMetadataFactory(std::string key, std::string value)
      : key_(std::move(key)), value_(std::move(value)) {}

  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new FixedMetadata(key_, value_);
  }

 private:
  const std::string key_;
  const std::string value_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface> FixedMetadataInterceptors(
    std::string key, std::string value) {
  return std::make_unique<FixedMetadataFactory>(std::move(key), std::move(value));
}

}  // namespace kvcache::internal
