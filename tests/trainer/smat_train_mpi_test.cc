// smat_train end to end under mpirun (the test runs mpirun itself): a short
// 2-rank run prints the rank placement, progress and evaluation as plain
// lines and exits 0; bad configs, a wrong world size, a missing data file and
// impossible shapes stop every rank before any step with exit code 2; a loss
// that turns NaN/inf exits 4 (core/exit_codes.h).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/exit_codes.h"
#include "core/status.h"
#include "gtest/gtest.h"

namespace smat {
namespace {

constexpr char kConfig[] = R"(
run { name: "cli" steps: 4 log_every: 2 eval_every: 4 seed: 1 }
model { vocab_size: 64 width: 32 layers: 1 heads: 2 routing: TOKEN_HASH }
smat { d: 2 chunk: 16 }
parallel { dp: 1 sp: 2 collective_timeout_seconds: 30 }
data { kind: MQAR seq_len: 256 batch_size: 2 num_pairs: 8 vocab: 64 seed: 5 }
optimizer { lr: 3e-3 }
checkpoint { every_steps: 0 }
metrics { enabled: false }
)";

std::string Dir() {
  static const std::string dir = [] {
    std::string d = (std::filesystem::temp_directory_path() /
                     ("smat_train_cli_" + std::to_string(getpid()))).string();
    std::filesystem::remove_all(d);
    std::filesystem::create_directories(d);
    std::ofstream(d + "/cli.textproto") << kConfig;
    return d;
  }();
  return dir;
}

// Runs smat_train on `np` ranks with extra arguments; returns the exit code
// and the merged output.
int RunTrain(int np, const std::string& args, std::string* output) {
  const std::string cmd =
      absl::StrCat(SMAT_MPIEXEC, " -np ", np, " --oversubscribe --bind-to none ", SMAT_TRAIN_BIN,
                   " --config ", Dir(), "/cli.textproto --set run.dir=", Dir(), "/run ", args,
                   " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  SMAT_CHECK(p != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(SmatTrainCli, ShortRunPrintsProgressAndAccuracy) {
  std::string out;
  ASSERT_EQ(RunTrain(2, "", &out), kExitOk) << out;
  // Rank 0's placement table (parallel/rank_placement.h), one row per rank.
  EXPECT_TRUE(absl::StrContains(out, "smat: 2 ranks launched by")) << out;
  EXPECT_TRUE(absl::StrContains(out, "rank  host")) << out;
  EXPECT_TRUE(absl::StrContains(out, "local  cpus  ")) << out;
  // Two ranks unbound (--bind-to none) share the host's CPUs among their
  // BLAS threads (parallel/launch_env.h CpuThreadsPerRank), unless told.
  const bool told = std::getenv("OPENBLAS_NUM_THREADS") != nullptr ||
                    std::getenv("GOTO_NUM_THREADS") != nullptr ||
                    std::getenv("OMP_NUM_THREADS") != nullptr;
  EXPECT_EQ(absl::StrContains(out, "per rank: 2 ranks share rank 0's "), !told) << out;
  EXPECT_TRUE(absl::StrContains(out, "step 2/4  loss")) << out;
  EXPECT_TRUE(absl::StrContains(out, "step 4/4  loss")) << out;
  EXPECT_TRUE(absl::StrContains(out, "eval 4/4  loss")) << out;
  EXPECT_TRUE(absl::StrContains(out, "answers")) << out;
  EXPECT_TRUE(absl::StrContains(out, "smat: done: 4 steps")) << out;
  EXPECT_TRUE(absl::StrContains(out, "accuracy")) << out;
  // Output to a pipe: plain lines, no carriage-return redraws.
  EXPECT_FALSE(absl::StrContains(out, "\r")) << out;
}

struct BadCase {
  const char* name;
  int np;
  const char* args;
  const char* message;  // must appear in the output
};

TEST(SmatTrainCli, BadInputStopsEveryRankWithExitTwo) {
  const BadCase cases[] = {
      {"unknown field", 2, "--set model.widht=3", "widht"},
      {"heads do not divide width", 2, "--set model.heads=3", "model.heads = 3"},
      {"world size != dp x sp", 3, "", "needs 2 ranks but 3 were started"},
      {"missing data file", 2,
       "--set data.kind=TEXT --set data.path=/nonexistent/tokens.bin --set run.eval_every=0",
       "/nonexistent/tokens.bin"},
      {"T too small for d", 2, "--set smat.d=8", "smat.d = 8"},
      {"fewer chunks than sp ranks", 2, "--set data.seq_len=16 --set data.num_pairs=2",
       "fewer than parallel.sp"},
  };
  for (const BadCase& c : cases) {
    std::string out;
    EXPECT_EQ(RunTrain(c.np, c.args, &out), kExitBadInput) << c.name << "\n" << out;
    EXPECT_TRUE(absl::StrContains(out, c.message)) << c.name << "\n" << out;
    // Stopped before any work, and every rank said why (no rank left waiting).
    EXPECT_FALSE(absl::StrContains(out, "step 1/")) << c.name << "\n" << out;
    for (int r = 0; r < c.np; ++r) {
      EXPECT_TRUE(absl::StrContains(out, absl::StrCat("rank ", r, ":"))) << c.name << "\n" << out;
    }
  }
}

TEST(SmatTrainCli, NonFiniteLossExitsFour) {
  std::string out;
  EXPECT_EQ(RunTrain(2, "--set optimizer.lr=1e20 --set optimizer.grad_clip=0 --set run.steps=10",
                     &out),
            kExitNonFiniteLoss)
      << out;
  EXPECT_TRUE(absl::StrContains(out, "the training loss is")) << out;
}

}  // namespace
}  // namespace smat
