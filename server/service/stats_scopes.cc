#include "service/stats_scopes.h"

#include <cstdint>
#include <string>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"

namespace kvcache::service {
namespace {

using google::protobuf::FieldDescriptor;
using S = v1::Stats;

// Each field's scope, from what GetStats has shown each caller since tenants
// came: the pool's use by everyone is hidden from tenants, their own engines'
// counts are summed for admins, and limits stay the caller's own.
constexpr StatsFieldScope kStatsFieldScopes[] = {
    {S::kDeviceFieldNumber, StatsScope::kServerSetting},
    {S::kPoolBytesTotalFieldNumber, StatsScope::kServerSetting},
    {S::kPoolBytesUsedFieldNumber, StatsScope::kSharedPool},
    {S::kPageBytesFieldNumber, StatsScope::kServerSetting},
    {S::kPagesUsedFieldNumber, StatsScope::kSharedPool},
    {S::kPagesTotalFieldNumber, StatsScope::kServerSetting},
    {S::kCachesFieldNumber, StatsScope::kSummedForAdmin},
    {S::kSnapshotsFieldNumber, StatsScope::kSummedForAdmin},
    {S::kEvictionsFieldNumber, StatsScope::kSharedPool},
    {S::kTransferPathFieldNumber, StatsScope::kServerSetting},
    {S::kDataLaneAddressFieldNumber, StatsScope::kServerSetting},
    {S::kCachesExpiredFieldNumber, StatsScope::kSummedForAdmin},
    {S::kSnapshotsExpiredFieldNumber, StatsScope::kSummedForAdmin},
    {S::kPinnedBytesFieldNumber, StatsScope::kSummedForAdmin},
    {S::kMaxPinnedBytesFieldNumber, StatsScope::kOwnLimit},
    {S::kMetadataBytesFieldNumber, StatsScope::kSummedForAdmin},
    {S::kMaxMetadataBytesFieldNumber, StatsScope::kOwnLimit},
    {S::kHostPagesUsedFieldNumber, StatsScope::kSharedPool},
    {S::kHostPagesTotalFieldNumber, StatsScope::kServerSetting},
    {S::kDiskPagesUsedFieldNumber, StatsScope::kSharedPool},
    {S::kDiskPagesTotalFieldNumber, StatsScope::kServerSetting},
    {S::kDemotionsFieldNumber, StatsScope::kSharedPool},
    {S::kPromotionsFromHostFieldNumber, StatsScope::kSharedPool},
    {S::kPromotionsFromDiskFieldNumber, StatsScope::kSharedPool},
    {S::kPrefixEntriesFieldNumber, StatsScope::kSummedForAdmin},
    {S::kPrefixTokensFieldNumber, StatsScope::kSummedForAdmin},
    {S::kPrefixLookupsFieldNumber, StatsScope::kSummedForAdmin},
    {S::kPrefixHitsFieldNumber, StatsScope::kSummedForAdmin},
    {S::kPrefixMatchedTokensFieldNumber, StatsScope::kSummedForAdmin},
    {S::kPrefixEntriesDroppedFieldNumber, StatsScope::kSummedForAdmin},
    {S::kTenantFieldNumber, StatsScope::kIdentity},
    {S::kServerWideFieldNumber, StatsScope::kIdentity},
    {S::kReplicaNameFieldNumber, StatsScope::kServerSetting},
    {S::kTenantDeviceBytesFieldNumber, StatsScope::kOwn},
    {S::kTenantHostBytesFieldNumber, StatsScope::kOwn},
    {S::kTenantDiskBytesFieldNumber, StatsScope::kOwn},
    {S::kTenantMaxDeviceBytesFieldNumber, StatsScope::kOwnLimit},
    {S::kTenantMaxHostBytesFieldNumber, StatsScope::kOwnLimit},
    {S::kTenantMaxDiskBytesFieldNumber, StatsScope::kOwnLimit},
    {S::kSavedBytesFieldNumber, StatsScope::kSummedForAdmin},
    {S::kMaxSavedBytesFieldNumber, StatsScope::kOwnLimit},
    {S::kRequestLogEntriesFieldNumber, StatsScope::kOwn},
    {S::kRequestLogBytesFieldNumber, StatsScope::kOwn},
    {S::kRequestsReplayedFieldNumber, StatsScope::kOwn},
};

// Calls `visit` with each field of `scope`.
template <typename Visit>
void ForEachFieldOf(StatsScope scope, Visit visit) {
  const google::protobuf::Descriptor& descriptor = *S::descriptor();
  for (const StatsFieldScope& entry : kStatsFieldScopes) {
    if (entry.scope == scope) visit(*descriptor.FindFieldByNumber(entry.field_number));
  }
}

void ClearSharedPool(S& stats) {
  const google::protobuf::Reflection& reflection = *stats.GetReflection();
  ForEachFieldOf(StatsScope::kSharedPool,
                 [&](const FieldDescriptor& field) { reflection.ClearField(&stats, &field); });
}

void SumOverTenants(absl::Span<const S> every_tenant, S& stats) {
  const google::protobuf::Reflection& reflection = *stats.GetReflection();
  ForEachFieldOf(StatsScope::kSummedForAdmin, [&](const FieldDescriptor& field) {
    uint64_t sum = 0;
    for (const S& counts : every_tenant) sum += reflection.GetUInt64(counts, &field);
    reflection.SetUInt64(&stats, &field, sum);
  });
}

}  // namespace

absl::Span<const StatsFieldScope> StatsFieldScopes() { return kStatsFieldScopes; }

void ScopeStatsFor(StatsViewer viewer, absl::string_view tenant,
                   absl::Span<const v1::Stats> every_tenant, v1::Stats& stats) {
  stats.set_tenant(std::string(tenant));
  stats.set_server_wide(viewer != StatsViewer::kTenant);
  if (viewer == StatsViewer::kTenant) ClearSharedPool(stats);
  if (viewer == StatsViewer::kAdmin) SumOverTenants(every_tenant, stats);
}

}  // namespace kvcache::service
