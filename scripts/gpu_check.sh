#!/usr/bin/env bash
# Builds the CUDA backend (libsmat_cuda.so) and every test labelled gpu
# (gpu_test, gpu_exposer_test, tools_gpu_test, and nccl_communicator_test,
# which runs under mpirun -np 2 with one GPU per rank), plus smat_bench,
# smat_train, smat_op and smat_data for the GPU benchmarks and training runs,
# then runs the gpu tests, on a host with an NVIDIA GPU. The one command to run
# for every CUDA or NCCL change:
#
#   scripts/gpu_check.sh [build-dir]        (default: build-gpu)
#
# SMAT_REQUIRE_GPU=1 turns the tests' "no GPU, skipped" into a failure, so a
# backend that does not load on a GPU host cannot pass as a skip. Every gpu
# test must run: a skipped one (NCCL that did not start, say) fails the check.
# With one GPU the 2-rank NCCL test and the second-device case of gpu_test are
# left out, saying so. On the H200 test hosts (PLATFORM.md) the missing Debian
# packages come from .device/; setup.sh is sourced when it is there.
set -eo pipefail
cd "$(dirname "$0")/.."
build="${1:-build-gpu}"

if [ -f .device/setup.sh ]; then
  # shellcheck disable=SC1091
  source .device/setup.sh
fi
set -u

gpus=0
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
  gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ' || true)
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
# Build what the gpu-labelled tests run (their executables, read from CTest's
# own test list), the CUDA plugin, and the tools the GPU benchmarks use.
gpu_targets=$(ctest --test-dir "$build" -N -L gpu --show-only=json-v1 | python3 -c '
import json, os, sys
names = set()
for t in json.load(sys.stdin).get("tests", []):
    for arg in t.get("command", []):
        base = os.path.basename(arg)
        if base.endswith("_test") and os.path.dirname(arg).startswith(sys.argv[1]):
            names.add(base)
print(" ".join(sorted(names)))' "$(cd "$build" && pwd)")
# The executables of today's gpu tests are named too, in case the list above
# comes back short (a test whose executable is not built shows as "Not Run").
gpu_targets=$(echo gpu_test gpu_exposer_test nccl_communicator_test tools_test $gpu_targets |
  tr " " "\n" | sort -u | tr "\n" " ")
echo "gpu_check: building smat_cuda smat_bench smat_train smat_op smat_data $gpu_targets"
# shellcheck disable=SC2086
cmake --build "$build" -j "$(nproc)" --target smat_cuda smat_bench smat_train smat_op smat_data \
  $gpu_targets

# The SMat variants (gpu_smat_*: gpu_test --gtest_filter=Smat* under other
# kernel settings) time nothing, and their CPU references run on one thread:
# they run side by side, up to one per two cores. The other gpu tests (timing
# checks among them) run one at a time after them.
jobs=$(($(nproc) / 2))
[ "$jobs" -gt 8 ] && jobs=8
[ "$jobs" -lt 1 ] && jobs=1
exclude='^gpu_smat_'
if [ "$gpus" -lt 2 ]; then
  echo "gpu_check: $gpus GPU(s); nccl_communicator_test_np2 needs 2 (one per rank), not run" >&2
  exclude="$exclude|nccl_communicator_test"
  # The one case that needs a second GPU would skip, and CTest reports a test
  # with any skipped case as skipped, hiding whether the others passed: leave
  # it out by name instead (an explicit --gtest_filter of a test overrides this).
  echo "gpu_check: GpuTest.SecondDeviceIfPresent needs 2 GPUs, left out" >&2
  export GTEST_FILTER=-GpuTest.SecondDeviceIfPresent
fi
log="$build/gpu_check_ctest.log"
status=0
SMAT_REQUIRE_GPU=1 ctest --test-dir "$build" -L gpu -R '^gpu_smat_' -j "$jobs" \
  --output-on-failure 2>&1 | tee "$log" || status=1
SMAT_REQUIRE_GPU=1 ctest --test-dir "$build" -L gpu -E "$exclude" --output-on-failure 2>&1 |
  tee -a "$log" || status=1
if grep -q '\*\*\*Skipped' "$log"; then
  echo "gpu_check: every gpu test must run on a GPU host; skipped:" >&2
  grep '\*\*\*Skipped' "$log" >&2
  exit 1
fi
exit "$status"
