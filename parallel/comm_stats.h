// Communication accounting: a Communicator that forwards every call to the one
// it wraps and records each collective (kind, size, times) into a CommRecorder,
// so the code that issues collectives (the sequence-parallel SMat op, the
// model's short-conv halo exchange, the training loop) needs no counting of
// its own and nothing can be missed. smat_bench --sp reads the per-collective
// records; the trainer reads the per-kind totals into StepStats and from there
// smat_comm_seconds_total{op} / smat_comm_bytes_total{op} (ARCHITECTURE.md
// section 8).
//
// Definitions (the same for every caller):
//   bytes    the size of the tensor the collective fills on this rank:
//            AllReduce and Broadcast the buffer, AllGather the gathered buffer
//            (size x the rank's part: SequenceParallelVolume's scan_words x 4
//            for the forward scan), ReduceScatter the rank's reduced part,
//            Barrier 0. It does not depend on the algorithm the transport
//            picks; CollectiveRecord::wire_bytes holds what a ring sends.
//   seconds  host time this rank was blocked in the collective: inside Start
//            plus inside Wait (or the Poll that saw it complete). Work the
//            caller overlaps with an asynchronous collective is not counted,
//            so the sum over collectives is the step time communication costs
//            (never more than the step). For the blocking forms it is the
//            whole collective. CollectiveRecord::in_flight_seconds (Start to
//            completion) is there for the benchmark.
//   1 rank   a collective on a communicator of one rank moves nothing between
//            ranks (MPI_COMM_SELF copies locally): it is recorded in the
//            per-collective list but left out of the totals, so a one-process
//            run reports no communication and sp = 1 reports only the grid's.
//
// Recording adds two clock reads and a vector append per collective (well
// under a microsecond against the tens of microseconds a collective costs at
// least), and no arithmetic: the wrapped communicator computes the same bits.
//
//   CommRecorder recorder;
//   RecordingCommunicator sequence(pg.sequence(), &recorder);
//   SMAT_RETURN_IF_ERROR(SequenceParallelSmatForward(backend, sequence, ...));
//   double s = recorder.totals()[CollectiveOp::kAllReduce].seconds;
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace smat {

enum class CollectiveOp : int {
  kAllReduce = 0,
  kAllGather,
  kReduceScatter,
  kBroadcast,
  kBarrier,
};
inline constexpr int kNumCollectiveOps = 5;

// The Prometheus label value: "all_reduce", "all_gather", "reduce_scatter",
// "broadcast", "barrier".
const char* CollectiveOpLabel(CollectiveOp op);
// The Communicator method's name: "AllReduce", "AllGather", ...
const char* CollectiveOpName(CollectiveOp op);

// Per-kind totals (see the header comment for what seconds and bytes mean).
struct CommStats {
  struct Totals {
    double seconds = 0;
    int64_t bytes = 0;
    int64_t calls = 0;
  };
  std::array<Totals, kNumCollectiveOps> ops;

  Totals& operator[](CollectiveOp op) { return ops[static_cast<int>(op)]; }
  const Totals& operator[](CollectiveOp op) const { return ops[static_cast<int>(op)]; }
  double seconds() const;  // over every kind
  int64_t bytes() const;
  void Add(const CommStats& other);
};

// One collective as a RecordingCommunicator saw it.
struct CollectiveRecord {
  std::string phase;  // CommRecorder::set_phase at Start ("forward", ...)
  CollectiveOp op = CollectiveOp::kBarrier;
  int ranks = 1;          // size of the communicator
  int64_t words = 0;      // elements of the tensor the collective fills on this rank
  int64_t bytes = 0;      // words x element size
  double wire_bytes = 0;  // bytes a ring sends per rank (and receives)
  std::chrono::steady_clock::time_point start;
  double in_flight_seconds = 0;  // Start called -> completion seen (Wait / Poll)
  double waited_seconds = 0;     // blocked in Start + Wait
};

// Where RecordingCommunicators put what they see: per-kind totals and the
// list of collectives since the last Reset (the owner resets it once per step
// or benchmark run, so the list stays a few dozen entries). Not thread-safe:
// one recorder per thread that issues collectives (the training loop's).
class CommRecorder {
 public:
  const CommStats& totals() const { return totals_; }
  const std::vector<CollectiveRecord>& records() const { return records_; }
  // Clears totals and records. A handle started before a Reset and finished
  // after it is not counted.
  void Reset();
  // Labels the records of collectives started from now on.
  void set_phase(std::string phase) { phase_ = std::move(phase); }

  // For RecordingCommunicator and its handles: Begin returns the index of the
  // new record; Finish adds waited time to it, and with `done` sets its
  // in-flight time and adds it to the totals (once; not for one-rank
  // communicators). `generation` is the one Begin saw.
  size_t Begin(CollectiveRecord rec);
  uint64_t generation() const { return generation_; }
  void Finish(uint64_t generation, size_t index, double waited_seconds, bool done);

 private:
  std::string phase_;
  CommStats totals_;
  std::vector<CollectiveRecord> records_;
  std::vector<bool> counted_;  // per record: already added to the totals
  uint64_t generation_ = 0;    // bumped by Reset
};

// A Communicator that records every collective of the communicator it wraps
// into `recorder` and otherwise behaves exactly like it (same bits, same
// errors, same deadlines). `inner` and `recorder` must outlive it and the
// handles it returns.
class RecordingCommunicator final : public Communicator {
 public:
  RecordingCommunicator(Communicator& inner, CommRecorder* recorder)
      : inner_(&inner), recorder_(recorder) {}
  // Owns what it wraps (the result of Split).
  RecordingCommunicator(std::unique_ptr<Communicator> owned, CommRecorder* recorder)
      : owned_(std::move(owned)), inner_(owned_.get()), recorder_(recorder) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Device device() const override { return inner_->device(); }
  std::string name() const override { return inner_->name(); }
  absl::Duration default_timeout() const override { return inner_->default_timeout(); }

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

  void Abort(const std::string& reason) override { inner_->Abort(reason); }
  bool aborted() const override { return inner_->aborted(); }

  // The child records into the same recorder.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override;

  Communicator& inner() { return *inner_; }

 private:
  template <typename StartFn>
  absl::StatusOr<std::unique_ptr<CollectiveHandle>> Record(CollectiveOp op, int64_t words,
                                                           int64_t bytes, double wire_bytes,
                                                           StartFn start);

  std::unique_ptr<Communicator> owned_;  // null unless made by Split
  Communicator* inner_;
  CommRecorder* recorder_;
};

}  // namespace smat
