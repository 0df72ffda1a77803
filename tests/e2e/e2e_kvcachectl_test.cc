// kvcachectl's command table as the shell sees it, without a server: the
// usage it prints (every command's line, in the table's order), an unknown
// command, a command's usage error, and a fleet-only command without a fleet.
#include <sys/wait.h>

#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;

// What kvcachectl printed (stdout and stderr) for `args`, and its exit code.
// --server names a port nothing listens on: no case here may reach a server.
std::pair<std::string, int> RunKvcachectl(const std::string& args) {
  const std::string command =
      absl::StrCat(KVCACHECTL_BINARY, " --server=127.0.0.1:1 ", args, " 2>&1");
  FILE* out = popen(command.c_str(), "r");
  std::string text;
  char buffer[512];
  while (out != nullptr && fgets(buffer, sizeof(buffer), out) != nullptr) text += buffer;
  const int status = out != nullptr ? pclose(out) : -1;
  return {text, WIFEXITED(status) ? WEXITSTATUS(status) : -1};
}

// The usage scripts and operators have read since the commands were listed by
// hand; the table must print it unchanged.
constexpr char kUsage[] =
    "kvcachectl [--server=ADDR | --peers=NAME=ADDR,... | --etcd_endpoints=HOST:PORT,...] "
    "replicas | stats | caches [--tenant=NAME] | snapshots [CACHE] [--tenant=NAME] | "
    "evict [BYTES] [--tenant=NAME] | snapshot CACHE [--from=N] [--pinned] [--ttl=S] | "
    "restore CACHE [SNAPSHOT] --target=N | release SNAPSHOT | pin SNAPSHOT | unpin SNAPSHOT | "
    "renew ID... | prefixes | save SNAPSHOT FILE [--metadata=k=v,...] | "
    "load FILE [--name=NAME] | pull SNAPSHOT [--pinned] [--ttl=S] | saved | "
    "store SNAPSHOT NAME | load-saved NAME | download NAME FILE | delete-saved NAME | "
    "describe ID | health [SERVICE] | metrics [FILTER] [--metrics=HOST:PORT] | "
    "kv-events [FROM] | curve-keypair SECRET_FILE";

TEST(KvcachectlTest, WithoutACommandPrintsEveryCommandsUsageLine) {
  const auto [text, code] = RunKvcachectl("");
  EXPECT_EQ(code, 2);
  EXPECT_EQ(text, absl::StrCat(kUsage, "\n"));
}

TEST(KvcachectlTest, AnUnknownCommandIsNamedBeforeTheUsage) {
  const auto [text, code] = RunKvcachectl("frobnicate");
  EXPECT_EQ(code, 2);
  EXPECT_EQ(text, absl::StrCat("kvcachectl: unknown command \"frobnicate\"\n", kUsage, "\n"));
}

TEST(KvcachectlTest, ACommandsUsageErrorIsItsLineOfTheUsage) {
  const struct {
    const char* args;
    const char* usage;
  } cases[] = {
      {"release", "usage: release SNAPSHOT"},
      {"pin", "usage: pin SNAPSHOT"},
      {"unpin a b", "usage: unpin SNAPSHOT"},
      {"restore cache-1", "usage: restore CACHE [SNAPSHOT] --target=N"},
      {"renew", "usage: renew ID..."},
      {"evict lots", "usage: evict [BYTES] [--tenant=NAME]"},
      {"health a b", "usage: health [SERVICE]"},
      {"kv-events not-a-number", "usage: kv-events [FROM]"},
      {"curve-keypair", "usage: curve-keypair SECRET_FILE"},
  };
  for (const auto& [args, usage] : cases) {
    SCOPED_TRACE(args);
    const auto [text, code] = RunKvcachectl(args);
    EXPECT_EQ(code, 1);
    EXPECT_THAT(text, HasSubstr(absl::StrCat("kvcachectl: INVALID_ARGUMENT: ", usage, "\n")));
  }
}

TEST(KvcachectlTest, ReplicasNeedsAFleet) {
  const auto [text, code] = RunKvcachectl("replicas");
  EXPECT_EQ(code, 2);
  EXPECT_THAT(text, HasSubstr("replicas needs a fleet: --peers or --etcd_endpoints"));
}

}  // namespace
}  // namespace kvcache::testing
