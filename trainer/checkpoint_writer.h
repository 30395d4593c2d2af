// CheckpointWriter: sharded, atomic, checksummed and asynchronous checkpoint
// saves (ARCHITECTURE.md section 7, docs/FAULT_TOLERANCE.md).
//
// Sharding. Parameters and optimizer state are replicated on every rank, so
// any rank can write any tensor. The tensor list is split over all world ranks
// (largest first onto the least-loaded shard, ties to the lower rank): every
// rank writes about 1/W of the bytes, in parallel, instead of rank 0 writing
// everything while the others wait. The split depends only on the names and
// sizes, so every rank computes the same one without talking, and a reader
// needs only the manifest (any grid can load it).
//
// Commit protocol for step S of launch attempt A:
//   1. every rank writes its shard into step_S.tmp-A/, fsyncs it and the
//      directory (the background thread, when async);
//   2. exchange: every rank hands in its shard's CRC-32 (or a failure) and
//      receives everyone's; this is also the barrier;
//   3. rank 0 writes manifest.pb (with all CRCs and the manifest's own),
//      fsyncs it, renames step_S.tmp-A to step_S (the commit: one rename),
//      fsyncs the parent, rewrites `latest` atomically, applies retention and
//      removes stale temporaries;
//   4. exchange again, so every rank returns the same verdict.
// Steps 2-4 run on the caller's thread (inside the next Save or Finish), never
// on the background thread: MPI runs in MPI_THREAD_FUNNELED mode and the
// collectives of a communicator must be issued in the same order on all ranks
// (the same reason Megatron-LM finalises async saves on the training thread).
//
// Asynchronous saves. Save copies the state into the writer's own buffers
// (the caller's only stall) and returns; the caller may change its tensors at
// once. Poll, called by the loop after every step, commits the save as soon as
// every rank's write has finished (until then a crash loses only this save);
// the next Save (or Finish) waits for the write and commits it, so at most one
// save is in flight; a failed write is reported there.
//
// Fault injection (tests): SMAT_FAULT_CHECKPOINT=phase:step[:rank[:attempt]]
// raises SIGKILL on that rank (every rank when omitted or -1) at `phase` of
// the save of `step`, in launch attempt `attempt` only when given (so the
// restarted job does not die the same way); phases in order: writing_shards (half the shard
// written), after_shards (shards fsynced, before the exchange), after_manifest (manifest written,
// before the commit rename), after_rename (committed, before `latest` is updated).
//
//   CheckpointWriterOptions opts{.dir = cfg.checkpoint().dir(), .keep_last = 3};
//   CheckpointWriter writer(opts, ExchangeOverCommunicator(pg->host_world()));
//   SMAT_RETURN_IF_ERROR(writer.Poll());        // after every step
//   SMAT_RETURN_IF_ERROR(writer.Save(state));   // every checkpoint.every_steps
//   ...
//   SMAT_RETURN_IF_ERROR(writer.Finish());       // before exit
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trainer/checkpoint.h"

namespace smat {

class Communicator;

// Hands in this rank's value and returns every rank's, in rank order; no rank
// returns before every rank has called it. The commit's barrier.
using CheckpointExchange = std::function<absl::StatusOr<std::vector<int64_t>>(int64_t)>;
// One process: returns {value}.
CheckpointExchange SingleProcessExchange();
// AllGather of one int64 over `comm` (host memory: MpiCommunicator), which
// must outlive the writer. Call only on the thread that drives `comm`.
CheckpointExchange ExchangeOverCommunicator(Communicator& comm);

struct CheckpointWriterOptions {
  std::string dir;  // checkpoint.dir; created when absent
  int rank = 0;     // world rank and size: shard count = size
  int world_size = 1;
  int keep_last = 3;       // checkpoint.keep_last; <= 0 keeps all
  int64_t keep_every = 0;  // checkpoint.keep_every; 0: none kept for good
  bool async = true;       // checkpoint.async
  // Launch attempt (SMAT_RESTART_COUNT), the suffix of temporary directories:
  // a rerun never writes into what a crashed attempt left.
  std::string attempt = "0";
  // Fault plan; default from $SMAT_FAULT_CHECKPOINT (FromEnvironment).
  std::string fault;
  // Options with attempt and fault from the environment.
  static CheckpointWriterOptions FromEnvironment(std::string dir, int rank, int world_size);
};

// Which shard each tensor of `tensors` goes to, for `shards` shards (the
// deterministic split described above).
std::vector<int> AssignShards(const std::vector<NamedTensor>& tensors, int shards);

class CheckpointWriter {
 public:
  CheckpointWriter(CheckpointWriterOptions options, CheckpointExchange exchange);
  // Waits for a write in flight (without committing it: that needs the other
  // ranks, and a destructor cannot report failure). Call Finish first.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Commits the previous save (waiting for its write), then saves `state`:
  // synchronously, or copied and written in the background (options.async).
  // Collective: every rank calls it with the same step and the same tensor
  // names, dtypes and shapes. Errors: kInvalidArgument (a bad state: device
  // tensor, duplicate or empty name), kUnavailable (a write or the exchange
  // failed, on this or another rank: the job should end and restart).
  absl::Status Save(const CheckpointState& state);
  // Commits the save in flight once every rank has written its shard; returns
  // at once otherwise. Collective: call it at the same step on every rank
  // (one AllGather of an int64 per call while a save is in flight, none
  // otherwise). Errors as Save.
  absl::Status Poll();
  // Commits the save in flight, if any, waiting for its write. Collective.
  absl::Status Finish();
  // Bytes this rank wrote for the newest committed save.
  uint64_t last_shard_bytes() const { return last_shard_bytes_; }
  // Seconds this rank spent writing that shard (CRC, write, fsyncs; on the
  // background thread when async): last_shard_bytes() / this is the rank's
  // write bandwidth.
  double last_write_seconds() const { return last_write_seconds_; }
  // Step of the newest committed checkpoint (-1 before the first).
  int64_t last_committed_step() const { return last_committed_step_; }

 private:
  struct Pending;
  absl::Status Commit();
  static void WriteShard(Pending* p);

  CheckpointWriterOptions options_;
  CheckpointExchange exchange_;
  std::unique_ptr<Pending> pending_;
  std::thread thread_;
  uint64_t last_shard_bytes_ = 0;
  double last_write_seconds_ = 0;
  int64_t last_committed_step_ = -1;
};

}  // namespace smat
