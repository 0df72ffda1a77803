// Snapshots written as mlx-lm prompt caches (engine/files/mlx_state.h) and read
// back: every class's tensors and meta_state as mlx-lm's save_prompt_cache
// would write them (checked against plain models of mlx-lm's caches, built
// from the same token history), a cache rebuilt from the file reading the
// same bytes and writing the same file again, and every hostile file refused
// with nothing taken from the pool.
#include "engine/files/mlx_state.h"

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "chunked_recurrent_test_util.h"
#include "engine_test_util.h"
#include "gtest/gtest.h"
#include "hybrid_test_fixture.h"
#include "mlx_state_test_util.h"

namespace kvcache::testing {
namespace {

using engine::CacheSnapshot;
using engine::CacheSpec;
using engine::PromptCacheFile;

engine::LayerSpec QuantizedSpec(uint32_t heads, uint32_t k_dim, uint32_t v_dim, uint32_t group,
                                uint32_t bits) {
  return {.num_kv_heads = heads,
          .k_head_dim = k_dim,
          .v_head_dim = v_dim,
          .kind = engine::QuantizedKind{.group_size = group, .bits = bits}};
}

const std::map<std::string, std::string> kUserMetadata = {{"tokenizer_config", "{\"a\": 1}"},
                                                          {"chat.template", "x"}};

class MlxStateTest : public HybridEngineTest {
 protected:
  std::shared_ptr<const CacheSnapshot> Live(const std::string& cache_id) {
    auto view = engine_->Freeze(cache_id, "");
    EXPECT_TRUE(view.ok()) << view.status();
    return view.ok() ? *view : nullptr;
  }

  // The file of `mirror`'s cache now, checked against the mlx-lm models.
  PromptCacheFile ExportChecked(const MlxMirror& mirror) {
    const auto view = Live(mirror.id());
    if (view == nullptr) return {};
    absl::StatusOr<PromptCacheFile> file = engine::ToPromptCache(*view, kUserMetadata);
    EXPECT_TRUE(file.ok()) << file.status();
    if (!file.ok()) return {};
    EXPECT_TRUE(mirror.FileMatches(*file, *view)) << "at offset " << mirror.offset();
    EXPECT_TRUE(RoundTrips(*view, *file));
    return *file;
  }

  // A cache loaded from `file` reads as `view` and writes `file` again.
  ::testing::AssertionResult RoundTrips(const CacheSnapshot& view, const PromptCacheFile& file) {
    auto cache =
        engine::CacheFromPromptCache(file, engine::SpecLimits{}, *pool_, kHybridPageTokens);
    if (!cache.ok()) return ::testing::AssertionFailure() << cache.status();
    auto loaded = (*cache)->Freeze("loaded");
    if (!loaded.ok()) return ::testing::AssertionFailure() << loaded.status();
    if (auto same = SameContents(view, **loaded); !same) return same;
    absl::StatusOr<PromptCacheFile> again = engine::ToPromptCache(**loaded, kUserMetadata);
    if (!again.ok()) return ::testing::AssertionFailure() << again.status();
    return SameFile(file, *again);
  }

