// Where a rank runs and which GPU it takes, from the environment its launcher
// set: Open MPI's mpirun (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK,
// _LOCAL_SIZE), Slurm's srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) or
// MPICH's Hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID). Without any of them the
// local rank comes from MPI (MPI_Comm_split_type shared, ProcessGroup), which
// every MPI provides. smat_launch reads the same variables for its defaults.
//
// The environment is read through a lookup function, so tests hand in a fake
// one and nothing here touches MPI:
//
//   SMAT_ASSIGN_OR_RETURN(LaunchEnvironment env, ReadLaunchEnvironment(std::getenv));
//   SMAT_RETURN_IF_ERROR(CheckAgainstMpi(env, world_rank, world_size));
//   int gpu = GpuForLocalRank(env.local_rank, env.visible_devices);
//
// Why the check: `srun` without `--mpi=pmix` (or a PMI the MPI was built
// for) starts every task as a one-rank MPI job; each then trains alone and
// they overwrite each other's checkpoints. SLURM_NTASKS = 8 against an
// MPI world of 1 says exactly that, before any step runs.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace smat {

// getenv-like: nullptr when the variable is not set.
using EnvironmentLookup = std::function<const char*(const char*)>;

struct LaunchEnvironment {
  // "Open MPI", "Slurm", "MPICH/PMI" or "" (none found: the MPI fallback).
  std::string launcher;
  int rank = -1, size = -1;              // -1: not given by the launcher
  int local_rank = -1, local_size = -1;  // rank among this host's ranks
  std::string node;                      // SLURMD_NODENAME (Slurm), else ""
  std::string visible_devices;           // CUDA_VISIBLE_DEVICES as set, "" if unset
  bool found() const { return !launcher.empty(); }
};

// Open MPI's variables win over Slurm's: mpirun inside a Slurm allocation
// sets both, and OMPI_* describe the MPI job while SLURM_* describe the batch
// step that runs mpirun. InvalidArgument names a variable that is set but not
// a number, or out of range (rank >= size).
absl::StatusOr<LaunchEnvironment> ReadLaunchEnvironment(const EnvironmentLookup& lookup);

// FailedPrecondition when the launcher's rank or size disagrees with MPI's
// (MPI_COMM_WORLD): the tasks were not wired into one MPI job.
absl::Status CheckAgainstMpi(const LaunchEnvironment& env, int world_rank, int world_size);

// The CUDA device index (as the process sees it) for a local rank: the local
// rank itself, except when CUDA_VISIBLE_DEVICES lists exactly one device (a
// scheduler that gives every task its own GPU: Slurm --gpus-per-task=1,
// Kubernetes one GPU per pod), which is then device 0 whatever the local rank.
int GpuForLocalRank(int local_rank, const std::string& visible_devices);

// The physical GPU behind device `device`: the device'th entry of
// CUDA_VISIBLE_DEVICES ("2,3" -> device 1 is "3"), or the index itself.
std::string PhysicalGpu(int device, const std::string& visible_devices);

// The threads a rank's CPU products (OpenBLAS) should run on, or 0 to leave
// OpenBLAS's own choice (one thread per CPU the rank may run on):
// - 0 where OPENBLAS_NUM_THREADS, GOTO_NUM_THREADS or OMP_NUM_THREADS is set
//   (OpenBLAS reads them itself: the user's choice stands);
// - 0 where no other rank of the host may run on exactly this rank's CPUs
//   (ranks_sharing_cpus <= 1, this rank counted: bound to CPUs of its own);
// - else allowed_cpus / ranks_sharing_cpus, at least 1. Ranks that share a set
//   of CPUs (mpirun --bind-to none: the whole host; Open MPI's default binding
//   of more than two ranks: a socket or NUMA domain, several ranks to each)
//   would otherwise each start a thread per CPU of the set, and their
//   spinning waits would take the CPUs from each other's work (torchrun sets
//   OMP_NUM_THREADS=1 for the same reason). With
//   two unbound ranks on two CPUs (make demo) a step took 123-200 ms on two
//   threads a rank, 110-114 on one.
int CpuThreadsPerRank(const EnvironmentLookup& lookup, int ranks_sharing_cpus, int allowed_cpus);

// CPU numbers as ranges: {0, 1, 2, 3, 8, 10, 11} -> "0-3,8,10-11"; none -> "-".
// `cpus` ascending.
std::string FormatCpuList(const std::vector<int>& cpus);

// One rank's placement, for the table rank 0 prints at start.
struct RankPlacement {
  int rank = 0;
  std::string host;
  int local_rank = 0;
  int gpu = -1;              // CUDA device the rank uses; -1: CPU
  std::string physical_gpu;  // PhysicalGpu(gpu, ...), "" on CPU
  std::string cpus;          // the CPUs it may run on (FormatCpuList)
};

// The table, one line per rank, with a header naming the launcher:
//   smat: 4 ranks launched by Open MPI on 2 hosts
//     rank  host    local  cpus   gpu
//        0  node-a      0  0-15   cuda:0
//        1  node-a      1  16-31  cuda:1 (physical 3)
std::string FormatPlacementTable(const std::vector<RankPlacement>& ranks,
                                 const std::string& launcher);

}  // namespace smat
