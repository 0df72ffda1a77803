// Handler tests without a network: every validation rule answers with the
// right code, names the field, and changes nothing.
#include "service/handlers.h"

#include <memory>
#include <random>

#include "engine_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "handlers_test_base.h"
#include "service/calls/update_parser.h"
#include "service/convert.h"
#include "service_test_util.h"
#include "support/gpu_test_base.h"
#include "update_wire_util.h"

namespace kvcache::testing {
namespace {

using ::testing::HasSubstr;

// A cache of two standard layers and a rotating one (window 8, 4 sinks), 5
// tokens each, and a snapshot of it.
class HandlersTest : public HandlersTestBase {
 protected:
  void SetUp() override {
    HandlersTestBase::SetUp();
    if (HasFatalFailure()) return;
    spec_ = ProtoSpec(2, 2, 8, /*window=*/8);
    v1::CreateCacheRequest create;
    *create.mutable_spec() = spec_;
    v1::CacheInfo info;
    ASSERT_TRUE(handlers_->CreateCache(create, &info).ok());
    cache_id_ = info.cache_id();
    for (uint32_t layer = 0; layer < 3; ++layer) {
      v1::UpdateResponse ack;
      ASSERT_TRUE(handlers_->Update(RandomUpdate(cache_id_, spec_, layer, 5, rng_), nullptr, &ack).ok());
    }
    v1::SnapshotRequest snap;
    snap.set_cache_id(cache_id_);
    v1::SnapshotInfo snapshot;
    ASSERT_TRUE(handlers_->Snapshot(snap, &snapshot).ok());
    snapshot_id_ = snapshot.snapshot_id();
  }

  absl::Status Update(const v1::UpdateRequest& request) {
    v1::UpdateResponse ack;
    return handlers_->Update(request, nullptr, &ack);
  }

