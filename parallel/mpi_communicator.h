// MpiCommunicator: the Communicator over Open MPI, for host (CPU) tensors.
//
// Every collective is a nonblocking MPI call (MPI_Ialltoallv, MPI_Iallgather,
// MPI_Ibcast, MPI_Ibarrier) polled with MPI_Test until it completes or its
// deadline passes, so a dead or stalled peer becomes DeadlineExceeded instead
// of a hang. Progress is made by the polling (Open MPI 4.1 has no progress
// thread by default): a handle that is not waited on progresses when any
// other call on this rank polls.
//
// Determinism. Reductions never use MPI's reduction operators, whose order
// depends on the algorithm Open MPI picks (message size, rank count, tuning
// files). AllReduce is a reduce-scatter (MPI_Ialltoallv of 1/size blocks, then a
// local sum over ranks in order 0..size-1, in fp32 for fp32 and bf16, wrapping
// integer arithmetic for int32/int64) followed by an MPI_Iallgatherv of the
// summed blocks. Same ranks, same inputs -> same bits on every rank, every run;
// volume 2 (size-1)/size N per rank, as a ring all-reduce. bf16 is summed in
// fp32 and rounded once, so no custom MPI_Op is needed.
//
// Failure. After a deadline, an injected failure or an MPI error the
// communicator is unusable: collective requests cannot be cancelled or freed
// (MPI 3.1 section 5.12), so they and their buffers are kept until the process
// ends and later calls return kAborted. The caller propagates the status to
// main, which calls AbortJob (MPI_Abort): returning normally would run
// MPI_Finalize, which waits for the dead peer. The job then ends non-zero and
// smat_launch restarts it.
//
// Not thread-safe: one thread drives a communicator (MPI_THREAD_FUNNELED).
//
//   SMAT_ASSIGN_OR_RETURN(MpiSession mpi, MpiSession::Init(&argc, &argv));
//   SMAT_ASSIGN_OR_RETURN(CommOptions opts, CommOptions::FromEnvironment());
//   SMAT_ASSIGN_OR_RETURN(auto world, MpiCommunicator::Create(MPI_COMM_WORLD, opts));
//   absl::Status s = world->AllReduce(grad);
//   if (!s.ok()) AbortJob(s);   // main only
#pragma once

#include <memory>
#include <string>

#include <mpi.h>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace smat {

// Owns MPI initialisation for main: MPI_Init_thread on Init, MPI_Finalize when
// destroyed (only if this object initialised MPI).
class MpiSession {
 public:
  static absl::StatusOr<MpiSession> Init(int* argc, char*** argv);
  MpiSession(MpiSession&& o) noexcept : owns_(o.owns_) { o.owns_ = false; }
  MpiSession& operator=(MpiSession&&) = delete;
  MpiSession(const MpiSession&) = delete;
  ~MpiSession();

  int world_rank() const;
  int world_size() const;

 private:
  explicit MpiSession(bool owns) : owns_(owns) {}
  bool owns_ = false;
};

// Ends the whole MPI job with a non-zero status after printing `status` with
// this rank: for main (and test mains) only, after a collective failed.
[[noreturn]] void AbortJob(const absl::Status& status);

class MpiCommunicator final : public Communicator {
 public:
  // A communicator over a duplicate of `parent` (so its traffic cannot match
  // anybody else's), errors returned rather than fatal. Collective over parent.
  static absl::StatusOr<std::unique_ptr<MpiCommunicator>> Create(MPI_Comm parent,
                                                                 CommOptions options);
  MpiCommunicator(MpiCommunicator&&) noexcept = default;
  MpiCommunicator& operator=(MpiCommunicator&&) noexcept = default;
  ~MpiCommunicator() override;

  int rank() const override;
  int size() const override;
  Device device() const override { return Device::Cpu(); }
  std::string name() const override { return "mpi"; }
  absl::Duration default_timeout() const override;

  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartAllReduce(
      Tensor& data, absl::Duration timeout) override;
  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartAllGather(
      const Tensor& send, Tensor& recv, absl::Duration timeout) override;
  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartReduceScatter(
      const Tensor& send, Tensor& recv, absl::Duration timeout) override;
  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartBroadcast(
      Tensor& data, int root, absl::Duration timeout) override;
  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartBarrier(
      absl::Duration timeout) override;

  void Abort(const std::string& reason) override;
  bool aborted() const override;

  // Collective over this communicator; the child inherits the options (its
  // collectives are counted separately for fault injection). The split itself
  // is preceded by a Barrier under the deadline, so a dead peer is an error.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override;
  absl::StatusOr<std::unique_ptr<MpiCommunicator>> SplitMpi(int color, int key);

  // The underlying communicator, e.g. to bootstrap NCCL (MPI_Bcast of its id).
  MPI_Comm comm() const;

  // Shared with the handles, so a handle can mark the communicator unusable.
  struct State;

 private:
  explicit MpiCommunicator(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

}  // namespace smat
