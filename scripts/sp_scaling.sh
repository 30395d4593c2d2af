#!/usr/bin/env bash
# Weak scaling of sequence-parallel SMat on the GPUs of one host: for each d,
# `smat_bench smat --sp` under mpirun with 1 rank (the baseline: T tokens on one
# GPU), then with each larger rank count at the same T per rank, given the
# 1-rank forward and forward+backward times as baselines, so each line carries
# efficiency = t(1 GPU, T) / t(sp GPUs, sp x T). Prints one Markdown table last
# (docs/PERFORMANCE.md, "Sequence parallelism", shows one).
#
#   scripts/sp_scaling.sh [build-dir] [d ...]     (default: build-gpu, d = 2)
#
# Build first with scripts/gpu_check.sh (it builds smat_bench and
# libsmat_cuda.so into the same build directory). Settings from the
# environment, defaults the issue's shape:
#   SP_T=524288 (tokens per rank)  SP_DTYPE=bf16  SP_HEADS=8  SP_R=64  SP_DV=64
#   SP_CHUNK=128  SP_RANKS="1 2"  SP_REPS=10  SP_DEVICE=cuda  SP_EXTRA=""
#   (e.g. --gated)  SP_LOG_DIR=<build-dir>/sp_scaling (one log per run)
#   SP_LABEL=default (the table's variant column, e.g. "fast tiles" with
#   SMAT_CUDA_CHUNK_TILES=fast; every SMAT_* variable is passed to the ranks)
set -eo pipefail
cd "$(dirname "$0")/.."
build="${1:-build-gpu}"
shift || true
ds=("$@")
[ ${#ds[@]} -eq 0 ] && ds=(2)

if [ -f .device/setup.sh ]; then
  # shellcheck disable=SC1091
  source .device/setup.sh
fi
set -u

T="${SP_T:-524288}" dtype="${SP_DTYPE:-bf16}" heads="${SP_HEADS:-8}" r="${SP_R:-64}"
dv="${SP_DV:-64}" chunk="${SP_CHUNK:-128}" reps="${SP_REPS:-10}" device="${SP_DEVICE:-cuda}"
read -r -a ranks <<< "${SP_RANKS:-1 2}"
read -r -a extra <<< "${SP_EXTRA:-}"
logs="${SP_LOG_DIR:-$build/sp_scaling}" label="${SP_LABEL:-default}"
mpi_env=()
for v in $(compgen -e | grep '^SMAT_' || true); do mpi_env+=(-x "$v"); done
bench="$build/smat_bench"
if [ ! -x "$bench" ]; then
  echo "sp_scaling: $bench not found; build it first: scripts/gpu_check.sh $build" >&2
  exit 2
fi
mkdir -p "$logs"

# value KEY LINE: the value of KEY=... in a SUMMARY line ("" if absent).
value() { tr ' ' '\n' <<< "$2" | sed -n "s/^$1=//p"; }

rows=()
for d in "${ds[@]}"; do
  base="" base_fwd=""
  for np in "${ranks[@]}"; do
    args=(smat --sp --device "$device" --T "$T" --d "$d" --dtype "$dtype" --heads "$heads"
          --r "$r" --dv "$dv" --chunk "$chunk" --reps "$reps" "${extra[@]}")
    if [ -n "$base" ]; then args+=(--baseline_ms "$base" --baseline_fwd_ms "$base_fwd"); fi
    log="$logs/sp_d${d}_np${np}${SP_LABEL:+_${label// /_}}.log"
    echo "== d=$d, $np rank(s), $label: mpirun -np $np --bind-to none ${mpi_env[*]} $bench ${args[*]}"
    mpirun -np "$np" --bind-to none "${mpi_env[@]}" "$bench" "${args[@]}" 2>&1 | tee "$log"
    line=$(grep '^SUMMARY ' "$log" | tail -n 1)
    if [ -z "$line" ]; then
      echo "sp_scaling: no SUMMARY line from the $np-rank run (log: $log)" >&2
      exit 1
    fi
    fwd=$(value fwd_ms "$line") all=$(value fwd_bwd_ms "$line")
    if [ "$np" = "${ranks[0]}" ]; then
      base="$all" base_fwd="$fwd"
    fi
    eff=$(value efficiency "$line") eff_fwd=$(value efficiency_fwd "$line")
    op=$(value op_fwd_bwd_ms "$line")
    rows+=("| $d | $dtype | $label | $np | $T | $(value T "$line") | $fwd | $all | ${eff_fwd:--} | ${eff:--} | $(value comm_in_flight_ms "$line") | $(value comm_waited_ms "$line") | $(value comm_ring_bytes "$line") | ${op:--} |")
  done
done

table="| d | dtype | variant | GPUs | T per GPU | T | fwd ms | fwd+bwd ms | efficiency fwd | efficiency fwd+bwd | collectives in flight ms | waited ms | ring bytes sent per GPU | single-process op fwd+bwd ms |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for row in "${rows[@]}"; do table+=$'\n'"$row"; done
echo "$table" >> "$logs/table.md"
echo
echo "$table"
