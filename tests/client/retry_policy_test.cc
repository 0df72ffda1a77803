// The client's retry list is kept in step with the contract: every call
// whose request has a request_id is retried (gRPC's policy, or by hand for
// the client stream), every listed name is a method of the service, and the
// calls a repeat would harm are never listed.
#include "retry_policy.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvcache::internal {
namespace {

using ::testing::Contains;
using ::testing::Not;

const google::protobuf::ServiceDescriptor& Service() {
  return *google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
      v1::KvCacheService::service_full_name());
}

bool Retried(const std::string& method) {
  return absl::c_any_of(RetriedMethods(), [&](const char* name) { return method == name; });
}

TEST(RetryPolicyTest, EveryListedNameIsAMethodOfTheService) {
  for (const char* name : RetriedMethods()) {
    EXPECT_NE(Service().FindMethodByName(name), nullptr) << name;
  }
}

TEST(RetryPolicyTest, EveryCallThatCarriesARequestIdIsRetried) {
  int with_id = 0;
  for (int i = 0; i < Service().method_count(); ++i) {
    const google::protobuf::MethodDescriptor& method = *Service().method(i);
    if (method.input_type()->FindFieldByName("request_id") == nullptr) continue;
    ++with_id;
    if (method.client_streaming()) {
      // gRPC keeps too little of a client stream to send it again, so the
      // client does (RetryUnavailable); gRPC's policy must not as well.
      EXPECT_FALSE(Retried(method.name())) << method.name();
    } else {
      EXPECT_TRUE(Retried(method.name())) << method.name() << " has a request_id";
    }
  }
  EXPECT_GE(with_id, 20);
}

TEST(RetryPolicyTest, CallsThatARepeatWouldHarmAreNotRetried) {
  std::vector<std::string> listed(RetriedMethods().begin(), RetriedMethods().end());
  EXPECT_THAT(listed, Not(Contains("EvictSnapshots")));  // would move more pages
  EXPECT_THAT(listed, Not(Contains("Update")));          // resumed by expected_offset
  EXPECT_THAT(listed, Not(Contains("ImportSnapshot")));  // retried by hand
}

TEST(RetryPolicyTest, TheServiceConfigNamesEveryListedMethodWithThePolicy) {
  google::protobuf::Struct config;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(RetryServiceConfig(), &config).ok())
      << RetryServiceConfig();
  const auto& method_config = config.fields().at("methodConfig").list_value().values(0).struct_value();
  const auto& names = method_config.fields().at("name").list_value().values();
  ASSERT_EQ(names.size(), static_cast<int>(RetriedMethods().size()));
  for (int i = 0; i < names.size(); ++i) {
    const auto& name = names[i].struct_value().fields();
    EXPECT_EQ(name.at("service").string_value(), Service().full_name());
    EXPECT_EQ(name.at("method").string_value(), RetriedMethods()[i]);
  }
  const auto& policy = method_config.fields().at("retryPolicy").struct_value().fields();
  EXPECT_EQ(policy.at("maxAttempts").number_value(), kRetryPolicy.max_attempts);
  EXPECT_EQ(policy.at("initialBackoff").string_value(), "0.05s");
  EXPECT_EQ(policy.at("maxBackoff").string_value(), "1s");
  EXPECT_EQ(policy.at("retryableStatusCodes").list_value().values(0).string_value(),
            "UNAVAILABLE");
}

grpc::Status Unavailable() { return grpc::Status(grpc::StatusCode::UNAVAILABLE, "gone"); }

TEST(RetryUnavailableTest, AnUnavailableCallIsTriedAsOftenAsThePolicySays) {
  int attempts = 0;
  const grpc::Status status = RetryUnavailable(absl::Now() + absl::Seconds(30), [&] {
    ++attempts;
    return Unavailable();
  });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(attempts, kRetryPolicy.max_attempts);
}

TEST(RetryUnavailableTest, ItStopsAtTheFirstAnswerThatIsNotUnavailable) {
  int attempts = 0;
  EXPECT_TRUE(RetryUnavailable(absl::Now() + absl::Seconds(30), [&] {
                return ++attempts < 2 ? Unavailable() : grpc::Status::OK;
              }).ok());
  EXPECT_EQ(attempts, 2);
  attempts = 0;
  const grpc::Status refused = RetryUnavailable(absl::Now() + absl::Seconds(30), [&] {
    ++attempts;
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "name: bad");
  });
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(attempts, 1);
}

TEST(RetryUnavailableTest, NoAttemptStartsPastTheDeadline) {
  int attempts = 0;
  RetryUnavailable(absl::Now(), [&] {
    ++attempts;
    return Unavailable();
  });
  EXPECT_EQ(attempts, 1);
}

}  // namespace
}  // namespace kvcache::internal
