#!/usr/bin/env bash
# One-command set-up on Debian 12: installs the Debian packages smat needs that
# are missing (idempotent; sudo when not root; says what it installs), then
# configures and builds into build/ (or $BUILD_DIR).
#
#   scripts/setup.sh              # packages + configure + build
#   scripts/setup.sh --deps-only  # packages only
#   SMAT_CUDA=off scripts/setup.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

packages=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev libprotobuf-dev protobuf-compiler prometheus-cpp-dev libgtest-dev
  libopenmpi-dev openmpi-bin libopenblas-dev zlib1g-dev
  prometheus curl iproute2 procps python3-yaml
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if ((${#missing[@]})); then
  echo "setup: installing missing Debian packages: ${missing[*]}"
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "setup: not root and no sudo; install as root: apt-get install ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all Debian packages present"
fi

[[ "${1:-}" == "--deps-only" ]] && exit 0

build_dir=${BUILD_DIR:-build}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DSMAT_CUDA="${SMAT_CUDA:-auto}"
fi
cmake --build "$build_dir" -j "$(nproc)"