  // Loading `file` fails with `code` mentioning `text`, taking no page.
  void ExpectRefused(const PromptCacheFile& file, absl::StatusCode code, const std::string& text,
                     const engine::SpecLimits& limits = {}) {
    const int64_t before = UsedPages();
    auto cache = engine::CacheFromPromptCache(file, limits, *pool_, kHybridPageTokens);
    ASSERT_FALSE(cache.ok()) << "loaded: expected " << text;
    EXPECT_EQ(cache.status().code(), code) << cache.status();
    EXPECT_TRUE(Mentions(cache.status(), text));
    EXPECT_EQ(UsedPages(), before);
  }
};

TEST_P(MlxStateTest, StandardLayersAreKVCaches) {
  MlxMirror mirror(
      *engine_, MakeSpec({StandardLayerSpec(2, 8), StandardLayerSpec(1, 4, 6)}, DType::kFloat16, 2),
      1);
  for (uint64_t tokens : {5, 1, 3, 1}) {
    ASSERT_TRUE(mirror.Step(tokens));
    ExportChecked(mirror);
  }
}

// The ring as mlx-lm holds it: before it fills, after single-token steps
// wrap it (with and without sinks), after a multi-token step re-orders it.
TEST_P(MlxStateTest, RotatingLayersWriteTheRawRing) {
  MlxMirror mirror(*engine_,
                   MakeSpec({RotatingLayerSpec(2, 4, 0, 6, 0), RotatingLayerSpec(1, 8, 4, 5, 2)},
                            DType::kBFloat16),
                   2);
  ASSERT_TRUE(mirror.Step(3));
  ExportChecked(mirror);
  for (int step = 0; step < 12; ++step) {
    ASSERT_TRUE(mirror.Step(1));
    ExportChecked(mirror);
  }
  ASSERT_TRUE(mirror.Step(4));
  ExportChecked(mirror);
  for (int step = 0; step < 3; ++step) ASSERT_TRUE(mirror.Step(1));
  ExportChecked(mirror);
  ASSERT_TRUE(mirror.Step(9));
  ExportChecked(mirror);
}

TEST_P(MlxStateTest, QuantizedLayersKeepTheirPackedBytes) {
  MlxMirror mirror(
      *engine_,
      MakeSpec({QuantizedSpec(2, 64, 32, 32, 4), QuantizedSpec(1, 64, 64, 64, 8)}, DType::kFloat16),
      3);
  for (uint64_t tokens : {3, 1, 6}) {
    ASSERT_TRUE(mirror.Step(tokens));
    ExportChecked(mirror);
  }
}

TEST_P(MlxStateTest, ChunkedLayersSliceByOffset) {
  MlxMirror mirror(*engine_, MakeSpec({ChunkedLayerSpec(2, 4, 4, 4)}, DType::kFloat32), 4);
  for (uint64_t tokens : {3, 3, 1, 5, 1, 2}) {
    ASSERT_TRUE(mirror.Step(tokens));
    ExportChecked(mirror);
  }
}

TEST_P(MlxStateTest, RecurrentLayersAreArraysCaches) {
  MlxMirror mirror(
      *engine_,
      MakeSpec({SmallState(), StandardLayerSpec(1, 4), ThreePageState()}, DType::kFloat32), 5);
  for (uint64_t tokens : {2, 1, 4}) {
    ASSERT_TRUE(mirror.Step(tokens));
    ExportChecked(mirror);
  }
}

// No attention layer tells the offset: the state stands for one token.
TEST_P(MlxStateTest, AllRecurrentFileLoadsAtOffsetOne) {
  MlxMirror mirror(*engine_, MakeSpec({SmallState(), ThreePageState()}, DType::kFloat32), 6);
  ASSERT_TRUE(mirror.Step(7));
  const auto view = Live(mirror.id());
  auto file = engine::ToPromptCache(*view, {});
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(mirror.FileMatches(*file, *view));
  auto cache = engine::CacheFromPromptCache(*file, {}, *pool_, kHybridPageTokens);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ((*cache)->layer_offsets(), (std::vector<uint64_t>{1, 1}));
  auto loaded = (*cache)->Freeze("loaded");
  ASSERT_TRUE(loaded.ok());
  for (uint32_t layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(ReadLayerState(**loaded, layer).value(), ReadLayerState(*view, layer).value());
  }
  auto again = engine::ToPromptCache(**loaded, {});
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(SameFile(*file, *again));
}

// Left padding: BatchKVCache and BatchRotatingKVCache (before and after its
// ring wraps, and after a multi-token step re-orders it), beside ArraysCache.
CacheSpec PaddedSpec() {
  CacheSpec spec =
      MakeSpec({StandardLayerSpec(2, 4), RotatingLayerSpec(1, 4, 0, 5, 0), SmallState()},
               DType::kFloat16, 3);
  spec.left_padding = {2, 0, 1};
  return spec;
}

TEST_P(MlxStateTest, LeftPaddedCachesAreBatchCaches) {
  MlxMirror mirror(*engine_, PaddedSpec(), 7);
  ASSERT_TRUE(mirror.Step(3));
  ExportChecked(mirror);
  for (int step = 0; step < 7; ++step) {
    ASSERT_TRUE(mirror.Step(1));
    ExportChecked(mirror);
  }
  ASSERT_TRUE(mirror.Step(4));
  ExportChecked(mirror);
  ASSERT_TRUE(mirror.Step(1));
  ExportChecked(mirror);
}

TEST_P(MlxStateTest, MixedKindsInOneFile) {
  MlxMirror mirror(
      *engine_,
      MakeSpec({StandardLayerSpec(1, 8), RotatingLayerSpec(2, 4, 0, 6, 2),
                ChunkedLayerSpec(1, 4, 8, 4), QuantizedSpec(1, 32, 32, 32, 8), SmallState()},
               DType::kFloat16),
      8);
  for (uint64_t tokens : {4, 1, 1, 3, 1, 1, 1, 5}) {
    ASSERT_TRUE(mirror.Step(tokens));
    ExportChecked(mirror);
  }
}

// Random updates and trims (where every layer allows one), written and read
// back every few operations: with a rotating layer (trims only until it
// fills), without one, and beside recurrent layers (no trims at all).
TEST_P(MlxStateTest, RandomSequencesRoundTrip) {
  const std::vector<CacheSpec> specs = {
      MakeSpec({StandardLayerSpec(1, 4), RotatingLayerSpec(1, 4, 0, 7, 1),
                RotatingLayerSpec(2, 4, 4, 5, 0), ChunkedLayerSpec(1, 4, 4, 5),
                QuantizedSpec(1, 32, 64, 32, 4)},
               DType::kBFloat16),
      MakeSpec(
          {StandardLayerSpec(2, 4), ChunkedLayerSpec(1, 4, 4, 3), QuantizedSpec(1, 32, 32, 32, 8)},
          DType::kFloat16, 2),
      MakeSpec({SmallState(), RotatingLayerSpec(1, 4, 0, 4, 2), StandardLayerSpec(1, 4)},
               DType::kFloat32)};
  uint64_t seed = 20;
  for (const CacheSpec& spec : specs) {
    std::mt19937_64 rng(++seed);
    MlxMirror mirror(*engine_, spec, seed);
    for (int op = 0; op < 120; ++op) {
      const uint64_t pick = rng() % 20;
      if (pick < 4 && mirror.offset() > 0) {
        absl::StatusOr<uint64_t> trimmed = mirror.Trim(1 + rng() % 4);
        if (!trimmed.ok()) {
          EXPECT_EQ(trimmed.status().code(), absl::StatusCode::kFailedPrecondition);
        }
      } else {
        ASSERT_TRUE(mirror.Step(pick < 14 ? 1 : 2 + rng() % 6));
      }
      if (op % 8 == 7 && mirror.offset() > 0) ExportChecked(mirror);
    }
    ReleaseEverything(*engine_);
  }
}

class MlxRefusalTest : public MlxStateTest {
 protected:
  // Standard, rotating (wrapped, one sink), quantized, chunked (front
  // trimmed) and recurrent layers at offset 6.
  PromptCacheFile GoodFile() {
    MlxMirror mirror(
        *engine_,
        MakeSpec({StandardLayerSpec(1, 4), RotatingLayerSpec(1, 4, 0, 4, 1),
                  QuantizedSpec(1, 32, 32, 32, 4), ChunkedLayerSpec(1, 4, 4, 3), SmallState()},
                 DType::kFloat16),
        9);
    EXPECT_TRUE(mirror.Step(2));
    for (int step = 0; step < 4; ++step) EXPECT_TRUE(mirror.Step(1));
    return ExportChecked(mirror);
  }
};

TEST_P(MlxRefusalTest, ClassesAndLayerIndices) {
  const PromptCacheFile good = GoodFile();
  PromptCacheFile file = good;
  file.metadata["2.0"] = "FancyCache";
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "metadata \"2.0\": unknown cache class");
  file = good;
  file.metadata["2.1"] = "CacheList";
  ExpectRefused(file, absl::StatusCode::kFailedPrecondition, "loading a CacheList layer");
  file = good;
  file.metadata["2.0"] = "RotatingKVCache";  // no meta_state for it
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "metadata \"0.0.0\": missing");
  file = good;
  file.metadata["2.7"] = file.metadata["2.4"];
  file.metadata.erase("2.4");
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "metadata \"2.4\": missing");
  file = good;
  file.metadata["3.x"] = "?";
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "metadata \"3.x\": not a prompt-cache");
  ExpectRefused(good, absl::StatusCode::kInvalidArgument, "allows 4",
                engine::SpecLimits{.max_layers = 4});
  ExpectRefused(good, absl::StatusCode::kInvalidArgument, "num_kv_heads",
                engine::SpecLimits{.max_kv_heads = 0});
}

