#include "service/tokens_file.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>
#include <limits>
#include <sstream>
#include <variant>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/client_text.h"

namespace kvcache {
namespace {

bool ValidTenantName(absl::string_view name) {
  if (name.empty() || name.size() > kMaxTenantNameBytes) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') return false;
  }
  return true;
}

absl::Status LineError(int line, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tokens_file line ", line, ": ", what));
}

template <typename Int>
absl::Status ParseLimit(int line, absl::string_view key, absl::string_view value, Int& out) {
  uint64_t parsed = 0;
  if (!absl::SimpleAtoi(value, &parsed) || parsed > std::numeric_limits<Int>::max()) {
    return LineError(line, absl::StrCat(key, ": ", Quoted(value), " is not a count in range"));
  }
  out = static_cast<Int>(parsed);
  return absl::OkStatus();
}

absl::Status ParseDigest(int line, absl::string_view hex, TokenDigest& out) {
  if (hex.size() != 2 * out.size()) {
    return LineError(line, "sha256: must be 64 hex digits");
  }
  for (char c : hex) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) {
      return LineError(line, "sha256: must be 64 hex digits");
    }
  }
  const std::string bytes = absl::HexStringToBytes(hex);
  std::copy(bytes.begin(), bytes.end(), out.begin());
  return absl::OkStatus();
}

// The bytes of the fields kTenantQuotaKeys sets, each counted once per row.
constexpr size_t QuotaKeyFieldBytes() {
  size_t bytes = 0;
  for (const TenantQuotaKey& quota : kTenantQuotaKeys) {
    bytes += std::holds_alternative<uint64_t TenantQuotas::*>(quota.field) ? sizeof(uint64_t)
                                                                           : sizeof(uint32_t);
  }
  return bytes;
}
// A new TenantQuotas field needs its row in kTenantQuotaKeys, or no file
// could set it; a field without one (or a row twice) breaks this.
static_assert(sizeof(TenantQuotas) == QuotaKeyFieldBytes(),
              "every TenantQuotas field needs exactly one row in kTenantQuotaKeys");

// The message for a key the file does not know, with the keys it does.
std::string UnknownKey(absl::string_view key) {
  std::string known = "tenant, token, sha256";
  for (const TenantQuotaKey& quota : kTenantQuotaKeys) absl::StrAppend(&known, ", ", quota.name);
  return absl::StrCat("unknown key ", Quoted(key), " (known: ", known, ")");
}

// One line's fields into `tenant`; whether it named a token.
absl::StatusOr<bool> ParseField(int line, absl::string_view field, TenantConfig& tenant) {
  if (field == "admin") {
    tenant.admin = true;
    return false;
  }
  const size_t equals = field.find('=');
  if (equals == absl::string_view::npos) {
    return LineError(line, absl::StrCat(Quoted(field.substr(0, 32)), " is not key=value"));
  }
  const absl::string_view key = field.substr(0, equals);
  const absl::string_view value = field.substr(equals + 1);
  if (key == "tenant") {
    if (!ValidTenantName(value)) {
      return LineError(line, "tenant: must be 1-64 of [A-Za-z0-9_-]");
    }
    tenant.name = std::string(value);
    return false;
  }
  if (key == "token") {
    if (value.size() < kMinTokenBytes) {
      return LineError(line, absl::StrCat("token: shorter than ", kMinTokenBytes, " bytes"));
    }
    if (value.size() > kMaxTokenBytes) {
      return LineError(line, absl::StrCat("token: longer than ", kMaxTokenBytes, " bytes"));
    }
    tenant.token_digest = DigestToken(value);
    return true;
  }
  if (key == "sha256") {
    if (absl::Status status = ParseDigest(line, value, tenant.token_digest); !status.ok()) {
      return status;
    }
    return true;
  }
  for (const TenantQuotaKey& quota : kTenantQuotaKeys) {
    if (key != quota.name) continue;
    absl::Status parsed = std::visit(
        [&](auto field) { return ParseLimit(line, key, value, tenant.quotas.*field); },
        quota.field);
    if (!parsed.ok()) return parsed;
    return false;
  }
  return LineError(line, UnknownKey(key));
}

absl::StatusOr<TenantConfig> ParseLine(int line, absl::string_view text) {
  TenantConfig tenant;
  int tokens = 0;
  for (absl::string_view field : absl::StrSplit(text, absl::ByAnyChar(" \t"), absl::SkipEmpty())) {
    absl::StatusOr<bool> named_token = ParseField(line, field, tenant);
    if (!named_token.ok()) return named_token.status();
    tokens += *named_token ? 1 : 0;
  }
  if (tenant.name.empty()) return LineError(line, "tenant: missing");
  if (tokens != 1) return LineError(line, "needs exactly one of token= and sha256=");
  return tenant;
}

}  // namespace

TokenDigest DigestToken(absl::string_view token) {
  TokenDigest digest;
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest.data());
  return digest;
}

absl::StatusOr<std::vector<TenantConfig>> ParseTokensFile(absl::string_view text) {
  std::vector<TenantConfig> tenants;
  absl::flat_hash_set<std::string> names, digests;
  int line = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line;
    absl::string_view content = absl::StripAsciiWhitespace(raw);
    if (content.empty() || content.front() == '#') continue;
    absl::StatusOr<TenantConfig> tenant = ParseLine(line, content);
    if (!tenant.ok()) return tenant.status();
    if (!names.insert(tenant->name).second) {
      return LineError(line, absl::StrCat("tenant ", tenant->name, " is named twice"));
    }
    const std::string digest(tenant->token_digest.begin(), tenant->token_digest.end());
    if (!digests.insert(digest).second) {
      return LineError(line, "token: another tenant has the same token");
    }
    tenants.push_back(*std::move(tenant));
  }
  if (tenants.empty()) return absl::InvalidArgumentError("tokens_file: names no tenant");
  return tenants;
}

absl::StatusOr<std::vector<TenantConfig>> ReadTokensFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("tokens_file: cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  return ParseTokensFile(text.str());
}

TokenDirectory::TokenDirectory(const std::vector<TenantConfig>& tenants) {
  digests_.reserve(tenants.size());
  for (const TenantConfig& tenant : tenants) digests_.push_back(tenant.token_digest);
}

int TokenDirectory::FindDigest(const TokenDigest& presented) const {
  int found = -1;
  for (size_t i = 0; i < digests_.size(); ++i) {
    // Every digest is compared in full and no loop ends early.
    const bool equal = CRYPTO_memcmp(presented.data(), digests_[i].data(), presented.size()) == 0;
    found = equal ? static_cast<int>(i) : found;
  }
  return found;
}

}  // namespace kvcache
