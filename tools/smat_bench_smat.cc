// SMat-Attention benchmarks of smat_bench (see smat_bench_smat.h).
#include "tools/smat_bench_smat.h"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "kernels/smat.h"
#include "tools/smat_bench_util.h"

namespace smat {
namespace {

struct BenchProblem {
  SmatPlan plan;
  SmatInputs in;
  Tensor d_o;  // [batch, T, H, dv] in cfg.do_dtype
};

absl::StatusOr<BenchProblem> MakeProblem(Backend& backend, const SmatBenchConfig& cfg, int64_t T,
                                         int d) {
  if (cfg.reps < 1 || cfg.warmup < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--reps must be >= 1 and --warmup >= 0; got ", cfg.reps, ", ", cfg.warmup));
  }
  BenchProblem pr;
  SMAT_ASSIGN_OR_RETURN(pr.plan, MakeSmatPlan(T, d, cfg.chunk, cfg.q));
  const int64_t B = cfg.batch, H = cfg.heads;
  // Features in [0.05, 1] as after elu+1 of small projections; values in [-1, 1].
  SMAT_ASSIGN_OR_RETURN(pr.in.phi, RandomOnDevice(backend, {B, T, H, cfg.r}, cfg.dtype, cfg.seed, 0.05f, 1.f));
  SMAT_ASSIGN_OR_RETURN(pr.in.psi, RandomOnDevice(backend, {B, T, H, cfg.r}, cfg.dtype, cfg.seed + 1, 0.05f, 1.f));
  SMAT_ASSIGN_OR_RETURN(pr.in.v, RandomOnDevice(backend, {B, T, H, cfg.dv}, cfg.dtype, cfg.seed + 2, -1.f, 1.f));
  if (cfg.gated) {
    SMAT_ASSIGN_OR_RETURN(pr.in.logg, RandomOnDevice(backend, {B, T, H}, DType::kF32, cfg.seed + 3, -0.05f, 0.f));
  }
  pr.in.eps = 1e-6f;
  return pr;
}

// Process CPU time (all threads) in ms: on a shared development machine the
// wall time of a run depends on the other processes, its CPU time much less.
double ProcessCpuMs() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

struct Timings {
  std::vector<double> wall_ms;  // backend events
  std::vector<double> cpu_ms;   // process CPU time
};

// Runs `body` warmup + reps times, timing each run with backend events (and
// the process CPU time around it).
template <typename Body>
absl::StatusOr<Timings> TimeRuns(Backend& backend, const SmatBenchConfig& cfg, Body body) {
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> start, backend.CreateEvent());
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> stop, backend.CreateEvent());
  Timings t;
  for (int i = 0; i < cfg.warmup + cfg.reps; ++i) {
    SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
    const double cpu0 = ProcessCpuMs();
    SMAT_RETURN_IF_ERROR(backend.Record(*start, nullptr));
    SMAT_RETURN_IF_ERROR(body());
    SMAT_RETURN_IF_ERROR(backend.Record(*stop, nullptr));
    SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
    const double cpu1 = ProcessCpuMs();
    SMAT_ASSIGN_OR_RETURN(float elapsed, backend.ElapsedMs(*start, *stop));
    if (i >= cfg.warmup) {
      t.wall_ms.push_back(elapsed);
      t.cpu_ms.push_back(cpu1 - cpu0);
    }
  }
  return t;
}

SmatBenchResult Summarize(std::string what, const BenchProblem& pr, const SmatBenchConfig& cfg,
                          const Timings& t) {
  SmatBenchResult r;
  r.what = std::move(what);
  r.plan = pr.plan;
  r.cfg = cfg;
  r.median_ms = Median(t.wall_ms);
  r.min_ms = *std::min_element(t.wall_ms.begin(), t.wall_ms.end());
  r.cpu_median_ms = Median(t.cpu_ms);
  r.tokens_per_s = static_cast<double>(cfg.batch * pr.plan.T) / (r.median_ms * 1e-3);
  return r;
}

}  // namespace

