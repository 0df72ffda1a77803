// Whose activity GetStats shows, field by field: every field of v1::Stats has
// a declared scope, a tenant that is not an admin sees nothing of another
// tenant in any field, an admin sees every tenant's counts summed, and a
// server without tenants shows its one caller everything. Each Stats here has
// every field set, by reflection, to a value no other field and no other
// tenant holds, so a field that leaks shows whose value it carries.
#include "service/stats_scopes.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "google/protobuf/descriptor.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace kvcache::service {
namespace {

using google::protobuf::FieldDescriptor;

std::optional<StatsScope> ScopeOf(const FieldDescriptor& field) {
  for (const StatsFieldScope& entry : StatsFieldScopes()) {
    if (entry.field_number == field.number()) return entry.scope;
  }
  return std::nullopt;
}

// Every field of Stats, in declaration order.
std::vector<const FieldDescriptor*> StatsFields() {
  const google::protobuf::Descriptor& descriptor = *v1::Stats::descriptor();
  std::vector<const FieldDescriptor*> fields;
  for (int i = 0; i < descriptor.field_count(); ++i) fields.push_back(descriptor.field(i));
  return fields;
}

// A field's value as text, whatever its type, so any two can be compared.
std::string ValueOf(const v1::Stats& stats, const FieldDescriptor& field) {
  std::string text;
  google::protobuf::TextFormat::PrintFieldValueToString(stats, &field, -1, &text);
  return text;
}

bool IsZero(const v1::Stats& stats, const FieldDescriptor& field) {
  return !stats.GetReflection()->HasField(stats, &field);  // proto3: unset is 0, "" or false
}

// Stats with every field set: numbers to `base` plus the field's number
// (bases 1000 apart never meet), strings to "<who>.<field>", bools to true.
v1::Stats EveryFieldSet(uint64_t base, const std::string& who) {
  v1::Stats stats;
  const google::protobuf::Reflection& reflection = *stats.GetReflection();
  for (const FieldDescriptor* field : StatsFields()) {
    const uint64_t number = base + field->number();
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_UINT64:
        reflection.SetUInt64(&stats, field, number);
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        reflection.SetUInt32(&stats, field, static_cast<uint32_t>(number));
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        reflection.SetInt64(&stats, field, static_cast<int64_t>(number));
        break;
      case FieldDescriptor::CPPTYPE_STRING:
        reflection.SetString(&stats, field, who + "." + field->name());
        break;
      case FieldDescriptor::CPPTYPE_BOOL:
        reflection.SetBool(&stats, field, true);
        break;
      default:
        ADD_FAILURE() << field->name() << ": a type this test cannot fill yet";
    }
  }
  return stats;
}

// Every field of Stats has its scope declared, once, and the table names
// nothing else: a counter added to the proto fails here until someone
// decides whether other tenants' activity shows in it.
TEST(StatsScopesTest, EveryFieldOfStatsHasOneDeclaredScope) {
  for (const FieldDescriptor* field : StatsFields()) {
    EXPECT_TRUE(ScopeOf(*field).has_value())
        << "Stats." << field->name() << " has no scope in stats_scopes.cc";
  }
  std::vector<int> seen;
  for (const StatsFieldScope& entry : StatsFieldScopes()) {
    EXPECT_NE(v1::Stats::descriptor()->FindFieldByNumber(entry.field_number), nullptr)
        << "field number " << entry.field_number << " is not a field of Stats";
    EXPECT_EQ(std::count(seen.begin(), seen.end(), entry.field_number), 0)
        << "field number " << entry.field_number << " has two scopes";
    seen.push_back(entry.field_number);
  }
}

// ScopeStatsFor clears and sums these by reflection as uint64.
TEST(StatsScopesTest, SummedAndSharedPoolFieldsAreCounts) {
  for (const FieldDescriptor* field : StatsFields()) {
    const std::optional<StatsScope> scope = ScopeOf(*field);
    if (scope != StatsScope::kSummedForAdmin && scope != StatsScope::kSharedPool) continue;
    EXPECT_EQ(field->cpp_type(), FieldDescriptor::CPPTYPE_UINT64)
        << "Stats." << field->name() << " is summed or cleared as a uint64";
    EXPECT_FALSE(field->is_repeated()) << "Stats." << field->name();
  }
}

