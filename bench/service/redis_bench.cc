// Redis SET / GET throughput through hiredis, the peer of service_bench's
// Update / Fetch rows: the same chunk sizes, one connection (and thread) per
// kvcached stream, printed in the same row format.
//
//   redis_bench --port=6390 --ops=set,get --connections=1,4
//
// Pipelined, like kvcached's streams (an Update stream does not wait for an
// acknowledgement before the next message; Fetch pushes chunks back to back):
// each connection keeps about --pipeline_bytes of commands in flight. SET
// commands are formatted once and appended again and again, as service_bench
// reuses one UpdateRequest; hiredis still copies each into its output buffer,
// as gRPC serialises each message. Each connection cycles over
// --working_set_bytes of keys, as each kvcached stream cycles over a cache
// (or rotating window) of that size: neither side serves from the CPU cache.
#include <hiredis/hiredis.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "load_meter.h"

ABSL_FLAG(std::string, host, "127.0.0.1", "redis-server host");
ABSL_FLAG(int, port, 6379, "redis-server port");
ABSL_FLAG(std::string, ops, "set,get", "what to measure");
ABSL_FLAG(std::string, connections, "1,4", "concurrent connections, each its own thread");
ABSL_FLAG(std::string, chunks, "65536,262144,1048576", "value bytes per SET / GET");
ABSL_FLAG(uint64_t, pipeline_bytes, 4 << 20, "bytes of commands in flight per connection");
ABSL_FLAG(uint64_t, working_set_bytes, 64 << 20, "bytes of keys each connection cycles over");
ABSL_FLAG(double, warmup, 0.5, "seconds before measuring");
ABSL_FLAG(double, seconds, 2.5, "seconds measured per row");

namespace kvcache::bench {
namespace {

struct Command {
  char* text = nullptr;
  int length = 0;
};

// The formatted commands of one connection: one per key.
std::vector<Command> FormatCommands(bool set, int connection, int keys, const std::string& value) {
  std::vector<Command> commands(keys);
  for (int i = 0; i < keys; ++i) {
    const std::string key = absl::StrCat("bench:", connection, ":", i);
    commands[i].length =
        set ? redisFormatCommand(&commands[i].text, "SET %b %b", key.data(), key.size(),
                                 value.data(), value.size())
            : redisFormatCommand(&commands[i].text, "GET %b", key.data(), key.size());
  }
  return commands;
}

// Reads one reply; false (with `error` set) unless it is what the op expects.
bool ReadReply(redisContext* redis, bool set, size_t value_bytes, std::string& error) {
  void* raw = nullptr;
  if (redisGetReply(redis, &raw) != REDIS_OK) {
    error = redis->errstr;
    return false;
  }
  auto* reply = static_cast<redisReply*>(raw);
  const bool ok = set ? reply->type == REDIS_REPLY_STATUS
                      : reply->type == REDIS_REPLY_STRING && size_t(reply->len) == value_bytes;
  if (!ok) error = reply->type == REDIS_REPLY_ERROR ? reply->str : "unexpected reply";
  freeReplyObject(reply);
  return ok;
}

// Sends `commands` round and round, `depth` in flight, until told to stop
// (once round when `context.stop` is already set).
void Pipeline(redisContext* redis, bool set, size_t value_bytes,
              const std::vector<Command>& commands, size_t depth, WorkerContext& context) {
  size_t next = 0;
  size_t outstanding = 0;
  for (; outstanding < depth; ++outstanding, ++next) {
    const Command& command = commands[next % commands.size()];
    redisAppendFormattedCommand(redis, command.text, command.length);
  }
  while (outstanding > 0) {
    if (!ReadReply(redis, set, value_bytes, context.error)) return;
    --outstanding;
    context.messages.fetch_add(1, std::memory_order_relaxed);
    if (!context.stop.load(std::memory_order_relaxed) || next < commands.size()) {
      const Command& command = commands[next++ % commands.size()];
      redisAppendFormattedCommand(redis, command.text, command.length);
      ++outstanding;
    }
  }
}

void RedisWorker(bool set, int connection, uint64_t chunk, WorkerContext& context) {
  redisContext* redis = redisConnect(absl::GetFlag(FLAGS_host).c_str(), absl::GetFlag(FLAGS_port));
  if (redis == nullptr || redis->err) {
    context.error = redis ? redis->errstr : "cannot allocate a redis context";
    if (redis) redisFree(redis);
    return;
  }
  const size_t depth = std::max<uint64_t>(2, absl::GetFlag(FLAGS_pipeline_bytes) / chunk);
  const int keys = static_cast<int>(std::max<uint64_t>(depth, absl::GetFlag(FLAGS_working_set_bytes) / chunk));
  const std::string value(chunk, 'v');
  std::vector<Command> sets = FormatCommands(true, connection, keys, value);
  if (!set) {  // the keys must exist before they are read
    WorkerContext fill;
    fill.stop = true;
    Pipeline(redis, true, chunk, sets, depth, fill);
    std::vector<Command> gets = FormatCommands(false, connection, keys, value);
    Pipeline(redis, false, chunk, gets, depth, context);
    for (Command& command : gets) redisFreeCommand(command.text);
  } else {
    Pipeline(redis, true, chunk, sets, depth, context);
  }
  for (Command& command : sets) redisFreeCommand(command.text);
  redisFree(redis);
}

}  // namespace
}  // namespace kvcache::bench

int main(int argc, char** argv) {
  using namespace kvcache::bench;
  absl::ParseCommandLine(argc, argv);
  kvcache::bench::KeepMessageBuffersInHeap();
  const MeterOptions meter{.warmup_seconds = absl::GetFlag(FLAGS_warmup),
                           .measure_seconds = absl::GetFlag(FLAGS_seconds)};
  const std::vector<std::string> ops = absl::StrSplit(absl::GetFlag(FLAGS_ops), ',');
  for (const std::string& op : ops) {
    const bool set = op == "set";
    for (uint64_t connections : ParseList(absl::GetFlag(FLAGS_connections))) {
      for (uint64_t chunk : ParseList(absl::GetFlag(FLAGS_chunks))) {
        std::vector<Worker> workers;
        for (uint64_t c = 0; c < connections; ++c) {
          workers.push_back([=](WorkerContext& context) { RedisWorker(set, int(c), chunk, context); });
        }
        PrintRow("redis", op.c_str(), connections, chunk, MeasureRate(workers, meter));
      }
    }
  }
  return 0;
}
