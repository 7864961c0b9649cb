# tools/plot_trace.py (halfstep-plot) on input that is not a trace to plot: one line,
# "halfstep-plot: FILE: what is wrong", and exit code 2, without a traceback, and without reading
# more than a bounded part of it; exit code 1 when the plot cannot be written. A trace's
# description (TRACE.csv.json) titles the plot; one that cannot be read is said, and the plot goes
# on. --version and --help answer in full.
# Run as: cmake -DPLOT=... -DVERSION=... -DWORK_DIR=... -P plot_cli_test.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
# Within 2 GB of address space (a plot of a small trace takes a quarter of it): a plotter that
# reads an unbounded input whole fails here instead of exhausting the machine's memory.
set(PROGRAM sh -c "ulimit -v 2000000 && exec \"$0\" \"$@\"" "${PLOT}")
set(EXPECT_TIMEOUT 60)  # a FIFO without a writer must not block it
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
set(out -o "${WORK_DIR}/out.png")
# What halfstep-train 0.2.0 wrote above the header; the plot still reads such a trace.
set(first_line "# halfstep-train --cpu --steps 3 --trace run.csv (halfstep 0.2.0, cpu)\n")
set(header "attempt,step,outcome,reason,spike,loss,lr,scale_used,scale_next,grad_norm,clip_coef,nonfinite_count,first_nonfinite_tensor,max_abs_scaled,headroom_log2,subnormal_count,zero_count,numel,held_elements\n")
set(row1 "1,0,skipped_overflow,nonfinite_gradient,0,2.92063737,0.00100000005,65536,32768,nan,nan,1,6,57248,0.194357708,1,689,152336,0\n")
set(row2 "2,1,applied,none,0,2.88372397,0.00100000005,32768,32768,10.017761475677444,0.0998226926,0,-1,33600,0.963121772,0,862,152336,0\n")
# expect_refused(<file> <regex of what is wrong>): exit code 2 and exactly that one line.
function(expect_refused file what)
  expect(2 "^halfstep-plot: [^\n]*${file}: ${what}\n$" "${file}" ${out})
  set(failures "${failures}" PARENT_SCOPE)
endfunction()

expect(ok "^halfstep-plot ${VERSION}\n$" --version)
expect(ok "means that the plot could not be written\\.\n\npositional arguments:.*\n  --version +print halfstep-plot's version and exit\n$"
       --help)
file(WRITE "${WORK_DIR}/run.csv" "${header}${row1}${row2}")
file(WRITE "${WORK_DIR}/run.csv.json" "{\"trace\": \"run.csv\", \"runs\": [{\"command\": \"halfstep-train --cpu --steps 2\",
  \"halfstep\": \"${VERSION}\", \"engine\": \"cpu\", \"rank\": 0, \"ranks\": 1, \"first_attempt\": 1}]}\n")
expect(ok "^wrote [^\n]*/out.png\n$" "${WORK_DIR}/run.csv" ${out})
file(WRITE "${WORK_DIR}/legacy.csv" "${first_line}${header}${row1}${row2}")
expect(ok "^wrote [^\n]*/out.png\n$" "${WORK_DIR}/legacy.csv" ${out})
file(WRITE "${WORK_DIR}/described.csv" "${header}${row1}${row2}")
foreach(description "{\"runs\": 3}" "not json" "{\"runs\": [{\"command\": \"x\"}]}")
  file(WRITE "${WORK_DIR}/described.csv.json" "${description}")
  expect(ok "^wrote [^\n]*/out.png\nhalfstep-plot: [^\n]*/described.csv.json: not a halfstep-train trace description \\([^\n]+\\); the title names the trace instead\n$"
         "${WORK_DIR}/described.csv" ${out})
endforeach()
expect_refused("${WORK_DIR}/missing.csv" "No such file or directory")
file(WRITE "${WORK_DIR}/empty.csv" "")
expect_refused("${WORK_DIR}/empty.csv" "empty")
expect_refused("${WORK_DIR}" "not a regular file but a directory")
foreach(device /dev/urandom /dev/zero)
  if(EXISTS ${device})
    expect_refused(${device} "not a regular file but a device, FIFO or socket")
  endif()
