// The tokens file (kvcached --tokens_file): who may call, as which tenant,
// within which quotas. One tenant per line, fields as key=value:
//
//   # comments and blank lines are skipped
//   tenant=alice token=3f1c...   max_pinned_bytes=1073741824 max_requests_in_flight=64
//   tenant=ops   sha256=9a0b...  admin
//
// The quota keys, each a count (0 or absent: no limit), are kTenantQuotaKeys.
// `token=` holds the bearer token itself (at least kMinTokenBytes); `sha256=`
// its SHA-256 in hex, so that the file need not hold the secret. Only the
// digest is kept in memory, and tokens are compared digest to digest in
// constant time (TokenDirectory), so neither a log nor a timing shows them.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcache {

inline constexpr size_t kMinTokenBytes = 16;
// A token must fit a data-lane AUTH frame (lane::kMaxAuthFrameBytes) and a
// gRPC metadata entry; a longer one could never be presented.
inline constexpr size_t kMaxTokenBytes = 4 << 10;
inline constexpr size_t kMaxTenantNameBytes = 64;

using TokenDigest = std::array<unsigned char, 32>;

// SHA-256 of a bearer token.
TokenDigest DigestToken(absl::string_view token);

// What a tenant may hold; 0: no limit of its own (the server's flags still apply).
struct TenantQuotas {
  uint64_t max_pinned_bytes = 0;
  uint64_t max_metadata_bytes = 0;
  // Bytes of pool pages the tenant's caches and snapshots may hold in each
  // tier (a shared page counts once), whole pages of the server's page_bytes.
  uint64_t max_device_bytes = 0;
  uint64_t max_host_bytes = 0;
  uint64_t max_disk_bytes = 0;
  // Bytes of its saved prompt-cache files (<data_dir>/tenants/<name>), which
  // share the data dir's --disk_bytes with the disk tier and other tenants.
  uint64_t max_saved_bytes = 0;
  uint64_t max_caches = 0;
  uint64_t max_snapshots = 0;
  uint32_t max_requests_in_flight = 0;
  uint32_t max_lane_connections = 0;
};

// One quota key of the tokens file: its name, as the file, the messages that
// name the quota and the docs spell it, and the TenantQuotas field it sets.
// The field's type bounds the value: a count from 0 to its largest.
struct TenantQuotaKey {
  absl::string_view name;
  std::variant<uint64_t TenantQuotas::*, uint32_t TenantQuotas::*> field;
};

// Every quota key: the parser and its unknown-key message read this table, so
// a new quota is a field above and a row here.
inline constexpr TenantQuotaKey kTenantQuotaKeys[] = {
    {"max_pinned_bytes", &TenantQuotas::max_pinned_bytes},
    {"max_metadata_bytes", &TenantQuotas::max_metadata_bytes},
    {"max_device_bytes", &TenantQuotas::max_device_bytes},
    {"max_host_bytes", &TenantQuotas::max_host_bytes},
    {"max_disk_bytes", &TenantQuotas::max_disk_bytes},
    {"max_saved_bytes", &TenantQuotas::max_saved_bytes},
    {"max_caches", &TenantQuotas::max_caches},
    {"max_snapshots", &TenantQuotas::max_snapshots},
    {"max_requests_in_flight", &TenantQuotas::max_requests_in_flight},
    {"max_lane_connections", &TenantQuotas::max_lane_connections},
};

// The tokens file's name of a TenantQuotas field, for messages that name the
// quota a tenant ran into; empty for a field with no row.
template <typename Int>
constexpr absl::string_view TenantQuotaName(Int TenantQuotas::*field) {
  for (const TenantQuotaKey& key : kTenantQuotaKeys) {
    const auto* member = std::get_if<Int TenantQuotas::*>(&key.field);
    if (member != nullptr && *member == field) return key.name;
  }
  return {};
}

struct TenantConfig {
  std::string name;  // 1-64 of [A-Za-z0-9_-]; names its files' directory too
  TokenDigest token_digest{};
  // Sees the server's totals in GetStats (others see their own share).
  bool admin = false;
  TenantQuotas quotas;
};

// Parses the file's text. A bad line is INVALID_ARGUMENT naming its number and
// field; a token is never quoted back.
absl::StatusOr<std::vector<TenantConfig>> ParseTokensFile(absl::string_view text);
// Reads and parses `path`.
absl::StatusOr<std::vector<TenantConfig>> ReadTokensFile(const std::string& path);

// Finds the tenant of a bearer token: SHA-256 of the token against every
// tenant's digest, each compared in full, so the time taken says nothing
// about which tenant (if any) or how many bytes matched.
class TokenDirectory {
 public:
  explicit TokenDirectory(const std::vector<TenantConfig>& tenants);
  // The index in `tenants` of the token's tenant; -1 when none.
  int Find(absl::string_view token) const { return FindDigest(DigestToken(token)); }
  // The same for a token known by its digest.
  int FindDigest(const TokenDigest& presented) const;

 private:
  std::vector<TokenDigest> digests_;
};

}  // namespace kvcache
