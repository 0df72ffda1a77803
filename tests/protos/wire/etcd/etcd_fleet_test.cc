#include "wire/etcd/etcd_fleet.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace kvcache::etcd {
namespace {

TEST(EtcdFleetTest, ARangeEndCoversExactlyThePrefix) {
  EXPECT_EQ(PrefixRangeEnd("/kvcached/replicas/"), "/kvcached/replicas0");
  EXPECT_EQ(PrefixRangeEnd("a"), "b");
  // Trailing 0xff bytes cannot be raised: the byte before them is.
  EXPECT_EQ(PrefixRangeEnd(std::string("a\xff\xff", 3)), "b");
  // Nothing to raise: every key from the prefix on ("\0" is etcd's "to the end").
  EXPECT_EQ(PrefixRangeEnd(std::string("\xff", 1)), std::string(1, '\0'));
  const std::string end = PrefixRangeEnd("/p/");
  EXPECT_LT(std::string("/p/zzzz"), end);
  EXPECT_GE(std::string("/p0"), end);
}

TEST(EtcdFleetTest, KeysNameReplicas) {
  EXPECT_EQ(ReplicaKey("/kvcached/replicas/", "kvcached-0"), "/kvcached/replicas/kvcached-0");
  EXPECT_EQ(ReplicaOfKey("/kvcached/replicas/", "/kvcached/replicas/kvcached-0").value(),
            "kvcached-0");
  // Not under the prefix, no name, or one that ids cannot carry: skipped.
  EXPECT_FALSE(ReplicaOfKey("/kvcached/replicas/", "/other/kvcached-0").ok());
  EXPECT_FALSE(ReplicaOfKey("/kvcached/replicas/", "/kvcached/replicas/").ok());
  EXPECT_FALSE(ReplicaOfKey("/kvcached/replicas/", "/kvcached/replicas/a:b").ok());
  EXPECT_FALSE(
      ReplicaOfKey("/kvcached/replicas/", "/kvcached/replicas/" + std::string(64, 'a')).ok());
}

TEST(EtcdFleetTest, EndpointsAreCheckedAndNamed) {
  EXPECT_TRUE(EtcdChannels::Make({.endpoints = "127.0.0.1:2379"}).ok());
  absl::StatusOr<EtcdChannels> two =
      EtcdChannels::Make({.endpoints = "http://10.0.0.1:2379/, 10.0.0.2:2379"});
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->current_endpoint(), "10.0.0.1:2379");
  two->Next();
  EXPECT_EQ(two->current_endpoint(), "10.0.0.2:2379");
  two->Next();
  EXPECT_EQ(two->current_endpoint(), "10.0.0.1:2379");
  EXPECT_TRUE(EtcdChannels::Make({.endpoints = "https://etcd:2379"}).ok());

  struct Bad {
    EtcdOptions options;
    const char* names;
  };
  const std::string missing = ::testing::TempDir() + "/no-such.pem";
  const std::string not_pem = ::testing::TempDir() + "/not.pem";
  std::ofstream(not_pem) << "not a certificate";
  for (const Bad& bad : std::initializer_list<Bad>{
           {{.endpoints = ""}, "etcd_endpoints"},
           {{.endpoints = " , "}, "etcd_endpoints"},
           {{.endpoints = "http://"}, "etcd_endpoints"},
           {{.endpoints = "10.0.0.1:2379/v3"}, "etcd_endpoints"},
           {{.endpoints = "user@10.0.0.1:2379"}, "etcd_endpoints"},
           {{.endpoints = "https://10.0.0.1:2379,10.0.0.2:2379"}, "etcd_endpoints"},
           {{.endpoints = "10.0.0.1:2379", .prefix = ""}, "etcd_prefix"},
           {{.endpoints = "10.0.0.1:2379", .cert_file = not_pem}, "etcd_cert, etcd_key"},
           {{.endpoints = "10.0.0.1:2379", .ca_file = missing}, "etcd_ca"},
           {{.endpoints = "10.0.0.1:2379", .ca_file = not_pem}, "etcd_ca"},
           {{.endpoints = "10.0.0.1:2379", .cert_file = not_pem, .key_file = not_pem}, "etcd_cert"},
       }) {
    absl::StatusOr<EtcdChannels> made = EtcdChannels::Make(bad.options);
    ASSERT_FALSE(made.ok()) << bad.names;
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(made.status().message().rfind(bad.names, 0), 0u) << made.status();
  }
  std::filesystem::remove(not_pem);
}

TEST(EtcdFleetTest, BackoffDoublesToItsBound) {
  EXPECT_EQ(EtcdBackoff(1, absl::Seconds(2)), absl::Milliseconds(100));
  EXPECT_EQ(EtcdBackoff(2, absl::Seconds(2)), absl::Milliseconds(200));
  EXPECT_EQ(EtcdBackoff(4, absl::Seconds(2)), absl::Milliseconds(800));
  EXPECT_EQ(EtcdBackoff(50, absl::Seconds(2)), absl::Seconds(2));
}

}  // namespace
}  // namespace kvcache::etcd
