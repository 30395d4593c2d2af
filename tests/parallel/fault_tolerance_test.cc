// A rank of a 3-rank MPI job is killed (SIGKILL) or stopped (SIGSTOP) in the
// middle of a collective (fault injection in fault_worker). This test runs
// mpirun itself and checks what a launcher relies on:
//   * the job ends with a non-zero status, within a bound (nothing hangs);
//   * no rank reports success;
//   * stopped rank: the surviving ranks fail the collective with
//     DeadlineExceeded naming AllReduce within the 3 s deadline, and abort;
//     killed rank: mpirun notices the death (or a survivor reports the error)
//     and ends the job;
//   * afterwards none of the three rank processes is alive (the stopped one
//     included).
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace {

struct JobResult {
  bool finished = false;  // false: it outlived the bound and was killed
  int status = 0;         // waitpid status
  double seconds = 0;
  std::string output;
  std::vector<pid_t> rank_pids;
};

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool Alive(pid_t pid) {
  if (kill(pid, 0) != 0) return false;  // ESRCH: gone
  // A zombie (exited, not yet reaped by its parent) counts as gone.
  std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  size_t close = stat.rfind(')');
  return !(close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'Z');
}

JobResult RunJob(const std::string& fault, double bound_s) {
  char dir_template[] = "/tmp/smat_fault_XXXXXX";
  std::string dir = mkdtemp(dir_template);
  const std::string log = dir + "/output.txt";
  JobResult r;
  absl::Time t0 = absl::Now();
  pid_t child = fork();
  if (child == 0) {
    setpgid(0, 0);  // its own process group, so a hung job can be killed whole
    setenv("SMAT_FAULT", fault.c_str(), 1);
    setenv("SMAT_COLLECTIVE_TIMEOUT_S", "3", 1);
    setenv("SMAT_PID_DIR", dir.c_str(), 1);
    FILE* out = std::freopen(log.c_str(), "w", stdout);
    (void)out;
    dup2(fileno(stdout), fileno(stderr));
    execl(SMAT_MPIEXEC, SMAT_MPIEXEC, "-np", "3", "--oversubscribe", "--bind-to", "none",
          SMAT_FAULT_WORKER, static_cast<char*>(nullptr));
    std::_Exit(127);
  }
  setpgid(child, child);
  for (;;) {
    pid_t w = waitpid(child, &r.status, WNOHANG);
    if (w == child) {
      r.finished = true;
      break;
    }
    if (absl::ToDoubleSeconds(absl::Now() - t0) > bound_s) {
      kill(-child, SIGKILL);
      waitpid(child, &r.status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  r.seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  r.output = ReadFile(log);
  for (int rank = 0; rank < 3; ++rank) {
    std::string pid = ReadFile(dir + "/rank" + std::to_string(rank) + ".pid");
    if (!pid.empty()) r.rank_pids.push_back(static_cast<pid_t>(std::atoi(pid.c_str())));
  }
  return r;
}

// Waits up to 5 s for every rank process to be gone.
bool AllRanksGone(const std::vector<pid_t>& pids) {
  for (int i = 0; i < 100; ++i) {
    bool any = false;
    for (pid_t p : pids) any |= Alive(p);
    if (!any) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (pid_t p : pids) {
    if (Alive(p)) kill(p, SIGKILL);  // do not leave it behind
  }
  return false;
}

bool ExitedNonZero(int status) {
  return (WIFEXITED(status) && WEXITSTATUS(status) != 0) || WIFSIGNALED(status);
}

TEST(FaultTolerance, StoppedRankMakesSurvivorsMissTheDeadlineAndTheJobEnd) {
  // Bound: the 3 s deadline, MPI start-up (~1 s) and abort (~1-2 s) on 2
  // shared cores, with a margin.
  JobResult r = RunJob("stop_in_collective:rank=1:call=5", 25);
  EXPECT_TRUE(r.finished) << "the job hung for " << r.seconds << " s:\n" << r.output;
  EXPECT_TRUE(ExitedNonZero(r.status)) << r.output;
  EXPECT_FALSE(absl::StrContains(r.output, ": done")) << r.output;
  // At least one survivor (rank 0 or 2) reports the deadline (the first to
  // abort may take the other down before it prints).
  const bool survivor_reported =
      (absl::StrContains(r.output, "rank 0: DEADLINE_EXCEEDED") ||
       absl::StrContains(r.output, "rank 2: DEADLINE_EXCEEDED")) &&
      absl::StrContains(r.output, "AllReduce") && absl::StrContains(r.output, "within 3s");
  EXPECT_TRUE(survivor_reported) << r.output;
  EXPECT_FALSE(absl::StrContains(r.output, "rank 1: DEADLINE_EXCEEDED")) << r.output;
  // The survivors gave up at the deadline, not before and not much after:
  // "elapsed X s" in [3, 4.5) (1.5 s of slack for polling on shared cores).
  size_t at = r.output.find("elapsed ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const double elapsed = std::atof(r.output.c_str() + at + 8);
  EXPECT_GE(elapsed, 3.0);
  EXPECT_LT(elapsed, 4.5);
  EXPECT_GE(r.seconds, 3.0) << "the job ended before any deadline could have passed";
  ASSERT_EQ(r.rank_pids.size(), 3u) << r.output;
  EXPECT_TRUE(AllRanksGone(r.rank_pids)) << "a rank process outlived the job";
}

TEST(FaultTolerance, KilledRankEndsTheJobNonZero) {
  JobResult r = RunJob("kill_in_collective:rank=1:call=5", 25);
  EXPECT_TRUE(r.finished) << "the job hung for " << r.seconds << " s:\n" << r.output;
  EXPECT_TRUE(ExitedNonZero(r.status)) << r.output;
  EXPECT_FALSE(absl::StrContains(r.output, ": done")) << r.output;
  // Either mpirun saw rank 1 die on signal 9, or a survivor timed out first.
  const bool noticed = absl::StrContains(r.output, "signal 9") ||
                       absl::StrContains(r.output, "Killed") ||
                       absl::StrContains(r.output, "DEADLINE_EXCEEDED");
  EXPECT_TRUE(noticed) << r.output;
  ASSERT_EQ(r.rank_pids.size(), 3u) << r.output;
  EXPECT_TRUE(AllRanksGone(r.rank_pids)) << "a rank process outlived the job";
}

}  // namespace
