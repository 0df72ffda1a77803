// Whose activity each field of kvcache.v1.Stats shows, declared once: one
// table gives every field its scope, and ScopeStatsFor clears and sums by it,
// so what a tenant may see of the others is decided per field, here.
//
// A caller's own handlers fill its Stats from its own engine, over the pool
// that every tenant shares; the scope then says what becomes of each field:
//
//   scope             no tenants    a tenant            an admin
//   kIdentity         set here: tenant = the caller, server_wide = it sees all
//   kServerSetting    as filled     as filled           as filled
//   kOwnLimit         as filled     as filled           as filled (its own)
//   kOwn              as filled     as filled           as filled (its own)
//   kSummedForAdmin   as filled     as filled           every tenant's, summed
//   kSharedPool       as filled     0                   as filled
//
// A field added to Stats needs a row in the table (stats_scopes_test.cc walks
// the descriptor), so a new counter cannot reach tenants undecided.
#pragma once

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache::service {

enum class StatsScope {
  // Who the counts are for (tenant, server_wide): set by ScopeStatsFor.
  kIdentity,
  // How the server runs, the same for every caller: the device, addresses,
  // the sizes of the pool and of its tiers.
  kServerSetting,
  // The caller's own budget or quota (its engine's, its tokens-file line's);
  // an admin's stays its own.
  kOwnLimit,
  // The caller's own use, an admin's too, never summed: the tier bytes its
  // account holds, its request log.
  kOwn,
  // The caller's own use; an admin sees every tenant's summed (uint64 only).
  kSummedForAdmin,
  // The shared pool's use by everyone: it would show how busy the other
  // tenants are, so a tenant that is not an admin reads 0 (uint64 only).
  kSharedPool,
};

struct StatsFieldScope {
  int field_number;  // v1::Stats::k...FieldNumber
  StatsScope scope;
};

// Every field of v1::Stats and its scope, in field-number order.
absl::Span<const StatsFieldScope> StatsFieldScopes();

// Who asks for Stats, which decides how much of the server it sees.
enum class StatsViewer {
  kOnlyCaller,  // a server without tenants: its one caller sees all of it
  kTenant,      // a tenant that is not an admin: its own counts only
  kAdmin,       // every tenant's counts summed, and the shared pool's use
};

// Scopes `stats`, as `tenant`'s own handlers filled it, for `viewer`.
// `every_tenant` holds each tenant's own counts (the caller's among them),
// read for an admin only; its kSummedForAdmin fields are what is summed.
void ScopeStatsFor(StatsViewer viewer, absl::string_view tenant,
                   absl::Span<const v1::Stats> every_tenant, v1::Stats& stats);

}  // namespace kvcache::service
