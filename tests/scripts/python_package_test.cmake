# `pip install` of the repository into a scratch directory (scikit-build-core builds libhalfstep
# with CMake; sm_90 only, to keep it short), then the package's import and C API tests and the
# README's PyTorch snippet against the installed copy: the library inside the package, found
# without HALFSTEP_LIBRARY.
# Run as: cmake -DPYTHON=<venv python> -DSOURCE_DIR=<repo> -DWORK_DIR=<scratch> -P python_package_test.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
include(${CMAKE_CURRENT_LIST_DIR}/script_run.cmake)
run("${PYTHON}" -m pip install --no-build-isolation --no-deps --disable-pip-version-check -q
    --target "${WORK_DIR}/site" --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90-real
    "--config-settings=build-dir=${WORK_DIR}/build" "${SOURCE_DIR}")
set(env ${CMAKE_COMMAND} -E env --unset=HALFSTEP_LIBRARY "PYTHONPATH=${WORK_DIR}/site")
run(${env} "${PYTHON}" -c "import halfstep
print(halfstep.library_path())")
if(NOT out MATCHES "^${WORK_DIR}/site/halfstep/libhalfstep.so")
  message(FATAL_ERROR "the installed package loads ${out}, not the library inside it")
endif()
run(${env} "${PYTHON}" -m pytest -q -p no:cacheprovider "${SOURCE_DIR}/python/tests/test_package.py"
    "${SOURCE_DIR}/python/tests/test_readme.py")
message(STATUS "pip install . built the package; its tests and the README snippet ran against it:\n${out}")

# On a current PyTorch from PyPI (TORCH_PYTHON, its own NCCL inside): the package's library has
# no NCCL of its own, so it imports before torch as well as after, and the whole suite runs.
if(TORCH_PYTHON)
  foreach(order "import halfstep.torch, torch" "import torch, halfstep.torch")
    run(${env} "${TORCH_PYTHON}" -c "${order}
import halfstep
assert not halfstep.has_nccl(), 'the package library links NCCL'
maps = open('/proc/self/maps').read()
assert 'libhalfstep' in maps
print(torch.__version__, 'imports:', '${order}')")
    message(STATUS "${out}")
  endforeach()
  run(${env} "${TORCH_PYTHON}" -m pytest -q -rs -p no:cacheprovider "${SOURCE_DIR}/python/tests")
  message(STATUS "the package's suite on PyTorch from PyPI:\n${out}")
endif()
