// End to end: smat_launch runs smat_train under mpirun -np 2 (tiny_cpu on a
// dp = 2 grid, a checkpoint every 3 steps); the test kills rank 1 with SIGKILL
// once the job has logged a randomly chosen step. The launcher must restart
// the job, which resumes from the newest intact checkpoint, and the result
// must be indistinguishable from an uninterrupted run of the same config:
//   * every checkpoint both runs wrote (the final one included) is
//     byte-identical shard for shard and loads to the same tensors and step;
//   * every step the restarted attempt logs after its resume point shows the
//     same loss, learning rate and gradient norm as the uninterrupted run.
// Further tests: the same with 4 ranks (dp 2 x sp 2); a crash before the
// commit rename; SIGTERM to the launcher and a relaunch; a rank stopped by
// SIGSTOP inside a collective (every rank fails at the collective deadline,
// the launcher restarts); a flipped byte in the newest checkpoint (skipped,
// the previous one resumed). reshard_e2e_test.cc resumes a checkpoint on
// other grids.
// ARCHITECTURE.md section 5 promises this: fixed-order reductions, a data
// sampler that is a pure function of the global sequence index, counter-based
// random numbers.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/exit_codes.h"
#include "gtest/gtest.h"
#include "tests/launcher/launch_test_util.h"
#include "tests/launcher/resume_e2e_util.h"
#include "trainer/checkpoint.h"

namespace smat {
namespace {

using launch_test::ReadFile;
using launch_test::TempDir;
using namespace resume_e2e;  // NOLINT: the launch arguments and log readers

// The smat_train process of world rank `rank` whose environment carries `tag`.
pid_t FindRank(const std::string& tag, int rank) {
  DIR* proc = opendir("/proc");
  pid_t found = -1;
  while (dirent* e = readdir(proc)) {
    int pid = 0;
    if (!absl::SimpleAtoi(e->d_name, &pid)) continue;
    const std::string dir = absl::StrCat("/proc/", pid);
    if (!absl::StartsWith(ReadFile(dir + "/comm"), "smat_train")) continue;
    const std::string env = ReadFile(dir + "/environ");
    std::vector<std::string> vars = absl::StrSplit(env, '\0');
    bool tagged = false, ranked = false;
    for (const std::string& v : vars) {
      tagged |= v == "SMAT_E2E_TAG=" + tag;
      ranked |= v == absl::StrCat("OMPI_COMM_WORLD_RANK=", rank);
    }
    if (tagged && ranked) found = pid;
  }
  closedir(proc);
  return found;
}

// Checkpoint `step` under dir_a and dir_b: the same tensors, step and cursor,
// and byte-identical shards (both written by 2 ranks).
void ExpectSameCheckpoint(const std::string& dir_a, const std::string& dir_b, int step,
                          int shards = 2) {
  SCOPED_TRACE(absl::StrCat("checkpoint step ", step));
  const std::string a = CheckpointPath(dir_a, step), b = CheckpointPath(dir_b, step);
  absl::StatusOr<CheckpointState> sa = LoadCheckpoint(a), sb = LoadCheckpoint(b);
  ASSERT_TRUE(sa.ok()) << sa.status();
  ASSERT_TRUE(sb.ok()) << sb.status();
  EXPECT_EQ(sa->step, sb->step);
  EXPECT_EQ(sa->sampler_cursor, sb->sampler_cursor);
  ASSERT_EQ(sa->tensors.size(), sb->tensors.size());
  ASSERT_GT(sa->tensors.size(), 0u);
  for (size_t i = 0; i < sa->tensors.size(); ++i) {
    const Tensor& x = sa->tensors[i].tensor;
    const Tensor& y = sb->tensors[i].tensor;
    ASSERT_EQ(sa->tensors[i].name, sb->tensors[i].name);
    ASSERT_EQ(x.nbytes(), y.nbytes());
    EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0)
        << "tensor " << sa->tensors[i].name << " differs";
  }
  for (int shard = 0; shard < shards; ++shard) {
    EXPECT_EQ(ReadFile(a + "/" + ShardFileName(shard)), ReadFile(b + "/" + ShardFileName(shard)))
        << "shard " << shard;
  }
}

TEST(ResumeE2E, KilledRankIsRestartedAndTheRunMatchesAnUninterruptedOne) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
  TempDir dir;
  const std::string ref = dir.path() + "/reference", run = dir.path() + "/interrupted";

