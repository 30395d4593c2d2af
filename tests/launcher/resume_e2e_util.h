// Shared by the launcher's resume end-to-end tests (resume_e2e_test.cc,
// reshard_e2e_test.cc): the smat_launch arguments of the small dp = 2 job
// (tiny_cpu, a checkpoint every kEvery steps), a bounded launcher run, and the
// per-step figures of a training log. Needs SMAT_SOURCE_DIR, SMAT_TRAIN_BINARY
// and SMAT_MPIEXEC defined by the build.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/launcher/launch_test_util.h"

namespace smat {
namespace resume_e2e {

inline constexpr int kSteps = 18;
inline constexpr int kEvery = 3;

inline std::vector<std::string> LaunchArgs(const std::string& run_dir, int steps = kSteps) {
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

// Runs smat_launch (bounded) and returns its exit code (-1: killed by a signal
// or after the bound, which also fails the test); `watch` runs beside it with
// the launcher's pid.
inline int RunLauncher(const std::vector<std::string>& args, const std::string& out, double bound_s,
                const std::function<void(pid_t)>& watch = nullptr) {
  const launch_test::LaunchResult r = launch_test::RunLauncher(args, out, bound_s, watch);
  if (!r.finished) {
    ADD_FAILURE() << "smat_launch outlived " << bound_s << " s";
    return -1;
  }
  return launch_test::ExitCode(r);
}

// "loss X lr Y gnorm Z" of each "step N/M ..." line of `log`, by N.
inline std::map<int, std::string> StepFigures(const std::string& log) {
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

}  // namespace resume_e2e
}  // namespace smat
