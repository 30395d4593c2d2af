// The rank -> host -> GPU table smat_train prints at start (rank 0 prints it,
// every rank contributes its row through one AllGather over the host
// communicator), and the check that the launcher's view of the job matches
// MPI's (parallel/launch_env.h).
//
//   SMAT_ASSIGN_OR_RETURN(std::string table, DescribeRankPlacement(pg->host_world(), *pg));
//   if (rank == 0) std::puts(table.c_str());
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "parallel/launch_env.h"
#include "parallel/mpi_communicator.h"
#include "parallel/process_group.h"

namespace smat {

// Collective over `control` (every rank calls it). Reads this process's
// launch environment with `lookup`, checks it against MPI, gathers every
// rank's host name, local rank and GPU. A rank whose launch environment is
// inconsistent returns its FailedPrecondition; its peers return one that
// names it, so no rank is left waiting.
absl::StatusOr<std::string> DescribeRankPlacement(MpiCommunicator& control, const ProcessGroup& pg,
                                                  const EnvironmentLookup& lookup);

}  // namespace smat
