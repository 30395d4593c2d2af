// End to end: a checkpoint written by one process grid resumes on another.
// smat_launch runs smat_train (tiny_cpu) on dp 1 x sp 2, then the checkpoint
// of step 4 is resumed on dp 1 x sp 4 and on dp 2 x sp 1: the same state (the
// trainer's CRC-32 equals the checkpoint's), the data stream continued at the
// saved cursor with nothing skipped or repeated, and on sp = 4 the losses of
// the sp = 2 run to fp32 rounding.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/launcher/launch_test_util.h"
#include "tests/launcher/resume_e2e_util.h"
#include "trainer/checkpoint.h"

namespace smat {
namespace {

using launch_test::ReadFile;
using launch_test::TempDir;
using namespace resume_e2e;  // NOLINT: the launch arguments and log readers

// "data cursor C, crc32 X" of the "smat: resumed state:" line of `log`.
bool ResumedState(const std::string& log, int64_t* cursor, std::string* crc) {
  const size_t at = log.find("smat: resumed state: data cursor ");
  if (at == std::string::npos) return false;
  const size_t from = at + std::strlen("smat: resumed state: data cursor ");
  const size_t comma = log.find(',', from);
  const size_t c = log.find("crc32 ", comma);
  if (comma == std::string::npos || c == std::string::npos) return false;
  *crc = log.substr(c + 6, 8);
  return absl::SimpleAtoi(log.substr(from, comma - from), cursor);
}

// "data: step N sequences [a, b)" lines of `log`: N -> (a, b).
std::map<int, std::pair<int64_t, int64_t>> DataRanges(const std::string& log) {
  std::map<int, std::pair<int64_t, int64_t>> out;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    int step = 0;
    long long a = 0, b = 0;
    if (std::sscanf(std::string(line).c_str(), "data: step %d sequences [%lld, %lld)", &step, &a,
                    &b) == 3) {
      out[step] = {a, b};
    }
  }
  return out;
}

// A checkpoint written by dp 1 x sp 2 (2 ranks) resumes on dp 1 x sp 4 (4
// ranks) and on dp 2 x sp 1 (2 ranks): every grid loads the same parameters
// and optimizer moments (the CRC-32 the trainer prints over its state equals
// the CRC of the checkpoint's tensors), starts at the saved data cursor, and
// the sequences of the following steps continue the global stream with none
// skipped or repeated (run.log_data), whatever the global batch. On sp = 4 the
// losses continue the sp = 2 run's to fp32 rounding (same data, other sums).
TEST(ResumeE2E, CheckpointOfOneGridResumesOnAnotherWithTheSameStateAndData) {
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
  constexpr int kSaved = 4, kMore = 2, kBatch = 2;
  TempDir dir;
  auto grid = [&](const std::string& run_dir, int np, int dp, int sp, int steps) {
    std::vector<std::string> args = LaunchArgs(run_dir, steps);
    args[1] = absl::StrCat(np);
    args.insert(args.end(),
                {"--set", absl::StrCat("parallel.dp=", dp), "--set",
                 absl::StrCat("parallel.sp=", sp), "--set", "data.seq_len=128", "--set",
                 absl::StrCat("data.batch_size=", kBatch), "--set", "run.log_data=true", "--set",
                 absl::StrCat("checkpoint.every_steps=", kSaved), "--max_restarts", "0"});
    return args;
  };
  // sp = 2 to step kSaved + kMore, with a checkpoint at kSaved.
  const std::string base = dir.path() + "/sp2";
  ASSERT_EQ(RunLauncher(grid(base, 2, 1, 2, kSaved + kMore), dir.path() + "/sp2.out", 120), 0)
      << ReadFile(dir.path() + "/sp2.out");
  const std::string base_log = ReadFile(base + "/launch/attempt_0.log");
  const std::map<int, std::string> base_steps = StepFigures(base_log);
  const std::map<int, std::pair<int64_t, int64_t>> base_data = DataRanges(base_log);
  ASSERT_EQ(base_data.size(), static_cast<size_t>(kSaved + kMore)) << base_log;
  absl::StatusOr<CheckpointState> saved =
      LoadCheckpoint(CheckpointPath(base + "/checkpoints", kSaved));
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->sampler_cursor, int64_t{kSaved} * kBatch);
  uint32_t crc = 0;
  for (const NamedTensor& t : saved->tensors) crc = Crc32(crc, t.tensor.raw(), t.tensor.nbytes());
  char want_crc[9];
  std::snprintf(want_crc, sizeof(want_crc), "%08x", crc);

  struct Grid {
    int np, dp, sp;
  };
  for (const Grid& g : {Grid{4, 1, 4}, Grid{2, 2, 1}}) {
    SCOPED_TRACE(absl::StrCat("resumed on dp ", g.dp, " x sp ", g.sp));
    const std::string run = absl::StrCat(dir.path(), "/dp", g.dp, "sp", g.sp);
    // Only the step-kSaved checkpoint, copied: the resume must pick it.
    ASSERT_EQ(std::system(absl::StrCat("mkdir -p '", run, "/checkpoints' && cp -r '",
                                       CheckpointPath(base + "/checkpoints", kSaved), "' '", run,
                                       "/checkpoints/'")
                              .c_str()),
              0);
    std::vector<std::string> args = grid(run, g.np, g.dp, g.sp, kSaved + kMore);
    ASSERT_EQ(RunLauncher(args, run + ".out", 120), 0) << ReadFile(run + ".out");
    const std::string log = ReadFile(run + "/launch/attempt_0.log");
    int64_t cursor = -1;
    std::string got_crc;
    ASSERT_TRUE(ResumedState(log, &cursor, &got_crc)) << log;
    EXPECT_EQ(cursor, saved->sampler_cursor);
    EXPECT_EQ(got_crc, want_crc) << "the loaded parameters and moments differ from the checkpoint";
    // The data continues at the cursor, dp * batch sequences a step.
    const std::map<int, std::pair<int64_t, int64_t>> data = DataRanges(log);
    ASSERT_EQ(data.size(), static_cast<size_t>(kMore)) << log;
    int64_t next = saved->sampler_cursor;
    for (const auto& [step, range] : data) {
      EXPECT_EQ(range.first, next) << "step " << step;
      EXPECT_EQ(range.second - range.first, int64_t{g.dp} * kBatch) << "step " << step;
      next = range.second;
    }
    absl::StatusOr<CheckpointManifest> end =
        VerifyCheckpoint(CheckpointPath(run + "/checkpoints", kSaved + kMore));
    ASSERT_TRUE(end.ok()) << end.status();
    EXPECT_EQ(end->sampler_cursor(), next);
    if (g.dp == 1) {
      // The same sequences as the sp = 2 run: the same steps' data, and losses
      // equal to the printed digits up to fp32 rounding of other sums.
      const std::map<int, std::string> steps = StepFigures(log);
      for (const auto& [step, range] : data) EXPECT_EQ(range, base_data.at(step));
      for (const auto& [step, figures] : steps) {
        const double a = std::atof(figures.substr(figures.find(' ') + 1).c_str());
        const std::string& ref = base_steps.at(step);
        const double b = std::atof(ref.substr(ref.find(' ') + 1).c_str());
        EXPECT_NEAR(a, b, 1e-3 * std::abs(b))
            << "step " << step << ": " << figures << " vs " << ref;
      }
    }
  }
}

}  // namespace
}  // namespace smat