  v1::CacheSpec spec_;
  std::string cache_id_;
  std::string snapshot_id_;
};

TEST_P(HandlersTest, CreateCacheRefusesMalformedSpecs) {
  const auto create = [&](v1::CacheSpec spec) {
    return [this, spec] {
      v1::CreateCacheRequest request;
      *request.mutable_spec() = spec;
      v1::CacheInfo info;
      return handlers_->CreateCache(request, &info);
    };
  };
  using Code = absl::StatusCode;
  ExpectRefused(Code::kInvalidArgument, "spec.layers", create(ProtoSpec(0, 2, 8)));
  v1::CacheSpec spec = spec_;
  spec.set_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectRefused(Code::kInvalidArgument, "spec.dtype", create(spec));
  spec = spec_;
  spec.mutable_layers(1)->clear_kind();
  ExpectRefused(Code::kInvalidArgument, "spec.layers[1].kind", create(spec));
  spec = spec_;
  spec.mutable_layers(0)->set_num_kv_heads(0);
  ExpectRefused(Code::kInvalidArgument, "layers[0].num_kv_heads", create(spec));
  spec = spec_;
  spec.mutable_layers(1)->set_k_head_dim(0);
  ExpectRefused(Code::kInvalidArgument, "layers[1].k_head_dim", create(spec));
  spec = spec_;
  spec.mutable_layers(2)->mutable_rotating()->set_keep(8);
  ExpectRefused(Code::kInvalidArgument, "layers[2].rotating.keep", create(spec));
  spec = spec_;
  spec.mutable_layers(2)->mutable_rotating()->set_max_size(0);
  ExpectRefused(Code::kInvalidArgument, "layers[2].rotating.max_size", create(spec));
  spec = spec_;
  spec.mutable_layers(0)->set_k_head_dim(1 << 20);
  ExpectRefused(Code::kInvalidArgument, "layers[0].k_head_dim", create(spec));
}

TEST_P(HandlersTest, UpdateRefusesEachMalformedField) {
  using Code = absl::StatusCode;
  const v1::UpdateRequest good = RandomUpdate(cache_id_, spec_, 0, 3, rng_);
  const auto refuse = [&](Code code, const std::string& field, auto mutate) {
    v1::UpdateRequest request = good;
    mutate(request);
    ExpectRefused(code, field, [&] { return Update(request); });
  };
  refuse(Code::kInvalidArgument, "cache_id", [](auto& r) { r.clear_cache_id(); });
  refuse(Code::kNotFound, "cache_id", [](auto& r) { r.set_cache_id("0123456789abcdef"); });
  refuse(Code::kInvalidArgument, "layer", [](auto& r) { r.set_layer(3); });
  refuse(Code::kInvalidArgument, "keys.dtype", [](auto& r) { r.mutable_keys()->set_dtype(v1::DTYPE_FLOAT32); });
  refuse(Code::kInvalidArgument, "values.dtype", [](auto& r) { r.mutable_values()->set_dtype(v1::DTYPE_BFLOAT16); });
  refuse(Code::kInvalidArgument, "keys.shape", [](auto& r) { r.mutable_keys()->mutable_shape()->RemoveLast(); });
  refuse(Code::kInvalidArgument, "keys.shape[0]", [](auto& r) { r.mutable_keys()->set_shape(0, 2); });
  refuse(Code::kInvalidArgument, "keys.shape[1]", [](auto& r) { r.mutable_keys()->set_shape(1, 3); });
  refuse(Code::kInvalidArgument, "keys.shape[2]", [](auto& r) { r.mutable_keys()->set_shape(2, 0); });
  refuse(Code::kInvalidArgument, "keys.shape[3]", [](auto& r) { r.mutable_keys()->set_shape(3, 16); });
  refuse(Code::kInvalidArgument, "values.shape[2]", [](auto& r) { r.mutable_values()->set_shape(2, 4); });
  refuse(Code::kInvalidArgument, "keys.data", [](auto& r) { r.mutable_keys()->mutable_data()->pop_back(); });
  refuse(Code::kInvalidArgument, "values.data", [](auto& r) { r.mutable_values()->mutable_data()->append("xy"); });
  refuse(Code::kFailedPrecondition, "expected_offset", [](auto& r) { r.set_expected_offset(4); });
  refuse(Code::kInvalidArgument, "state", [](auto& r) { r.mutable_state()->set_advance(1); });
  const v1::UpdateRequest too_long = RandomUpdate(cache_id_, spec_, 0, 65, rng_);
  ExpectRefused(Code::kInvalidArgument, "tokens", [&] { return Update(too_long); });
}

TEST_P(HandlersTest, UpdateAppliesAndAcknowledges) {
  v1::UpdateRequest request = RandomUpdate(cache_id_, spec_, 1, 3, rng_);
  request.set_expected_offset(5);
  v1::UpdateResponse ack;
  ASSERT_TRUE(handlers_->Update(request, nullptr, &ack).ok());
  EXPECT_EQ(ack.layer(), 1u);
  EXPECT_EQ(ack.offset(), 8u);
  v1::GetCacheRequest get;
  get.set_cache_id(cache_id_);
  v1::CacheInfo info;
  ASSERT_TRUE(handlers_->GetCache(get, &info).ok());
  EXPECT_FALSE(info.in_step());
  EXPECT_EQ(info.offset(), 5u);
  EXPECT_EQ(info.layer_offsets(1), 8u);
}

// Updates parsed from messages cut anywhere (tensors in many pieces, as gRPC
// delivers large ones) land byte for byte, on every layer kind.
TEST_P(HandlersTest, TensorsInPiecesAreWrittenWhole) {
  for (int round = 0; round < 30; ++round) {
    const uint32_t layer = round % 3;
    const v1::UpdateRequest request = RandomUpdate(cache_id_, spec_, layer, 1 + round % 7, rng_);
    const std::vector<std::string> pieces =
        RandomPieces(request.SerializeAsString(), rng_, /*max_cuts=*/60);
    service::UpdateView view;
    ASSERT_TRUE(service::ParseUpdateRequest(Spans(pieces), view));
    v1::UpdateResponse ack;
    ASSERT_TRUE(handlers_->Update(view, nullptr, &ack).ok());
    const uint64_t tokens = request.keys().shape(2);
    auto live = engine_->Freeze(cache_id_, "");
    ASSERT_TRUE(live.ok()) << live.status();
    std::string keys(request.keys().data().size(), '\0');
    std::string values(request.values().data().size(), '\0');
    const engine::KvOutput out{
        .keys = absl::MakeSpan(reinterpret_cast<std::byte*>(keys.data()), keys.size()),
        .values = absl::MakeSpan(reinterpret_cast<std::byte*>(values.data()), values.size())};
    ASSERT_TRUE((*live)->Read(layer, {ack.offset() - tokens, ack.offset()}, out).ok());
    EXPECT_EQ(keys, request.keys().data()) << "round " << round;
    EXPECT_EQ(values, request.values().data()) << "round " << round;
  }
}

// A cache of one standard and one recurrent layer, batch 2: the recurrent
// layer takes a state (conv [2, 3, 16], delta [2, 2, 4, 8]) and nothing else.
TEST_P(HandlersTest, UpdateChecksRecurrentStates) {
  using Code = absl::StatusCode;
  v1::CreateCacheRequest create;
  *create.mutable_spec() = ProtoSpec(1, 2, 8, 0, v1::DTYPE_FLOAT16, /*batch=*/2);
  v1::RecurrentLayer* kind = create.mutable_spec()->add_layers()->mutable_recurrent();
  kind->set_conv_tail(3);
  kind->set_conv_dim(16);
  kind->set_num_v_heads(2);
  kind->set_head_v_dim(4);
  kind->set_head_k_dim(8);
  v1::CacheInfo info;
  ASSERT_TRUE(handlers_->CreateCache(create, &info).ok());
  v1::UpdateRequest good;
  good.set_cache_id(info.cache_id());
  good.set_layer(1);
  *good.mutable_state()->mutable_conv_state() = RandomTensor(v1::DTYPE_FLOAT16, {2, 3, 16}, rng_);
  *good.mutable_state()->mutable_delta_state() =
      RandomTensor(v1::DTYPE_FLOAT16, {2, 2, 4, 8}, rng_);
  good.mutable_state()->set_advance(5);
  const auto refuse = [&](Code code, const std::string& field, auto mutate) {
    v1::UpdateRequest request = good;
    mutate(request);
    ExpectRefused(code, field, [&] { return Update(request); });
  };
  const v1::UpdateRequest kv = RandomUpdate(info.cache_id(), create.spec(), 0, 2, rng_);
  refuse(Code::kInvalidArgument, "keys", [&](auto& r) { *r.mutable_keys() = kv.keys(); });
  refuse(Code::kInvalidArgument, "values", [&](auto& r) { *r.mutable_values() = kv.values(); });
  refuse(Code::kInvalidArgument, "state", [](auto& r) { r.clear_state(); });
  refuse(Code::kInvalidArgument, "state.conv_state.dtype",
         [](auto& r) { r.mutable_state()->mutable_conv_state()->set_dtype(v1::DTYPE_FLOAT32); });
  refuse(Code::kInvalidArgument, "state.conv_state.shape",
         [](auto& r) { r.mutable_state()->mutable_conv_state()->mutable_shape()->RemoveLast(); });
  refuse(Code::kInvalidArgument, "state.conv_state.shape[0]",
         [](auto& r) { r.mutable_state()->mutable_conv_state()->set_shape(0, 1); });
  refuse(Code::kInvalidArgument, "state.conv_state.shape[1]",
         [](auto& r) { r.mutable_state()->mutable_conv_state()->set_shape(1, 4); });
  refuse(Code::kInvalidArgument, "state.delta_state.shape[3]",
         [](auto& r) { r.mutable_state()->mutable_delta_state()->set_shape(3, 4); });
  refuse(Code::kInvalidArgument, "state.delta_state.data",
         [](auto& r) { r.mutable_state()->mutable_delta_state()->mutable_data()->pop_back(); });
  refuse(Code::kInvalidArgument, "state.delta_state.dtype",
         [](auto& r) { r.mutable_state()->clear_delta_state(); });
  refuse(Code::kFailedPrecondition, "expected_offset", [](auto& r) { r.set_expected_offset(2); });
  v1::UpdateResponse ack;
  ASSERT_TRUE(handlers_->Update(good, nullptr, &ack).ok());
  EXPECT_EQ(ack.layer(), 1u);
  EXPECT_EQ(ack.offset(), 5u);
  good.set_expected_offset(5);
  good.mutable_state()->set_advance(0);  // replaces the state in place
  ASSERT_TRUE(handlers_->Update(good, nullptr, &ack).ok());
  EXPECT_EQ(ack.offset(), 5u);
  // An attention layer of the same cache refuses a state.
  v1::UpdateRequest state_on_kv = kv;
  *state_on_kv.mutable_state() = good.state();
  ExpectRefused(Code::kInvalidArgument, "state", [&] { return Update(state_on_kv); });
}

TEST_P(HandlersTest, IdsAreRequiredAndLookedUp) {
  using Code = absl::StatusCode;
  v1::TrimRequest trim;
  v1::TrimResponse trimmed;
  ExpectRefused(Code::kInvalidArgument, "cache_id", [&] { return handlers_->Trim(trim, &trimmed); });
  v1::SnapshotRequest snap;
  v1::SnapshotInfo info;
  ExpectRefused(Code::kInvalidArgument, "cache_id", [&] { return handlers_->Snapshot(snap, &info); });
  snap.set_cache_id("nope");
  ExpectRefused(Code::kNotFound, "cache_id", [&] { return handlers_->Snapshot(snap, &info); });
  v1::RestoreRequest restore;
  restore.set_cache_id(cache_id_);
  restore.set_snapshot_id("nope");
  v1::CacheInfo cache;
  ExpectRefused(Code::kNotFound, "snapshot_id", [&] { return handlers_->Restore(restore, &cache); });
  v1::MergeSnapshotsRequest merge;
  merge.set_parent_id(snapshot_id_);
  ExpectRefused(Code::kInvalidArgument, "child_id", [&] { return handlers_->MergeSnapshots(merge, &info); });
  merge.set_child_id("nope");
  ExpectRefused(Code::kNotFound, "snapshot_id", [&] { return handlers_->MergeSnapshots(merge, &info); });
  v1::SplitSnapshotRequest split;
  v1::SplitSnapshotResponse halves;
  ExpectRefused(Code::kInvalidArgument, "snapshot_id", [&] { return handlers_->SplitSnapshot(split, &halves); });
  split.set_snapshot_id(snapshot_id_);
  split.set_at(5);
  ExpectRefused(Code::kFailedPrecondition, "split point", [&] { return handlers_->SplitSnapshot(split, &halves); });
  v1::ReleaseSnapshotRequest release;
  v1::ReleaseSnapshotResponse released;
  ExpectRefused(Code::kInvalidArgument, "snapshot_id", [&] { return handlers_->ReleaseSnapshot(release, &released); });
  v1::DeleteCacheRequest remove;
  remove.set_cache_id("nope");
  v1::DeleteCacheResponse removed;
  ExpectRefused(Code::kNotFound, "cache_id", [&] { return handlers_->DeleteCache(remove, &removed); });
}

TEST_P(HandlersTest, FetchRefusesBadRequests) {
  using Code = absl::StatusCode;
  const auto plan = [&](v1::FetchRequest request) {
    return [this, request] { return handlers_->PlanFetch(request).status(); };
  };
  ExpectRefused(Code::kInvalidArgument, "cache_id", plan(v1::FetchRequest()));
  v1::FetchRequest request;
  request.set_cache_id(cache_id_);
  request.set_start(4);
  request.set_end(2);
  ExpectRefused(Code::kInvalidArgument, "end", plan(request));
  request.clear_end();
  request.add_layers(7);
  ExpectRefused(Code::kInvalidArgument, "layers[0]", plan(request));
  request.clear_layers();
  request.set_snapshot_id("nope");
  ExpectRefused(Code::kNotFound, "snapshot_id", plan(request));
}

TEST_P(HandlersTest, FetchChunksEachLayerInTemporalOrder) {
  for (int step = 0; step < 10; ++step) {  // 15 tokens: the 8-token window has wrapped
    for (uint32_t layer = 0; layer < 3; ++layer) {
      ASSERT_TRUE(Update(RandomUpdate(cache_id_, spec_, layer, 1, rng_)).ok());
    }
  }
  v1::FetchRequest request;
  request.set_cache_id(cache_id_);
  request.set_max_chunk_tokens(4);
  auto plan = handlers_->PlanFetch(request);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<std::pair<uint32_t, std::pair<uint64_t, uint64_t>>> seen;
  for (size_t i = 0; i < plan->chunks.size(); ++i) {
    v1::FetchResponse chunk;
    ASSERT_TRUE(handlers_->FillFetchChunk(*plan, i, &chunk).ok());
    const uint64_t length = chunk.keys().shape(2);
    EXPECT_LE(length, 4u);
    EXPECT_EQ(chunk.keys().data().size(), 2 * length * 8 * 2);
    seen.push_back({chunk.layer(), {chunk.start(), chunk.start() + length}});
  }
  using Chunk = std::pair<uint32_t, std::pair<uint64_t, uint64_t>>;
  const std::vector<Chunk> expected = {
      {0, {0, 4}},  {0, {4, 8}},  {0, {8, 12}}, {0, {12, 15}},
      {1, {0, 4}},  {1, {4, 8}},  {1, {8, 12}}, {1, {12, 15}},
      {2, {0, 4}},  {2, {11, 15}}};  // sinks [0,4), then the window's last 4
  EXPECT_EQ(seen, expected);
}

TEST_P(HandlersTest, StatsCountWhatIsHeld) {
  v1::Stats stats;
  ASSERT_TRUE(handlers_->GetStats(v1::GetStatsRequest(), &stats).ok());
  EXPECT_EQ(stats.device(), "test");
  EXPECT_EQ(stats.caches(), 1u);
  EXPECT_EQ(stats.snapshots(), 1u);
  EXPECT_EQ(stats.pages_used(), pool_->stats().used_pages);
  EXPECT_GT(stats.pages_used(), 0u);
  EXPECT_EQ(stats.page_bytes(), 64u << 10);
}

// TrimResponse as the contract says, per kind: every layer drops the least of
// n and what each can (a chunked layer only what it holds above its start
// position), and the cache is the one the trim left. A layer that cannot drop
// tokens (a recurrent state; a rotating window that has filled) refuses the
// whole trim, naming itself and why.
TEST_P(HandlersTest, TrimAnswersWhatEveryLayerDropped) {
  const engine::CacheSpec chunked =
      MakeSpec({ChunkedLayerSpec(1, 4, 4, 6), StandardLayerSpec(1, 4)});
  RefCache reference(chunked);
  v1::TrimRequest trim;
  trim.set_cache_id(Create(chunked));
  ASSERT_TRUE(Step(trim.cache_id(), reference, 10));
  ASSERT_TRUE(Step(trim.cache_id(), reference, 2));  // chunked: start 4, offset 12
  trim.set_n(100);
  v1::TrimResponse trimmed;
  ASSERT_TRUE(handlers_->Trim(trim, &trimmed).ok());
  EXPECT_EQ(trimmed.trimmed(), 8u);
  EXPECT_EQ(reference.Trim(100), std::optional<uint64_t>(8));
  EXPECT_EQ(trimmed.cache().offset(), 4u);
  EXPECT_THAT(trimmed.cache().layer_offsets(), ::testing::ElementsAre(4u, 4u));
  EXPECT_TRUE(Matches(trim.cache_id(), reference));

  using Code = absl::StatusCode;
  trim.set_n(1);
  const engine::CacheSpec recurrent =
      MakeSpec({StandardLayerSpec(1, 4), RecurrentLayerSpec(2, 4, 1, 2, 2)});
  RefCache recurrent_ref(recurrent);
  trim.set_cache_id(Create(recurrent));
  ASSERT_TRUE(Step(trim.cache_id(), recurrent_ref, 3));
  ExpectRefused(Code::kFailedPrecondition, "layer 1 cannot be trimmed: a recurrent state",
                [&] { return handlers_->Trim(trim, &trimmed); });
  trim.set_cache_id(cache_id_);
  for (uint32_t layer = 0; layer < 3; ++layer) {
    ASSERT_TRUE(Update(RandomUpdate(cache_id_, spec_, layer, 3, rng_)).ok());  // offset 8
  }
  ExpectRefused(Code::kFailedPrecondition,
                "layer 2 cannot be trimmed: its rotating window has filled",
                [&] { return handlers_->Trim(trim, &trimmed); });
}

TEST(ConvertTest, ALeaseLongerThanTtlSecondsCanSayShowsItsLongest) {
  v1::Lease lease;
  service::ToProto(engine::LeaseInfo{.id = "x", .ttl = absl::Hours(24 * 365 * 200)}, &lease);
  EXPECT_EQ(lease.ttl_seconds(), std::numeric_limits<uint32_t>::max());
  service::ToProto(engine::LeaseInfo{.id = "x", .ttl = absl::Seconds(90)}, &lease);
  EXPECT_EQ(lease.ttl_seconds(), 90u);
  v1::SnapshotInfo info;
  service::ToProto(engine::SnapshotInfo{.ttl = absl::InfiniteDuration()}, &info);
  EXPECT_EQ(info.ttl_seconds(), std::numeric_limits<uint32_t>::max());
}

INSTANTIATE_TEST_SUITE_P(AllPaths, HandlersTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
