// kvcachectl: inspect and drive a kvcached from the shell.
//
//   kvcachectl [--server=HOST:PORT | --peers=... | --etcd_endpoints=...] COMMAND [ARGS]
//
// The commands are kCommands below: each one's usage line (which `kvcachectl`
// alone prints, and its usage error repeats), what it does, and where it runs,
// on one kvcached or over a fleet (client/sharded_client.h: --peers=NAME=
// HOST:PORT,... or dns:HOST:PORT, or the replicas etcd lists).
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kvcache_client.h"
#include "sharded_client.h"
#include "tools/connection_flags.h"
#include "tools/http_get.h"
#include "tools/kv_event_replay.h"
#include "wire/curve/curve_keys.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "kvcached address");
ABSL_FLAG(std::string, peers, "",
          "a fleet instead of --server: NAME=HOST:PORT,... (or HOST:PORT, or dns:HOST:PORT)");
ABSL_FLAG(std::string, etcd_endpoints, "",
          "a fleet instead of --server: the replicas etcd lists (their --etcd_endpoints)");
ABSL_FLAG(std::string, etcd_prefix, "/kvcached/replicas/", "where replicas list themselves");
ABSL_FLAG(std::string, etcd_ca, "", "PEM CA of etcd's certificate: TLS to etcd");
ABSL_FLAG(std::string, etcd_cert, "", "PEM client certificate for etcd");
ABSL_FLAG(std::string, etcd_key, "", "PEM private key of --etcd_cert");
ABSL_FLAG(std::string, replica, "",
          "with --peers: the replica for load, load-saved, download, "
          "delete-saved, and the one that pulls");
ABSL_FLAG(bool, tls, false, "TLS to kvcached (kvcached --tls_cert), trusting the system's CAs");
ABSL_FLAG(std::string, tls_ca, "", "TLS, trusting this PEM CA bundle (implies --tls)");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate for mutual TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "", "the name to check the server's certificate against");
ABSL_FLAG(std::string, token, "",
          "bearer token (kvcached --tokens_file); default: the KVCACHE_TOKEN environment "
          "variable, which, unlike a flag, other users cannot read in the process list");
ABSL_FLAG(uint64_t, from, 0, "snapshot: first position to capture");
ABSL_FLAG(bool, pinned, false, "snapshot: never evict it");
ABSL_FLAG(int64_t, target, -1, "restore: the offset to bring every layer to");
ABSL_FLAG(uint32_t, ttl, 0,
          "snapshot, load, load-saved: the lease in seconds (0: the server's default)");
ABSL_FLAG(std::vector<std::string>, metadata, {},
          "save, store: user metadata as key=value,... (mlx-lm writes \"model\")");
ABSL_FLAG(std::string, metrics, "127.0.0.1:9464",
          "metrics: kvcached's Prometheus endpoint (kvcached --metrics_listen)");
ABSL_FLAG(std::string, kv_events_replay, "tcp://127.0.0.1:5558",
          "kv-events: the replica's --kv_events_replay_endpoint");
ABSL_FLAG(bool, json, false, "kv-events: each batch whole, as JSON");
ABSL_FLAG(std::string, kv_events_server_key, "",
          "kv-events: the replica's CURVE public key (Z85; kvcached logs it at start), where it "
          "runs with --kv_events_curve_key_file");
ABSL_FLAG(std::string, kv_events_curve_key_file, "",
          "kv-events: this subscriber's CURVE secret key file (mode 600), whose public key the "
          "replica's --kv_events_curve_subscribers_file lists");
ABSL_FLAG(std::string, tenant, "",
          "caches, snapshots, evict: another tenant's (an admin token only; as the tokens file "
          "names it)");
ABSL_FLAG(std::string, name, "", "load: also keep the file in the server's data dir as NAME");

namespace {

using Args = std::vector<char*>;

std::string Bytes(uint64_t bytes) {
  if (bytes >= (1ull << 30)) return absl::StrFormat("%.2f GiB", bytes / double(1ull << 30));
  if (bytes >= (1ull << 20)) return absl::StrFormat("%.2f MiB", bytes / double(1ull << 20));
  if (bytes >= (1ull << 10)) return absl::StrFormat("%.1f KiB", bytes / 1024.0);
  return absl::StrFormat("%d B", bytes);
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "kvcachectl: %s\n", status.ToString().c_str());
  return 1;
}

// The command's usage line (from kCommands) as its error.
int Usage(const Args& args);

// "never", or how long until the lease runs out.
std::string Expiry(bool has_expiry, const google::protobuf::Timestamp& expires_at) {
  if (!has_expiry) return "never";
  const int64_t left = expires_at.seconds() - static_cast<int64_t>(std::time(nullptr));
  return left <= 0 ? "now" : absl::StrFormat("in %ds", left);
}

