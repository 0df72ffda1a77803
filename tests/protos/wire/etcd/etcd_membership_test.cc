// EtcdMembership's failures where no etcd answers: the owner hears of the
// first of a run, once, and the membership keeps trying (last_failure).
#include "wire/etcd/etcd_membership.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace kvcache::etcd {
namespace {

// A loopback port that nothing listens on: bound, then closed.
int ClosedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), length), 0);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  close(fd);
  return ntohs(address.sin_port);
}

TEST(EtcdMembershipTest, TheOwnerHearsOfTheFirstFailureOfARunOnce) {
  absl::Mutex mutex;
  int failures = 0;
  absl::Status first;
  EtcdOptions options;
  options.endpoints = absl::StrCat("127.0.0.1:", ClosedPort());
  auto membership = EtcdMembership::Start(
      options, absl::ZeroDuration(), [](const std::map<std::string, std::string>&) {},
      [&](const absl::Status& failure) {
        absl::MutexLock lock(&mutex);
        if (failures++ == 0) first = failure;
      });
  ASSERT_TRUE(membership.ok()) << membership.status();
  {
    absl::MutexLock lock(&mutex);
    ASSERT_TRUE(mutex.AwaitWithTimeout(absl::Condition(
                                           +[](int* told) { return *told > 0; }, &failures),
                                       absl::Seconds(20)));
  }
  // Backing off from 100 ms, the membership tries again several times here.
  absl::SleepFor(absl::Seconds(1));
  absl::MutexLock lock(&mutex);
  EXPECT_EQ(failures, 1);
  EXPECT_TRUE(absl::IsUnavailable(first) || absl::IsDeadlineExceeded(first)) << first;
  EXPECT_FALSE((*membership)->last_failure().ok());
}

}  // namespace
}  // namespace kvcache::etcd
