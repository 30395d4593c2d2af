// Communication accounting (comm_stats.h): the recorder and the recording
// communicator.
#include "parallel/comm_stats.h"

#include <utility>

#include "core/status.h"

namespace smat {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Finishes the record of its collective when Wait returns or Poll sees it done.
class RecordedHandle final : public CollectiveHandle {
 public:
  RecordedHandle(std::unique_ptr<CollectiveHandle> inner, CommRecorder* recorder,
                 uint64_t generation, size_t index)
      : inner_(std::move(inner)), recorder_(recorder), generation_(generation), index_(index) {}

  absl::Status Wait() override {
    const Clock::time_point t0 = Clock::now();
    absl::Status s = inner_->Wait();
    recorder_->Finish(generation_, index_, SecondsBetween(t0, Clock::now()), true);
    return s;
  }
  absl::StatusOr<bool> Poll() override {
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<bool> done = inner_->Poll();
    recorder_->Finish(generation_, index_, SecondsBetween(t0, Clock::now()),
                      done.ok() && *done);
    return done;
  }

 private:
  std::unique_ptr<CollectiveHandle> inner_;
  CommRecorder* recorder_;
  uint64_t generation_;
  size_t index_;
};

int64_t Bytes(const Tensor& t) { return static_cast<int64_t>(t.nbytes()); }

}  // namespace

const char* CollectiveOpLabel(CollectiveOp op) {
  static const char* const kLabels[kNumCollectiveOps] = {"all_reduce", "all_gather",
                                                         "reduce_scatter", "broadcast", "barrier"};
  return kLabels[static_cast<int>(op)];
}

const char* CollectiveOpName(CollectiveOp op) {
  static const char* const kNames[kNumCollectiveOps] = {"AllReduce", "AllGather",
                                                        "ReduceScatter", "Broadcast", "Barrier"};
  return kNames[static_cast<int>(op)];
}

double CommStats::seconds() const {
  double s = 0;
  for (const Totals& t : ops) s += t.seconds;
  return s;
}

int64_t CommStats::bytes() const {
  int64_t b = 0;
  for (const Totals& t : ops) b += t.bytes;
  return b;
}

void CommStats::Add(const CommStats& other) {
  for (int i = 0; i < kNumCollectiveOps; ++i) {
    ops[i].seconds += other.ops[i].seconds;
    ops[i].bytes += other.ops[i].bytes;
    ops[i].calls += other.ops[i].calls;
  }
}

void CommRecorder::Reset() {
  totals_ = CommStats();
  records_.clear();
  counted_.clear();
  ++generation_;
}

size_t CommRecorder::Begin(CollectiveRecord rec) {
  rec.phase = phase_;
  records_.push_back(std::move(rec));
  counted_.push_back(false);
  return records_.size() - 1;
}

void CommRecorder::Finish(uint64_t generation, size_t index, double waited_seconds, bool done) {
  if (generation != generation_ || index >= records_.size()) return;
  CollectiveRecord& rec = records_[index];
  rec.waited_seconds += waited_seconds;
  if (!done || counted_[index]) return;
  counted_[index] = true;
  rec.in_flight_seconds = SecondsBetween(rec.start, Clock::now());
  if (rec.ranks < 2) return;  // nothing crossed a rank boundary (comm_stats.h)
  CommStats::Totals& t = totals_[rec.op];
  t.seconds += rec.waited_seconds;
  t.bytes += rec.bytes;
  t.calls += 1;
}

template <typename StartFn>
absl::StatusOr<std::unique_ptr<CollectiveHandle>> RecordingCommunicator::Record(
    CollectiveOp op, int64_t words, int64_t bytes, double wire_bytes, StartFn start) {
  CollectiveRecord rec;
  rec.op = op;
  rec.ranks = size();
  rec.words = words;
  rec.bytes = bytes;
  rec.wire_bytes = wire_bytes;
  rec.start = Clock::now();
  absl::StatusOr<std::unique_ptr<CollectiveHandle>> inner = start();
  // A collective that failed to start is not recorded: the step fails with it.
  if (!inner.ok()) return inner.status();
  rec.waited_seconds = SecondsBetween(rec.start, Clock::now());
  const size_t index = recorder_->Begin(std::move(rec));
  return std::unique_ptr<CollectiveHandle>(new RecordedHandle(
      std::move(inner).value(), recorder_, recorder_->generation(), index));
}

absl::StatusOr<std::unique_ptr<CollectiveHandle>> RecordingCommunicator::StartAllReduce(
    Tensor& data, absl::Duration timeout) {
  const double W = size();
  return Record(CollectiveOp::kAllReduce, data.numel(), Bytes(data),
                2 * (W - 1) / W * static_cast<double>(data.nbytes()),
                [&] { return inner_->StartAllReduce(data, timeout); });
}

absl::StatusOr<std::unique_ptr<CollectiveHandle>> RecordingCommunicator::StartAllGather(
    const Tensor& send, Tensor& recv, absl::Duration timeout) {
  return Record(CollectiveOp::kAllGather, recv.numel(), Bytes(recv),
                (size() - 1) * static_cast<double>(send.nbytes()),
                [&] { return inner_->StartAllGather(send, recv, timeout); });
}

absl::StatusOr<std::unique_ptr<CollectiveHandle>> RecordingCommunicator::StartReduceScatter(
    const Tensor& send, Tensor& recv, absl::Duration timeout) {
  const double W = size();
  return Record(CollectiveOp::kReduceScatter, recv.numel(), Bytes(recv),
                (W - 1) / W * static_cast<double>(send.nbytes()),
                [&] { return inner_->StartReduceScatter(send, recv, timeout); });
}

absl::StatusOr<std::unique_ptr<CollectiveHandle>> RecordingCommunicator::StartBroadcast(
    Tensor& data, int root, absl::Duration timeout) {
  return Record(CollectiveOp::kBroadcast, data.numel(), Bytes(data),
                static_cast<double>(data.nbytes()),
                [&] { return inner_->StartBroadcast(data, root, timeout); });
}

absl::StatusOr<std::unique_ptr<CollectiveHandle>> RecordingCommunicator::StartBarrier(
    absl::Duration timeout) {
  return Record(CollectiveOp::kBarrier, 0, 0, 0, [&] { return inner_->StartBarrier(timeout); });
}

absl::StatusOr<std::unique_ptr<Communicator>> RecordingCommunicator::Split(int color, int key) {
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> child, inner_->Split(color, key));
  return std::unique_ptr<Communicator>(new RecordingCommunicator(std::move(child), recorder_));
}

}  // namespace smat
