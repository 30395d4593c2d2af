// Supervisor: runs a job's mpirun command, watches it, and restarts it from
// its newest intact checkpoint after a failure that a restart can cure
// (docs/FAULT_TOLERANCE.md; exit codes in core/exit_codes.h).
//
//   exit 0                                   finished: done
//   exit 2 (bad input), 4 (NaN/inf loss)     stop: a restart fails the same way
//   exit 1, 3 (retryable), 5 (preempted),    restart after a backoff of
//   a rank or mpirun killed by a signal,     backoff * 2^(restart-1), capped
//   no output for hang_timeout seconds
//
// Every attempt's output (mpirun's and all ranks') goes to log_dir/attempt_N.log
// and to the launcher's stdout. The summary at the end lists, per attempt, the
// exit reason, the last step the attempt logged, the checkpoint step a restart
// resumes from (the `latest` file of the checkpoint directory) and the steps
// lost in between, and how long each restart took to log its first step.
//
// A stop request (SIGTERM or SIGINT to the launcher, seen through `stop`) is
// forwarded to mpirun as SIGUSR2, which mpirun passes to every rank: they
// checkpoint and exit with code 5 (trainer/preemption.h). SIGTERM would not
// do: mpirun answers it by killing the ranks within a second. A job still
// running after stop_grace_seconds gets SIGTERM, 10 s later SIGKILL. No
// further attempt starts.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "launcher/mpirun_command.h"

namespace smat {

struct SupervisorOptions {
  JobCommand job;
  int max_restarts = 3;
  double backoff_seconds = 10;       // before the first restart
  double backoff_max_seconds = 300;  // cap of the exponential growth
  std::string log_dir;               // attempt_N.log and summary.txt
  std::string checkpoint_dir;        // where `latest` is read; empty: not known
  // After forwarding SIGUSR2, how long the job gets to checkpoint and exit
  // before SIGTERM.
  double stop_grace_seconds = 120;
  // No output line for this long: the job is hung (outside any collective,
  // whose deadline would have ended it), terminated and restarted. 0: off.
  double hang_timeout_seconds = 0;
  // When set, asked before every restart (attempt >= 1) for the job to run:
  // smat_launch --elastic shrinks it to the hosts that answer
  // (launcher/elastic.h). An error is a failed attempt, retried after the
  // backoff. Unset: every attempt runs `job`.
  std::function<absl::StatusOr<JobCommand>(int attempt)> job_for_attempt;
};

enum class AttemptOutcome : int { kFinished = 0, kRetry = 1, kStop = 2 };

struct ExitClassification {
  AttemptOutcome outcome = AttemptOutcome::kRetry;
  int code = 0;        // the job's exit code, 128 + signal for a signal
  std::string reason;  // "retryable failure", "rank killed by signal 9 (Killed)", ...
};

// What a waitpid status of mpirun, with the tail of its output, means.
ExitClassification ClassifyExit(int wait_status, absl::string_view output_tail);

// The largest N of the last "step N" (or "step N/M", "step=N") in `text`; -1
// when there is none.
int64_t LastLoggedStep(absl::string_view text);

// Seconds to wait before restart `restart` (1 for the first).
double BackoffSeconds(double base, double cap, int restart);

struct AttemptRecord {
  int attempt = 0;
  ExitClassification exit;
  double start_s = 0, end_s = 0;  // since the supervisor started
  double backoff_s = 0;           // waited before it started
  int64_t first_step = -1, last_step = -1;
  double first_step_s = -1;      // when its first step line arrived
  int64_t checkpoint_step = -1;  // `latest` when it ended
};

class Supervisor {
 public:
  // `stop` holds the number of a signal to forward (0: none); set by main's
  // signal handler.
  Supervisor(SupervisorOptions options, const std::atomic<int>* stop);

  // Runs attempts until the job finishes, stops, is stopped, or max_restarts
  // restarts have failed. Returns the launcher's exit code: 0, the job's
  // non-retryable code (2, 4), kExitPreempted when stopped by a signal,
  // kExitRetryable after giving up, kExitFailure when mpirun cannot start.
  int Run();

  const std::vector<AttemptRecord>& attempts() const { return attempts_; }
  std::string Summary() const;

 private:
  AttemptRecord RunAttempt(int attempt, double backoff_s);
  double Now() const;
  bool StopRequested() const { return stop_ != nullptr && stop_->load() != 0; }

  SupervisorOptions options_;
  const std::atomic<int>* stop_;
  std::vector<AttemptRecord> attempts_;
  std::string result_;  // last line of the summary
  int64_t start_ns_ = 0;
};

}  // namespace smat