// "device", "host", "disk", or the mix, by where its bytes are.
std::string Tiers(const kvcache::v1::SnapshotInfo& s) {
  std::vector<std::string> parts;
  if (s.device_bytes() > 0) parts.push_back("device " + Bytes(s.device_bytes()));
  if (s.host_bytes() > 0) parts.push_back("host " + Bytes(s.host_bytes()));
  if (s.disk_bytes() > 0) parts.push_back("disk " + Bytes(s.disk_bytes()));
  return parts.empty() ? "-" : absl::StrJoin(parts, ", ");
}

void PrintSnapshot(const kvcache::v1::SnapshotInfo& s) {
  std::printf("%-32s  %-32s  [%8llu, %8llu)  %10s  %-8s  %-6s  %s\n", s.snapshot_id().c_str(),
              s.cache_id().c_str(), (unsigned long long)s.from_offset(),
              (unsigned long long)s.to_offset(), Bytes(s.size_bytes()).c_str(),
              Expiry(s.has_expires_at(), s.expires_at()).c_str(), s.pinned() ? "pinned" : "",
              Tiers(s).c_str());
}

void PrintCache(const kvcache::v1::CacheInfo& c) {
  std::printf("%-32s  %6d  %8llu  %-9s  %10s  %-8s  %s\n", c.cache_id().c_str(),
              c.spec().layers_size(), (unsigned long long)c.offset(),
              c.in_step() ? "in step" : "mid-step", Bytes(c.size_bytes()).c_str(),
              Expiry(c.has_expires_at(), c.expires_at()).c_str(), c.spec().model().c_str());
}

std::string PrefixTotals(const kvcache::v1::Stats& stats) {
  return absl::StrFormat(
      "%d entries, %d distinct tokens; %d lookups, %d hits, %d tokens matched; %d dropped for room",
      stats.prefix_entries(), stats.prefix_tokens(), stats.prefix_lookups(), stats.prefix_hits(),
      stats.prefix_matched_tokens(), stats.prefix_entries_dropped());
}

int Stats(kvcache::Client& client, const Args&) {
  auto stats = client.GetStats();
  if (!stats.ok()) return Fail(stats.status());
  std::printf("device        %s (%s transfers)\n", stats->device().c_str(),
              stats->transfer_path().c_str());
  if (!stats->replica_name().empty()) {
    std::printf("replica       %s\n", stats->replica_name().c_str());
  }
  std::printf("data lane     %s\n",
              stats->data_lane_address().empty() ? "off" : stats->data_lane_address().c_str());
  if (!stats->tenant().empty()) {
    std::printf("tenant        %s (%s)\n", stats->tenant().c_str(),
                stats->server_wide() ? "admin: the whole server's counts"
                                     : "its own counts; the shared pool's use is for admins");
  }
  std::printf("pool          %s used of %s (%llu of %llu pages of %s)\n",
              Bytes(stats->pool_bytes_used()).c_str(), Bytes(stats->pool_bytes_total()).c_str(),
              (unsigned long long)stats->pages_used(), (unsigned long long)stats->pages_total(),
              Bytes(stats->page_bytes()).c_str());
  std::printf("caches        %llu (%llu expired)\nsnapshots     %llu (%llu expired)\n",
              (unsigned long long)stats->caches(), (unsigned long long)stats->caches_expired(),
              (unsigned long long)stats->snapshots(),
              (unsigned long long)stats->snapshots_expired());
  std::printf(
      "pinned        %s of %s\nmetadata      %s of %s (host memory of tables and handles)\n",
      Bytes(stats->pinned_bytes()).c_str(),
      stats->max_pinned_bytes() == 0 ? "no limit" : Bytes(stats->max_pinned_bytes()).c_str(),
      Bytes(stats->metadata_bytes()).c_str(), Bytes(stats->max_metadata_bytes()).c_str());
  const auto tier = [&](uint64_t used, uint64_t total) {
    if (total == 0) return std::string("off");
    return absl::StrFormat("%s used of %s (%llu of %llu pages)", Bytes(used * stats->page_bytes()),
                           Bytes(total * stats->page_bytes()), (unsigned long long)used,
                           (unsigned long long)total);
  };
  std::printf("host tier     %s\ndisk tier     %s\n",
              tier(stats->host_pages_used(), stats->host_pages_total()).c_str(),
              tier(stats->disk_pages_used(), stats->disk_pages_total()).c_str());
  std::printf(
      "pages moved   %llu evicted, %llu host to disk, %llu back from host, %llu back from "
      "disk\n",
      (unsigned long long)stats->evictions(), (unsigned long long)stats->demotions(),
      (unsigned long long)stats->promotions_from_host(),
      (unsigned long long)stats->promotions_from_disk());
  if (!stats->tenant().empty()) {
    const auto quota = [](uint64_t used, uint64_t max) {
      return Bytes(used) + (max == 0 ? "" : " of " + Bytes(max));
    };
    std::printf("tenant pages  device %s, host %s, disk %s\n",
                quota(stats->tenant_device_bytes(), stats->tenant_max_device_bytes()).c_str(),
                quota(stats->tenant_host_bytes(), stats->tenant_max_host_bytes()).c_str(),
                quota(stats->tenant_disk_bytes(), stats->tenant_max_disk_bytes()).c_str());
  }
  if (stats->max_saved_bytes() != 0 || stats->saved_bytes() != 0) {
    std::printf("saved files   %s%s\n", Bytes(stats->saved_bytes()).c_str(),
                stats->max_saved_bytes() == 0
                    ? ""
                    : (" of " + Bytes(stats->max_saved_bytes())).c_str());
  }
  std::printf("prefixes      %s\n", PrefixTotals(*stats).c_str());
  std::printf("request log   %llu answers kept for retries (%s), %llu retries answered from it\n",
              (unsigned long long)stats->request_log_entries(),
              Bytes(stats->request_log_bytes()).c_str(),
              (unsigned long long)stats->requests_replayed());
  return 0;
}

