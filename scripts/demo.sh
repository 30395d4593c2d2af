#!/usr/bin/env bash
# `make demo`: the end-to-end demonstration. After a quick check of the core
# library, two MPI ranks train one model with every sequence split between them
# (sequence parallelism, sp = 2) on multi-query associative recall at T = 4096
# with a d = 2 SMat mask (configs/demo_cpu.textproto), evaluating as they go;
# the run ends by printing its held-out accuracy. A few minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build_dir=${BUILD_DIR:-build}

echo "demo: core tests"
"$build_dir/core_test" --gtest_brief=1

# Open MPI refuses to start as root unless told twice (containers run as root).
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# A fresh run each time: otherwise checkpoint.resume = auto would resume the
# previous demo at its last step and have nothing left to train.
rm -rf runs/demo_cpu
echo "demo: mpirun -np 2 $build_dir/smat_train --config configs/demo_cpu.textproto"
mpirun -np 2 --oversubscribe --bind-to none "$build_dir/smat_train" \
  --config configs/demo_cpu.textproto "$@"
