#include "batch_test_util.h"

#include <algorithm>
#include <cstring>

#include "reference_batch.h"

namespace kvcache::testing {
namespace {

constexpr uint64_t kPageBytes = 4096;
constexpr uint64_t kBudgetBytes = 4 << 20;

float FloatAt(const std::vector<std::byte>& bytes, size_t index) {
  float value;
  std::memcpy(&value, bytes.data() + index * sizeof(float), sizeof(float));
  return value;
}

}  // namespace

engine::LayerSpec TinyStandard() { return StandardLayerSpec(1, 2, 2); }

engine::LayerSpec TinyRotating(uint32_t max_size, uint32_t keep) {
  return RotatingLayerSpec(1, 2, 2, max_size, keep);
}

engine::CacheSpec TinySpec(std::vector<engine::LayerSpec> layers, std::vector<uint32_t> padding) {
  engine::CacheSpec spec =
      MakeSpec(std::move(layers), DType::kFloat32, static_cast<uint32_t>(padding.size()));
  // All zero is no padding (a spec with padding may not keep rotating sinks).
  if (std::any_of(padding.begin(), padding.end(), [](uint32_t p) { return p != 0; })) {
    spec.left_padding = std::move(padding);
  }
  return spec;
}

void BatchTestBase::SetUp() {
  GpuTestBase::SetUp();
  StartEngine(kBudgetBytes, engine::EngineOptions{.page_tokens = 3});
}

void BatchTestBase::TearDown() {
  if (engine_ != nullptr) {
    ReleaseEverything(*engine_);
    EXPECT_EQ(pool_->stats().used_pages, 0u) << "pages leaked";
  }
  engine_.reset();
  pool_.reset();
  GpuTestBase::TearDown();
}

void BatchTestBase::StartEngine(uint64_t budget_bytes, engine::EngineOptions options) {
  engine_.reset();
  pool_ = MakePool(kPageBytes, budget_bytes);
  ASSERT_NE(pool_, nullptr);
  engine_ = std::make_unique<engine::Engine>(*pool_, options);
}

std::string BatchTestBase::NewCache(const engine::CacheSpec& spec) {
  absl::StatusOr<engine::CacheInfo> info = engine_->CreateCache(spec);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->cache_id : "";
}

void BatchTestBase::Append(const std::string& id, uint64_t tokens, int tag, uint64_t step) {
  absl::StatusOr<engine::CacheInfo> info = engine_->GetCache(id);
  ASSERT_TRUE(info.ok()) << info.status();
  const uint32_t batch = info->spec.batch_size;
  for (uint64_t done = 0; done < tokens;) {
    const uint64_t count = step == 0 ? tokens : std::min(step, tokens - done);
    const uint64_t first = info->offset + done;
    std::vector<float> keys(batch * count * 2), values(keys.size());
    for (uint32_t r = 0; r < batch; ++r) {
      for (uint64_t l = 0; l < count; ++l) {
        for (uint32_t d = 0; d < 2; ++d) {
          keys[(r * count + l) * 2 + d] = TaggedValue(tag, r, first + l, d);
          values[(r * count + l) * 2 + d] = -TaggedValue(tag, r, first + l, d);
        }
      }
    }
    const auto bytes = [](const std::vector<float>& v) {
      return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(v.data()), v.size() * 4);
    };
    for (uint32_t layer = 0; layer < info->spec.layers.size(); ++layer) {
      auto result = engine_->Update(id, layer, {bytes(keys), bytes(values), count});
      ASSERT_TRUE(result.ok()) << result.status();
    }
    done += count;
  }
}

BatchTestBase::RowContents BatchTestBase::Row(const std::string& id, uint32_t layer, uint32_t row) {
  RowContents contents;
  auto view = engine_->Freeze(id, "");
  EXPECT_TRUE(view.ok()) << view.status();
  if (!view.ok()) return contents;
  contents.ranges = (*view)->Ranges(layer, kEverything);
  absl::StatusOr<std::vector<RefToken>> tokens = FetchLayer(**view, layer, kEverything);
  EXPECT_TRUE(tokens.ok()) << tokens.status();
  if (!tokens.ok()) return contents;
  const RefShape shape = ShapeOf((*view)->spec, layer);
  for (const RefToken& token : *tokens) {
    const RefRowBytes bytes = RowOf(shape, token, row);
    contents.keys.push_back(FloatAt(bytes.keys, 0));
    for (size_t d = 0; d < 2; ++d) {
      EXPECT_EQ(FloatAt(bytes.values, d), -FloatAt(bytes.keys, d)) << "position " << token.position;
      EXPECT_EQ(FloatAt(bytes.keys, d),
                FloatAt(bytes.keys, 0) == 0 ? 0 : FloatAt(bytes.keys, 0) + d);
    }
  }
  return contents;
}

std::vector<float> BatchTestBase::Expected(int tag, uint32_t source_row, uint64_t source_begin,
                                           uint64_t count) {
  std::vector<float> keys;
  for (uint64_t i = 0; i < count; ++i) {
    keys.push_back(tag < 0 ? 0.0f : TaggedValue(tag, source_row, source_begin + i, 0));
  }
  return keys;
}

}  // namespace kvcache::testing