TEST_P(MlxRefusalTest, TensorsPerClass) {
  const PromptCacheFile good = GoodFile();
  PromptCacheFile file = good;
  file.tensors.erase("1.1");
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "tensor \"1.1\": missing");
  file = good;
  file.tensors.erase("2.1.2");
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "tensor \"2.1.2\": missing");
  file = good;
  file.tensors["0.2"] = good.tensors.at("0.0");
  ExpectRefused(file, absl::StatusCode::kInvalidArgument,
                "tensor \"0.2\": not part of layer 0's KVCache");
  file = good;
  file.tensors["4.2"] = good.tensors.at("4.0");
  ExpectRefused(file, absl::StatusCode::kInvalidArgument,
                "tensor \"4.2\": not part of layer 4's ArraysCache");
  file = good;
  file.metadata["0.0.0"] = "1";
  ExpectRefused(file, absl::StatusCode::kInvalidArgument,
                "metadata \"0.0.0\": not part of layer 0's KVCache's meta_state");
  file = good;
  file.metadata["0.4"] = "2";
  ExpectRefused(file, absl::StatusCode::kInvalidArgument,
                "metadata \"0.4\": ArraysCache has no meta_state");
}

TEST_P(MlxRefusalTest, ShapesAndDTypes) {
  const PromptCacheFile good = GoodFile();
  PromptCacheFile file = good;
  {  // values one token shorter than keys
    engine::FileTensor& values = file.tensors.at("0.1");
    values.shape[2] -= 1;
    values.data.resize(values.data.size() / 6 * 5);
  }
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "tensor \"0.1\": shape [1,1,5,4]");
  file = good;
  file.tensors.at("0.0").shape[3] = 8;  // bytes no longer match
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "tensor \"0.0\": 48 bytes");
  file = good;
  file.tensors.at("3.0").dtype = engine::FileDType::kI32;
  file.tensors.at("3.0").shape[3] = 2;
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "tensor \"3.0\": dtype must be F32");
  file = good;
  {  // layer 3 in float32: the file's layers disagree
    for (const char* key : {"3.0", "3.1"}) {
      engine::FileTensor& tensor = file.tensors.at(key);
      tensor.dtype = engine::FileDType::kF32;
      tensor.shape[3] = 2;
    }
  }
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "tensor \"3.0\": dtype differs");
  file = good;
  file.tensors.at("2.0.0").dtype = engine::FileDType::kF32;
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "tensor \"2.0.0\": dtype must be U32");
  file = good;
  {  // scales of a head dim that is not the wq's
    engine::FileTensor& scales = file.tensors.at("2.1.1");
    scales.shape[3] = 2;
    scales.data.resize(scales.data.size() * 2);
  }
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "tensor \"2.1.1\"");
  file = good;
  file.tensors.at("4.1").shape = {2, 1, 2, 1};  // a batch of 2 beside a conv state of 1
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "tensor \"4.1\"");
}

