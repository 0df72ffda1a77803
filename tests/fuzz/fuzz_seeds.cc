// Writes the fuzzers' seed corpora: well-formed inputs of each kind, made
// with protobuf and the lane's own header encoder, that the fuzzers mutate.
//   fuzz_seeds DIR   (DIR/<fuzzer>/<seed>)
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "engine/files/safetensors.h"
#include "kvcache/v1/kvcache.pb.h"
#include "wire/lane/frame.h"

namespace {

namespace fs = std::filesystem;
using kvcache::v1::FetchRequest;
using kvcache::v1::FetchResponse;
using kvcache::v1::Tensor;
using kvcache::v1::UpdateRequest;

void Write(const fs::path& dir, const std::string& name, const std::string& bytes) {
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

void Fill(Tensor& tensor, int heads, int tokens, int dim) {
  tensor.set_dtype(kvcache::v1::DTYPE_FLOAT16);
  for (int d : {1, heads, tokens, dim}) tensor.add_shape(d);
  tensor.set_data(std::string(2 * heads * tokens * dim, '\x3c'));
}

UpdateRequest Step(bool with_state) {
  UpdateRequest request;
  request.set_cache_id("0123456789abcdef0123456789abcdef");
  request.set_layer(1);
  if (with_state) {
    auto& state = *request.mutable_state();
    Fill(*state.mutable_conv_state(), 1, 3, 4);
    Fill(*state.mutable_delta_state(), 1, 2, 2);
    state.set_advance(1);
  } else {
    Fill(*request.mutable_keys(), 2, 3, 4);
    Fill(*request.mutable_values(), 2, 3, 4);
    request.set_expected_offset(16);
  }
  return request;
}

std::string Frame(int kind, const std::string& payload) {
  std::byte header[kvcache::lane::kHeaderBytes];
  kvcache::lane::EncodeHeader({.length = static_cast<uint32_t>(payload.size()), .kind = kind},
                              header);
  return std::string(reinterpret_cast<const char*>(header), sizeof(header)) + payload;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds DIR\n");
    return 2;
  }
  const fs::path root = argv[1];

  // Update requests, whole and cut (the first byte says how many cuts).
  const std::string kv = Step(false).SerializeAsString();
  const std::string state = Step(true).SerializeAsString();
  UpdateRequest drafted = Step(false);
  drafted.set_speculation_id("spec-1");
  const fs::path update = root / "update_parser_fuzzer";
  Write(update, "kv", std::string(1, '\0') + kv);
  Write(update, "kv_cut_twice", std::string("\x02\x05\x20", 3) + kv);
  Write(update, "state", std::string(1, '\0') + state);
  Write(update, "drafted", std::string("\x01\x11", 2) + drafted.SerializeAsString());

  // Fetch chunks of keys and values.
  FetchResponse chunk;
  chunk.set_layer(2);
  chunk.set_start(32);
  Fill(*chunk.mutable_keys(), 2, 5, 8);
  Fill(*chunk.mutable_values(), 2, 5, 8);
  Write(root / "fetch_chunk_fuzzer", "chunk", chunk.SerializeAsString());
  chunk.mutable_values()->clear_data();
  Write(root / "fetch_chunk_fuzzer", "empty_values", chunk.SerializeAsString());

  // Lane connections: preamble, AUTH, an Update call, a Fetch; and a Fetch
  // alone, as a server without tenants takes it.
  kvcache::v1::LaneAuth auth;
  auth.set_token("a-token-of-sixteen-bytes");
  FetchRequest fetch;
  fetch.set_cache_id("0123456789abcdef0123456789abcdef");
  fetch.add_layers(0);
  fetch.set_end(64);
  const std::string magic(kvcache::lane::kMagic, sizeof(kvcache::lane::kMagic));
  const fs::path lane = root / "lane_frames_fuzzer";
  Write(lane, "session",
        magic + Frame(kvcache::v1::LANE_FRAME_AUTH, auth.SerializeAsString()) +
            Frame(kvcache::v1::LANE_FRAME_UPDATE, kv) +
            Frame(kvcache::v1::LANE_FRAME_UPDATE, state) +
            Frame(kvcache::v1::LANE_FRAME_UPDATE_END, "") +
            Frame(kvcache::v1::LANE_FRAME_FETCH, fetch.SerializeAsString()));
  Write(lane, "fetch", magic + Frame(kvcache::v1::LANE_FRAME_FETCH, fetch.SerializeAsString()));
  // Prompt-cache files: one kvcached writes (with its checksum), and one
  // laid out by hand as mlx-lm writes it (no checksum, no padding).
  kvcache::engine::PromptCacheFile file;
  for (const char* key : {"0.0", "0.1"}) {
    std::vector<std::byte> bytes(2 * 1 * 2 * 4 * 2, std::byte{0x3c});
    file.tensors[key] = {
        .dtype = kvcache::engine::FileDType::kF16, .shape = {1, 2, 4, 2}, .data = std::move(bytes)};
  }
  file.metadata = {{"1.model", "toy"}, {"2.0", "KVCache"}};
  auto encoded = kvcache::engine::EncodeSafetensorsBytes(file);
  if (!encoded.ok()) return 1;
  const fs::path files = root / "prompt_cache_file_fuzzer";
  Write(files, "kvcached", *encoded);
  const std::string header = R"({"0.0":{"dtype":"F16","shape":[1,1,2,2],"data_offsets":[0,8]},)"
                             R"("0.1":{"dtype":"F16","shape":[1,1,2,2],"data_offsets":[8,16]},)"
                             R"("__metadata__":{"2.0":"KVCache","1.model":"toy"}})";
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  Write(files, "mlx", length + header + std::string(16, '\x3c'));
  return 0;
}