// Every published prefix, then the totals (shared pages count once there).
int Prefixes(kvcache::Client& client, const Args&) {
  auto entries = client.ListPrefixes();
  if (!entries.ok()) return Fail(entries.status());
  auto stats = client.GetStats();
  if (!stats.ok()) return Fail(stats.status());
  std::printf("%-32s  %-16s  %8s  %10s  %8s  %-8s  %s\n", "ENTRY", "MODEL", "TOKENS", "SIZE",
              "HITS", "EXPIRES", "WHERE");
  for (const auto& entry : *entries) {
    const auto& s = entry.snapshot();
    std::printf("%-32s  %-16s  %8llu  %10s  %8llu  %-8s  %s\n", s.snapshot_id().c_str(),
                entry.model().c_str(), (unsigned long long)entry.tokens(),
                Bytes(s.size_bytes()).c_str(), (unsigned long long)entry.hits(),
                Expiry(s.has_expires_at(), s.expires_at()).c_str(), Tiers(s).c_str());
  }
  std::printf("%s\n", PrefixTotals(*stats).c_str());
  return 0;
}

int Caches(kvcache::Client& client, const Args&) {
  auto caches = client.ListCaches({.tenant = absl::GetFlag(FLAGS_tenant)});
  if (!caches.ok()) return Fail(caches.status());
  std::printf("%-32s  %6s  %8s  %-9s  %10s  %-8s  %s\n", "CACHE", "LAYERS", "OFFSET", "STATE",
              "SIZE", "EXPIRES", "MODEL");
  for (const auto& cache : *caches) PrintCache(cache);
  return 0;
}

int Snapshots(kvcache::Client& client, const Args& args) {
  auto snapshots = client.ListSnapshots(
      {.cache_id = args.size() > 1 ? args[1] : "", .tenant = absl::GetFlag(FLAGS_tenant)});
  if (!snapshots.ok()) return Fail(snapshots.status());
  std::printf("%-32s  %-32s  %-20s  %10s  %-8s  %-6s  %s\n", "SNAPSHOT", "CACHE", "TOKENS", "SIZE",
              "EXPIRES", "PIN", "WHERE");
  for (const auto& snapshot : *snapshots) PrintSnapshot(snapshot);
  return 0;
}

// evict [BYTES]: idle snapshots' device pages down a tier now (all without BYTES).
int Evict(kvcache::Client& client, const Args& args) {
  uint64_t bytes = 0;
  if (args.size() > 2 || (args.size() == 2 && !absl::SimpleAtoi(args[1], &bytes))) {
    return Usage(args);
  }
  auto evicted = client.EvictSnapshots({.bytes = bytes, .tenant = absl::GetFlag(FLAGS_tenant)});
  if (!evicted.ok()) return Fail(evicted.status());
  std::printf("moved %llu pages (%s) off the device\n",
              static_cast<unsigned long long>(evicted->pages_moved()),
              Bytes(evicted->bytes_moved()).c_str());
  return 0;
}

int Snapshot(kvcache::Client& client, const Args& args) {
  if (args.size() != 2) return Usage(args);
  auto snapshot = client.Snapshot(args[1], {.from_offset = absl::GetFlag(FLAGS_from),
                                            .pinned = absl::GetFlag(FLAGS_pinned),
                                            .ttl_seconds = absl::GetFlag(FLAGS_ttl)});
  if (!snapshot.ok()) return Fail(snapshot.status());
  PrintSnapshot(*snapshot);
  return 0;
}

int Restore(kvcache::Client& client, const Args& args) {
  const int64_t target = absl::GetFlag(FLAGS_target);
  if (args.size() < 2 || args.size() > 3 || target < 0) {
    return Usage(args);
  }
  auto cache = client.Restore(args[1], args.size() == 3 ? args[2] : "", target);
  if (!cache.ok()) return Fail(cache.status());
  PrintCache(*cache);
  return 0;
}

int Release(kvcache::Client& client, const Args& args) {
  if (args.size() != 2) return Usage(args);
  if (auto status = client.ReleaseSnapshot(args[1]); !status.ok()) return Fail(status);
  std::printf("released %s\n", args[1]);
  return 0;
}

