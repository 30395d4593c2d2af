// End to end: smat_launch runs smat_train under mpirun -np 2 (tiny_cpu on a
// dp = 2 grid, a checkpoint every 3 steps); the test kills rank 1 with SIGKILL
// once the job has logged a randomly chosen step. The launcher must restart
// the job, which resumes from the newest intact checkpoint, and the result
// must be indistinguishable from an uninterrupted run of the same config:
//   * every checkpoint both runs wrote (the final one included) is
//     byte-identical shard for shard and loads to the same tensors and step;
//   * every step the restarted attempt logs after its resume point shows the
//     same loss, learning rate and gradient norm as the uninterrupted run.
// A second test preempts the job with SIGTERM to the launcher and launches
// it again. ARCHITECTURE.md section 5 promises this: fixed-order reductions, a data
// sampler that is a pure function of the step, counter-based random numbers.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
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
#include "trainer/checkpoint.h"

namespace smat {
namespace {

constexpr int kSteps = 18;
constexpr int kEvery = 3;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/smat_resume_e2e_XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::vector<std::string> LaunchArgs(const std::string& run_dir, int steps = kSteps) {
  return {"--np",         "2",
          "--config",     SMAT_SOURCE_DIR "/configs/tiny_cpu.textproto",
          "--set",        "parallel.dp=2",
          "--set",        absl::StrCat("run.steps=", steps),
          "--set",        "optimizer.warmup_steps=2",
          "--set",        "run.log_every=1",
          "--set",        "run.eval_every=0",
          "--set",        "data.batch_size=4",
          "--set",        absl::StrCat("checkpoint.every_steps=", kEvery),
          "--set",        "checkpoint.keep_last=100",
          "--set",        "run.dir=" + run_dir,
          "--train",      SMAT_TRAIN_BINARY,
          "--mpirun",     SMAT_MPIEXEC,
          "--mpirun_arg", "--bind-to",
          "--mpirun_arg", "none"};
}

// Runs smat_launch (bounded); `watch` runs beside it with the launcher's pid.
int RunLauncher(const std::vector<std::string>& args, const std::string& out, double bound_s,
                const std::function<void(pid_t)>& watch = nullptr) {
  const pid_t child = fork();
  if (child == 0) {
    setpgid(0, 0);
    FILE* f = std::freopen(out.c_str(), "w", stdout);
    (void)f;
    dup2(fileno(stdout), fileno(stderr));
    std::vector<char*> argv = {const_cast<char*>(SMAT_LAUNCH_BINARY)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(SMAT_LAUNCH_BINARY, argv.data());
    std::_Exit(127);
  }
  setpgid(child, child);
  if (watch) watch(child);
  const auto t0 = std::chrono::steady_clock::now();
  int status = 0;
  for (;;) {
    if (waitpid(child, &status, WNOHANG) == child) break;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > bound_s) {
      kill(-child, SIGKILL);
      waitpid(child, &status, 0);
      ADD_FAILURE() << "smat_launch outlived " << bound_s << " s";
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// "loss X lr Y gnorm Z" of each "step N/M ..." line of `log`, by N.
std::map<int, std::string> StepFigures(const std::string& log) {
  std::map<int, std::string> out;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    std::vector<std::string> w = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (w.size() < 8 || w[0] != "step") continue;
    int step = 0;
    if (!absl::SimpleAtoi(w[1].substr(0, w[1].find('/')), &step)) continue;
    out[step] = absl::StrCat(w[2], " ", w[3], " ", w[4], " ", w[5], " ", w[6], " ", w[7]);
  }
  return out;
}

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
void ExpectSameCheckpoint(const std::string& dir_a, const std::string& dir_b, int step) {
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
  for (int shard = 0; shard < 2; ++shard) {
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

}  // namespace
}  // namespace smat
