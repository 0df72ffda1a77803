// Prefix sharing: PublishPrefix, LookupPrefix, ListPrefixes.
#include <string>

#include "core/status_macros.h"
#include "service/convert.h"
#include "service/handlers.h"
#include "service/validation.h"

namespace kvcache::service {
namespace {

// Each tenant has an engine, and so a prefix index, of its own: within one,
// every caller shares the namespace.
const std::string& CallerNamespace() {
  static const std::string* const kShared = new std::string();
  return *kShared;
}

// The layout a lookup names: a spec, or a cache's.
absl::StatusOr<engine::CacheSpec> LookupLayout(const engine::Engine& engine,
                                               const v1::LookupPrefixRequest& request) {
  if (request.has_spec() == !request.cache_id().empty()) {
    return absl::InvalidArgumentError("spec, cache_id: give exactly one (the layout to look in)");
  }
  if (request.has_spec()) return FromProto(request.spec());
  RETURN_IF_ERROR(CheckIdLength("cache_id", request.cache_id()));
  return engine.GetSpec(request.cache_id());
}

}  // namespace

absl::Status Handlers::PublishPrefix(const v1::PublishPrefixRequest& request,
                                     v1::PublishPrefixResponse* response) {
  RETURN_IF_ERROR(RequireId("snapshot_id", request.snapshot_id()));
  ASSIGN_OR_RETURN(const engine::PublishedPrefix published,
                   engine_.PublishPrefix(CallerNamespace(), request.snapshot_id(), request.tokens(),
                                         absl::Seconds(request.ttl_seconds())));
  ToProto(published.entry, response->mutable_entry());
  response->set_shared_tokens(published.shared_tokens);
  response->set_already_published(published.already_published);
  return absl::OkStatus();
}

absl::Status Handlers::LookupPrefix(const v1::LookupPrefixRequest& request,
                                    v1::LookupPrefixResponse* response) {
  ASSIGN_OR_RETURN(const engine::CacheSpec spec, LookupLayout(engine_, request));
  ASSIGN_OR_RETURN(const engine::PrefixLookup found,
                   engine_.LookupPrefix(CallerNamespace(), spec, request.tokens(),
                                        absl::Seconds(request.ttl_seconds())));
  if (found.handle.has_value()) ToProto(*found.handle, response->mutable_snapshot());
  response->set_matched_tokens(found.matched_tokens);
  response->set_prefix_tokens(found.prefix_tokens);
  return absl::OkStatus();
}

absl::Status Handlers::ListPrefixes(const v1::ListPrefixesRequest&,
                                    v1::ListPrefixesResponse* response) {
  for (const engine::PrefixEntry& entry : engine_.ListPrefixes()) {
    v1::PrefixEntry* out = response->add_entries();
    ToProto(entry.snapshot, out->mutable_snapshot());
    out->set_model(entry.model);
    out->set_tokens(entry.tokens);
    out->set_hits(entry.hits);
  }
  return absl::OkStatus();
}

}  // namespace kvcache::service