int SetPinned(kvcache::Client& client, const Args& args, bool pinned) {
  if (args.size() != 2) return Usage(args);
  auto snapshot = client.SetPinned(args[1], pinned);
  if (!snapshot.ok()) return Fail(snapshot.status());
  PrintSnapshot(*snapshot);
  return 0;
}

int Pin(kvcache::Client& client, const Args& args) { return SetPinned(client, args, true); }
int Unpin(kvcache::Client& client, const Args& args) { return SetPinned(client, args, false); }

// Renews each id's lease, as a snapshot if the server lists one by that id,
// else as a cache.
int Renew(kvcache::Client& client, const Args& args) {
  if (args.size() < 2) return Usage(args);
  auto snapshots = client.ListSnapshots();
  if (!snapshots.ok()) return Fail(snapshots.status());
  std::vector<std::string> cache_ids, snapshot_ids;
  for (size_t i = 1; i < args.size(); ++i) {
    const bool is_snapshot = std::any_of(snapshots->begin(), snapshots->end(),
                                         [&](const auto& s) { return s.snapshot_id() == args[i]; });
    (is_snapshot ? snapshot_ids : cache_ids).push_back(args[i]);
  }
  auto renewed = client.RenewLease(cache_ids, snapshot_ids);
  if (!renewed.ok()) return Fail(renewed.status());
  for (const auto& leases : {renewed->caches(), renewed->snapshots()}) {
    for (const kvcache::v1::Lease& lease : leases) {
      std::printf("%-32s  expires %s\n", lease.id().c_str(),
                  Expiry(lease.has_expires_at(), lease.expires_at()).c_str());
    }
  }
  return 0;
}

std::map<std::string, std::string> MetadataFlag() {
  std::map<std::string, std::string> metadata;
  for (const std::string& entry : absl::GetFlag(FLAGS_metadata)) {
    std::pair<std::string, std::string> pair = absl::StrSplit(entry, absl::MaxSplits('=', 1));
    metadata[pair.first] = pair.second;
  }
  return metadata;
}

void PrintSaved(const kvcache::v1::SavedFile& file) {
  const std::time_t modified = file.modified().seconds();
  char when[32];
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", std::gmtime(&modified));
  std::printf("%-40s  %10s  %s UTC\n", file.name().c_str(), Bytes(file.size_bytes()).c_str(), when);
}

void PrintLoaded(const kvcache::v1::LoadSnapshotResponse& loaded) {
  PrintSnapshot(loaded.snapshot());
  std::printf("%d layers, model \"%s\", checksum %s\n", loaded.spec().layers_size(),
              loaded.spec().model().c_str(),
              loaded.checksum_verified() ? "verified" : "absent (not written by kvcached)");
}

// Writes `bytes` to `path` whole or not at all (a temporary renamed over it).
absl::Status WriteLocalFile(const std::string& path, const std::string& bytes) {
  const std::string temporary = path + ".partial";
  std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out || std::rename(temporary.c_str(), path.c_str()) != 0) {
    std::remove(temporary.c_str());
    return absl::UnavailableError(absl::StrCat(path, ": cannot write"));
  }
  return absl::OkStatus();
}

int Save(kvcache::Client& client, const Args& args) {
  if (args.size() != 3) return Usage(args);
  kvcache::v1::ExportSnapshotRequest request;
  request.set_snapshot_id(args[1]);
  const std::map<std::string, std::string> metadata = MetadataFlag();
  request.mutable_metadata()->insert(metadata.begin(), metadata.end());
  auto file = client.ExportSnapshot(request);
  if (!file.ok()) return Fail(file.status());
  if (auto status = WriteLocalFile(args[2], *file); !status.ok()) return Fail(status);
  std::printf("saved %s to %s (%s)\n", args[1], args[2], Bytes(file->size()).c_str());
  return 0;
}

int Download(kvcache::Client& client, const Args& args) {
  if (args.size() != 3) return Usage(args);
  kvcache::v1::ExportSnapshotRequest request;
  request.set_name(args[1]);
  auto file = client.ExportSnapshot(request);
  if (!file.ok()) return Fail(file.status());
  if (auto status = WriteLocalFile(args[2], *file); !status.ok()) return Fail(status);
  std::printf("downloaded %s to %s (%s)\n", args[1], args[2], Bytes(file->size()).c_str());
  return 0;
}

int Load(kvcache::Client& client, const Args& args) {
  if (args.size() != 2) return Usage(args);
  std::ifstream in(args[1], std::ios::binary);
  if (!in) return Fail(absl::NotFoundError(absl::StrCat(args[1], ": cannot open")));
  std::stringstream bytes;
  bytes << in.rdbuf();
  kvcache::v1::ImportSnapshotRequest options;
  options.set_name(absl::GetFlag(FLAGS_name));
  options.set_pinned(absl::GetFlag(FLAGS_pinned));
  options.set_ttl_seconds(absl::GetFlag(FLAGS_ttl));
  auto loaded = client.ImportSnapshot(bytes.str(), options);
  if (!loaded.ok()) return Fail(loaded.status());
  PrintLoaded(*loaded);
  return 0;
}

