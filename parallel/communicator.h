// Communicator: the collectives that sequence and data parallelism need
// (AllReduce(sum), AllGather, ReduceScatter, Broadcast, Barrier, Abort), for
// fp32, bf16, int32 and int64 tensors. Two implementations: MpiCommunicator
// (host memory, parallel/mpi_communicator.h) and NcclCommunicator (device
// memory, parallel/cuda/nccl_communicator.h, inside libsmat_cuda.so).
//
// Every collective has a deadline. A collective that misses it returns
// DeadlineExceeded naming the operation, the rank and the elapsed time, and the
// communicator becomes unusable (later calls return kAborted): a peer is dead or
// stalled, the collective cannot be cancelled (MPI forbids cancelling collective
// requests; NCCL's only cure is ncclCommAbort), so the process must end with a
// non-zero status and the launcher restarts the job from its last checkpoint
// (ARCHITECTURE.md sections 6 and 7).
//
// Asynchronous variants return a CollectiveHandle, so communication overlaps
// local work; the blocking calls are Start* followed by Wait:
//
//   SMAT_ASSIGN_OR_RETURN(auto h, comm.StartAllGather(span_state, all_states));
//   ... chunk-local work ...
//   SMAT_RETURN_IF_ERROR(h->Wait());
//
// Reductions are deterministic: the same inputs on the same number of ranks give
// the same bits on every rank and in every run (ARCHITECTURE.md section 5).
//
// This header is also compiled into libsmat_cuda.so (NcclCommunicator), so it
// depends on core only and keeps everything inline except FaultPlan parsing.
#pragma once

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/status.h"
#include "core/tensor.h"

namespace smat {

// A fault to inject into the collectives of a communicator, so failure
// handling is tested rather than hoped for. Spelled (in $SMAT_FAULT or
// CommOptions::fault):
//
//   stall_in_collective:rank=1:call=3[:seconds=6]   rank 1 sleeps before posting
//                                                   its 3rd collective (forever
//                                                   without seconds=)
//   fail_collective:rank=0:call=2                   call 2 of rank 0 returns
//                                                   kUnavailable without posting
//   kill_in_collective:rank=1:call=3                rank 1 raises SIGKILL
//   stop_in_collective:rank=1:call=3                rank 1 raises SIGSTOP
//
// `rank` is the rank within the communicator the plan is attached to; `call`
// counts that communicator's collectives from 1 (Barrier included).
struct FaultPlan {
  enum class Kind : int { kNone = 0, kStall, kFail, kKill, kStop };
  Kind kind = Kind::kNone;
  int rank = -1;
  int64_t call = 0;
  absl::Duration stall = absl::InfiniteDuration();

