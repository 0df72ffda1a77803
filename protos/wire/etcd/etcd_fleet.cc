#include "wire/etcd/etcd_fleet.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "wire/ids/replica_id.h"
#include "wire/net/address.h"

namespace kvcache::etcd {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view field) {
  if (path.empty()) return std::string();
  std::ifstream file(path, std::ios::binary);
  std::string pem((std::istreambuf_iterator<char>(file)), {});
  if (!file.good() && !file.eof()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read ", path));
  }
  if (pem.find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, " holds no PEM"));
  }
  return pem;
}

grpc::ChannelArguments EtcdChannelArguments() {
  grpc::ChannelArguments arguments;
  // A watch on an etcd that vanished (a partition, a host gone) ends within
  // 15 s instead of hanging: etcd admits pings every 5 s or more (its
  // --grpc-keepalive-min-time), and a watch sends no data that would let
  // gRPC go on pinging past its default two.
  arguments.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10'000);
  arguments.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5'000);
  arguments.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Back to a restarted etcd within 2 s rather than gRPC's two minutes.
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2'000);
  return arguments;
}

}  // namespace

absl::StatusOr<EtcdChannels> EtcdChannels::Make(const EtcdOptions& options) {
  if (options.prefix.empty()) {
    return absl::InvalidArgumentError("etcd_prefix: empty (every key of etcd would be a replica)");
  }
  if (options.cert_file.empty() != options.key_file.empty()) {
    return absl::InvalidArgumentError("etcd_cert, etcd_key: give both or neither");
  }
  absl::StatusOr<std::string> ca = ReadPem(options.ca_file, "etcd_ca");
  absl::StatusOr<std::string> cert = ReadPem(options.cert_file, "etcd_cert");
  absl::StatusOr<std::string> key = ReadPem(options.key_file, "etcd_key");
  for (const absl::StatusOr<std::string>* pem : {&ca, &cert, &key}) {
    if (!pem->ok()) return pem->status();
  }
  EtcdChannels channels;
  int tls_endpoints = 0;
  for (absl::string_view entry : absl::StrSplit(options.endpoints, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    bool tls = !ca->empty();
    if (absl::ConsumePrefix(&entry, "https://")) {
      tls = true;
    } else if (absl::ConsumePrefix(&entry, "http://") && tls) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd_endpoints: http://", entry, " with etcd_ca (TLS): write https://"));
    }
    entry = absl::StripSuffix(entry, "/");
    // host:port, no path, query or user: the channel's whole gRPC target.
    if (absl::Status address =
            net::ParseHostPort(entry, "etcd_endpoints", net::AddressUse::kConnect).status();
        !address.ok()) {
      return address;
    }
    if (!tls && !cert->empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "etcd_cert: a client certificate for plaintext ", entry, " (give etcd_ca or https://)"));
    }
    std::shared_ptr<grpc::ChannelCredentials> credentials =
        tls ? grpc::SslCredentials(
                  {.pem_root_certs = *ca, .pem_private_key = *key, .pem_cert_chain = *cert})
            : grpc::InsecureChannelCredentials();
    tls_endpoints += tls ? 1 : 0;
    channels.endpoints_.emplace_back(entry);
    channels.channels_.push_back(
        grpc::CreateCustomChannel(std::string(entry), credentials, EtcdChannelArguments()));
  }
  if (channels.channels_.empty()) return absl::InvalidArgumentError("etcd_endpoints: none given");
  if (tls_endpoints != 0 && tls_endpoints != static_cast<int>(channels.channels_.size())) {
    return absl::InvalidArgumentError(
        "etcd_endpoints: some https://, some plaintext (one etcd cluster speaks one of them)");
  }
  return channels;
}

std::string ReplicaKey(absl::string_view prefix, absl::string_view name) {
  return absl::StrCat(prefix, name);
}

std::string PrefixRangeEnd(absl::string_view prefix) {
  std::string end(prefix);
  while (!end.empty() && static_cast<unsigned char>(end.back()) == 0xff) end.pop_back();
  if (end.empty()) return std::string(1, '\0');  // every key from the prefix on
  end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
  return end;
}

absl::StatusOr<std::string> ReplicaOfKey(absl::string_view prefix, absl::string_view key) {
  absl::string_view name = key;
  if (!absl::ConsumePrefix(&name, prefix)) {
    return absl::InvalidArgumentError(absl::StrCat("etcd key \"", key, "\" is not under ", prefix));
  }
  if (absl::Status valid = ids::CheckReplicaName(name, absl::StrCat("etcd key ", key));
      !valid.ok()) {
    return valid;
  }
  return std::string(name);
}

absl::Status EtcdError(const grpc::Status& status, absl::string_view what,
                       absl::string_view endpoint) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("etcd at ", endpoint, ": ", what, ": ", status.error_message()));
}

absl::Duration EtcdBackoff(int failures, absl::Duration most) {
  absl::Duration wait = absl::Milliseconds(100);
  for (int i = 1; i < failures && wait < most; ++i) wait *= 2;
  return std::min(wait, most);
}

StoppableCalls::Call::Call(StoppableCalls& calls, absl::Duration timeout)
    : calls_(calls), context_(std::make_unique<grpc::ClientContext>()) {
  if (timeout != absl::InfiniteDuration()) {
    context_->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  }
  absl::MutexLock lock(&calls_.mu_);
  if (calls_.stopping_) context_->TryCancel();
  calls_.in_flight_ = context_.get();
}

StoppableCalls::Call::~Call() {
  absl::MutexLock lock(&calls_.mu_);
  calls_.in_flight_ = nullptr;
}

void StoppableCalls::Stop() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  if (in_flight_ != nullptr) in_flight_->TryCancel();
}

bool StoppableCalls::WaitStopping(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&stopping_), timeout);
}

}  // namespace kvcache::etcd