// The server copies a snapshot of another replica of its fleet (its peer).
int Pull(kvcache::Client& client, const Args& args) {
  if (args.size() != 2) return Usage(args);
  auto pulled = client.PullSnapshot(
      args[1], {.pinned = absl::GetFlag(FLAGS_pinned), .ttl_seconds = absl::GetFlag(FLAGS_ttl)});
  if (!pulled.ok()) return Fail(pulled.status());
  PrintLoaded(*pulled);
  return 0;
}

int Saved(kvcache::Client& client, const Args&) {
  auto files = client.ListSaved();
  if (!files.ok()) return Fail(files.status());
  std::printf("%-40s  %10s  %s\n", "NAME", "SIZE", "WRITTEN");
  for (const auto& file : *files) PrintSaved(file);
  return 0;
}

int Store(kvcache::Client& client, const Args& args) {
  if (args.size() != 3) return Usage(args);
  auto saved = client.SaveSnapshot(args[1], args[2], MetadataFlag());
  if (!saved.ok()) return Fail(saved.status());
  PrintSaved(*saved);
  return 0;
}

int LoadSaved(kvcache::Client& client, const Args& args) {
  if (args.size() != 2) return Usage(args);
  auto loaded = client.LoadSnapshot(
      args[1], {.pinned = absl::GetFlag(FLAGS_pinned), .ttl_seconds = absl::GetFlag(FLAGS_ttl)});
  if (!loaded.ok()) return Fail(loaded.status());
  PrintLoaded(*loaded);
  return 0;
}

int DeleteSaved(kvcache::Client& client, const Args& args) {
  if (args.size() != 2) return Usage(args);
  if (auto status = client.DeleteSaved(args[1]); !status.ok()) return Fail(status);
  std::printf("deleted %s\n", args[1]);
  return 0;
}

// Exit 0 only when SERVING, so that it serves as a container's health check.
int Health(kvcache::Client& client, const Args& args) {
  if (args.size() > 2) return Usage(args);
  const std::string service = args.size() == 2 ? args[1] : "kvcache.v1.KvCacheService";
  absl::StatusOr<bool> serving = client.Serving(service);
  if (!serving.ok()) return Fail(serving.status());
  std::printf("%s: %s\n", service.empty() ? "(server)" : service.c_str(),
              *serving ? "SERVING" : "NOT_SERVING");
  return *serving ? 0 : 1;
}

// The endpoint's text, or its lines that contain any FILTER (a metric's name).
int Metrics(const Args& args) {
  absl::StatusOr<std::string> text = kvcache::HttpGet(absl::GetFlag(FLAGS_metrics), "/metrics");
  if (!text.ok()) return Fail(text.status());
  const std::vector<absl::string_view> filters(args.begin() + 1, args.end());
  for (absl::string_view line : absl::StrSplit(*text, '\n', absl::SkipEmpty())) {
    const bool wanted =
        filters.empty() || std::any_of(filters.begin(), filters.end(), [&](absl::string_view f) {
          return absl::StrContains(line, f);
        });
    if (wanted) std::printf("%.*s\n", static_cast<int>(line.size()), line.data());
  }
  return 0;
}

// A new CURVE pair: the secret key into args[1] (never printed), the public
// key on stdout.
int CurveKeypair(const Args& args) {
  if (args.size() != 2) return Usage(args);
  absl::StatusOr<kvcache::curve::KeyPair> pair = kvcache::curve::NewKeyPair();
  if (!pair.ok()) return Fail(pair.status());
  if (absl::Status written = kvcache::curve::WriteSecretKeyFile(args[1], pair->secret_key);
      !written.ok()) {
    return Fail(written);
  }
  std::printf("%s\n", pair->public_key.c_str());
  return 0;
}

// A line per buffered event (--json: per batch,
// {"sequence":N,"batch":[ts,[event...],rank]}).
int KvEvents(const Args& args) {
  uint64_t from = 0;
  if (args.size() > 2 || (args.size() == 2 && !absl::SimpleAtoi(args[1], &from))) {
    return Usage(args);
  }
  kvcache::KvEventCurve curve{.server_key = absl::GetFlag(FLAGS_kv_events_server_key)};
  const std::string key_file = absl::GetFlag(FLAGS_kv_events_curve_key_file);
  if (curve.server_key.empty() != key_file.empty()) {
    return Fail(absl::InvalidArgumentError(
        "--kv_events_server_key and --kv_events_curve_key_file: CURVE needs both"));
  }
  if (!curve.server_key.empty()) {
    if (absl::Status valid = kvcache::curve::CheckKey(curve.server_key, "--kv_events_server_key");
        !valid.ok()) {
      return Fail(valid);
    }
    absl::StatusOr<kvcache::curve::KeyPair> pair =
        kvcache::curve::ReadSecretKeyFile(key_file, "--kv_events_curve_key_file");
    if (!pair.ok()) return Fail(pair.status());
    curve.public_key = pair->public_key;
    curve.secret_key = pair->secret_key;
  }
  absl::StatusOr<std::vector<kvcache::KvEventBatch>> batches =
      kvcache::ReplayKvEvents(absl::GetFlag(FLAGS_kv_events_replay), from, absl::Seconds(5), curve);
  if (!batches.ok()) return Fail(batches.status());
  for (const kvcache::KvEventBatch& batch : *batches) {
    if (absl::GetFlag(FLAGS_json)) {
      std::printf("{\"sequence\":%llu,\"batch\":%s}\n",
                  static_cast<unsigned long long>(batch.sequence), batch.json.c_str());
      continue;
    }
    for (const std::string& line : batch.summary) std::printf("%s\n", line.c_str());
  }
  return 0;
}

