# halfstep-train's command line: what it refuses, with which message, and what it says instead of
# overriding a setting silently. Every case runs a few steps at most.
# Run as: cmake -DTRAIN=... -DWORK_DIR=... -DVERSION=... -P train_cli_test.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(PROGRAM "${TRAIN}")
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
expect(ok "halfstep-train ${VERSION}" --version)
expect(ok "total optimizer steps of the run, counting those before --resume" --help)
expect(ok "With --resume\n +the rows are appended to FILE, with the header first if FILE is new or empty\\." --help)
expect(2 "not expected: --bogus" --bogus)
expect(2 "warp-drive not in" --scenario warp-drive)
expect(2 "--steps: 0 is less than 1" --steps 0)
expect(2 "--steps: 'abc' is not a decimal integer" --steps abc)
expect(fail "before the detector can tell it apart.*--steps 534 or more" --cpu --scenario spike --steps 300)
expect(fail "--spike-factor 5.* too small" --cpu --scenario spike --steps 600 --spike-factor 5)
expect(fail "not inside the run" --cpu --scenario spike --steps 600 --spike-step 700)
expect(ok "runs with your --growth-interval 100" --cpu --quiet --scenario lr-decay --steps 5 --growth-interval 100)
# Integers are decimal and in range: CLI11 alone wrapped -1 around to 2^64 - 1, saturated past
# 2^64 - 1, and read 010 as octal.
expect(2 "--seed: '-1' is negative \\(give a decimal integer from 0 to 18446744073709551615\\)"
       --cpu --quiet --steps 1 --seed -1)
expect(2 "--seed: 18446744073709551616 is more than 18446744073709551615"
       --cpu --quiet --steps 1 --seed 18446744073709551616)
expect(2 "--seed: '0x10' is not a decimal integer" --cpu --quiet --steps 1 --seed 0x10)
expect(2 "--spike-step: 99999999999999999999 is more than"
       --cpu --quiet --steps 600 --scenario spike --spike-step 99999999999999999999)
expect(ok "checkpoint written" --cpu --quiet --steps 1 --seed 18446744073709551615
       --checkpoint "${WORK_DIR}/max_seed.safetensors")
expect(fail "--seed 18446744073709551615 there, 10 in this run"
       --cpu --quiet --steps 2 --seed 010 --resume "${WORK_DIR}/max_seed.safetensors")
# A master in 2 B, or none, needs a bf16 model copy; a resume repeats the run's precision (an f16
# checkpoint from before --precision existed reads as f16).
expect(2 "--master none needs --precision bf16: without a master the weights are the bf16 model copy"
       --cpu --quiet --steps 1 --master none)
expect(2 "--master remainder needs --precision bf16" --cpu --quiet --steps 1 --master remainder)
expect(2 "bogus not in" --cpu --quiet --steps 1 --precision bogus)
expect(ok "bf16 weights and gradients, no master \\(the bf16 weights, stochastic rounding\\), block8 moments"
       --cpu --steps 2 --precision bf16 --master none --moments block8 --checkpoint "${WORK_DIR}/bf16.safetensors")
expect(fail "--precision: .*bf16.safetensors was written by a run with --precision bf16, this run has --precision f16"
       --cpu --quiet --steps 3 --resume "${WORK_DIR}/bf16.safetensors")
# --print-every: a positive count; its default (without the option) is a fifteenth of the run.
expect(2 "--print-every: 0 is less than 1" --cpu --steps 3 --print-every 0)
expect(2 "--print-every: '-3' is negative" --cpu --steps 3 --print-every -3)
expect(ok "\nstep +2  .*\nstep +4  .*\ndone: 4 steps" --cpu --steps 4 --print-every 2)
expect(ok "\nstep +2  .*\nstep +4  .*\nstep +6  .*\ndone: 30 steps" --cpu --steps 30)
# Outputs that cannot be written are refused before the run, not after it.
expect(2 "--checkpoint [^\n]*/nodir/x.safetensors: its directory [^\n]*/nodir: No such file or directory"
       --cpu --quiet --steps 1 --checkpoint "${WORK_DIR}/nodir/x.safetensors")
file(WRITE "${WORK_DIR}/a_file" "")
expect(2 "--checkpoint [^\n]*: [^\n]*/a_file is not a directory"
       --cpu --quiet --steps 1 --checkpoint "${WORK_DIR}/a_file/x.safetensors")
expect(2 "--checkpoint [^\n]*: is a directory" --cpu --quiet --steps 1 --checkpoint "${WORK_DIR}")
# A link to /dev/null stands for /dev/null itself: renaming over the link leaves the device alone
# should the check ever be lost.
file(CREATE_LINK /dev/null "${WORK_DIR}/null.safetensors" SYMBOLIC)
expect(2 "--checkpoint [^\n]*/null.safetensors: exists and is not a regular file"
       --cpu --quiet --steps 1 --checkpoint "${WORK_DIR}/null.safetensors")
file(MAKE_DIRECTORY "${WORK_DIR}/read_only")
file(CHMOD "${WORK_DIR}/read_only" PERMISSIONS OWNER_READ OWNER_EXECUTE)
execute_process(COMMAND ${CMAKE_COMMAND} -E touch "${WORK_DIR}/read_only/probe" RESULT_VARIABLE writable
                ERROR_QUIET)
if(NOT writable EQUAL 0)  # root writes there anyway
  expect(2 "--checkpoint [^\n]*: cannot write in its directory [^\n]*/read_only: Permission denied"
         --cpu --quiet --steps 1 --checkpoint "${WORK_DIR}/read_only/x.safetensors")
