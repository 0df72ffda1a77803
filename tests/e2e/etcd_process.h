// An etcd server of Debian's etcd-server package, on loopback ports of its
// own and a data dir of the test's, for the tests of fleets that etcd lists.
#pragma once

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "fleet_test_util.h"
#include "gtest/gtest.h"
#include "wire/etcd/etcd_fleet.h"

namespace kvcache::testing {

// PEM files of a TLS etcd that admits only clients with certificates of its CA.
struct EtcdTls {
  std::string ca, cert, key;            // etcd's own
  std::string client_cert, client_key;  // what the test's own reads present
};

class EtcdProcess {
 public:
  explicit EtcdProcess(std::string dir, std::optional<EtcdTls> tls = std::nullopt)
      : dir_(std::move(dir)),
        tls_(std::move(tls)),
        client_url_(absl::StrCat(tls_ ? "https" : "http", "://127.0.0.1:", FreePort())),
        peer_url_(absl::StrCat("http://127.0.0.1:", FreePort())) {}
  ~EtcdProcess() { Kill(); }

  // Where the etcd binary is; empty when etcd-server is not installed.
  static std::string Binary() { return access(ETCD_BINARY, X_OK) == 0 ? ETCD_BINARY : ""; }

  // host:port of its client API.
  std::string endpoint() const { return client_url_.substr(client_url_.find("//") + 2); }

  // Starts it and waits until it answers a read.
  ::testing::AssertionResult Start() {
    std::vector<std::string> args = {Binary(),
                                     "--name=test",
                                     "--data-dir=" + dir_,
                                     "--listen-client-urls=" + client_url_,
                                     "--advertise-client-urls=" + client_url_,
                                     "--listen-peer-urls=" + peer_url_,
                                     "--initial-advertise-peer-urls=" + peer_url_,
                                     "--initial-cluster=test=" + peer_url_};
    if (tls_) {
      args.insert(args.end(), {"--cert-file=" + tls_->cert, "--key-file=" + tls_->key,
                               "--client-cert-auth", "--trusted-ca-file=" + tls_->ca});
    }
    const std::string log = dir_ + ".log";
    pid_ = SpawnLogged(args, log);
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      channel_ = nullptr;  // a new one each time, not one backing off since the first refusal
      etcdserverpb::RangeRequest request;
      request.set_key("/");
      etcdserverpb::RangeResponse answer;
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
      if (Kv()->Range(&context, request, &answer).ok()) return ::testing::AssertionSuccess();
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
        pid_ = -1;
        return ::testing::AssertionFailure() << "etcd exited at start; see " << dir_ << ".log";
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return ::testing::AssertionFailure() << "etcd did not answer; see " << dir_ << ".log";
  }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  std::unique_ptr<etcdserverpb::KV::Stub> Kv() { return etcdserverpb::KV::NewStub(Channel()); }
  std::unique_ptr<etcdserverpb::Lease::Stub> Lease() {
    return etcdserverpb::Lease::NewStub(Channel());
  }

  // The keys under `prefix` and their values.
  std::map<std::string, std::string> Listed(const std::string& prefix) {
    etcdserverpb::RangeRequest request;
    request.set_key(prefix);
    request.set_range_end(etcd::PrefixRangeEnd(prefix));
    etcdserverpb::RangeResponse answer;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    std::map<std::string, std::string> listed;
    if (!Kv()->Range(&context, request, &answer).ok()) return listed;
    for (const mvccpb::KeyValue& kv : answer.kvs()) listed[kv.key()] = kv.value();
    return listed;
  }

 private:
  std::shared_ptr<grpc::Channel> Channel() {
    if (channel_) return channel_;
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
    if (tls_) {
      auto read = [](const std::string& path) {
        std::ifstream file(path);
        return std::string((std::istreambuf_iterator<char>(file)), {});
      };
      credentials = grpc::SslCredentials({.pem_root_certs = read(tls_->ca),
                                          .pem_private_key = read(tls_->client_key),
                                          .pem_cert_chain = read(tls_->client_cert)});
    }
    channel_ = grpc::CreateChannel(endpoint(), credentials);
    return channel_;
  }

  std::string dir_;
  std::optional<EtcdTls> tls_;
  std::string client_url_, peer_url_;
  std::shared_ptr<grpc::Channel> channel_;
  pid_t pid_ = -1;
};

}  // namespace kvcache::testing
