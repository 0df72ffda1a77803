// LayerSnapshot::Mapped: the pages a Fetch chunk lies in, for sending without a
// copy (the data lane). Its pieces, joined, are exactly what Read copies, on
// every layer kind whose pages hold tokens as they are read and over ranges
// that cross pages and a rotating window's wrap; quantized and recurrent
// layers, and the staging paths, say FAILED_PRECONDITION instead.
#include <vector>

#include "chunked_recurrent_test_util.h"
#include "engine/layers/cache.h"
#include "engine/layers/layer.h"
#include "engine_test_util.h"
#include "gpu/device.h"
#include "gtest/gtest.h"
#include "hybrid_test_fixture.h"

namespace kvcache::testing {
namespace {

using engine::TokenRange;

class SnapshotViewTest : public HybridEngineTest {};

std::vector<std::byte> Joined(const std::vector<absl::Span<const std::byte>>& pieces) {
  std::vector<std::byte> joined;
  for (absl::Span<const std::byte> piece : pieces) joined.insert(joined.end(), piece.begin(), piece.end());
  return joined;
}

TEST_P(SnapshotViewTest, PiecesJoinToWhatReadCopies) {
  engine::LayerSpec quantized = StandardLayerSpec(1, 32);
  quantized.kind = engine::QuantizedKind{.group_size = 32, .bits = 8};
  const engine::CacheSpec spec =
      MakeSpec({StandardLayerSpec(2, 8, 4), RotatingLayerSpec(1, 8, 0, 7, 2),
                ChunkedLayerSpec(2, 4, 8, 5), quantized, SmallState()},
               DType::kFloat16, 2);
  HybridCache cache(*engine_, spec);
  ASSERT_TRUE(cache.Step(9));
  for (int i = 0; i < 6; ++i) ASSERT_TRUE(cache.Step(1));  // the window wraps
  auto view = engine_->Freeze(cache.id(), "");
  ASSERT_TRUE(view.ok()) << view.status();
  const bool host_visible = device().direct_host_access();
  for (uint32_t layer = 0; layer < 3; ++layer) {
    SCOPED_TRACE(layer);
    for (TokenRange range : (*view)->Ranges(layer, kEverything)) {
      // The whole range, and a part of it off the page boundaries.
      for (TokenRange part : {range, TokenRange{range.begin + 1, range.end}}) {
        if (part.size() == 0) continue;
        const engine::LayerSpec& layer_spec = spec.layers[layer];
        const uint64_t rows_heads_tokens = uint64_t{2} * layer_spec.num_kv_heads * part.size();
        const uint32_t v_dim = layer_spec.v_head_dim != 0 ? layer_spec.v_head_dim : layer_spec.k_head_dim;
        std::vector<std::byte> keys(rows_heads_tokens * layer_spec.k_head_dim * 2);  // f16
        std::vector<std::byte> values(rows_heads_tokens * v_dim * 2);
        ASSERT_TRUE((*view)->Read(layer, part, {.keys = absl::MakeSpan(keys),
                                                .values = absl::MakeSpan(values)})
                        .ok());
        engine::KvMappedPieces pieces;
        const absl::Status status = (*view)->Mapped(layer, part, pieces);
        if (!host_visible) {
          EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
          continue;
        }
        ASSERT_TRUE(status.ok()) << status;
        EXPECT_EQ(Joined(pieces.keys), keys);
        EXPECT_EQ(Joined(pieces.values), values);
      }
    }
  }
  engine::KvMappedPieces pieces;
  EXPECT_EQ((*view)->Mapped(3, {0, 4}, pieces).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*view)->Mapped(4, {0, 1}, pieces).code(), absl::StatusCode::kFailedPrecondition);
  // A range it does not hold is refused like a Read of it.
  EXPECT_EQ((*view)->Mapped(0, {0, 99}, pieces).code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, SnapshotViewTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