endif()
file(CHMOD "${WORK_DIR}/read_only" PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
expect(2 "--trace [^\n]*/nodir/run.csv: No such file or directory"
       --cpu --quiet --steps 1 --trace "${WORK_DIR}/nodir/run.csv")
expect(2 "--trace [^\n]*: Is a directory" --cpu --quiet --steps 1 --trace "${WORK_DIR}")
expect(2 "--trace [^\n]*/same.safetensors names the same file as --checkpoint [^\n]*/read_only/../same.safetensors"
       --cpu --quiet --steps 1 --trace "${WORK_DIR}/same.safetensors"
       --checkpoint "${WORK_DIR}/read_only/../same.safetensors")
# Resuming: the checkpoint's step against --steps (the total), another shape, another scenario or
# setting.
expect(ok "checkpoint written" --cpu --quiet --steps 20 --checkpoint "${WORK_DIR}/at20.safetensors")
expect(fail "already at step 20 and --steps 20 is the total: nothing to run \\(give --steps 21 or more\\)"
       --cpu --quiet --steps 20 --resume "${WORK_DIR}/at20.safetensors")
expect(fail "already at step 20" --cpu --quiet --steps 10 --resume "${WORK_DIR}/at20.safetensors")
# Another shape: what differs, in words.
expect(fail "--resume [^\n]*/at20.safetensors: it was written by a run of another network, batch or seed: --width 256 there, 128 in this run \\(a resumed run must repeat them\\)\n"
       --cpu --quiet --steps 30 --width 128 --resume "${WORK_DIR}/at20.safetensors")
expect(fail "seed: --seed 1 there, 2 in this run \\(" --cpu --quiet --steps 30 --seed 2 --resume "${WORK_DIR}/at20.safetensors")
expect(fail "seed: --layers 3 there, 2 in this run; --batch 128 there, 96 in this run; dataset samples 8192 there, 8160 in this run \\("
       --cpu --quiet --steps 30 --layers 2 --batch 96 --resume "${WORK_DIR}/at20.safetensors")
expect(2 "--trace [^\n]*/at20.safetensors names the same file as --resume"
       --cpu --quiet --steps 30 --trace "${WORK_DIR}/at20.safetensors" --resume "${WORK_DIR}/at20.safetensors")
foreach(other "--scenario;overflow-storm;default" "--scenario;lr-decay;default" "--scenario;fixed-scale;default"
        "--lr;2e-3;0.001" "--growth-interval;50;100" "--headroom-growth;on;off")
  list(GET other 0 option)
  list(GET other 1 value)
  list(GET other 2 saved)
  set(args ${option} ${value})
  if(value STREQUAL "on")
    set(args ${option})
  elseif(value STREQUAL "2e-3")
    set(value 0.002)
  endif()
  expect(fail "${option}: [^\n]*/at20.safetensors was written by a run with ${option} ${saved}, this run has ${option} ${value}"
         --cpu --quiet --steps 30 ${args} --resume "${WORK_DIR}/at20.safetensors")
endforeach()
expect(ok "checkpoint written" --cpu --quiet --scenario fixed-scale --scale 2^10 --steps 5
       --checkpoint "${WORK_DIR}/fixed.safetensors")
expect(fail "--scale: [^\n]*/fixed.safetensors was written by a run with --scale 1024, this run has --scale 2048"
       --cpu --quiet --scenario fixed-scale --scale 2048 --steps 8 --resume "${WORK_DIR}/fixed.safetensors")
expect(ok "resumed from .* at step 5" --cpu --scenario fixed-scale --scale 1024 --steps 8
       --resume "${WORK_DIR}/fixed.safetensors")
expect(ok "resumed from .* at step 20" --cpu --steps 25 --resume "${WORK_DIR}/at20.safetensors")
expect(fail "--resume: File does not exist" --cpu --resume "${WORK_DIR}/missing.safetensors")
file(WRITE "${WORK_DIR}/junk.safetensors" "not a checkpoint at all")
expect(fail "header length" --cpu --steps 30 --resume "${WORK_DIR}/junk.safetensors")
# --ranks: the default batch is rounded up to a multiple of the ranks; a --batch given that they do
# not divide is refused, after the line that says which engine runs.
expect(ok "batch 129, 2 steps\n  data parallel over 3 ranks: each rank computes 43 samples \\(the default batch of 128 rounded up to a multiple of 3\\)"
       --cpu --quiet --steps 2 --ranks 3)
expect(ok "batch 128, 2 steps\n  data parallel over 4 ranks: each rank computes 32 samples, optimizer" --cpu --quiet --steps 2 --ranks 4)
execute_process(COMMAND sh -c "exec \"$0\" \"$@\" 2>&1" "${TRAIN}" --cpu --steps 2 --ranks 3 --batch 100
                RESULT_VARIABLE rc OUTPUT_VARIABLE both)
if(NOT rc EQUAL 2 OR NOT both MATCHES "^--cpu: running on the CPU [^\n]*\nhalfstep-train: --ranks 3 must divide --batch 100, each rank computing an equal part of it \\(give --batch 99 or 102, or --replicate-batch\\)\n")
  string(APPEND failures "\n  --ranks 3 --batch 100: exit ${rc}, wanted 2 and the refusal after the engine's line, got:\n${both}")
endif()
# The loss in 4 significant digits at any size: lr-decay's fine-tuning loss is about 10^-3 and falls
# (five fixed decimals printed 0.00000 from step 1000 of its 3000 on).
expect(ok "\nstep +20  loss [1-9]\\.[0-9][0-9][0-9]e-03  scale .*\n  loss [1-9]\\.[0-9][0-9][0-9]e-03 over the first 4 steps, [1-9]\\.[0-9][0-9][0-9]e-03 over the last 4\n"
       --cpu --scenario lr-decay --steps 20 --print-every 20)
expect_report("halfstep-train refuses what cannot run, with a message")
