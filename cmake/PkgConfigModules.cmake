# kv_pkg_config_module(PREFIX MODULE): PkgConfig::<PREFIX>, a GLOBAL imported
# target of a pkg-config module, defined once for the whole tree.
#
# CMake's pkg_check_modules puts an "-isystem DIR" of a module's cflags
# (libzmq's: -isystem /usr/include/mit-krb5) among the target's include
# directories when it queries pkg-config, and among its compile options when
# it reads its own cache on the next configure. So every configure after the
# first changed the compile command of every unit that used ZeroMQ, and
# ninja rebuilt all of them (.ci/run's ASan stage configures its build a
# second time). Here the directories go to the include directories both times.
find_package(PkgConfig REQUIRED)

function(kv_pkg_config_module prefix module)
  if(TARGET PkgConfig::${prefix})
    return()
  endif()
  pkg_check_modules(${prefix} REQUIRED IMPORTED_TARGET GLOBAL ${module})
  set(dirs ${${prefix}_INCLUDE_DIRS})
  set(options)
  set(next_is_dir FALSE)
  foreach(flag IN LISTS ${prefix}_CFLAGS_OTHER)
    if(next_is_dir)
      list(APPEND dirs "${flag}")
      set(next_is_dir FALSE)
    elseif(flag STREQUAL "-isystem")
      set(next_is_dir TRUE)
    else()
      list(APPEND options "${flag}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES dirs)
  set_target_properties(PkgConfig::${prefix} PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${dirs}" INTERFACE_COMPILE_OPTIONS "${options}")
endfunction()