  bool active() const { return kind != Kind::kNone; }
  bool Fires(int my_rank, int64_t my_call) const {
    return active() && my_rank == rank && my_call == call;
  }
  std::string ToString() const {
    static const char* const kNames[] = {"none", "stall_in_collective", "fail_collective",
                                         "kill_in_collective", "stop_in_collective"};
    std::string s = absl::StrCat(kNames[static_cast<int>(kind)], ":rank=", rank, ":call=", call);
    if (kind == Kind::kStall && stall != absl::InfiniteDuration()) {
      absl::StrAppend(&s, ":seconds=", absl::ToDoubleSeconds(stall));
    }
    return s;
  }
};

// Parses the spelling above; "" is no fault. InvalidArgument names the part
// that is wrong.
absl::StatusOr<FaultPlan> ParseFaultPlan(const std::string& spec);

// Carries out a firing fault on the calling rank: sleeps (kStall; then the
// collective is posted late), raises SIGKILL / SIGSTOP, or returns kUnavailable
// (kFail). `what` names the collective for the messages. Inline because
// libsmat_cuda.so (NCCL) uses it without linking smat_parallel.
inline absl::Status InjectFault(const FaultPlan& plan, const std::string& what) {
  std::fprintf(stderr, "smat: injecting fault %s in %s\n", plan.ToString().c_str(), what.c_str());
  std::fflush(stderr);
  switch (plan.kind) {
    case FaultPlan::Kind::kNone:
      return absl::OkStatus();
    case FaultPlan::Kind::kStall:
      if (plan.stall == absl::InfiniteDuration()) {
        for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
      }
      std::this_thread::sleep_for(absl::ToChronoNanoseconds(plan.stall));
      return absl::OkStatus();
    case FaultPlan::Kind::kFail:
      return absl::UnavailableError(
          absl::StrCat(what, ": injected failure (", plan.ToString(), ")"));
    case FaultPlan::Kind::kKill:
      std::raise(SIGKILL);
      return absl::OkStatus();
    case FaultPlan::Kind::kStop:
      std::raise(SIGSTOP);
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

class ParallelConfig;  // core/config.proto

struct CommOptions {
  // Deadline of every collective that is not given its own; a trainer sets it
  // from parallel.collective_timeout_seconds (FromConfig).
  absl::Duration timeout = absl::Seconds(60);
  FaultPlan fault;

  // Defaults plus $SMAT_FAULT (if set) and $SMAT_COLLECTIVE_TIMEOUT_S (if set).
  static absl::StatusOr<CommOptions> FromEnvironment();
  // FromEnvironment, with the timeout from the config unless
  // $SMAT_COLLECTIVE_TIMEOUT_S overrides it (tests shorten it that way).
  static absl::StatusOr<CommOptions> FromConfig(const ParallelConfig& config);
};

// One collective in flight. Destroying a handle that has not completed leaves
// the communicator unusable (the buffers it uses stay owned by the
// communicator until it is destroyed), since a collective cannot be withdrawn.
class CollectiveHandle {
 public:
  virtual ~CollectiveHandle() = default;
  // Waits until the collective completes or its deadline (fixed when it was
  // started: start + timeout) passes. OK, DeadlineExceeded, kUnavailable
  // (transport error) or kAborted (the communicator was aborted).
  virtual absl::Status Wait() = 0;
  // Non-blocking: true once complete; an error as Wait would return it.
  virtual absl::StatusOr<bool> Poll() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  Communicator(Communicator&&) = default;
  Communicator& operator=(Communicator&&) = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Where the tensors of every call must live (cpu, or cuda:N for NCCL).
  virtual Device device() const = 0;
  virtual std::string name() const = 0;  // "mpi", "nccl"
  virtual absl::Duration default_timeout() const = 0;

  // --- asynchronous collectives; timeout is measured from the Start call ---------
  // data (any shape, N elements) <- sum over ranks, in rank order 0..size-1 in
  // fp32 (bf16 rounded once at the end), identical bits on every rank.
  virtual absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartAllReduce(
      Tensor& data, absl::Duration timeout) = 0;
  // send (N elements) -> recv (size * N elements, rank-major: rank i's send at
  // [i*N, (i+1)*N)).
  virtual absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartAllGather(
      const Tensor& send, Tensor& recv, absl::Duration timeout) = 0;
  // send (size * N elements) -> recv (N elements): recv = sum over ranks i of
  // send_i[rank*N, (rank+1)*N), in rank order as AllReduce.
  virtual absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartReduceScatter(
      const Tensor& send, Tensor& recv, absl::Duration timeout) = 0;
  // data on every rank <- data on `root`.
  virtual absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartBroadcast(
      Tensor& data, int root, absl::Duration timeout) = 0;
  virtual absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartBarrier(
      absl::Duration timeout) = 0;

  // Marks the communicator unusable on this rank (NCCL: ncclCommAbort, which
  // also unblocks its kernels). Every later call returns kAborted with `reason`.
  // It does not end the process: main does that (see AbortJob in
  // mpi_communicator.h), since only main may exit.
  virtual void Abort(const std::string& reason) = 0;
  virtual bool aborted() const = 0;

  // A sub-communicator of the ranks passing the same `color`, ordered by `key`
  // (MPI_Comm_split / ncclCommSplit). Collective over this communicator.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) = 0;

  // --- blocking forms ---------------------------------------------------------------
  absl::Status AllReduce(Tensor& data) { return AllReduce(data, default_timeout()); }
  absl::Status AllReduce(Tensor& data, absl::Duration timeout) {
    return WaitFor(StartAllReduce(data, timeout));
  }
  absl::Status AllGather(const Tensor& send, Tensor& recv) {
    return AllGather(send, recv, default_timeout());
  }
  absl::Status AllGather(const Tensor& send, Tensor& recv, absl::Duration timeout) {
    return WaitFor(StartAllGather(send, recv, timeout));
  }
  absl::Status ReduceScatter(const Tensor& send, Tensor& recv) {
    return ReduceScatter(send, recv, default_timeout());
  }
  absl::Status ReduceScatter(const Tensor& send, Tensor& recv, absl::Duration timeout) {
    return WaitFor(StartReduceScatter(send, recv, timeout));
  }
  absl::Status Broadcast(Tensor& data, int root) {
    return Broadcast(data, root, default_timeout());
  }
  absl::Status Broadcast(Tensor& data, int root, absl::Duration timeout) {
    return WaitFor(StartBroadcast(data, root, timeout));
  }
  absl::Status Barrier() { return Barrier(default_timeout()); }
  absl::Status Barrier(absl::Duration timeout) { return WaitFor(StartBarrier(timeout)); }

 private:
  static absl::Status WaitFor(absl::StatusOr<std::unique_ptr<CollectiveHandle>> h) {
    if (!h.ok()) return h.status();
    return (*h)->Wait();
  }
};

// True for the dtypes every communicator supports.
inline bool IsCollectiveDType(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kI32 || t == DType::kI64;
}

}  // namespace smat