// Every field of a cache, or of a snapshot, by its id.
int Describe(kvcache::Client& client, const Args& args) {
  if (args.size() != 2) return Usage(args);
  absl::StatusOr<kvcache::v1::CacheInfo> cache = client.GetCache(args[1]);
  if (cache.ok()) {
    std::printf("cache %s\n%s", args[1], cache->Utf8DebugString().c_str());
    return 0;
  }
  if (!absl::IsNotFound(cache.status())) return Fail(cache.status());
  auto snapshots = client.ListSnapshots();
  if (!snapshots.ok()) return Fail(snapshots.status());
  for (const kvcache::v1::SnapshotInfo& snapshot : *snapshots) {
    if (snapshot.snapshot_id() != args[1]) continue;
    std::printf("snapshot %s\n%s", args[1], snapshot.Utf8DebugString().c_str());
    return 0;
  }
  return Fail(absl::NotFoundError(absl::StrCat("no cache or snapshot ", args[1])));
}

// The fleet of --peers or --etcd_endpoints, its clients made with `options`.
absl::StatusOr<std::unique_ptr<kvcache::ShardedClient>> ConnectFleet(
    const kvcache::ClientOptions& options) {
  kvcache::ShardedClientOptions fleet_options{
      .etcd = {.endpoints = absl::GetFlag(FLAGS_etcd_endpoints),
               .prefix = absl::GetFlag(FLAGS_etcd_prefix),
               .ca_file = absl::GetFlag(FLAGS_etcd_ca),
               .cert_file = absl::GetFlag(FLAGS_etcd_cert),
               .key_file = absl::GetFlag(FLAGS_etcd_key)},
      .on_etcd_failure =
          [](const absl::Status& failure) {
            std::fprintf(stderr, "kvcachectl: etcd: %s (trying again)\n",
                         failure.ToString().c_str());
          },
      .client = options};
  if (!absl::GetFlag(FLAGS_peers).empty()) {
    absl::StatusOr<std::vector<kvcache::Replica>> replicas =
        kvcache::ParsePeers(absl::GetFlag(FLAGS_peers));
    if (!replicas.ok()) return replicas.status();
    fleet_options.replicas = *replicas;
  }
  return kvcache::ShardedClient::Connect(fleet_options);
}

using ServerCommand = int (*)(kvcache::Client&, const Args&);
using FleetCommand = int (*)(kvcache::ShardedClient&, const Args&);
using LocalCommand = int (*)(const Args&);

// Each replica in turn, under a header naming it; the worst exit code.
int OnEveryReplica(kvcache::ShardedClient& fleet, ServerCommand run, const Args& args) {
  int worst = 0;
  for (size_t i = 0; i < fleet.size(); ++i) {
    std::printf("== replica %s (%s)\n", fleet.replica(i).name.c_str(),
                fleet.replica(i).address.c_str());
    worst = std::max(worst, run(fleet.client(i), args));
  }
  return worst;
}

// On the replica the id (args[1]) names.
int OnIdsReplica(kvcache::ShardedClient& fleet, ServerCommand run, const Args& args) {
  if (args.size() < 2) return Usage(args);
  absl::StatusOr<kvcache::Client*> owner = fleet.Owner(args[1]);
  if (!owner.ok()) return Fail(owner.status());
  return run(**owner, args);
}

// On the replica --replica names.
int OnNamedReplica(kvcache::ShardedClient& fleet, ServerCommand run, const Args& args) {
  const std::string wanted = absl::GetFlag(FLAGS_replica);
  for (size_t i = 0; i < fleet.size(); ++i) {
    if (fleet.replica(i).name == wanted) return run(fleet.client(i), args);
  }
  return Fail(absl::InvalidArgumentError(
      absl::StrCat("replica: with --peers, ", args[0], " needs --replica=NAME of the fleet")));
}

int Replicas(kvcache::ShardedClient& fleet, const Args&) {
  for (size_t i = 0; i < fleet.size(); ++i) {
    const kvcache::Replica replica = fleet.replica(i);
    std::printf("%s %s\n", replica.name.c_str(), replica.address.c_str());
  }
  return 0;
}

// From a snapshot of another replica, the fleet copies it over first.
int RestoreOnFleet(kvcache::ShardedClient& fleet, const Args& args) {
  if (args.size() != 3 || absl::GetFlag(FLAGS_target) < 0) {
    return OnIdsReplica(fleet, Restore, args);
  }
  auto cache = fleet.Restore(args[1], args[2], absl::GetFlag(FLAGS_target));
  if (!cache.ok()) return Fail(cache.status());
  PrintCache(*cache);
  return 0;
}

