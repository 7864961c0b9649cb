# HALFSTEP_SANITIZE=ON builds host C++ code (library host files and host tests) with
# AddressSanitizer and UndefinedBehaviorSanitizer. Device code is left alone: compute-sanitizer
# is its tool (bench/gpu_check.sh).
option(HALFSTEP_SANITIZE "Build host code with ASan + UBSan" OFF)
if(HALFSTEP_SANITIZE)
  add_compile_options(
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined>
    $<$<COMPILE_LANGUAGE:CXX>:-fno-sanitize-recover=all>
    $<$<COMPILE_LANGUAGE:CXX>:-fno-omit-frame-pointer>)
  add_link_options(-fsanitize=address,undefined)
endif()