endforeach()
execute_process(COMMAND mkfifo "${WORK_DIR}/fifo.csv" RESULT_VARIABLE no_fifo ERROR_QUIET)
if(no_fifo EQUAL 0)
  expect_refused("${WORK_DIR}/fifo.csv" "not a regular file but a device, FIFO or socket")
endif()
# Over 1 GiB, as a sparse file: refused by its size, unread.
file(WRITE "${WORK_DIR}/huge.csv" "")
execute_process(COMMAND truncate -s 1100M "${WORK_DIR}/huge.csv" RESULT_VARIABLE no_truncate ERROR_QUIET)
if(no_truncate EQUAL 0)
  expect_refused("${WORK_DIR}/huge.csv" "1153433600 bytes, more than the 1073741824 \\(1 GiB\\) a trace may have")
endif()
file(REMOVE "${WORK_DIR}/huge.csv")
string(REPEAT "x" 1100000 long_line)
file(WRITE "${WORK_DIR}/long.csv" "${long_line}\n")
expect_refused("${WORK_DIR}/long.csv" "line 1 is longer than 1048576 bytes: not a halfstep-train trace")
string(ASCII 255 254 200 1 binary)
file(WRITE "${WORK_DIR}/binary.csv" "${header}${binary}\n")
expect_refused("${WORK_DIR}/binary.csv" "line 2 is not text \\(UTF-8\\): not a halfstep-train trace")
file(WRITE "${WORK_DIR}/junk.csv" "not a checkpoint at all\n1,2,3\n")
expect_refused("${WORK_DIR}/junk.csv" "not a halfstep-train trace: its header \\(line 1\\) lacks the columns attempt, [^\n]*")
file(WRITE "${WORK_DIR}/comments.csv" "${first_line}")
expect_refused("${WORK_DIR}/comments.csv" "no header line: not a halfstep-train trace")
file(WRITE "${WORK_DIR}/header.csv" "${header}")
expect_refused("${WORK_DIR}/header.csv" "no rows after the header: the run recorded no step")
string(REPLACE "2.88372397" "abc" bad_loss "${row2}")
file(WRITE "${WORK_DIR}/text.csv" "${header}${row1}${bad_loss}")
expect_refused("${WORK_DIR}/text.csv" "line 3: loss is 'abc', not a number")
string(REPLACE "2,1," "2.5,1," bad_attempt "${row2}")
file(WRITE "${WORK_DIR}/fraction.csv" "${header}${row1}${bad_attempt}")
expect_refused("${WORK_DIR}/fraction.csv" "line 3: attempt is '2.5', not an integer")
file(WRITE "${WORK_DIR}/short.csv" "${header}${row1}2,1,applied\n")
expect_refused("${WORK_DIR}/short.csv" "line 3 has 3 fields, the header 19")
string(REPLACE ",32768,32768," ",0,32768," zero_scale "${row2}")
file(WRITE "${WORK_DIR}/zero_scale.csv" "${header}${row1}${zero_scale}")
expect_refused("${WORK_DIR}/zero_scale.csv" "line 3: scale_used is 0, not a loss scale")
# The plot: an unknown format is refused before any work; a file that cannot be written fails.
expect(2 "^halfstep-plot: [^\n]*/out.xyz: unknown image format 'xyz' \\(give one of [^\n]*png[^\n]*\\)\n$"
       "${WORK_DIR}/run.csv" -o "${WORK_DIR}/out.xyz")
expect(1 "^halfstep-plot: [^\n]*/nodir/out.png: No such file or directory\n$"
       "${WORK_DIR}/run.csv" -o "${WORK_DIR}/nodir/out.png")
if(EXISTS /dev/full)
  expect(1 "^halfstep-plot: /dev/full: No space left on device\n$" "${WORK_DIR}/run.csv" -o /dev/full)
endif()
expect_report("halfstep-plot refuses what is not a trace, in one line, and says its version")
