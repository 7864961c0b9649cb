# Warnings as errors for halfstep's own targets. Host code: the full -Wall -Wextra -Wshadow
# -Wconversion set. Device code: nvcc promotes all of its warnings, and the host compiler sees the
# same host flags through -Xcompiler minus -Wshadow/-Wconversion, which fire inside nvcc's own
# generated stubs rather than in our code.
function(halfstep_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wshadow -Wconversion -Werror>
    $<$<COMPILE_LANGUAGE:C>:-Wall -Wextra -Wconversion -Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror>)
endfunction()
