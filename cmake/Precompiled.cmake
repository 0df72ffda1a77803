# KVCACHED_STRICT_INCLUDES: the product's code (server/, client/, protos/)
# compiles unit by unit and without precompiled headers, so that each of its
# files must include what it uses; the tests keep both. The AddressSanitizer
# build (.ci/sanitize) turns it on: it is the include check, at less cost
# than compiling the tests that way too.
option(KVCACHED_STRICT_INCLUDES "Product units one by one, without PCH" OFF)

# kv_is_product(TARGET OUT): whether TARGET is defined under server/, client/
# or protos/.
function(kv_is_product target out)
  get_target_property(dir ${target} SOURCE_DIR)
  string(REGEX MATCH "^${PROJECT_SOURCE_DIR}/(server|client|protos)(/|$)" product "${dir}")
  if(product)
    set(${out} TRUE PARENT_SCOPE)
  else()
    set(${out} FALSE PARENT_SCOPE)
  endif()
endfunction()

# kv_strict_product_units(DIR): with KVCACHED_STRICT_INCLUDES, every product
# target defined in DIR or below builds unit by unit.
function(kv_strict_product_units dir)
  if(NOT KVCACHED_STRICT_INCLUDES)
    return()
  endif()
  get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    kv_is_product(${target} product)
    if(product)
      set_target_properties(${target} PROPERTIES UNITY_BUILD OFF)
    endif()
  endforeach()
  get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(subdir IN LISTS subdirs)
    kv_strict_product_units("${subdir}")
  endforeach()
endfunction()

# Precompiled headers for the main build. Most of a translation unit's compile
# time here is parsing the same large headers again: gRPC with the generated
# kvcache.pb.h (~6 s per unit with g++), googletest (~3 s), vulkan_raii.hpp in
# gpu/ (~6 s). A target's units get them once from a precompiled header.
# Off in the fuzz build, and for the product in the ASan build
# (KVCACHED_STRICT_INCLUDES above), which thereby still check that the
# product's files include what they use (-DKVCACHED_PCH=OFF
# -DKVCACHED_UNITY=OFF checks the tests' too).
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
  if(KVCACHED_STRICT_INCLUDES)
    kv_is_product(${target} product)
    if(product)
      return()
    endif()
  endif()
  set(headers)
  foreach(set IN LISTS ARGN)
    list(APPEND headers ${KV_PCH_${set}})
  endforeach()
  target_precompile_headers(${target} PRIVATE ${headers})
endfunction()