// Each id on the replica it names.
int RenewOnFleet(kvcache::ShardedClient& fleet, const Args& args) {
  if (args.size() < 2) return Usage(args);
  int worst = 0;
  for (size_t i = 1; i < args.size(); ++i) {
    absl::StatusOr<kvcache::Client*> owner = fleet.Owner(args[i]);
    worst = std::max(worst, owner.ok() ? Renew(**owner, {args[0], args[i]}) : Fail(owner.status()));
  }
  return worst;
}

// Where a command runs: here, or on one kvcached (--server); over a fleet
// (--peers or --etcd_endpoints), on which of its replicas.
enum class Runs {
  kHere,                     // this machine, or an endpoint of its own flag: no kvcached client
  kOnlyOverAFleet,           // needs --peers or --etcd_endpoints
  kOnEveryReplica,           // each replica in turn
  kOnEveryReplicaWithoutId,  // each replica, or with an id the replica it names
  kOnIdsReplica,             // the replica its id (the first argument) names
  kOnNamedReplica,           // --replica=NAME
};

struct Command {
  const char* name;
  const char* usage;  // its arguments and flags, after the name
  Runs runs;
  ServerCommand on_server = nullptr;
  // Over a fleet in place of `runs`' choice of replicas; for kOnlyOverAFleet, the command.
  FleetCommand on_fleet = nullptr;
  LocalCommand here = nullptr;  // for kHere
};

// Every command, in the order the usage lists them.
constexpr Command kCommands[] = {
    {.name = "replicas", .usage = "", .runs = Runs::kOnlyOverAFleet, .on_fleet = Replicas},
    {.name = "stats", .usage = "", .runs = Runs::kOnEveryReplica, .on_server = Stats},
    {.name = "caches",
     .usage = "[--tenant=NAME]",
     .runs = Runs::kOnEveryReplica,
     .on_server = Caches},
    {.name = "snapshots",
     .usage = "[CACHE] [--tenant=NAME]",
     .runs = Runs::kOnEveryReplicaWithoutId,
     .on_server = Snapshots},
    // Idle snapshots' device pages down a tier now (all of them without BYTES).
    {.name = "evict",
     .usage = "[BYTES] [--tenant=NAME]",
     .runs = Runs::kOnEveryReplica,
     .on_server = Evict},
    {.name = "snapshot",
     .usage = "CACHE [--from=N] [--pinned] [--ttl=S]",
     .runs = Runs::kOnIdsReplica,
     .on_server = Snapshot},
    // Without a snapshot, rewinds the live cache.
    {.name = "restore",
     .usage = "CACHE [SNAPSHOT] --target=N",
     .runs = Runs::kOnIdsReplica,
     .on_server = Restore,
     .on_fleet = RestoreOnFleet},
    {.name = "release", .usage = "SNAPSHOT", .runs = Runs::kOnIdsReplica, .on_server = Release},
    {.name = "pin", .usage = "SNAPSHOT", .runs = Runs::kOnIdsReplica, .on_server = Pin},
    {.name = "unpin", .usage = "SNAPSHOT", .runs = Runs::kOnIdsReplica, .on_server = Unpin},
    // Caches' or snapshots' leases.
    {.name = "renew",
     .usage = "ID...",
     .runs = Runs::kOnIdsReplica,
     .on_server = Renew,
     .on_fleet = RenewOnFleet},
    // The published prefixes.
    {.name = "prefixes", .usage = "", .runs = Runs::kOnEveryReplica, .on_server = Prefixes},
    // Prompt-cache files (mlx-lm's save_prompt_cache layout): to this machine.
    {.name = "save",
     .usage = "SNAPSHOT FILE [--metadata=k=v,...]",
     .runs = Runs::kOnIdsReplica,
     .on_server = Save},
    // From this machine (--pinned, --ttl=S too).
    {.name = "load",
     .usage = "FILE [--name=NAME]",
     .runs = Runs::kOnNamedReplica,
     .on_server = Load},
    // The server copies a peer's snapshot itself.
    {.name = "pull",
     .usage = "SNAPSHOT [--pinned] [--ttl=S]",
     .runs = Runs::kOnNamedReplica,
     .on_server = Pull},
    // The files in the server's data dir.
    {.name = "saved", .usage = "", .runs = Runs::kOnEveryReplica, .on_server = Saved},
    // Into the server's data dir (--metadata=k=v,... too).
    {.name = "store", .usage = "SNAPSHOT NAME", .runs = Runs::kOnIdsReplica, .on_server = Store},
    {.name = "load-saved", .usage = "NAME", .runs = Runs::kOnNamedReplica, .on_server = LoadSaved},
    {.name = "download",
     .usage = "NAME FILE",
     .runs = Runs::kOnNamedReplica,
     .on_server = Download},
    {.name = "delete-saved",
     .usage = "NAME",
     .runs = Runs::kOnNamedReplica,
     .on_server = DeleteSaved},
    // Every field of a cache or a snapshot.
    {.name = "describe", .usage = "ID", .runs = Runs::kOnIdsReplica, .on_server = Describe},
    // grpc.health.v1; exit 0 only when SERVING.
    {.name = "health", .usage = "[SERVICE]", .runs = Runs::kOnEveryReplica, .on_server = Health},
    // kvcached's Prometheus endpoint (its --metrics_listen).
    {.name = "metrics",
     .usage = "[FILTER] [--metrics=HOST:PORT]",
     .runs = Runs::kHere,
     .here = Metrics},
    // The KV events a replica still buffers, from batch FROM: what a vLLM-style
    // router has been told (--json, --kv_events_replay=tcp://HOST:PORT; with
    // CURVE, --kv_events_server_key=Z85 --kv_events_curve_key_file=FILE).
    {.name = "kv-events", .usage = "[FROM]", .runs = Runs::kHere, .here = KvEvents},
    // A new CURVE pair: the secret key into SECRET_FILE (mode 600), the public
    // key printed, for a replica's or a subscriber's list.
    {.name = "curve-keypair", .usage = "SECRET_FILE", .runs = Runs::kHere, .here = CurveKeypair},
};

