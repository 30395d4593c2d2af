// A Communicator of one rank that runs in-process, for tests of
// sequence-parallel-aware code (trainer/model) without mpirun: every
// collective over one rank is a copy or nothing, completed at once. The MPI
// test (model_mpi_test.cc) checks that real multi-rank groups agree with it.
#pragma once

#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "parallel/communicator.h"

namespace smat {

class SingleRankCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return Device::Cpu(); }
  std::string name() const override { return "single"; }
  absl::Duration default_timeout() const override { return absl::Seconds(60); }

  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartAllReduce(Tensor& data,
                                                                    absl::Duration) override {
    SMAT_RETURN_IF_ERROR(Usable());
    (void)data;  // the sum over one rank is the data itself
    return Done();
  }
  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartAllGather(const Tensor& send,
                                                                    Tensor& recv,
                                                                    absl::Duration) override {
    SMAT_RETURN_IF_ERROR(Usable());
    SMAT_RETURN_IF_ERROR(SameSize(send, recv, "AllGather"));
    std::memcpy(recv.raw(), send.raw(), send.nbytes());
    return Done();
  }
  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartReduceScatter(const Tensor& send,
                                                                       Tensor& recv,
                                                                       absl::Duration) override {
    SMAT_RETURN_IF_ERROR(Usable());
    SMAT_RETURN_IF_ERROR(SameSize(send, recv, "ReduceScatter"));
    std::memcpy(recv.raw(), send.raw(), send.nbytes());
    return Done();
  }
  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartBroadcast(Tensor&, int root,
                                                                   absl::Duration) override {
    SMAT_RETURN_IF_ERROR(Usable());
    if (root != 0) return absl::InvalidArgumentError("Broadcast: root must be 0 of 1 rank");
    return Done();
  }
  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartBarrier(absl::Duration) override {
    SMAT_RETURN_IF_ERROR(Usable());
    return Done();
  }
  void Abort(const std::string& reason) override { abort_reason_ = reason; }
  bool aborted() const override { return !abort_reason_.empty(); }
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int, int) override {
    SMAT_RETURN_IF_ERROR(Usable());
    return std::unique_ptr<Communicator>(new SingleRankCommunicator());
  }

 private:
  class DoneHandle final : public CollectiveHandle {
   public:
    absl::Status Wait() override { return absl::OkStatus(); }
    absl::StatusOr<bool> Poll() override { return true; }
  };
  static std::unique_ptr<CollectiveHandle> Done() { return std::make_unique<DoneHandle>(); }
  absl::Status Usable() const {
    if (aborted()) return absl::AbortedError(absl::StrCat("communicator aborted: ", abort_reason_));
    return absl::OkStatus();
  }
  static absl::Status SameSize(const Tensor& a, const Tensor& b, const char* op) {
    if (a.dtype() != b.dtype() || a.numel() != b.numel()) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": send ", a.DebugString(),
                                                     " and recv ", b.DebugString(),
                                                     " differ on one rank"));
    }
    return absl::OkStatus();
  }
  std::string abort_reason_;
};

}  // namespace smat
