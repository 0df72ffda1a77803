#include "engine/files/mlx_batch_meta.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/client_text.h"
#include "core/status_macros.h"

namespace kvcache::engine {
namespace {

absl::Status Malformed(size_t index, absl::string_view text, absl::string_view want) {
  return absl::InvalidArgumentError(
      absl::StrCat("meta_state[", index, "]: ", Quoted(text), " is not ", want));
}

// Unsigned decimal digits only (absl::SimpleAtoi would also take signs and
// surrounding spaces).
absl::StatusOr<uint64_t> ParseCount(size_t index, absl::string_view text) {
  uint64_t value = 0;
  const bool digits =
      !text.empty() && text.find_first_not_of("0123456789") == absl::string_view::npos;
  if (!digits || !absl::SimpleAtoi(text, &value)) {
    return Malformed(index, text, "an unsigned integer");
  }
  return value;
}

}  // namespace

std::vector<std::string> BatchRotatingMetaState(const BatchRotatingMeta& meta) {
  return {absl::StrCat(meta.max_size), absl::StrCat(meta.offset), absl::StrCat(meta.idx),
          meta.rotated ? "True" : "False"};
}

absl::StatusOr<bool> ParsePythonBool(absl::string_view text) {
  if (text == "True") return true;
  if (text == "False") return false;
  return absl::InvalidArgumentError(absl::StrCat(Quoted(text), " is not True or False"));
}

absl::StatusOr<BatchRotatingMeta> ParseBatchRotatingMetaState(
    absl::Span<const std::string> meta_state) {
  if (meta_state.size() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("meta_state: ", meta_state.size(),
                     " entries; BatchRotatingKVCache writes 4 (max_size, "
                     "_offset, _idx, rotated)"));
  }
  BatchRotatingMeta meta;
  ASSIGN_OR_RETURN(meta.max_size, ParseCount(0, meta_state[0]));
  ASSIGN_OR_RETURN(meta.offset, ParseCount(1, meta_state[1]));
  ASSIGN_OR_RETURN(meta.idx, ParseCount(2, meta_state[2]));
  absl::StatusOr<bool> rotated = ParsePythonBool(meta_state[3]);
  if (!rotated.ok()) return Malformed(3, meta_state[3], "True or False");
  meta.rotated = *rotated;
  return meta;
}

}  // namespace kvcache::engine
