// smat_launch against a fake job under real mpirun -np 2: the "trainer" is a
// shell script (given with --train) that logs a step, records its attempt,
// arguments and environment, and then exits with the code its plan says for
// that attempt, or is killed by SIGKILL, or hangs. Checked: restart after
// retryable failures with backoff and resume, stop on a non-retryable code,
// --max_restarts, -x forwarding, SIGTERM to the launcher, --hang_timeout, the
// summary and the per-attempt logs, and the exact --dry_run command. The pure parts
// (classification, backoff, step parsing, quoting) are tested directly.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/exit_codes.h"
#include "gtest/gtest.h"
#include "launcher/mpirun_command.h"
#include "launcher/supervisor.h"
#include "tests/launcher/launch_test_util.h"

namespace smat {
namespace {

using launch_test::ExitCode;
using launch_test::LaunchResult;
using launch_test::ReadFile;
using launch_test::RunLauncher;
using launch_test::TempDir;

void WriteFile(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// The fake job. Plan line N (1-based) is attempt N-1's action:
//   exit:C  rank 0 logs a step; rank 1 exits with C (rank 0 too when C = 0)
//   kill    rank 1 kills itself with SIGKILL
//   hang    both ranks sleep until a signal ends them
constexpr char kFakeJob[] = R"sh(#!/bin/sh
dir="$(dirname "$0")"
n=${SMAT_RESTART_COUNT:-unset}
r=${OMPI_COMM_WORLD_RANK:-unset}
echo "start $(date +%s.%N) attempt=$n rank=$r pid=$$ var=${SMAT_TEST_VAR-unset} args=$*" >> "$dir/calls.txt"
action=$(sed -n "$((n + 1))p" "$dir/plan.txt")
[ "$r" = 0 ] && echo "step $((n * 10 + 7))/100 loss 1.25"
case "$action" in
  exit:0) exit 0 ;;
  exit:*) if [ "$r" = 1 ]; then echo "end $(date +%s.%N) attempt=$n" >> "$dir/calls.txt"; exit "${action#exit:}"; fi; exec sleep 20 ;;
  kill) if [ "$r" = 1 ]; then echo "end $(date +%s.%N) attempt=$n" >> "$dir/calls.txt"; kill -9 $$; fi; exec sleep 20 ;;
  hang) exec sleep 30 ;;
esac
exit 99
)sh";

