// The gRPC face of kvcached: a thin callback service that admits each call
// for its tenant (tenants.h), hands it to that tenant's Handlers and maps the
// returned absl::Status to a grpc::Status, code for code.
#pragma once

#include "fleet/peers.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "service/handlers.h"
#include "service/tenants.h"
#include "service/unary_rpcs.h"

namespace kvcache::service {

// Builds Base wrapped in each of With... (the generated WithCallbackMethod_*
// templates), outermost first.
template <typename Base, template <typename> class... With>
struct WithMethods {
  using type = Base;
};
template <typename Base, template <typename> class First, template <typename> class... Rest>
struct WithMethods<Base, First, Rest...> {
  using type = First<typename WithMethods<Base, Rest...>::type>;
};

// v1::KvCacheService::CallbackService with Update and Fetch registered raw
// (grpc::ByteBuffer), so their tensors skip protobuf's copies (wire_format.h),
// and every unary RPC of unary_rpcs.h as a callback method. An RPC missing
// here would be answered "unimplemented" by the synchronous base;
// e2e_validation_test calls every RPC of the proto to catch that.
#define KV_WITH_UNARY_METHOD(Name, Request, Response) v1::KvCacheService::WithCallbackMethod_##Name,
using KvCacheServiceBase = WithMethods<v1::KvCacheService::Service,
                                       KV_FOR_EACH_UNARY_RPC(KV_WITH_UNARY_METHOD)
                                           v1::KvCacheService::WithRawCallbackMethod_Update,
                                       v1::KvCacheService::WithRawCallbackMethod_Fetch,
                                       v1::KvCacheService::WithCallbackMethod_ExportSnapshot,
                                       v1::KvCacheService::WithCallbackMethod_ImportSnapshot,
                                       v1::KvCacheService::WithCallbackMethod_PullSnapshot>::type;
#undef KV_WITH_UNARY_METHOD

// Which calls reach past their caller: those whose request names a tenant
// act on that tenant's objects (an admin token's only), and an admin-only
// call names why it is (EvictSnapshots makes room below the device by moving
// any tenant's oldest host pages to disk). Every other call acts as its
// caller; HandlersFor checks that this list and the requests' fields agree.
template <typename Request>
struct CallReach {
  static constexpr bool kNamesTenant = false;
  static constexpr const char* kAdminOnly = nullptr;
};
template <>
struct CallReach<v1::ListCachesRequest> {
  static constexpr bool kNamesTenant = true;
  static constexpr const char* kAdminOnly = nullptr;
};
template <>
struct CallReach<v1::ListSnapshotsRequest> {
  static constexpr bool kNamesTenant = true;
  static constexpr const char* kAdminOnly = nullptr;
};
template <>
struct CallReach<v1::EvictSnapshotsRequest> {
  static constexpr bool kNamesTenant = true;
  static constexpr const char* kAdminOnly =
      "EvictSnapshots needs an admin token: making room below the device may move other "
      "tenants' pages from host memory to disk";
};

class KvCacheService final : public KvCacheServiceBase {
 public:
  // `peers` (null: none) serve PullSnapshot; `replica_name` is this replica's.
  KvCacheService(Tenants& tenants, Peers* peers, std::string replica_name)
      : tenants_(tenants), peers_(peers), replica_name_(std::move(replica_name)) {}

#define KV_DECLARE_UNARY_METHOD(Name, Request, Response)                                    \
  grpc::ServerUnaryReactor* Name(grpc::CallbackServerContext* context,                     \
                                 const v1::Request* request, v1::Response* response) override;
  KV_FOR_EACH_UNARY_RPC(KV_DECLARE_UNARY_METHOD)
#undef KV_DECLARE_UNARY_METHOD

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Update(
      grpc::CallbackServerContext* context) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Fetch(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request) override;
  grpc::ServerWriteReactor<v1::FileChunk>* ExportSnapshot(
      grpc::CallbackServerContext* context, const v1::ExportSnapshotRequest* request) override;
  grpc::ServerReadReactor<v1::ImportSnapshotRequest>* ImportSnapshot(
      grpc::CallbackServerContext* context, v1::LoadSnapshotResponse* response) override;
  grpc::ServerUnaryReactor* PullSnapshot(grpc::CallbackServerContext* context,
                                         const v1::PullSnapshotRequest* request,
                                         v1::LoadSnapshotResponse* response) override;

 private:
  absl::StatusOr<Admitted> Admit(const grpc::CallbackServerContext& context);
  // What a response shows depends on who asked (GetStats); others as they are.
  template <typename Response>
  void Scope(const Admitted&, Response*) {}
  void Scope(const Admitted& call, v1::Stats* stats) { tenants_.ScopeStats(call.tenant(), *stats); }
  // Whose handlers answer (CallReach below; Tenants::HandlersFor).
  template <typename Request>
  absl::StatusOr<Handlers*> HandlersFor(const Admitted& call, const Request& request) const {
    using Reach = CallReach<Request>;
    static_assert(
        Reach::kNamesTenant == requires { request.tenant(); },
        "a request with a tenant field must be listed in CallReach, and only those");
    if constexpr (Reach::kNamesTenant) {
      return tenants_.HandlersFor(call, request.tenant(), Reach::kAdminOnly);
    } else {
      return &call.handlers();
    }
  }

  Tenants& tenants_;
  Peers* const peers_;
  const std::string replica_name_;
};

}  // namespace kvcache::service
