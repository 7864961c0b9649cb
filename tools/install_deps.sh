#!/usr/bin/env bash
# Installs the Debian packages halfstep builds and tests with, if any are missing. Idempotent and
# non-interactive; the CUDA toolkit itself is assumed (nvcc, CUB, cuBLAS).
set -euo pipefail
packages=(cmake ninja-build g++ catch2 libbenchmark-dev libopenblas-dev pkg-config
          libboost-context-dev zlib1g-dev nlohmann-json3-dev libcli11-dev clang libclang-rt-14-dev
          python3 python3-numpy python3-pandas python3-matplotlib python3-venv python3-torch python3-pytest)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  echo "installing: ${missing[*]}"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "nvcc not found: install the CUDA toolkit (nvcc, CUB, cuBLAS) first" >&2
  exit 1
fi

# Python's safetensors package (PyPI; Debian has none) for the checkpoint interoperability tests,
# in a virtual environment at .venv that also sees Debian's numpy and matplotlib; and NVIDIA's
# cuobjdump and nvdisasm (PyPI's nvidia-cuda-cuobjdump and -nvdisasm), with which tools/count_instructions.py counts
# the instructions the GPU issues.
root=$(cd "$(dirname "$0")/.." && pwd)
if ! "$root/.venv/bin/python" -c "import safetensors, numpy" >/dev/null 2>&1; then
  echo "creating $root/.venv with safetensors"
  /usr/bin/python3 -m venv --system-site-packages "$root/.venv"
  "$root/.venv/bin/pip" install -q --disable-pip-version-check safetensors
fi
# scikit-build-core (PyPI) builds the Python package (pip install --no-build-isolation .); the
# package's tests use Debian's PyTorch (CPU) and pytest, which the environment sees.
if ! "$root/.venv/bin/python" -c "import scikit_build_core" >/dev/null 2>&1; then
  "$root/.venv/bin/pip" install -q --disable-pip-version-check scikit-build-core
fi
# A current PyTorch from PyPI (a CUDA build, about 5 GB, which also runs on the CPU), for the
# Python package's tests next to Debian's 1.13: users run 2.x, and 2.x brings its own NCCL.
# Pinned to the release the suite was last run against (2.15.0, the newest on PyPI then; 2.13.0
# passed too); it lives in a cache directory outside the clone, so a machine downloads it once.
# HALFSTEP_TORCH_VENV moves it.
torch_venv=${HALFSTEP_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/halfstep/torch-2.15}
if ! "$torch_venv/bin/python" -c "import torch, numpy, pytest; assert torch.__version__.startswith('2.15.0')" \
     >/dev/null 2>&1; then
  echo "installing PyTorch 2.15.0 from PyPI into $torch_venv"
  mkdir -p "$(dirname "$torch_venv")"
  /usr/bin/python3 -m venv "$torch_venv"
  "$torch_venv/bin/pip" install -q --disable-pip-version-check torch==2.15.0 numpy pytest
fi
# Hugging Face transformers and accelerate (PyPI, pinned) in the same environment: the side-by-side
# runs of halfstep inside Trainer and accelerate's loop (examples/torch/frameworks.py). Their
# models are built from small configurations with random weights: nothing is downloaded at run time.
# (An environment made by an earlier version of this script, with torch 2.13, is left alone.)
if ! "$torch_venv/bin/python" -c "import transformers, accelerate; assert transformers.__version__ == '5.24.0' \
     and accelerate.__version__ == '1.15.0'" >/dev/null 2>&1; then
  echo "installing transformers 5.24.0 and accelerate 1.15.0 from PyPI into $torch_venv"
  "$torch_venv/bin/pip" install -q --disable-pip-version-check transformers==5.24.0 accelerate==1.15.0
fi
if ! ls "$root"/.venv/lib/python3*/site-packages/nvidia/*/bin/nvdisasm >/dev/null 2>&1; then
  "$root/.venv/bin/pip" install -q --disable-pip-version-check nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm ||
    echo "nvidia-cuda-cuobjdump not installed: instruction counts will be PTX only" >&2
fi
