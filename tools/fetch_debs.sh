#!/usr/bin/env bash
# Downloads the Debian packages the GPU check needs into .debs/ (git-ignored), for a GPU machine
# that cannot reach a package registry: bench/gpu_check.sh unpacks them into a private prefix.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .debs
cd .debs
apt-get download catch2 libbenchmark-dev libbenchmark1debian
ls -l
