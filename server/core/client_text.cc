#include "core/client_text.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace kvcache {

std::string Quoted(absl::string_view input) {
  if (input.size() <= kMaxQuotedBytes) return absl::StrCat("\"", absl::CHexEscape(input), "\"");
  return absl::StrCat("\"", absl::CHexEscape(input.substr(0, kMaxQuotedBytes)), "…\" (",
                      input.size(), " bytes)");
}

}  // namespace kvcache
