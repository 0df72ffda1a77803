#include "fleet/kv_event_encoding.h"

#include <msgpack.h>

#include <memory>

#include "absl/strings/string_view.h"

namespace kvcache {
namespace {

using engine::BlockEvent;

constexpr absl::string_view kMedium = "GPU";

void PackString(msgpack_packer& packer, absl::string_view text) {
  msgpack_pack_str(&packer, text.size());
  msgpack_pack_str_body(&packer, text.data(), text.size());
}

void PackHashes(msgpack_packer& packer, const std::vector<uint64_t>& hashes) {
  msgpack_pack_array(&packer, hashes.size());
  for (uint64_t hash : hashes) msgpack_pack_uint64(&packer, hash);
}

void PackTokens(msgpack_packer& packer, const std::vector<uint32_t>& tokens) {
  msgpack_pack_array(&packer, tokens.size());
  for (uint32_t token : tokens) msgpack_pack_uint32(&packer, token);
}

void PackParent(msgpack_packer& packer, const BlockEvent& event) {
  if (event.parent_block_hash.has_value()) {
    msgpack_pack_uint64(&packer, *event.parent_block_hash);
  } else {
    msgpack_pack_nil(&packer);
  }
}

// The class's name: vLLM's tag.
absl::string_view TypeName(BlockEvent::Kind kind) {
  switch (kind) {
    case BlockEvent::Kind::kStored:
      return "BlockStored";
    case BlockEvent::Kind::kRemoved:
      return "BlockRemoved";
    case BlockEvent::Kind::kAllCleared:
      return "AllBlocksCleared";
  }
  return "";
}

// Each field's value after its key (kMap) or in its place (kArray).
void PackStoredFields(msgpack_packer& packer, const BlockEvent& event, uint32_t block_size,
                      bool keys) {
  const auto key = [&](absl::string_view name) {
    if (keys) PackString(packer, name);
  };
  key("block_hashes");
  PackHashes(packer, event.block_hashes);
  key("parent_block_hash");
  PackParent(packer, event);
  key("token_ids");
  PackTokens(packer, event.token_ids);
  key("block_size");
  msgpack_pack_uint32(&packer, block_size);
  key("lora_id");
  msgpack_pack_nil(&packer);
  key("medium");
  PackString(packer, kMedium);
  if (keys) {  // added after the array form was frozen
    key("lora_name");
    msgpack_pack_nil(&packer);
  }
}

void PackEvent(msgpack_packer& packer, const BlockEvent& event, KvEventFormat format,
               uint32_t block_size) {
  const bool keys = format == KvEventFormat::kMap;
  const size_t fields = event.kind == BlockEvent::Kind::kStored    ? (keys ? 7 : 6)
                        : event.kind == BlockEvent::Kind::kRemoved ? 2
                                                                   : 0;
  if (keys) {
    msgpack_pack_map(&packer, fields + 1);
    PackString(packer, "type");
  } else {
    msgpack_pack_array(&packer, fields + 1);
  }
  PackString(packer, TypeName(event.kind));
  switch (event.kind) {
    case BlockEvent::Kind::kStored:
      PackStoredFields(packer, event, block_size, keys);
      break;
    case BlockEvent::Kind::kRemoved:
      if (keys) PackString(packer, "block_hashes");
      PackHashes(packer, event.block_hashes);
      if (keys) PackString(packer, "medium");
      PackString(packer, kMedium);
      break;
    case BlockEvent::Kind::kAllCleared:
      break;
  }
}

}  // namespace

std::string EncodeKvEventBatch(absl::Time ts, absl::Span<const BlockEvent> events,
                               KvEventFormat format, uint32_t block_size) {
  msgpack_sbuffer buffer;
  msgpack_sbuffer_init(&buffer);
  const std::unique_ptr<msgpack_sbuffer, void (*)(msgpack_sbuffer*)> owned(&buffer,
                                                                           msgpack_sbuffer_destroy);
  msgpack_packer packer;
  msgpack_packer_init(&packer, &buffer, msgpack_sbuffer_write);
  msgpack_pack_array(&packer, 3);
  msgpack_pack_double(&packer, absl::ToDoubleSeconds(ts - absl::UnixEpoch()));
  msgpack_pack_array(&packer, events.size());
  for (const BlockEvent& event : events) PackEvent(packer, event, format, block_size);
  // One replica is one rank, as a vLLM without data parallelism says.
  msgpack_pack_uint32(&packer, 0);
  return std::string(buffer.data, buffer.size);
}

}  // namespace kvcache
