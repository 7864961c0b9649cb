# Fails unless README.md quotes the examples of tests/host/test_readme_example.cpp and
# tests/gpu/test_readme_distributed.cpp verbatim (the lines between "// example:begin" and
# "// example:end", with the function's two-space indent removed). Both are compiled and run by
# the tests. Run as: cmake -DSOURCE_DIR=<repo> -P check_readme_example.cmake
file(READ "${SOURCE_DIR}/README.md" readme)
foreach(file tests/host/test_readme_example.cpp tests/gpu/test_readme_distributed.cpp)
  file(READ "${SOURCE_DIR}/${file}" source)
  string(REGEX MATCH "// example:begin\n(.*)\n[ ]*// example:end" _ "${source}")
  set(example "${CMAKE_MATCH_1}")
  if(example STREQUAL "")
    message(FATAL_ERROR "no example between the markers in ${file}")
  endif()
  # (CMake's "^" also matches where a previous replacement ended, so indent via the newlines.)
  string(REPLACE "\n  " "\n" example "\n${example}")
  string(SUBSTRING "${example}" 1 -1 example)
  string(FIND "${readme}" "```cpp\n${example}\n```" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "README.md does not quote the example of ${file} verbatim. Expected:\n${example}")
  endif()
endforeach()
message(STATUS "README examples match the tested code")
