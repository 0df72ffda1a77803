# Precompiled headers for the main build. Most of a translation unit's compile
# time here is parsing the same large headers again: gRPC with the generated
# kvcache.pb.h (~6 s per unit with g++), googletest (~3 s), vulkan_raii.hpp in
# gpu/ (~6 s). A target's units get them once from a precompiled header.
# Off in the clang builds (.ci/sanitize, .ci/fuzz), which thereby still check
# that the server's, the client's and the e2e suite's files include what they
# use (-DKVCACHED_PCH=OFF checks the rest).
option(KVCACHED_PCH "Precompile the large third-party headers (main build)" ON)

set(KV_PCH_BASE
  <algorithm> <cstdint> <functional> <map> <memory> <optional> <string> <utility> <vector>
  [["absl/container/flat_hash_map.h"]] [["absl/status/status.h"]] [["absl/status/statusor.h"]]
  [["absl/strings/str_cat.h"]] [["absl/strings/str_format.h"]] [["absl/strings/string_view.h"]]
  [["absl/synchronization/mutex.h"]] [["absl/types/span.h"]])
set(KV_PCH_GRPC <grpcpp/grpcpp.h> [["kvcache/v1/kvcache.grpc.pb.h"]])
set(KV_PCH_GTEST [["gmock/gmock.h"]] [["gtest/gtest.h"]])
set(KV_PCH_VULKAN <vulkan/vulkan_raii.hpp>)

# kv_precompile(TARGET SET...): TARGET's units start from the headers of each
# SET (BASE, GRPC, GTEST, VULKAN above).
function(kv_precompile target)
  if(NOT KVCACHED_PCH OR NOT TARGET ${target})
    return()
  endif()
  set(headers)
  foreach(set IN LISTS ARGN)
    list(APPEND headers ${KV_PCH_${set}})
  endforeach()
  target_precompile_headers(${target} PRIVATE ${headers})
endfunction()
