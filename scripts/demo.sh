#!/usr/bin/env bash
# `make demo`: the largest end-to-end demonstration smat has so far.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build_dir=${BUILD_DIR:-build}
echo "demo: core tests"
"$build_dir/core_test"
