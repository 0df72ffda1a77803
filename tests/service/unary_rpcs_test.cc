// The unary RPC list that the callback service is built from matches the
// contract: every method of kvcache.v1.KvCacheService is either in it (unary,
// with the request and response types the proto gives) or one of the
// streaming calls with reactors of their own (Update and Fetch raw, the two
// file streams typed).
#include "service/unary_rpcs.h"

#include <set>
#include <string>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache::service {
namespace {

using Signature = std::tuple<std::string, std::string, std::string>;

std::set<Signature> ListedUnaryRpcs() {
  std::set<Signature> listed;
#define KV_LIST_UNARY_RPC(Name, Request, Response) \
  listed.insert({#Name, v1::Request::descriptor()->full_name(), v1::Response::descriptor()->full_name()});
  KV_FOR_EACH_UNARY_RPC(KV_LIST_UNARY_RPC)
#undef KV_LIST_UNARY_RPC
  return listed;
}

TEST(UnaryRpcsTest, EveryMethodOfTheContractIsListedOrStreamsRaw) {
  const google::protobuf::ServiceDescriptor* service =
      v1::CacheInfo::descriptor()->file()->FindServiceByName("KvCacheService");
  ASSERT_NE(service, nullptr);
  std::set<Signature> unary_in_proto;
  std::set<std::string> streaming_in_proto;
  for (int i = 0; i < service->method_count(); ++i) {
    const google::protobuf::MethodDescriptor* method = service->method(i);
    if (method->client_streaming() || method->server_streaming()) {
      streaming_in_proto.insert(method->name());
    } else {
      unary_in_proto.insert({method->name(), method->input_type()->full_name(),
                             method->output_type()->full_name()});
    }
  }
  // PullSnapshot is unary on the wire but answers from a reactor of its own
  // (service/grpc/pull_reactor.h), once the owner's stream has ended.
  EXPECT_EQ(unary_in_proto.erase({"PullSnapshot", "kvcache.v1.PullSnapshotRequest",
                                  "kvcache.v1.LoadSnapshotResponse"}),
            1u);
  EXPECT_EQ(ListedUnaryRpcs(), unary_in_proto);
  EXPECT_THAT(streaming_in_proto,
              testing::UnorderedElementsAre("Update", "Fetch", "ExportSnapshot", "ImportSnapshot"));
}

}  // namespace
}  // namespace kvcache::service