TEST_P(MlxRefusalTest, MetaValues) {
  const PromptCacheFile good = GoodFile();
  const auto refused = [&](const std::string& key, const std::string& value,
                           const std::string& text) {
    PromptCacheFile file = good;
    file.metadata[key] = value;
    ExpectRefused(file, absl::StatusCode::kInvalidArgument, "metadata \"" + key + "\": " + text);
  };
  refused("0.1.0", "-1", "\"-1\" is not a non-negative decimal");
  refused("0.1.0", "+1", "\"+1\" is not a non-negative decimal");
  refused("0.1.2", " 6", "\" 6\" is not a non-negative decimal");
  refused("0.1.0", "4", "keep 4 must be below max_size 4");
  refused("0.1.1", "0", "max_size must be at least 1");
  refused("0.1.2", "3", "offset 3 is below the 4 tokens held");
  refused("0.1.3", "5", "_idx 5 is past the buffer");
  refused("0.1.3", "1", "_idx 1 inside a buffer of 4 tokens that has not wrapped");
  refused("0.2.2", "5", "bits must be 4 or 8");
  refused("0.2.1", "16", "group_size must be 32, 64 or 128");
  refused("0.2.0", "5", "offset 5, but the tensors hold 6 tokens");
  refused("0.3.1", "7", "start_position 7 is past the offset 6");
  refused("0.3.0", "0", "chunk_size must be at least 1");
  refused("0.3.0", "True", "\"True\" is not a non-negative decimal");
  PromptCacheFile file = good;
  file.metadata["0.1.1"] = "9";
  ExpectRefused(file, absl::StatusCode::kInvalidArgument,
                "metadata \"0.1.2\": offset 6 with 4 tokens held: tokens evicted before the "
                "window of 9 filled");
  // Offsets that disagree between layers: the rotating layer says 7.
  file = good;
  file.metadata["0.1.2"] = "7";
  ExpectRefused(file, absl::StatusCode::kInvalidArgument,
                "metadata \"0.1.2\": offset 7 differs from 6");
}