absl::StatusOr<SmatBenchResult> BenchSmatForward(Backend& backend, const SmatBenchConfig& cfg,
                                                 int64_t T, int d) {
  SMAT_ASSIGN_OR_RETURN(BenchProblem pr, MakeProblem(backend, cfg, T, d));
  SMAT_ASSIGN_OR_RETURN(Timings ms, TimeRuns(backend, cfg, [&]() -> absl::Status {
    SmatForwardOutputs fwd;
    return SmatForward(backend, pr.plan, pr.in, &fwd);
  }));
  return Summarize("forward", pr, cfg, ms);
}

absl::StatusOr<SmatBenchResult> BenchSmatForwardBackward(Backend& backend,
                                                         const SmatBenchConfig& cfg, int64_t T,
                                                         int d) {
  SMAT_ASSIGN_OR_RETURN(BenchProblem pr, MakeProblem(backend, cfg, T, d));
  SMAT_ASSIGN_OR_RETURN(pr.d_o, RandomOnDevice(backend, {cfg.batch, T, cfg.heads, cfg.dv},
                                               cfg.do_dtype, cfg.seed + 4, -1.f, 1.f));
  SMAT_ASSIGN_OR_RETURN(Timings ms, TimeRuns(backend, cfg, [&]() -> absl::Status {
    SmatForwardOutputs fwd;
    SMAT_RETURN_IF_ERROR(SmatForward(backend, pr.plan, pr.in, &fwd));
    SmatGradients grads;
    return SmatBackward(backend, pr.plan, pr.in, fwd, pr.d_o, &grads);
  }));
  return Summarize("forward+backward", pr, cfg, ms);
}

std::string FormatSmatBenchResult(const SmatBenchResult& r) {
  const SmatPlan& p = r.plan;
  return absl::StrFormat(
      "smat %-16s T=%d d=%d q=%d P=%d B=%d n=%d batch=%d heads=%d r=%d dv=%d chunk=%d gated=%d "
      "%s: %.3f ms (median of %d, min %.3f; process CPU %.3f ms), %.4g tokens/s",
      r.what, p.T, p.geo.d, p.geo.q, p.geo.P, p.geo.B, p.n, r.cfg.batch, r.cfg.heads, r.cfg.r,
      r.cfg.dv, p.chunk, r.cfg.gated ? 1 : 0, DTypeName(r.cfg.dtype), r.median_ms, r.cfg.reps,
      r.min_ms, r.cpu_median_ms, r.tokens_per_s);
}

absl::StatusOr<std::string> SmatBenchSweep(Backend& backend, const SmatBenchConfig& cfg,
                                           const std::vector<int64_t>& Ts,
                                           const std::vector<int>& ds) {
  // Wall-clock medians and minima, and the median process CPU time: on a shared
  // machine the CPU time per token is the steadiest view of the scaling.
  std::string table =
      "| d | T | q | P | B | fwd ms median | fwd ms min | fwd CPU ms | fwd CPU ns/token "
      "| fwd+bwd ms median | fwd+bwd ms min | fwd+bwd CPU ms | fwd+bwd CPU ns/token |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (int d : ds) {
    for (int64_t T : Ts) {
      SMAT_ASSIGN_OR_RETURN(SmatBenchResult f, BenchSmatForward(backend, cfg, T, d));
      SMAT_ASSIGN_OR_RETURN(SmatBenchResult fb, BenchSmatForwardBackward(backend, cfg, T, d));
      const double tokens = static_cast<double>(cfg.batch * T);
      const std::string row = absl::StrFormat(
          "| %d | %d | %d | %d | %d | %.1f | %.1f | %.1f | %.0f | %.1f | %.1f | %.1f | %.0f |\n",
          d, T, f.plan.geo.q, f.plan.geo.P, f.plan.geo.B, f.median_ms, f.min_ms,
          f.cpu_median_ms, f.cpu_median_ms * 1e6 / tokens, fb.median_ms, fb.min_ms,
          fb.cpu_median_ms, fb.cpu_median_ms * 1e6 / tokens);
      std::fputs(row.c_str(), stderr);  // progress: the sweep takes minutes on a CPU
      table += row;
    }
  }
  return table;
}

}  // namespace smat
