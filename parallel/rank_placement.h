// The rank -> host -> CPUs -> GPU table smat_train prints at start (rank 0
// prints it, every rank contributes its row through one AllGather over the
// host communicator), the check that the launcher's view of the job matches
// MPI's (parallel/launch_env.h), and how many ranks share this rank's CPUs
// (for CpuThreadsPerRank).
//
//   SMAT_ASSIGN_OR_RETURN(PlacementReport p,
//                         DescribeRankPlacement(pg->host_world(), *pg, std::getenv));
//   if (rank == 0) std::puts(p.table.c_str());
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "parallel/launch_env.h"
#include "parallel/mpi_communicator.h"
#include "parallel/process_group.h"

namespace smat {

struct PlacementReport {
  std::string table;           // FormatPlacementTable
  int allowed_cpus = 0;        // CPUs this rank may run on (its affinity mask)
  int ranks_sharing_cpus = 1;  // ranks of this host with exactly those CPUs, this one included
};

// Collective over `control` (every rank calls it). Reads this process's
// launch environment with `lookup`, checks it against MPI, gathers every
// rank's host name, local rank, CPU affinity (the first 1024 CPUs) and GPU.
// A rank whose launch environment is inconsistent returns its
// FailedPrecondition; its peers return one that names it, so no rank is left
// waiting.
absl::StatusOr<PlacementReport> DescribeRankPlacement(MpiCommunicator& control,
                                                      const ProcessGroup& pg,
                                                      const EnvironmentLookup& lookup);

}  // namespace smat
