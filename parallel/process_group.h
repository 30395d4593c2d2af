// ProcessGroup: the dp x sp grid of ranks and its communicators
// (ARCHITECTURE.md section 4).
//
// World rank w sits in sequence group w / sp (the sp consecutive ranks that
// share one sequence: with sp <= GPUs per node the sequence-parallel traffic,
// the latency-sensitive part, stays inside a node) at sequence rank w % sp, and
// in data group w % sp (ranks holding the same span of different sequences:
// parameter gradients are all-reduced over the whole grid, see world()).
//
// Communicators: MPI (host tensors) or NCCL (device tensors, inside
// libsmat_cuda.so, bootstrapped here over MPI: rank 0 creates the
// ncclUniqueId, MPI broadcasts it under the deadline, every rank initialises
// on GPU local_rank; sub-groups through ncclCommSplit). A host MPI
// communicator over the world is always there for control traffic (verdicts,
// gathering outputs to rank 0).
//
//   ProcessGroupOptions opts{.sp = 4, .backend = CommBackend::kNccl};
//   SMAT_ASSIGN_OR_RETURN(auto pg, ProcessGroup::Create(MPI_COMM_WORLD, opts));
//   SMAT_RETURN_IF_ERROR(SequenceParallelSmatForward(gpu, pg->sequence(), ...));
#pragma once

#include <memory>
#include <string>

#include <mpi.h>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "parallel/mpi_communicator.h"

namespace smat {

enum class CommBackend : int { kMpi = 0, kNccl = 1 };
absl::StatusOr<CommBackend> ParseCommBackend(const std::string& name);  // "mpi", "nccl"

struct ProcessGroupOptions {
  int sp = 1;  // ranks per sequence group; must divide the world size
  CommBackend backend = CommBackend::kMpi;
  CommOptions comm;
};

class ProcessGroup {
 public:
  // Collective over `world`. InvalidArgument when sp does not divide the world
  // size; FailedPrecondition when NCCL is asked for without a usable GPU per
  // local rank or without libsmat_cuda.so.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> Create(MPI_Comm world,
                                                              const ProcessGroupOptions& options);

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  int sp() const { return sp_; }
  int dp() const { return world_size_ / sp_; }
  int sp_rank() const { return world_rank_ % sp_; }  // position in the sequence
  int dp_rank() const { return world_rank_ / sp_; }  // which sequence group
  int local_rank() const { return local_rank_; }     // rank among this host's ranks
  int local_size() const { return local_size_; }
  // CUDA device of this rank's NCCL communicators (local_rank), -1 with MPI.
  int device() const { return device_; }

  Communicator& world() { return *world_; }
  Communicator& sequence() { return *sequence_; }
  Communicator& data() { return *data_; }
  MpiCommunicator& host_world() { return *host_world_; }

  std::string DebugString() const;  // "rank 5 of 8: dp 2 x sp 4, sequence rank 1, data rank 1"

 private:
  ProcessGroup() = default;
  int world_rank_ = 0, world_size_ = 1, sp_ = 1, local_rank_ = 0, local_size_ = 1, device_ = -1;
  std::unique_ptr<MpiCommunicator> host_world_;
  std::unique_ptr<Communicator> world_, sequence_, data_;
};

}  // namespace smat
