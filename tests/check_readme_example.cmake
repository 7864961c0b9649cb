# Fails unless README.md quotes the example of tests/host/test_readme_example.cpp verbatim
# (the lines between "// example:begin" and "// example:end", with the function's two-space
# indent removed). Run as: cmake -DSOURCE_DIR=<repo> -P check_readme_example.cmake
file(READ "${SOURCE_DIR}/tests/host/test_readme_example.cpp" source)
file(READ "${SOURCE_DIR}/README.md" readme)
string(REGEX MATCH "// example:begin\n(.*)\n[ ]*// example:end" _ "${source}")
set(example "${CMAKE_MATCH_1}")
if(example STREQUAL "")
  message(FATAL_ERROR "no example between the markers in test_readme_example.cpp")
endif()
# (CMake's "^" also matches where a previous replacement ended, so indent via the newlines.)
string(REPLACE "\n  " "\n" example "\n${example}")
string(SUBSTRING "${example}" 1 -1 example)
string(FIND "${readme}" "```cpp\n${example}\n```" at)
if(at EQUAL -1)
  message(FATAL_ERROR "README.md does not quote the tested example verbatim. Expected:\n${example}")
endif()
message(STATUS "README example matches the tested code")
