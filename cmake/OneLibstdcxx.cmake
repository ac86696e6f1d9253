# tidal_one_libstdcxx(<target> <python>): link a shared-library target so that the
# process it is loaded into has one C++ runtime.
#
# Note [One libstdc++ in the process]
# tidal._C is loaded into a Python process that already holds a libstdc++.so.6
# (torch's libraries need it). A toolchain that links libstdc++ statically into
# shared objects -- the GPU image's /opt/gcc g++ 13.3 does -- puts a second copy
# of the C++ runtime into _C, with its symbols exported. The dynamic linker then
# binds some of _C's calls to the process's libstdc++ (the exported ones: locale
# ids, locale::classic) and keeps others in the copy (its internal functions),
# so a stream in _C looks up facets registered by the other runtime. Formatting a
# number into a std::ostringstream then crashes (gpt-350m died in chunk
# registration, writing the "tensor larger than a chunk" warning) or silently
# loses the text (what this Debian g++ 12 does with -static-libstdc++).
#
# Two links make it one runtime whatever the toolchain does:
#  - the libstdc++.so.6 that <python> loads (found in its /proc/self/maps after
#    importing torch) comes first on the link line, so every C++ runtime symbol
#    it defines binds to it and the module records it as NEEDED; only what that
#    library lacks can still come from a static archive;
#  - --exclude-libs,ALL keeps whatever does come from a static archive (that
#    rest, and tidal's own static libraries) out of the dynamic symbol table, so
#    no copy is half-interposed.
# tests/python/test_native_module.py checks the built module and this recipe
# against a module linked with -static-libstdc++.
function(tidal_one_libstdcxx target python)
  execute_process(
    COMMAND "${python}" -c
      "import torch; print(next((l.split()[-1] for l in open('/proc/self/maps') if '/libstdc++.so' in l), ''))"
    OUTPUT_VARIABLE _runtime OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _rc ERROR_QUIET)
  if(_rc EQUAL 0 AND _runtime AND EXISTS "${_runtime}")
    target_link_libraries(${target} PRIVATE "${_runtime}")
    message(STATUS "${target}: linked against the process's C++ runtime ${_runtime}")
  else()
    message(STATUS "${target}: no libstdc++.so in ${python}'s process after 'import torch'; "
                   "the compiler's own C++ runtime is used")
  endif()
  if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
    target_link_options(${target} PRIVATE "LINKER:--exclude-libs,ALL")
  endif()
endfunction()
