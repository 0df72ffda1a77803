#include "bearer_token.h"

#include <utility>

namespace kvcache::internal {
namespace {

class BearerToken final : public grpc::experimental::Interceptor {
 public:
  explicit BearerToken(const std::string& authorization) : authorization_(authorization) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({"authorization", authorization_});
    }
    methods->Proceed();
  }

 private:
  const std::string& authorization_;  // the factory's, which outlives the channel's calls
};

class BearerTokenFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerTokenFactory(std::string token) : authorization_("Bearer " + std::move(token)) {}

  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerToken(authorization_);
  }

 private:
  const std::string authorization_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface> BearerTokenInterceptors(
    std::string token) {
  return std::make_unique<BearerTokenFactory>(std::move(token));
}

}  // namespace kvcache::internal
