#include "handlers_test_base.h"

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "reference_quantized.h"
#include "reference_recurrent.h"
#include "wire_forms_util.h"

namespace kvcache::testing {

void HandlersTestBase::SetUp() {
  GpuTestBase::SetUp();
  pool_ = MakePool(64 << 10, 64 << 20);
  ASSERT_NE(pool_, nullptr);
  engine_ = std::make_unique<engine::Engine>(
      *pool_, engine::EngineOptions{.page_tokens = 16, .max_update_tokens = 64});
  handlers_ = std::make_unique<service::Handlers>(
      *engine_, service::ServiceOptions{.device_name = "test", .transfer_path = "direct"});
}

void HandlersTestBase::TearDown() {
  if (engine_) {
    ReleaseEverything(*engine_);
    EXPECT_EQ(pool_->stats().used_pages, 0u) << "pages leaked";
  }
  handlers_.reset();
  engine_.reset();
  pool_.reset();
  GpuTestBase::TearDown();
}

void HandlersTestBase::ExpectRefused(absl::StatusCode code, const std::string& field,
                                     const std::function<absl::Status()>& call) {
  SCOPED_TRACE(field);
  const FullFingerprint before = FullFingerprintOf(*engine_);
  const absl::Status status = call();
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr(field));
  EXPECT_TRUE(FullFingerprintOf(*engine_) == before) << "a refused call changed state";
}

std::string HandlersTestBase::Create(const engine::CacheSpec& spec) {
  v1::CreateCacheRequest request;
  *request.mutable_spec() = ToWireSpec(spec);
  v1::CacheInfo info;
  const absl::Status status = handlers_->CreateCache(request, &info);
  EXPECT_TRUE(status.ok()) << status;
  return info.cache_id();
}

v1::UpdateRequest HandlersTestBase::RandomLayerUpdate(const std::string& id,
                                                     const engine::CacheSpec& spec,
                                                     uint32_t layer, uint64_t tokens,
                                                     LayerUpdateData& data) {
  v1::UpdateRequest request;
  request.set_cache_id(id);
  request.set_layer(layer);
  data = LayerUpdateData{};
  if (engine::IsRecurrent(spec.layers[layer])) {
    data.state = RandomState(spec, layer, rng_);
    *request.mutable_state() = ToWireState(spec, layer, data.state, tokens);
    return request;
  }
  const KvTensors kv = RandomLayerKv(spec, layer, tokens, rng_);
  const RefShape shape = ShapeOf(spec, layer);
  for (auto [tensor, bytes, dim] : {std::tuple{request.mutable_keys(), &kv.keys, shape.k_dim},
                                    std::tuple{request.mutable_values(), &kv.values, shape.v_dim}}) {
    tensor->set_dtype(static_cast<v1::DType>(spec.dtype));
    for (uint64_t d : {uint64_t{shape.batch}, uint64_t{shape.heads}, tokens, uint64_t{dim}}) {
      tensor->add_shape(d);
    }
    tensor->set_data(reinterpret_cast<const char*>(bytes->data()), bytes->size());
  }
  data.tokens = TokensFromTensors(shape, kv.keys, kv.values, tokens);
  return request;
}

::testing::AssertionResult HandlersTestBase::Step(const std::string& id, RefCache& reference,
                                                  uint64_t tokens) {
  const engine::CacheSpec& spec = reference.spec();
  for (uint32_t layer = 0; layer < spec.layers.size(); ++layer) {
    LayerUpdateData data;
    const v1::UpdateRequest request = RandomLayerUpdate(id, spec, layer, tokens, data);
    v1::UpdateResponse ack;
    const absl::Status status = handlers_->Update(request, nullptr, &ack);
    if (!status.ok()) return ::testing::AssertionFailure() << "layer " << layer << ": " << status;
    if (engine::IsRecurrent(spec.layers[layer])) {
      reference.UpdateState(layer, std::move(data.state), tokens);
    } else {
      reference.Update(layer, std::move(data.tokens));
    }
    if (ack.offset() != reference.layer(layer).offset()) {
      return ::testing::AssertionFailure()
             << "layer " << layer << " acknowledged at " << ack.offset();
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult HandlersTestBase::Matches(const std::string& id,
                                                     const RefCache& reference) {
  absl::StatusOr<engine::CacheInfo> info = engine_->GetCache(id);
  if (!info.ok()) return ::testing::AssertionFailure() << info.status();
  const engine::CacheSpec& spec = reference.spec();
  std::vector<uint32_t> padding = spec.left_padding;
  if (std::all_of(padding.begin(), padding.end(), [](uint32_t p) { return p == 0; })) {
    padding.clear();  // the engine drops all-zero padding
  }
  if (info->spec.batch_size != spec.batch_size || info->spec.left_padding != padding ||
      info->layer_offsets != reference.layer_offsets()) {
    return ::testing::AssertionFailure() << "rows, padding or offsets differ";
  }
  auto view = engine_->Freeze(id, "");
  if (!view.ok()) return ::testing::AssertionFailure() << view.status();
  for (uint32_t layer = 0; layer < reference.num_layers(); ++layer) {
    if (engine::IsRecurrent(spec.layers[layer])) {
      absl::StatusOr<RefState> state = ReadLayerState(**view, layer);
      if (!state.ok()) return ::testing::AssertionFailure() << state.status();
      if (!(*state == reference.layer(layer).FetchState().value_or(ZeroState(spec, layer)))) {
        return ::testing::AssertionFailure() << "layer " << layer << ": state differs";
      }
      continue;
    }
    absl::StatusOr<std::vector<RefToken>> tokens = FetchStoredLayer(**view, layer, kEverything);
    if (!tokens.ok()) return ::testing::AssertionFailure() << tokens.status();
    ::testing::AssertionResult same = SameTokens(reference.layer(layer).Fetch(), *tokens);
    if (!same) return same << " (layer " << layer << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace kvcache::testing
