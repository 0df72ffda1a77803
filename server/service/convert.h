// Conversions between kvcache.v1 messages and the engine's own structs. Only
// the service knows both.
#pragma once

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvcache::service {

// INVALID_ARGUMENT naming the field for what the engine's spec cannot express
// (an unset dtype or layer kind); shape limits are the engine's to check.
absl::StatusOr<engine::CacheSpec> FromProto(const v1::CacheSpec& spec);
void ToProto(const engine::CacheSpec& spec, v1::CacheSpec* out);
void ToProto(const engine::CacheInfo& info, v1::CacheInfo* out);
void ToProto(const engine::SnapshotInfo& info, v1::SnapshotInfo* out);
void ToProto(const engine::LeaseInfo& lease, v1::Lease* out);
// What `stats` knows of Stats: everything but the server's settings
// (device, addresses, replica name), the caller's identity and its request log.
void ToProto(const engine::EngineStats& stats, v1::Stats* out);
void ToProto(absl::Time time, google::protobuf::Timestamp* out);

v1::DType ToProto(DType dtype);

}  // namespace kvcache::service
