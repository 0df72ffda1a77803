# Include roots that the compiler enforces.
#
# Headers are included by their path below a source root ("engine/layers/
# layer.h" below server/, "wire/lane/frame.h" below protos/, "kvcache_client.h"
# below client/). Exporting a whole source root would let any target include
# any header under it, so that only .ci/layering's script could catch a wrong
# include. Instead each library exports a root of its own in the build tree
# that holds links to the headers of its own folder and nothing else:
#
#   build/include_roots/kv_engine_layers/engine/layers/layer.h -> server/engine/layers/layer.h
#
# A target sees its own root and the roots of what it links, so an include of
# a folder it does not link (layers including the registry, the engine
# including gRPC's service) is not found: the build fails at that line.
# Files in a source root's own folder (the composition root in server/) see
# that folder's subfolders by the compiler's same-directory rule; that folder
# is the one that links everything.

# kv_export_headers(TARGET ROOT <source root> [FOLDER <folder>] [INTERFACE]):
# TARGET exports the headers of <folder> (by default that of the calling
# CMakeLists.txt), named by their path below <source root>. The link list
# follows the folder's headers at build time (CONFIGURE_DEPENDS): a new header
# is seen without re-running cmake by hand. Sources stay explicit in each
# add_library.
function(kv_export_headers target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "INTERFACE" "ROOT;FOLDER" "")
  set(folder "${CMAKE_CURRENT_SOURCE_DIR}")
  if(arg_FOLDER)
    set(folder "${arg_FOLDER}")
  endif()
  file(RELATIVE_PATH below_root "${arg_ROOT}" "${folder}")
  set(facade "${PROJECT_BINARY_DIR}/include_roots/${target}")
  set(links "${facade}/${below_root}")
  file(REMOVE_RECURSE "${facade}")
  file(MAKE_DIRECTORY "${links}")
  file(GLOB headers CONFIGURE_DEPENDS "${folder}/*.h")
  foreach(header IN LISTS headers)
    get_filename_component(name "${header}" NAME)
    file(CREATE_LINK "${header}" "${links}/${name}" SYMBOLIC)
  endforeach()
  if(arg_INTERFACE)
    target_include_directories(${target} INTERFACE "${facade}")
  else()
    target_include_directories(${target} PUBLIC "${facade}")
  endif()
endfunction()