const Command* FindCommand(absl::string_view name) {
  for (const Command& command : kCommands) {
    if (name == command.name) return &command;
  }
  return nullptr;
}

std::string UsageLine(const Command& command) {
  return *command.usage == '\0' ? command.name : absl::StrCat(command.name, " ", command.usage);
}

int Usage(const Args& args) {
  return Fail(
      absl::InvalidArgumentError(absl::StrCat("usage: ", UsageLine(*FindCommand(args[0])))));
}

// The program's usage: the connection flags, then every command's line.
std::string ProgramUsage() {
  std::vector<std::string> lines;
  for (const Command& command : kCommands) lines.push_back(UsageLine(command));
  return absl::StrCat(
      "kvcachectl [--server=ADDR | --peers=NAME=ADDR,... | --etcd_endpoints=HOST:PORT,...] ",
      absl::StrJoin(lines, " | "));
}

int OnFleet(const Command& command, const kvcache::ClientOptions& options, const Args& args) {
  absl::StatusOr<std::unique_ptr<kvcache::ShardedClient>> fleet = ConnectFleet(options);
  if (!fleet.ok()) return Fail(fleet.status());
  if (command.on_fleet != nullptr) return command.on_fleet(**fleet, args);
  switch (command.runs) {
    case Runs::kOnEveryReplicaWithoutId:
      if (args.size() > 1) return OnIdsReplica(**fleet, command.on_server, args);
      return OnEveryReplica(**fleet, command.on_server, args);
    case Runs::kOnEveryReplica:
      return OnEveryReplica(**fleet, command.on_server, args);
    case Runs::kOnNamedReplica:
      return OnNamedReplica(**fleet, command.on_server, args);
    default:
      return OnIdsReplica(**fleet, command.on_server, args);
  }
}

// The connection flags' ClientOptions; the token from $KVCACHE_TOKEN where
// --token is empty.
absl::StatusOr<kvcache::ClientOptions> OptionsFromFlags() {
  return kvcache::ClientOptionsFrom(
      {.address = absl::GetFlag(FLAGS_server),
       .token = kvcache::OrEnvironment(absl::GetFlag(FLAGS_token), "KVCACHE_TOKEN"),
       .tls = absl::GetFlag(FLAGS_tls),
       .tls_ca_file = absl::GetFlag(FLAGS_tls_ca),
       .tls_cert_file = absl::GetFlag(FLAGS_tls_cert),
       .tls_key_file = absl::GetFlag(FLAGS_tls_key),
       .tls_server_name = absl::GetFlag(FLAGS_tls_server_name)});
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage = ProgramUsage();
  absl::SetProgramUsageMessage(usage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  args.erase(args.begin());
  if (args.empty()) {
    std::fprintf(stderr, "%s\n", usage.c_str());
    return 2;
  }
  const Command* command = FindCommand(args[0]);
  if (command == nullptr) {
    std::fprintf(stderr, "kvcachectl: unknown command \"%s\"\n%s\n", args[0], usage.c_str());
    return 2;
  }
  absl::StatusOr<kvcache::ClientOptions> options = OptionsFromFlags();
  if (!options.ok()) return Fail(options.status());
  if (command->runs == Runs::kHere) return command->here(args);
  if (!absl::GetFlag(FLAGS_peers).empty() || !absl::GetFlag(FLAGS_etcd_endpoints).empty()) {
    return OnFleet(*command, *options, args);
  }
  if (command->runs == Runs::kOnlyOverAFleet) {
    std::fprintf(stderr, "kvcachectl: %s needs a fleet: --peers or --etcd_endpoints\n", args[0]);
    return 2;
  }
  auto client = kvcache::Client::Connect(*options);
  return command->on_server(*client, args);
}
