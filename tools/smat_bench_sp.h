// The sequence-parallel path of smat_bench (`smat_bench smat --sp` under
// mpirun): weak scaling of SequenceParallelSmatForward / Backward
// (parallel/sequence_parallel_smat.h). Every rank holds one span of --T tokens
// (T per rank is fixed; the sequence has sp x T tokens, sp = the world size),
// filled with Philox numbers indexed by global position, so a token's inputs do
// not depend on the number of ranks. The op runs on the CUDA backend with the
// NCCL communicator (rank i on cuda:<local rank i>), or on the CPU backend with
// the MPI communicator (--device cpu).
//
// Per rank: warm-up, then forward and forward+backward timed with backend
// events (CUDA events on the GPU) in the same runs, after a host barrier so
// the ranks start together; median of the timed runs. The sequence
// communicator is wrapped (RecordingCommunicator, parallel/comm_stats.h, as
// the trainer's metrics do) so every collective is recorded: its words, the bytes
// a ring sends per rank, the time from Start to the end of Wait ("in flight")
// and the time the rank was blocked in Start + Wait ("waited", the exposed
// part). Rank 0 prints the per-rank table, the per-collective table beside
// SequenceParallelVolume's formulas, and one SUMMARY line of key=value pairs
// (scripts/sp_scaling.sh reads it). With one rank it also times the
// single-process op (kernels/smat.h) on the same inputs.
//
//   mpirun -np 1 smat_bench smat --sp --device cuda --T 524288 --d 2 --dtype bf16
//       --heads 8 --r 64 --dv 64 --chunk 128
//   mpirun -np 2 smat_bench smat --sp --device cuda --T 524288 ... --baseline_ms 224.3
//       (efficiency = baseline / forward+backward at sp = 2: 1.0 is perfect weak scaling)
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.h"
#include "tools/smat_bench_smat.h"

namespace smat {

struct SpBenchOptions {
  int64_t T_per_rank = 0;  // tokens per rank; a multiple of the chunk width
  int d = 2;
  Device device = Device::Cpu();  // cpu, or cuda (the index is the local rank's)
  std::string comm = "auto";      // mpi, nccl, or auto: nccl on cuda, mpi on cpu
  double baseline_ms = 0;         // forward+backward of the 1-rank run; 0: not given
  double baseline_fwd_ms = 0;     // forward of the 1-rank run; 0: not given
};

// Checks the options that need no MPI (InvalidArgument: bad usage).
absl::Status ValidateSpBenchOptions(const SmatBenchConfig& cfg, const SpBenchOptions& opts);

// Initialises MPI, runs the benchmark on every rank, prints on rank 0 and
// returns the process exit status for main: 0 on success. A failure after MPI
// is up ends the whole job non-zero through AbortJob (returning would run
// MPI_Finalize against ranks that may be stuck in a collective).
int RunSmatBenchSp(const SmatBenchConfig& cfg, const SpBenchOptions& opts);

}  // namespace smat
