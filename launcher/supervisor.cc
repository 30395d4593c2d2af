// Supervisor: attempts, classification, backoff and the summary
// (launcher/supervisor.h).
#include "launcher/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "core/exit_codes.h"
#include "launcher/child_process.h"

namespace smat {
namespace {

constexpr size_t kTailBytes = 64 << 10;  // output kept for classification

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// Step of the newest commit: checkpoint_dir/latest holds "step_NNNNNNNN"
// (layout in trainer/checkpoint.h; the launcher reads only this file and so
// does not link the trainer).
int64_t LatestCheckpointStep(const std::string& checkpoint_dir) {
  if (checkpoint_dir.empty()) return -1;
  std::ifstream f(checkpoint_dir + "/latest");
  std::string text;
  if (!std::getline(f, text)) return -1;
  absl::string_view rest = absl::StripAsciiWhitespace(text);
  int64_t step = -1;
  if (!absl::ConsumePrefix(&rest, "step_") || !absl::SimpleAtoi(rest, &step)) return -1;
  return step;
}

void SleepSeconds(double s) {
  timespec ts{static_cast<time_t>(s), static_cast<long>((s - std::floor(s)) * 1e9)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

}  // namespace

ExitClassification ClassifyExit(int wait_status, absl::string_view output_tail) {
  ExitClassification c;
  if (WIFSIGNALED(wait_status)) {
    c.code = 128 + WTERMSIG(wait_status);
    c.reason = absl::StrCat("mpirun killed by signal ", WTERMSIG(wait_status), " (",
                            strsignal(WTERMSIG(wait_status)), ")");
    return c;
  }
  c.code = WEXITSTATUS(wait_status);
  // mpirun: "process rank 1 with PID 0 on node vm exited on signal 9 (Killed)."
  const size_t at = output_tail.rfind("exited on signal ");
  if (c.code != 0 && at != absl::string_view::npos) {
    absl::string_view sig = output_tail.substr(at + std::strlen("exited on signal "));
    sig = sig.substr(0, sig.find_first_of(".\n"));
    c.reason = absl::StrCat("a rank was killed by signal ", sig);
    return c;
  }
  switch (c.code) {
    case kExitOk:
      c.outcome = AttemptOutcome::kFinished;
      c.reason = "finished";
      break;
    case kExitBadInput:
      c.outcome = AttemptOutcome::kStop;
      c.reason = "bad config, data or checkpoint (not retryable)";
      break;
    case kExitNonFiniteLoss:
      c.outcome = AttemptOutcome::kStop;
      c.reason = "loss became NaN or inf (not retryable)";
      break;
    case kExitRetryable:
      c.reason = "retryable failure (collective deadline, dead peer, transport)";
      break;
    case kExitPreempted:
      c.reason = "preempted (checkpointed on SIGTERM)";
      break;
    case kExitFailure:
      c.reason = "unclassified failure";
      break;
    default:
      c.reason = c.code > 128 ? absl::StrCat("a rank was killed by signal ", c.code - 128)
                              : absl::StrCat("exit code ", c.code);
      break;
  }
  return c;
}

int64_t LastLoggedStep(absl::string_view text) {
  int64_t last = -1;
  for (size_t at = text.find("step"); at != absl::string_view::npos;
       at = text.find("step", at + 4)) {
    // A word of its own: "step 50/200", "step=50", not "steps: 300".
    if (at > 0 && absl::ascii_isalnum(static_cast<unsigned char>(text[at - 1]))) continue;
    size_t i = at + 4;
    if (i >= text.size() || (text[i] != ' ' && text[i] != '=' && text[i] != ':')) continue;
    while (i < text.size() && (text[i] == ' ' || text[i] == '=' || text[i] == ':')) ++i;
    size_t j = i;
    while (j < text.size() && absl::ascii_isdigit(static_cast<unsigned char>(text[j]))) ++j;
    int64_t step = 0;
    if (j > i && absl::SimpleAtoi(text.substr(i, j - i), &step)) last = step;
  }
  return last;
}

double BackoffSeconds(double base, double cap, int restart) {
  if (restart <= 0 || base <= 0) return 0;
  return std::min(cap, base * std::ldexp(1.0, std::min(restart - 1, 60)));
}

Supervisor::Supervisor(SupervisorOptions options, const std::atomic<int>* stop)
    : options_(std::move(options)), stop_(stop), start_ns_(MonotonicNs()) {}

double Supervisor::Now() const { return (MonotonicNs() - start_ns_) * 1e-9; }

AttemptRecord Supervisor::RunAttempt(int attempt, double backoff_s) {
  AttemptRecord rec;
  rec.attempt = attempt;
  rec.backoff_s = backoff_s;
  rec.start_s = Now();
  JobCommand job = options_.job;
  if (attempt > 0 && options_.job_for_attempt) {
    absl::StatusOr<JobCommand> next = options_.job_for_attempt(attempt);
    if (!next.ok()) {
      rec.exit = {AttemptOutcome::kRetry, kExitRetryable, std::string(next.status().message())};
      rec.end_s = Now();
      rec.checkpoint_step = LatestCheckpointStep(options_.checkpoint_dir);
      std::fprintf(stderr, "smat_launch: attempt %d not started: %s\n", attempt,
                   rec.exit.reason.c_str());
      return rec;
    }
    job = *std::move(next);
  }
  const std::vector<std::string> argv = MpirunArgv(job, attempt);
  const std::string log_path = absl::StrCat(options_.log_dir, "/attempt_", attempt, ".log");
  std::FILE* log = std::fopen(log_path.c_str(), "w");
  std::fprintf(stderr, "smat_launch: attempt %d: %s\n", attempt, ShellJoin(argv).c_str());
  if (log != nullptr)
    std::fprintf(log, "smat_launch: attempt %d: %s\n", attempt, ShellJoin(argv).c_str());

  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    rec.exit = {AttemptOutcome::kStop, kExitFailure,
                absl::StrCat("cannot create a pipe: ", std::strerror(errno))};
    if (log != nullptr) std::fclose(log);
    return rec;
  }
  ::setenv(kRestartCountVariable, absl::StrCat(attempt).c_str(), 1);
  const pid_t parent = ::getpid();
  const pid_t child = ::fork();
  if (child == 0) {
    ::setpgid(0, 0);  // its own group: a terminal's ^C reaches the launcher only
    // If the launcher dies without forwarding anything, the job goes too.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(kExitFailure);
    ExecWithOutput(argv, fds[1], "smat_launch: ");
  }
  ::close(fds[1]);
  if (child < 0) {
    ::close(fds[0]);
    rec.exit = {AttemptOutcome::kStop, kExitFailure,
                absl::StrCat("fork failed: ", std::strerror(errno))};
    if (log != nullptr) std::fclose(log);
    return rec;
  }

  std::string tail, line;
  int status = 0;
  bool exited = false, pipe_open = true, forwarded = false, terminated = false;
  double forwarded_at = 0;
  double last_output_at = Now(), hung_at = -1;
  char buf[8192];
  while (!exited || pipe_open) {
    // Stop: SIGUSR2 first (mpirun forwards it; every rank checkpoints and
    // exits 5, trainer/preemption.h), SIGTERM to mpirun after the grace
    // period (it kills the ranks within a second), SIGKILL 10 s later.
    if (StopRequested() && !forwarded) {
      std::fprintf(stderr,
                   "smat_launch: stop requested: forwarding SIGUSR2 (checkpoint and exit) to the "
                   "job (mpirun pid %d)\n",
                   child);
      ::kill(child, SIGUSR2);
      forwarded = true;
      forwarded_at = Now();
    }
    if (forwarded && !exited && !terminated && Now() - forwarded_at > options_.stop_grace_seconds) {
      std::fprintf(stderr, "smat_launch: the job outlived %.0f s after SIGUSR2; sending SIGTERM\n",
                   options_.stop_grace_seconds);
      ::kill(child, SIGTERM);
      terminated = true;
    }
    if (terminated && !exited && Now() - forwarded_at > options_.stop_grace_seconds + 10) {
      ::kill(-child, SIGKILL);
      ::kill(child, SIGKILL);
    }
    // A job that prints nothing for hang_timeout seconds is hung somewhere no
    // collective deadline covers: SIGTERM to mpirun (it kills the ranks), then
    // SIGKILL, and the attempt counts as a retryable failure.
    if (options_.hang_timeout_seconds > 0 && !exited && !forwarded && hung_at < 0 &&
        Now() - last_output_at > options_.hang_timeout_seconds) {
      std::fprintf(stderr, "smat_launch: no output for %.0f s: the job is hung; terminating it\n",
                   options_.hang_timeout_seconds);
      ::kill(child, SIGTERM);
      hung_at = Now();
    }
    if (hung_at >= 0 && !exited && Now() - hung_at > 10) {
      ::kill(-child, SIGKILL);
      ::kill(child, SIGKILL);
    }
    if (pipe_open) {
      pollfd p{fds[0], POLLIN, 0};
      // Once mpirun has exited, only drain what is already there.
      const int ready = ::poll(&p, 1, exited ? 0 : 100);
      if (ready > 0) {
        const ssize_t n = ::read(fds[0], buf, sizeof(buf));
        if (n > 0) {
          last_output_at = Now();
          std::fwrite(buf, 1, n, stdout);
          std::fflush(stdout);
          if (log != nullptr) std::fwrite(buf, 1, n, log);
          line.append(buf, n);
          // Steps are parsed per complete line.
          for (size_t nl = line.find('\n'); nl != std::string::npos; nl = line.find('\n')) {
            const int64_t step = LastLoggedStep(absl::string_view(line).substr(0, nl));
            if (step >= 0) {
              if (rec.first_step < 0) {
                rec.first_step = step;
                rec.first_step_s = Now();
              }
              rec.last_step = step;
            }
            tail.append(line, 0, nl + 1);
            line.erase(0, nl + 1);
          }
          if (tail.size() > 2 * kTailBytes) tail.erase(0, tail.size() - kTailBytes);
        } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
          pipe_open = false;
        }
      } else if (exited) {
        pipe_open = false;  // a stray process may hold the pipe; mpirun is gone
      }
    }
    if (!exited) {
      const pid_t w = ::waitpid(child, &status, pipe_open ? WNOHANG : 0);
      if (w == child) exited = true;
    }
  }
  ::close(fds[0]);
  tail += line;
  rec.end_s = Now();
  rec.exit = ClassifyExit(status, tail);
  if (hung_at >= 0 && rec.exit.outcome != AttemptOutcome::kFinished) {
    rec.exit.outcome = AttemptOutcome::kRetry;
    rec.exit.reason = absl::StrFormat("hung: no output for %.0f s (--hang_timeout)",
                                      options_.hang_timeout_seconds);
  }
  if (forwarded && rec.exit.outcome != AttemptOutcome::kFinished) {
    rec.exit.outcome = AttemptOutcome::kStop;
    rec.exit.reason += "; stopped by a signal to smat_launch";
  }
  rec.checkpoint_step = LatestCheckpointStep(options_.checkpoint_dir);
  const std::string done =
      absl::StrFormat("smat_launch: attempt %d ended after %.1f s: exit %d, %s\n", attempt,
                      rec.end_s - rec.start_s, rec.exit.code, rec.exit.reason);
  std::fputs(done.c_str(), stderr);
  if (log != nullptr) {
    std::fputs(done.c_str(), log);
    std::fclose(log);
  }
  return rec;
}

int Supervisor::Run() {
  for (int attempt = 0;; ++attempt) {
    const double backoff =
        BackoffSeconds(options_.backoff_seconds, options_.backoff_max_seconds, attempt);
    if (backoff > 0) {
      std::fprintf(stderr, "smat_launch: restart %d of %d in %.1f s\n", attempt,
                   options_.max_restarts, backoff);
      const double until = Now() + backoff;
      while (Now() < until && !StopRequested()) SleepSeconds(std::min(0.05, until - Now()));
    }
    if (StopRequested()) {
      result_ = "stopped by a signal before the next attempt";
      return kExitPreempted;
    }
    attempts_.push_back(RunAttempt(attempt, backoff));
    const AttemptRecord& rec = attempts_.back();
    switch (rec.exit.outcome) {
      case AttemptOutcome::kFinished:
        result_ = absl::StrCat("finished after ", attempts_.size(), " attempt(s)");
        return kExitOk;
      case AttemptOutcome::kStop:
        if (StopRequested()) {
          result_ = "stopped by a signal to smat_launch";
          return kExitPreempted;
        }
        result_ = absl::StrCat("stopped: ", rec.exit.reason, "; not restarting");
        return rec.exit.code > 0 && rec.exit.code < 128 ? rec.exit.code : kExitFailure;
      case AttemptOutcome::kRetry:
        if (attempt >= options_.max_restarts) {
          result_ =
              absl::StrCat("gave up after ", options_.max_restarts, " restart(s) (--max_restarts)");
          return kExitRetryable;
        }
        break;
    }
  }
}

std::string Supervisor::Summary() const {
  std::string s = "smat_launch: summary\n";
  int64_t total_lost = 0;
  for (size_t i = 0; i < attempts_.size(); ++i) {
    const AttemptRecord& a = attempts_[i];
    absl::StrAppendFormat(&s, "  attempt %d: exit %d (%s) after %.1f s", a.attempt, a.exit.code,
                          a.exit.reason, a.end_s - a.start_s);
    if (a.last_step >= 0) absl::StrAppend(&s, "; last step ", a.last_step);
    if (a.exit.outcome != AttemptOutcome::kFinished) {
      // A restart resumes from the newest checkpoint: what the attempt did
      // after it is done again.
      const int64_t resumed = std::max<int64_t>(a.checkpoint_step, 0);
      const int64_t lost = a.last_step >= 0 ? std::max<int64_t>(a.last_step - resumed, 0) : 0;
      total_lost += lost;
      absl::StrAppend(&s, "; checkpoint step ",
                      a.checkpoint_step >= 0 ? absl::StrCat(a.checkpoint_step) : "none",
                      "; steps lost ", lost);
    }
    if (i > 0 && a.first_step_s >= 0) {
      absl::StrAppendFormat(&s, "; recovered in %.1f s (backoff %.1f s)",
                            a.first_step_s - attempts_[i - 1].end_s, a.backoff_s);
    }
    s += "\n";
  }
  absl::StrAppend(&s, "  result: ", result_, "; ", attempts_.size(), " attempt(s), ",
                  attempts_.empty() ? 0 : attempts_.size() - 1, " restart(s), ", total_lost,
                  " step(s) lost\n");
  return s;
}

}  // namespace smat