// BatchRotatingKVCache's meta and arrays, `rotated` as Python writes bools
// only (mlx-lm would read "False" as True; mlx_batch_meta.h).
TEST_P(MlxRefusalTest, BatchMetaAndArrays) {
  MlxMirror mirror(*engine_, PaddedSpec(), 13);
  ASSERT_TRUE(mirror.Step(2));
  for (int step = 0; step < 5; ++step) ASSERT_TRUE(mirror.Step(1));  // offset 7: wrapped
  const PromptCacheFile good = ExportChecked(mirror);
  ASSERT_EQ(good.metadata.at("0.1.3"), "True");
  const auto refused = [&](const std::string& key, const std::string& value,
                           const std::string& text) {
    PromptCacheFile file = good;
    file.metadata[key] = value;
    ExpectRefused(file, absl::StatusCode::kInvalidArgument, "metadata \"" + key + "\": " + text);
  };
  refused("0.1.3", "false", "");
  refused("0.1.3", "1", "");
  refused("0.1.3", "False", "not rotated, but _idx 2 is inside the buffer of 5 tokens");
  refused("0.1.2", "6", "_idx 6 is past the buffer");
  PromptCacheFile file = good;
  file.metadata["0.1.0"] = "6";  // max_size: the window could not have filled
  ExpectRefused(file, absl::StatusCode::kInvalidArgument,
                "metadata \"0.1.1\": offset 7 with 5 tokens held: tokens evicted before the "
                "window of 6 filled");
  file = good;
  std::memcpy(file.tensors.at("1.3").data.data(), "\x05\0\0\0", 4);
  ExpectRefused(
      file, absl::StatusCode::kInvalidArgument,
      "tensor \"1.3\": left_padding[0] is 5, but padding 2 less the 2 evicted tokens is 0");
  file = good;
  std::memcpy(file.tensors.at("0.3").data.data(), "\x01\0\0\0", 4);
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "tensor \"0.2\": offset[0] is 5");
  file = good;
  file.tensors.at("1.2").dtype = engine::FileDType::kF32;
  ExpectRefused(file, absl::StatusCode::kInvalidArgument, "tensor \"1.2\": dtype must be I32");
  file = good;
  file.metadata["2.0"] = "KVCache";
  file.tensors.erase("0.2");
  file.tensors.erase("0.3");
  ExpectRefused(file, absl::StatusCode::kFailedPrecondition,
                "metadata \"2.0\": a KVCache beside batch layers");
}

// A load that fails part-way (the pool runs out) gives back every page.
TEST_P(MlxRefusalTest, FailedLoadFreesEveryPage) {
  const PromptCacheFile good = GoodFile();
  std::unique_ptr<gpu::PagePool> small = MakePool(kHybridPageBytes, 4 * kHybridPageBytes);
  ASSERT_NE(small, nullptr);
  auto cache = engine::CacheFromPromptCache(good, {}, *small, kHybridPageTokens);
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(), absl::StatusCode::kResourceExhausted) << cache.status();
  EXPECT_EQ(small->stats().used_pages, 0u);
}

TEST_P(MlxRefusalTest, WhatMlxCannotHoldIsNotWritten) {
  MlxMirror mirror(*engine_, MakeSpec({StandardLayerSpec(1, 4)}), 10);
  ASSERT_TRUE(mirror.Step(4));
  auto from2 = engine_->Snapshot(mirror.id(), 2);
  ASSERT_TRUE(from2.ok());
  auto view = engine_->Freeze("", from2->snapshot_id);
  ASSERT_TRUE(view.ok());
  auto file = engine::ToPromptCache(**view, {});
  EXPECT_EQ(file.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Mentions(file.status(), "starts at 2"));

  MlxMirror empty(*engine_, MakeSpec({StandardLayerSpec(1, 4)}), 11);
  const auto empty_view = Live(empty.id());
  ASSERT_NE(empty_view, nullptr);
  file = engine::ToPromptCache(*empty_view, {});
  EXPECT_EQ(file.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Mentions(file.status(), "layer 0 holds nothing"));

  CacheSpec padded = MakeSpec({QuantizedSpec(1, 32, 32, 32, 4)}, DType::kFloat16, 2);
  padded.left_padding = {1, 0};
  MlxMirror quantized(*engine_, padded, 12);
  ASSERT_TRUE(quantized.Step(2));
  file = engine::ToPromptCache(*Live(quantized.id()), {});
  EXPECT_EQ(file.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Mentions(file.status(), "no batch form of QuantizedKVCache"));
}

INSTANTIATE_TEST_SUITE_P(TransferPaths, MlxStateTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });
INSTANTIATE_TEST_SUITE_P(TransferPaths, MlxRefusalTest, ::testing::ValuesIn(kAllTransferPaths),
                         [](const auto& info) { return TransferPathName(info.param); });

}  // namespace
}  // namespace kvcache::testing