  // The uninterrupted run.
  std::vector<std::string> args = LaunchArgs(ref);
  args.insert(args.end(), {"--max_restarts", "0"});
  ASSERT_EQ(RunLauncher(args, dir.path() + "/reference.out", 120), 0)
      << ReadFile(dir.path() + "/reference.out");
  const std::map<int, std::string> ref_steps = StepFigures(ReadFile(ref + "/launch/attempt_0.log"));
  ASSERT_EQ(ref_steps.size(), static_cast<size_t>(kSteps))
      << ReadFile(ref + "/launch/attempt_0.log");

  // The interrupted one: rank 1 dies by SIGKILL once step kill_after is logged.
  const unsigned seed =
      static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count());
  const int kill_after = 5 + static_cast<int>(std::mt19937(seed)() % 4);  // 5..8
  SCOPED_TRACE(absl::StrCat("rank 1 killed after step ", kill_after, " (seed ", seed, ")"));
  const std::string tag = dir.path();
  args = LaunchArgs(run);
  args.insert(args.end(), {"--max_restarts", "2", "--backoff", "0.2", "-x", "SMAT_E2E_TAG=" + tag});
  const std::string out = dir.path() + "/interrupted.out";
  bool killed = false;
  const int code = RunLauncher(args, out, 150, [&](pid_t) {
    for (int i = 0; i < 3000 && !killed; ++i) {  // 60 s at most
      const std::map<int, std::string> seen = StepFigures(ReadFile(out));
      if (!seen.empty() && seen.rbegin()->first >= kill_after) {
        const pid_t victim = FindRank(tag, 1);
        if (victim > 0) killed = kill(victim, SIGKILL) == 0;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  const std::string output = ReadFile(out);
  ASSERT_TRUE(killed) << "rank 1 was never found and killed\n" << output;
  ASSERT_EQ(code, 0) << output;

  // Attempt 0 died before the end; attempt 1 resumed from a checkpoint at or
  // before the kill and finished.
  const std::string log0 = ReadFile(run + "/launch/attempt_0.log");
  const std::string log1 = ReadFile(run + "/launch/attempt_1.log");
  const std::map<int, std::string> steps0 = StepFigures(log0), steps1 = StepFigures(log1);
  ASSERT_FALSE(steps0.empty()) << log0;
  EXPECT_LT(steps0.rbegin()->first, kSteps) << "the job finished before the kill\n" << log0;
  EXPECT_TRUE(ReadFile(run + "/launch/attempt_2.log").empty()) << "a second restart was needed";
  const size_t at = log1.find("resumed from ");
  ASSERT_NE(at, std::string::npos) << "the restart did not resume\n" << log1;
  const size_t at_step = log1.find(" at step ", at);
  int resumed = -1;
  ASSERT_TRUE(
      absl::SimpleAtoi(log1.substr(at_step + 9, log1.find('\n', at_step) - at_step - 9), &resumed))
      << log1;
  EXPECT_GT(resumed, 0);
  EXPECT_EQ(resumed % kEvery, 0);
  EXPECT_LE(resumed, steps0.rbegin()->first);
  const std::string summary = ReadFile(run + "/launch/summary.txt");
  EXPECT_TRUE(absl::StrContains(summary, "2 attempt(s), 1 restart(s)")) << summary;

  // Every step after the resume: the same loss, learning rate and gradient norm.
  ASSERT_FALSE(steps1.empty()) << log1;
  EXPECT_EQ(steps1.begin()->first, resumed + 1);
  EXPECT_EQ(steps1.rbegin()->first, kSteps);
  for (const auto& [step, figures] : steps1) {
    EXPECT_EQ(figures, ref_steps.at(step)) << "step " << step;
  }
  // Every checkpoint both runs hold: the same bytes and tensors.
  int compared = 0;
  for (int step = kEvery; step <= kSteps; step += kEvery) {
    ExpectSameCheckpoint(ref + "/checkpoints", run + "/checkpoints", step);
    ++compared;
  }
  EXPECT_EQ(compared, kSteps / kEvery);
}

// Rank 0 is killed (checkpoint fault injection) after writing the manifest of
// step 6 and before the commit rename: step 6 must not be resumed from (its
// complete-looking temporary is not a checkpoint); the restart resumes at
// step 3, removes the temporary, and ends like the uninterrupted run.
TEST(ResumeE2E, CrashBeforeTheCommitRenameResumesFromThePreviousCheckpoint) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
  TempDir dir;
  const std::string ref = dir.path() + "/reference", run = dir.path() + "/crashed";
  std::vector<std::string> args = LaunchArgs(ref);
  args.insert(args.end(), {"--max_restarts", "0"});
  ASSERT_EQ(RunLauncher(args, dir.path() + "/reference.out", 120), 0)
      << ReadFile(dir.path() + "/reference.out");
  const std::map<int, std::string> ref_steps = StepFigures(ReadFile(ref + "/launch/attempt_0.log"));

  args = LaunchArgs(run);
  args.insert(args.end(), {"--max_restarts", "1", "--backoff", "0", "-x",
                           "SMAT_FAULT_CHECKPOINT=after_manifest:6:0:0"});
  const std::string out = dir.path() + "/crashed.out";
  ASSERT_EQ(RunLauncher(args, out, 120), 0) << ReadFile(out);
  const std::string output = ReadFile(out);
  EXPECT_TRUE(absl::StrContains(output, "injecting checkpoint fault (SIGKILL) at step 6 on rank 0"))
      << output;
  const std::string log1 = ReadFile(run + "/launch/attempt_1.log");
  EXPECT_TRUE(absl::StrContains(log1, CheckpointDirName(3) + " at step 3")) << log1;
  const std::map<int, std::string> steps = StepFigures(log1);
  ASSERT_FALSE(steps.empty()) << log1;
  EXPECT_EQ(steps.begin()->first, 4);
  for (const auto& [step, figures] : steps)
    EXPECT_EQ(figures, ref_steps.at(step)) << "step " << step;
  for (int step = kEvery; step <= kSteps; step += kEvery) {
    ExpectSameCheckpoint(ref + "/checkpoints", run + "/checkpoints", step);
  }
  // The crashed attempt's temporary was removed by the restart's first commit.
  DIR* d = opendir((run + "/checkpoints").c_str());
  ASSERT_NE(d, nullptr);
  while (dirent* e = readdir(d)) {
    EXPECT_FALSE(absl::StrContains(e->d_name, ".tmp-")) << e->d_name << " left behind";
  }
  closedir(d);
}

// The two earlier phases of the save, killed the same way: rank 1 half-way
// through writing its shard of step 9 (on the writer's background thread),
// and rank 0 after its shard is fsynced but before the CRC exchange. Either
// way step 9 never became a checkpoint: the restart resumes at step 6 and ends
// like the uninterrupted run.
TEST(ResumeE2E, CrashWhileWritingOrBeforeTheExchangeResumesFromThePreviousCheckpoint) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
  TempDir dir;
  const std::string ref = dir.path() + "/reference";
  std::vector<std::string> args = LaunchArgs(ref);
  args.insert(args.end(), {"--max_restarts", "0"});
  ASSERT_EQ(RunLauncher(args, dir.path() + "/reference.out", 120), 0)
      << ReadFile(dir.path() + "/reference.out");
  const std::map<int, std::string> ref_steps = StepFigures(ReadFile(ref + "/launch/attempt_0.log"));
  for (const char* fault : {"writing_shards:9:1:0", "after_shards:9:0:0"}) {
    SCOPED_TRACE(fault);
    const std::string run = dir.path() + "/" + std::string(fault).substr(0, 12);
    args = LaunchArgs(run);
    args.insert(args.end(), {"--max_restarts", "1", "--backoff", "0", "-x",
                             absl::StrCat("SMAT_FAULT_CHECKPOINT=", fault)});
    const std::string out = run + ".out";
    ASSERT_EQ(RunLauncher(args, out, 120), 0) << ReadFile(out);
    EXPECT_TRUE(absl::StrContains(ReadFile(out), "injecting checkpoint fault (SIGKILL) at step 9"))
        << ReadFile(out);
    const std::string log1 = ReadFile(run + "/launch/attempt_1.log");
    EXPECT_TRUE(absl::StrContains(log1, CheckpointDirName(6) + " at step 6")) << log1;
    const std::map<int, std::string> steps = StepFigures(log1);
    ASSERT_FALSE(steps.empty()) << log1;
    EXPECT_EQ(steps.begin()->first, 7);
    for (const auto& [step, figures] : steps) {
      EXPECT_EQ(figures, ref_steps.at(step)) << "step " << step;
    }
    for (int step = kEvery; step <= kSteps; step += kEvery) {
      ExpectSameCheckpoint(ref + "/checkpoints", run + "/checkpoints", step);
    }
  }
}

// SIGTERM to smat_launch: the ranks get SIGUSR2 through mpirun, agree on a
// step, checkpoint it and exit 5; no restart. Launched again, the job resumes
// there and ends exactly where an uninterrupted run ends.
TEST(ResumeE2E, SigtermToTheLauncherCheckpointsAndTheRelaunchMatches) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
  constexpr int kLongSteps = 27;
  TempDir dir;
  const std::string ref = dir.path() + "/reference", run = dir.path() + "/preempted";
  std::vector<std::string> args = LaunchArgs(ref, kLongSteps);
  args.insert(args.end(), {"--max_restarts", "0"});
  ASSERT_EQ(RunLauncher(args, dir.path() + "/reference.out", 120), 0)
      << ReadFile(dir.path() + "/reference.out");
  const std::map<int, std::string> ref_steps = StepFigures(ReadFile(ref + "/launch/attempt_0.log"));

  args = LaunchArgs(run, kLongSteps);
  args.insert(args.end(), {"--max_restarts", "3", "--backoff", "0", "--stop_grace", "60"});
  const std::string out = dir.path() + "/preempted.out";
  bool signalled = false;
  const int code = RunLauncher(args, out, 120, [&](pid_t launcher) {
    for (int i = 0; i < 3000 && !signalled; ++i) {
      const std::map<int, std::string> seen = StepFigures(ReadFile(out));
      if (!seen.empty() && seen.rbegin()->first >= 4) signalled = kill(launcher, SIGTERM) == 0;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  const std::string output = ReadFile(out);
  ASSERT_TRUE(signalled) << output;
  ASSERT_EQ(code, kExitPreempted) << output;
  const size_t at = output.find("smat: preempted: checkpoint of step ");
  ASSERT_NE(at, std::string::npos) << output;
  int preempted_at = -1;
  ASSERT_TRUE(
      absl::SimpleAtoi(output.substr(at + 36, output.find(' ', at + 36) - at - 36), &preempted_at))
      << output;
  EXPECT_GE(preempted_at, 4);
  EXPECT_LT(preempted_at, kLongSteps) << "the job ended before the signal";
  EXPECT_TRUE(ReadFile(run + "/launch/attempt_1.log").empty()) << "restarted after SIGTERM";
  absl::StatusOr<std::string> latest = FindLatestIntact(run + "/checkpoints");
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, CheckpointPath(run + "/checkpoints", preempted_at));

  // Launched again: resumes at the preemption step and finishes identically.
  args = LaunchArgs(run, kLongSteps);
  args.insert(args.end(), {"--max_restarts", "0", "--log_dir", run + "/relaunch"});
  ASSERT_EQ(RunLauncher(args, dir.path() + "/relaunch.out", 120), 0)
      << ReadFile(dir.path() + "/relaunch.out");
  const std::string log = ReadFile(run + "/relaunch/attempt_0.log");
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("at step ", preempted_at))) << log;
  const std::map<int, std::string> steps = StepFigures(log);
  ASSERT_FALSE(steps.empty()) << log;
  EXPECT_EQ(steps.begin()->first, preempted_at + 1);
  for (const auto& [step, figures] : steps)
    EXPECT_EQ(figures, ref_steps.at(step)) << "step " << step;
  ExpectSameCheckpoint(ref + "/checkpoints", run + "/checkpoints", kLongSteps);

  // Another grid: the 2-rank checkpoint (two shards) resumes in one process
  // (dp = 1), which goes on and writes a one-shard checkpoint.
  args = LaunchArgs(run, kLongSteps + 2);
  args[1] = "1";  // --np
  args.insert(args.end(),
              {"--set", "parallel.dp=1", "--max_restarts", "0", "--log_dir", run + "/one_rank"});
  ASSERT_EQ(RunLauncher(args, dir.path() + "/one_rank.out", 120), 0)
      << ReadFile(dir.path() + "/one_rank.out");
  const std::string one = ReadFile(run + "/one_rank/attempt_0.log");
  EXPECT_TRUE(
      absl::StrContains(one, absl::StrCat(CheckpointDirName(kLongSteps), " at step ", kLongSteps)))
      << one;
  absl::StatusOr<CheckpointManifest> m =
      VerifyCheckpoint(CheckpointPath(run + "/checkpoints", kLongSteps + 2));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->writer_ranks(), 1);
  EXPECT_EQ(m->dp(), 1);
}