class FakeJob {
 public:
  explicit FakeJob(const std::vector<std::string>& plan) {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    unsetenv("SMAT_TEST_VAR");
    script_ = dir_.path() + "/fake_train.sh";
    WriteFile(script_, kFakeJob);
    chmod(script_.c_str(), 0755);
    WriteFile(dir_.path() + "/plan.txt", absl::StrJoin(plan, "\n") + "\n");
    mkdir((dir_.path() + "/ckpt").c_str(), 0755);
    // The newest checkpoint a restart resumes from (what `latest` says).
    WriteFile(dir_.path() + "/ckpt/latest", "step_00000005\n");
  }
  std::vector<std::string> Args(std::vector<std::string> extra) const {
    std::vector<std::string> a = {"--np",         "2",
                                  "--config",     SMAT_SOURCE_DIR "/configs/tiny_cpu.textproto",
                                  "--set",        "parallel.dp=2",
                                  "--set",        "checkpoint.dir=" + dir_.path() + "/ckpt",
                                  "--train",      script_,
                                  "--mpirun",     SMAT_MPIEXEC,
                                  "--mpirun_arg", "--bind-to",
                                  "--mpirun_arg", "none",
                                  "--log_dir",    dir_.path() + "/logs"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  const std::string& dir() const { return dir_.path(); }
  std::string out() const { return dir_.path() + "/launcher.out"; }
  // Lines of calls.txt starting with `kind` ("start" or "end"), for `attempt`.
  std::vector<std::string> Calls(const std::string& kind, int attempt) const {
    std::vector<std::string> out;
    for (absl::string_view line : absl::StrSplit(ReadFile(dir_.path() + "/calls.txt"), '\n')) {
      if (absl::StartsWith(line, kind + " ") &&
          absl::StrContains(absl::StrCat(line, " "), absl::StrCat("attempt=", attempt, " "))) {
        out.emplace_back(line);
      }
    }
    return out;
  }
  double Time(const std::string& line) const {
    double t = 0;
    EXPECT_TRUE(absl::SimpleAtod(std::vector<std::string>(absl::StrSplit(line, ' '))[1], &t));
    return t;
  }

 private:
  TempDir dir_;
  std::string script_;
};

TEST(MpirunCommand, HostListsAndQuoting) {
  auto hosts = ParseHostList("a:4,b:4");
  ASSERT_TRUE(hosts.ok());
  EXPECT_EQ(TotalSlots(*hosts), 8);
  EXPECT_EQ(TotalSlots(ParseHostList("a,b:2").value()), 3);
  EXPECT_EQ(ParseHostList("a:0").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseHostList("a:x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShellJoin({"a", "b c", "it's", ""}), "a 'b c' 'it'\\''s' ''");
  JobCommand job;
  job.np = 2;
  job.train = "t";
  job.config = "c";
  EXPECT_EQ(ShellJoin(MpirunArgv(job, 0)), "mpirun -np 2 -x SMAT_RESTART_COUNT t --config c");
  EXPECT_EQ(ShellJoin(MpirunArgv(job, 1)),
            "mpirun -np 2 -x SMAT_RESTART_COUNT t --config c --set checkpoint.resume=auto");
}

TEST(Supervisor, ClassifiesExitCodesAndSignals) {
  auto exited = [](int code) { return code << 8; };  // a waitpid status of exit(code)
  EXPECT_EQ(ClassifyExit(exited(0), "").outcome, AttemptOutcome::kFinished);
  EXPECT_EQ(ClassifyExit(exited(kExitBadInput), "").outcome, AttemptOutcome::kStop);
  EXPECT_EQ(ClassifyExit(exited(kExitNonFiniteLoss), "").outcome, AttemptOutcome::kStop);
  EXPECT_EQ(ClassifyExit(exited(kExitRetryable), "").outcome, AttemptOutcome::kRetry);
  EXPECT_EQ(ClassifyExit(exited(kExitPreempted), "").outcome, AttemptOutcome::kRetry);
  EXPECT_EQ(ClassifyExit(exited(kExitFailure), "").outcome, AttemptOutcome::kRetry);
  const ExitClassification killed =
      ClassifyExit(exited(137),
                   "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 "
                   "(Killed).\n");
  EXPECT_EQ(killed.outcome, AttemptOutcome::kRetry);
  EXPECT_EQ(killed.reason, "a rank was killed by signal 9 (Killed)");
  const ExitClassification self = ClassifyExit(SIGKILL, "");  // mpirun itself killed
  EXPECT_EQ(self.outcome, AttemptOutcome::kRetry);
  EXPECT_EQ(self.code, 137);
}

TEST(Supervisor, StepsAndBackoff) {
  EXPECT_EQ(LastLoggedStep("step  50/200  loss 2.31\nstep 60/200 loss 2.2"), 60);
  EXPECT_EQ(LastLoggedStep("checkpoint saved step=40"), 40);
  EXPECT_EQ(LastLoggedStep("run { steps: 300 }"), -1);
  EXPECT_EQ(LastLoggedStep("no numbers here"), -1);
  EXPECT_DOUBLE_EQ(BackoffSeconds(10, 300, 0), 0);
  EXPECT_DOUBLE_EQ(BackoffSeconds(10, 300, 1), 10);
  EXPECT_DOUBLE_EQ(BackoffSeconds(10, 300, 2), 20);
  EXPECT_DOUBLE_EQ(BackoffSeconds(10, 300, 4), 80);
  EXPECT_DOUBLE_EQ(BackoffSeconds(10, 300, 6), 300);
  EXPECT_DOUBLE_EQ(BackoffSeconds(10, 300, 1000), 300);
}

TEST(SmatLaunch, DryRunWithHostfilePrintsTheExactCommand) {
  TempDir dir;
  const std::string hostfile = dir.path() + "/hosts";
  WriteFile(hostfile, "# two nodes\nnode-a slots=4\nnode-b slots=4 max_slots=8\n");
  const std::string config = SMAT_SOURCE_DIR "/configs/tiny_cpu.textproto";
  LaunchResult r = RunLauncher({"--hostfile", hostfile, "--config", config, "--set",
                                "parallel.dp=8", "--set", "checkpoint.dir=/mnt/ckpt dir", "-x",
                                "NCCL_DEBUG", "--train", "/opt/smat/smat_train", "--dry_run"},
                               dir.path() + "/out", 20);
  ASSERT_TRUE(r.finished);
  EXPECT_EQ(ExitCode(r), 0) << r.output;
  EXPECT_EQ(r.output, "mpirun -np 8 --hostfile " + hostfile +
                          " -x SMAT_RESTART_COUNT -x NCCL_DEBUG /opt/smat/smat_train --config " +
                          config + " --set parallel.dp=8 --set 'checkpoint.dir=/mnt/ckpt dir'\n");

  r = RunLauncher({"--hosts", "a:4,b:4", "--config", config, "--set", "parallel.dp=4", "--set",
                   "parallel.sp=2", "--train", "t", "--dry_run"},
                  dir.path() + "/out", 20);
  EXPECT_EQ(ExitCode(r), 0) << r.output;
  EXPECT_EQ(r.output, "mpirun -np 8 --host a:4,b:4 -x SMAT_RESTART_COUNT t --config " + config +
                          " --set parallel.dp=4 --set parallel.sp=2\n");

  // Wrong input is refused before anything runs, with exit code 2.
  r = RunLauncher({"--hostfile", hostfile, "--np", "9", "--config", config, "--dry_run"},
                  dir.path() + "/out", 20);
  EXPECT_EQ(ExitCode(r), kExitBadInput);
  EXPECT_TRUE(absl::StrContains(r.output, "exceeds the 8 slots")) << r.output;
  r = RunLauncher({"--np", "2", "--config", config, "--dry_run"}, dir.path() + "/out", 20);
  EXPECT_EQ(ExitCode(r), kExitBadInput);
  EXPECT_TRUE(absl::StrContains(r.output, "parallel.dp x sp = 1 x 1")) << r.output;
  r = RunLauncher({"--config", config, "--set", "model.heads=7", "--dry_run"}, dir.path() + "/out",
                  20);
  EXPECT_EQ(ExitCode(r), kExitBadInput) << r.output;
  r = RunLauncher({"--config", config, "--bogus"}, dir.path() + "/out", 20);
  EXPECT_EQ(ExitCode(r), kExitBadInput);
  EXPECT_TRUE(absl::StrContains(r.output, "unknown argument '--bogus'")) << r.output;
}

TEST(SmatLaunch, RestartsAfterRetryableFailuresWithBackoffUntilFinished) {
  FakeJob job({"exit:3", "kill", "exit:0"});
  LaunchResult r = RunLauncher(job.Args({"--max_restarts", "3", "--backoff", "0.5", "--backoff_max",
                                         "10", "-x", "SMAT_TEST_VAR=forwarded"}),
                               job.out(), 60);
  ASSERT_TRUE(r.finished) << r.output;
  EXPECT_EQ(ExitCode(r), 0) << r.output;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::vector<std::string> starts = job.Calls("start", attempt);
    ASSERT_EQ(starts.size(), 2u) << "attempt " << attempt << ": both ranks start\n" << r.output;
    for (const std::string& s : starts) {
      EXPECT_TRUE(absl::StrContains(s, "var=forwarded")) << s;
      EXPECT_EQ(absl::StrContains(s, "--set checkpoint.resume=auto"), attempt > 0) << s;
      EXPECT_TRUE(absl::StrContains(s, "--set parallel.dp=2")) << s;
    }
    EXPECT_TRUE(
        absl::StrContains(ReadFile(absl::StrCat(job.dir(), "/logs/attempt_", attempt, ".log")),
                          absl::StrCat("step ", attempt * 10 + 7, "/100")));
  }
  EXPECT_TRUE(job.Calls("start", 3).empty());
  // Backoff: restart k waits 0.5 * 2^(k-1) s after the failure.
  for (int attempt = 0; attempt < 2; ++attempt) {
    const double gap =
        job.Time(job.Calls("start", attempt + 1)[0]) - job.Time(job.Calls("end", attempt).at(0));
    EXPECT_GE(gap, 0.5 * (1 << attempt)) << "attempt " << attempt + 1 << " started too early";
  }
  const std::string summary = ReadFile(job.dir() + "/logs/summary.txt");
  EXPECT_TRUE(absl::StrContains(r.output, summary)) << "summary not printed";
  EXPECT_TRUE(absl::StrContains(summary, "attempt 0: exit 3 (retryable")) << summary;
  // Attempt 0 logged step 7, `latest` says 5: 2 steps lost; attempt 1 logged 17.
  EXPECT_TRUE(absl::StrContains(summary, "last step 7; checkpoint step 5; steps lost 2"))
      << summary;
  EXPECT_TRUE(absl::StrContains(summary, "attempt 1: exit 137 (a rank was killed by signal 9"))
      << summary;
  EXPECT_TRUE(absl::StrContains(summary, "steps lost 12")) << summary;
  EXPECT_TRUE(absl::StrContains(summary, "attempt 2: exit 0 (finished)")) << summary;
  EXPECT_TRUE(absl::StrContains(summary, "recovered in")) << summary;
  EXPECT_TRUE(absl::StrContains(summary, "3 attempt(s), 2 restart(s), 14 step(s) lost")) << summary;
}

TEST(SmatLaunch, StopsOnNonRetryableCodes) {
  for (int code : {kExitBadInput, kExitNonFiniteLoss}) {
    FakeJob job({absl::StrCat("exit:", code), "exit:0"});
    LaunchResult r =
        RunLauncher(job.Args({"--max_restarts", "3", "--backoff", "0"}), job.out(), 30);
    ASSERT_TRUE(r.finished) << r.output;
    EXPECT_EQ(ExitCode(r), code) << r.output;
    EXPECT_EQ(job.Calls("start", 0).size(), 2u);
    EXPECT_TRUE(job.Calls("start", 1).empty()) << "restarted after exit " << code;
    EXPECT_TRUE(absl::StrContains(r.output, "not restarting")) << r.output;
  }
}

TEST(SmatLaunch, GivesUpAfterMaxRestarts) {
  FakeJob job({"exit:3", "exit:3", "exit:3", "exit:3", "exit:0"});
  LaunchResult r = RunLauncher(job.Args({"--max_restarts", "2", "--backoff", "0"}), job.out(), 60);
  ASSERT_TRUE(r.finished) << r.output;
  EXPECT_EQ(ExitCode(r), kExitRetryable) << r.output;
  EXPECT_EQ(job.Calls("start", 2).size(), 2u);
  EXPECT_TRUE(job.Calls("start", 3).empty()) << "more than --max_restarts restarts";
  EXPECT_TRUE(absl::StrContains(r.output, "gave up after 2 restart(s)")) << r.output;
}

TEST(SmatLaunch, SilentJobIsTerminatedAndRestartedAfterHangTimeout) {
  FakeJob job({"hang", "exit:0"});
  LaunchResult r = RunLauncher(job.Args({"--backoff", "0", "--hang_timeout", "2"}), job.out(), 40);
  ASSERT_TRUE(r.finished) << r.output;
  EXPECT_EQ(ExitCode(r), 0) << r.output;
  EXPECT_EQ(job.Calls("start", 1).size(), 2u) << r.output;
  const std::string summary = ReadFile(job.dir() + "/logs/summary.txt");
  EXPECT_TRUE(absl::StrContains(summary, "attempt 0: exit")) << summary;
  EXPECT_TRUE(absl::StrContains(summary, "hung: no output for 2 s")) << summary;
  EXPECT_TRUE(absl::StrContains(summary, "attempt 1: exit 0 (finished)")) << summary;
}

TEST(SmatLaunch, SigtermStopsTheJobAndRestarting) {
  FakeJob job({"hang", "exit:0"});
  std::vector<pid_t> rank_pids;
  LaunchResult r = RunLauncher(job.Args({"--backoff", "0"}), job.out(), 30, [&](pid_t launcher) {
    for (int i = 0; i < 400 && job.Calls("start", 0).size() < 2; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    for (const std::string& line : job.Calls("start", 0)) {
      const size_t at = line.find("pid=");
      rank_pids.push_back(std::atoi(line.c_str() + at + 4));
    }
    kill(launcher, SIGTERM);
  });
  ASSERT_TRUE(r.finished) << r.output;
  EXPECT_EQ(ExitCode(r), kExitPreempted) << r.output;
  EXPECT_TRUE(absl::StrContains(r.output, "forwarding SIGUSR2")) << r.output;
  EXPECT_TRUE(job.Calls("start", 1).empty()) << "restarted after SIGTERM";
  ASSERT_EQ(rank_pids.size(), 2u);
  for (pid_t p : rank_pids) {
    bool gone = false;
    for (int i = 0; i < 100 && !gone; ++i) {
      gone = kill(p, 0) != 0;
      if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_TRUE(gone) << "rank process " << p << " outlived the job";
    if (!gone) kill(p, SIGKILL);
  }
}

}  // namespace
}  // namespace smat
