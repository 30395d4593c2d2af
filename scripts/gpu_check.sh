#!/usr/bin/env bash
# Builds the CUDA backend (libsmat_cuda.so) and the GPU tests, then runs every
# test labelled gpu, on a host with an NVIDIA GPU. The one command to run for
# every CUDA change:
#
#   scripts/gpu_check.sh [build-dir]        (default: build-gpu)
#
# SMAT_REQUIRE_GPU=1 turns the tests' "no GPU, skipped" into a failure, so a
# backend that does not load on a GPU host cannot pass as a skip. On the H200
# test hosts (PLATFORM.md) the missing Debian packages come from .device/;
# setup.sh is sourced when it is there.
set -eo pipefail
cd "$(dirname "$0")/.."
build="${1:-build-gpu}"

if [ -f .device/setup.sh ]; then
  # shellcheck disable=SC1091
  source .device/setup.sh
fi
set -u

if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
else
  echo "gpu_check: nvidia-smi not found; the GPU tests will fail (SMAT_REQUIRE_GPU=1)" >&2
fi

cmake_args=(-DCMAKE_BUILD_TYPE=Release -DSMAT_CUDA=on)
command -v ninja > /dev/null && cmake_args+=(-G Ninja)
# Debian's zlib1g-dev, unpacked on another distribution (the H200 hosts), has
# a libz.so that points at a libz.so.1.2.13 the host does not have; CMake then
# falls back to the non-PIC libz.a and libsmat_core.so fails to link. Use the
# host's shared zlib instead.
for prefix in ${CMAKE_PREFIX_PATH//:/ }; do
  dev_link="$prefix/lib/x86_64-linux-gnu/libz.so"
  if [ -L "$dev_link" ] && [ ! -e "$dev_link" ]; then
    host_zlib=$(ldconfig -p | awk '/libz\.so\.1 .*x86-64/ {print $NF; exit}')
    if [ -n "$host_zlib" ]; then
      echo "gpu_check: $dev_link is a dangling link; using $host_zlib"
      cmake_args+=(-DZLIB_LIBRARY="$host_zlib")
    fi
  fi
done
cmake -S . -B "$build" "${cmake_args[@]}"
cmake --build "$build" -j "$(nproc)" --target smat_cuda gpu_test gpu_exposer_test
SMAT_REQUIRE_GPU=1 ctest --test-dir "$build" -L gpu --output-on-failure