// The 4-rank variant of the kill test (dp = 2 x sp = 2, so the sequence-parallel
// collectives are in the step): rank 3 is killed by SIGKILL at a random step;
// the restarted job's steps and checkpoints equal an uninterrupted run's bit
// for bit. Fewer, shorter steps than the 2-rank test: 4 ranks share 2 cores.
TEST(ResumeE2E, KilledRankOfAFourRankJobIsRestartedAndMatches) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
  constexpr int kFourSteps = 9;
  TempDir dir;
  const std::string ref = dir.path() + "/reference", run = dir.path() + "/interrupted";
  auto four_ranks = [&](const std::string& run_dir) {
    std::vector<std::string> args = LaunchArgs(run_dir, kFourSteps);
    args[1] = "4";  // --np
    args.insert(args.end(), {"--set", "parallel.sp=2", "--set", "data.seq_len=128", "--set",
                             "data.batch_size=2"});
    return args;
  };
  std::vector<std::string> args = four_ranks(ref);
  args.insert(args.end(), {"--max_restarts", "0"});
  ASSERT_EQ(RunLauncher(args, dir.path() + "/reference.out", 120), 0)
      << ReadFile(dir.path() + "/reference.out");
  const std::map<int, std::string> ref_steps = StepFigures(ReadFile(ref + "/launch/attempt_0.log"));
  ASSERT_EQ(ref_steps.size(), static_cast<size_t>(kFourSteps));

  const unsigned seed =
      static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count());
  const int kill_after = 4 + static_cast<int>(std::mt19937(seed)() % 3);  // 4..6
  SCOPED_TRACE(absl::StrCat("rank 3 killed after step ", kill_after, " (seed ", seed, ")"));
  const std::string tag = dir.path();
  args = four_ranks(run);
  args.insert(args.end(), {"--max_restarts", "2", "--backoff", "0.2", "-x", "SMAT_E2E_TAG=" + tag});
  const std::string out = dir.path() + "/interrupted.out";
  bool killed = false;
  const int code = RunLauncher(args, out, 150, [&](pid_t) {
    for (int i = 0; i < 3000 && !killed; ++i) {
      const std::map<int, std::string> seen = StepFigures(ReadFile(out));
      if (!seen.empty() && seen.rbegin()->first >= kill_after) {
        const pid_t victim = FindRank(tag, 3);
        if (victim > 0) killed = kill(victim, SIGKILL) == 0;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  const std::string output = ReadFile(out);
  ASSERT_TRUE(killed) << output;
  ASSERT_EQ(code, 0) << output;
  const std::map<int, std::string> steps0 = StepFigures(ReadFile(run + "/launch/attempt_0.log"));
  ASSERT_FALSE(steps0.empty());
  EXPECT_LT(steps0.rbegin()->first, kFourSteps) << "the job finished before the kill";
  const std::string log1 = ReadFile(run + "/launch/attempt_1.log");
  ASSERT_TRUE(absl::StrContains(log1, "resumed from ")) << log1;
  const std::map<int, std::string> steps1 = StepFigures(log1);
  ASSERT_FALSE(steps1.empty()) << log1;
  EXPECT_EQ((steps1.begin()->first - 1) % kEvery, 0) << log1;
  EXPECT_EQ(steps1.rbegin()->first, kFourSteps);
  for (const auto& [step, figures] : steps1) {
    EXPECT_EQ(figures, ref_steps.at(step)) << "step " << step;
  }
  for (int step = kEvery; step <= kFourSteps; step += kEvery) {
    ExpectSameCheckpoint(ref + "/checkpoints", run + "/checkpoints", step, 4);
  }
}

// A wrapper for --train that arms SMAT_FAULT in the first launch attempt only
// (SMAT_RESTART_COUNT = 0), so the restart runs clean.
std::string WriteFirstAttemptFaultWrapper(const std::string& dir, const std::string& fault) {
  const std::string path = dir + "/train_with_fault.sh";
  std::ofstream f(path);
  f << "#!/bin/sh\n"
    << "if [ \"$SMAT_RESTART_COUNT\" = 0 ]; then export SMAT_FAULT='" << fault << "'; fi\n"
    << "exec '" << SMAT_TRAIN_BINARY << "' \"$@\"\n";
  f.close();
  chmod(path.c_str(), 0755);
  return path;
}

// Seconds since `t0` at which `needle` first appears in `path` (polled), or -1.
double WhenSeen(const std::string& path, const std::string& needle,
                std::chrono::steady_clock::time_point t0, double bound_s,
                const std::function<bool()>& done) {
  for (;;) {
    const double now = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (absl::StrContains(ReadFile(path), needle)) return now;
    if (now > bound_s || done()) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// SIGSTOP of rank 1 inside a collective (SMAT_FAULT, first attempt only) with a
// 10 s collective deadline: rank 0 fails the collective at the deadline, the
// job ends with the retryable exit code 3 within deadline + slack of the stop,
// smat_launch restarts it, the restart finishes, and the stopped process is not
// left behind. Then a flipped byte in the newest checkpoint's shard: a rerun
// names the shard and the CRC mismatch, skips it and resumes from the previous
// checkpoint, whose continuation matches the first run.
TEST(ResumeE2E, StoppedRankEndsTheJobAtTheDeadlineAndTheRestartFinishes) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
  constexpr double kDeadline = 10;
  TempDir dir;
  const std::string run = dir.path() + "/stopped", tag = dir.path();
  // Call 20 of one of rank 1's communicators: the host world's (two
  // collectives a step, three while a save is in flight) reaches it first,
  // around step 7.
  const std::string wrapper =
      WriteFirstAttemptFaultWrapper(dir.path(), "stop_in_collective:rank=1:call=20");
  std::vector<std::string> args = LaunchArgs(run);
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--train") args[i + 1] = wrapper;
  }
  args.insert(args.end(), {"--set", "parallel.collective_timeout_seconds=10", "--max_restarts", "1",
                           "--backoff", "0.2", "-x", "SMAT_E2E_TAG=" + tag});
  const std::string out = dir.path() + "/stopped.out";
  double stopped_at = -1, ended_at = -1;
  bool stopped_state = false;
  const int code = RunLauncher(args, out, 150, [&](pid_t launcher) {
    const auto t0 = std::chrono::steady_clock::now();
    auto launcher_done = [&] { return kill(launcher, 0) != 0; };
    stopped_at = WhenSeen(out, "injecting fault stop_in_collective", t0, 60, launcher_done);
    // The victim really is stopped (state T) while rank 0 waits.
    for (int i = 0; i < 100 && !stopped_state; ++i) {
      const pid_t victim = FindRank(tag, 1);
      const std::string stat = victim > 0 ? ReadFile(absl::StrCat("/proc/", victim, "/stat")) : "";
      const size_t close = stat.rfind(')');
      stopped_state =
          close != std::string::npos && close + 2 < stat.size() && stat[close + 2] == 'T';
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ended_at = WhenSeen(out, "attempt 0 ended", t0, 90, launcher_done);
  });
  const std::string output = ReadFile(out);
  ASSERT_EQ(code, 0) << output;
  ASSERT_GE(stopped_at, 0) << "the fault never fired\n" << output;
  EXPECT_TRUE(stopped_state) << "rank 1 was not seen stopped\n" << output;
  ASSERT_GE(ended_at, 0) << output;
  // Rank 0 gave up at the deadline (polling slack 1.5 s on shared cores).
  const std::string log0 = ReadFile(run + "/launch/attempt_0.log");
  EXPECT_TRUE(absl::StrContains(log0, "rank 0: DEADLINE_EXCEEDED")) << log0;
  const size_t at = log0.find("(elapsed ");
  ASSERT_NE(at, std::string::npos) << log0;
  const double elapsed = std::atof(log0.c_str() + at + 9);
  std::printf(
      "[ measure  ] rank 1 stopped at %.2f s; rank 0 failed after %.3f s; attempt 0 "
      "ended %.2f s after the stop\n",
      stopped_at, elapsed, ended_at - stopped_at);
  std::fflush(stdout);  // before the next fork copies the buffer
  EXPECT_GE(elapsed, kDeadline);
  EXPECT_LT(elapsed, kDeadline + 1.5);
  // The whole job ended within the deadline plus 8 s (abort and mpirun's
  // teardown of 2 ranks, one of them stopped) of the stop, with exit 3.
  EXPECT_GE(ended_at - stopped_at, kDeadline - 0.5);
  EXPECT_LT(ended_at - stopped_at, kDeadline + 8) << output;
  EXPECT_TRUE(absl::StrContains(output, "attempt 0 ended after")) << output;
  EXPECT_TRUE(absl::StrContains(log0, absl::StrCat("exit ", kExitRetryable, ","))) << log0;
  // The restart resumed and finished; nothing of the first attempt is left.
  const std::string log1 = ReadFile(run + "/launch/attempt_1.log");
  EXPECT_TRUE(absl::StrContains(log1, "resumed from ")) << log1;
  EXPECT_FALSE(absl::StrContains(log1, "injecting fault")) << log1;
  const std::map<int, std::string> steps1 = StepFigures(log1);
  ASSERT_FALSE(steps1.empty()) << log1;
  EXPECT_EQ(steps1.rbegin()->first, kSteps);
  for (int rank = 0; rank < 2; ++rank) {
    const pid_t left = FindRank(tag, rank);
    EXPECT_EQ(left, -1) << "rank " << rank << " process " << left << " outlived the job";
    if (left > 0) kill(left, SIGKILL);
  }

  // A flipped byte in the newest checkpoint (step 18, shard 1).
  const std::string ckpt = run + "/checkpoints";
  const std::string shard = CheckpointPath(ckpt, kSteps) + "/" + ShardFileName(1);
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good()) << shard;
    f.seekg(100);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(100);
    f.write(&c, 1);
  }
  args = LaunchArgs(run);
  args.insert(args.end(), {"--set", "checkpoint.every_steps=0", "--max_restarts", "0", "--log_dir",
                           run + "/after_flip"});
  ASSERT_EQ(RunLauncher(args, dir.path() + "/flip.out", 120), 0)
      << ReadFile(dir.path() + "/flip.out");
  const std::string flip = ReadFile(run + "/after_flip/attempt_0.log");
  EXPECT_TRUE(absl::StrContains(flip, "checkpoint shard '" + shard + "': CRC-32 mismatch")) << flip;
  const int previous = kSteps - kEvery;
  EXPECT_TRUE(absl::StrContains(
      flip, absl::StrCat("resumed from ", CheckpointPath(ckpt, previous), " at step ", previous)))
      << flip;
  const std::map<int, std::string> flip_steps = StepFigures(flip);
  ASSERT_EQ(flip_steps.size(), static_cast<size_t>(kEvery)) << flip;
  for (const auto& [step, figures] : flip_steps) {
    EXPECT_EQ(figures, steps1.at(step)) << "step " << step;
  }
}

}  // namespace
}  // namespace smat