// The contract (kvcache.proto, Stats.server_wide) names these as the shared
// pool's use, which reads 0 for a tenant that is not an admin.
TEST(StatsScopesTest, TheSharedPoolUseTheContractNamesIsSharedPool) {
  for (const char* name : {"pages_used", "pool_bytes_used", "evictions", "host_pages_used",
                           "disk_pages_used", "demotions", "promotions_from_host",
                           "promotions_from_disk"}) {
    const FieldDescriptor* field = v1::Stats::descriptor()->FindFieldByName(name);
    ASSERT_NE(field, nullptr) << name;
    EXPECT_EQ(ScopeOf(*field), StatsScope::kSharedPool) << "Stats." << name;
  }
}

// Alice's handlers filled every field (her own counts, her limits, the
// server's settings, and the shared pool's use by everyone); bob has activity
// in every field too. What alice sees holds, in every field, her own value or
// 0, and never one of bob's, even with bob's counts handed in.
TEST(StatsScopesTest, ATenantSeesNothingOfAnotherTenantInAnyField) {
  const v1::Stats alice = EveryFieldSet(1000, "alice");
  const v1::Stats bob = EveryFieldSet(2000, "bob");
  v1::Stats seen = alice;
  ScopeStatsFor(StatsViewer::kTenant, "alice", {alice, bob}, seen);

  EXPECT_EQ(seen.tenant(), "alice");
  EXPECT_FALSE(seen.server_wide());
  for (const FieldDescriptor* field : StatsFields()) {
    const std::string value = ValueOf(seen, *field);
    if (ValueOf(bob, *field) != ValueOf(alice, *field)) {
      EXPECT_NE(value, ValueOf(bob, *field)) << "Stats." << field->name() << " shows bob's";
    }
    const std::optional<StatsScope> scope = ScopeOf(*field);
    if (scope == StatsScope::kIdentity) continue;
    if (scope == StatsScope::kSharedPool) {
      EXPECT_TRUE(IsZero(seen, *field)) << "Stats." << field->name() << " = " << value
                                        << ": the shared pool's use shows the others' activity";
    } else {
      EXPECT_EQ(value, ValueOf(alice, *field)) << "Stats." << field->name() << " is alice's own";
    }
  }
}

// An admin sees every tenant's own counts summed (its own among them), and
// everything else as its handlers filled it, the shared pool's use included.
TEST(StatsScopesTest, AnAdminSeesEveryTenantsCountsSummed) {
  const v1::Stats ops = EveryFieldSet(1000, "ops");
  const v1::Stats alice = EveryFieldSet(2000, "alice");
  const v1::Stats bob = EveryFieldSet(3000, "bob");
  v1::Stats seen = ops;
  ScopeStatsFor(StatsViewer::kAdmin, "ops", {ops, alice, bob}, seen);

  EXPECT_EQ(seen.tenant(), "ops");
  EXPECT_TRUE(seen.server_wide());
  const google::protobuf::Reflection& reflection = *seen.GetReflection();
  for (const FieldDescriptor* field : StatsFields()) {
    const std::optional<StatsScope> scope = ScopeOf(*field);
    if (scope == StatsScope::kIdentity) continue;
    if (scope == StatsScope::kSummedForAdmin) {
      const uint64_t sum = reflection.GetUInt64(ops, field) + reflection.GetUInt64(alice, field) +
                           reflection.GetUInt64(bob, field);
      EXPECT_EQ(reflection.GetUInt64(seen, field), sum) << "Stats." << field->name();
    } else {
      EXPECT_EQ(ValueOf(seen, *field), ValueOf(ops, *field)) << "Stats." << field->name();
    }
  }
}

// Without tenants the one caller's counts are the server's: all shown.
TEST(StatsScopesTest, WithoutTenantsTheCallerSeesEveryField) {
  const v1::Stats filled = EveryFieldSet(1000, "");
  v1::Stats seen = filled;
  ScopeStatsFor(StatsViewer::kOnlyCaller, "", {}, seen);

  EXPECT_EQ(seen.tenant(), "");
  EXPECT_TRUE(seen.server_wide());
  for (const FieldDescriptor* field : StatsFields()) {
    if (ScopeOf(*field) == StatsScope::kIdentity) continue;
    EXPECT_EQ(ValueOf(seen, *field), ValueOf(filled, *field)) << "Stats." << field->name();
  }
}

}  // namespace
}  // namespace kvcache::service
