// smat_bench --sp: sequence-parallel weak scaling (see smat_bench_sp.h).
#include "tools/smat_bench_sp.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <mpi.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/convert.h"
#include "core/rng.h"
#include "core/status.h"
#include "kernels/backend.h"
#include "kernels/smat.h"
#include "parallel/comm_stats.h"
#include "parallel/mpi_communicator.h"
#include "parallel/process_group.h"
#include "parallel/sequence_parallel_smat.h"
#include "tools/smat_bench_util.h"

namespace smat {
namespace {

// On the GPU the medians come from at least this many timed runs after this
// many warm-up runs (the first NCCL calls set up their channels).
constexpr int kMinGpuReps = 10;
constexpr int kMinGpuWarmup = 2;

// What SequenceParallelVolume and ARCHITECTURE.md section 4 say the k-th
// collective of kind `op` in `phase` moves per rank, in words.
struct Expected {
  int64_t words = -1;  // -1: no formula for this collective
  std::string what;
  std::string formula;
};

Expected ExpectedWords(const std::string& phase, const std::string& op, int k,
                       const SpSmatVolume& vol, const SmatPlan& plan, int64_t sp,
                       int64_t batch, int64_t H, int64_t r, int64_t p) {
  Expected e;
  if (phase == "forward" && op == "AllGather" && k == 0) {
    e = {vol.scan_words, "span totals + log-decays",
         "sp x batch x 2 x H x (r p + 1) (SequenceParallelVolume scan_words)"};
  } else if (phase == "forward" && op == "AllReduce" && k == 0) {
    e = {vol.table_words, "profile table F",
         "batch x H x P x r x p (SequenceParallelVolume table_words)"};
  } else if (phase == "backward" && op == "AllReduce" && k == 0) {
    e = {batch * H * plan.geo.B * r * p, "type-table gradient U_bar", "batch x H x B x r x p"};
  } else if (phase == "backward" && op == "AllGather" && k == 0) {
    e = {sp * batch * 2 * H * r * p, "span state gradients", "sp x batch x 2 x H x r p"};
  } else if (phase == "backward" && op == "AllGather" && k == 1) {
    e = {sp * batch * H, "span sums of dL/dLambda (gated)", "sp x batch x H"};
  }
  return e;
}

// --- inputs ----------------------------------------------------------------------------

// This rank's part [batch, L, rest...] of a random [batch, T, rest...] tensor:
// element (b, t, ...) is Philox draw (b T + t) x row + ... of `seed`, whatever
// the split. In `dtype` on the backend (the CPU backend computes in fp32: bf16
// values are rounded to bf16 and widened back, as smat_op does).
absl::StatusOr<Tensor> SpanRandom(Backend& backend, Shape shape, int64_t T, const SmatSpan& span,
                                  DType dtype, uint64_t seed, float lo, float hi) {
  const int64_t batch = shape[0], L = shape[1];
  SMAT_ASSIGN_OR_RETURN(Tensor host, Tensor::Empty(shape, dtype));
  const int64_t row = host.numel() / (batch * L);
  for (int64_t b = 0; b < batch; ++b) {
    Tensor part = host.View(b * L * row, {L * row});
    SMAT_RETURN_IF_ERROR(FillUniform(part, seed, static_cast<uint64_t>((b * T + span.t0) * row),
                                     lo, hi));
  }
  if (backend.device().is_cpu()) {
    if (dtype != DType::kF32) return ConvertDType(host, DType::kF32);
    return host;
  }
  SMAT_ASSIGN_OR_RETURN(Tensor dev, Tensor::Empty(std::move(shape), dtype, backend.allocator()));
  SMAT_RETURN_IF_ERROR(backend.Copy(host, dev));
  SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  return dev;
}

// InternalError when `t` holds a NaN or Inf or only zeros: a benchmark of a
// broken op proves nothing.
absl::Status CheckResult(Backend& backend, const Tensor& t, const char* name, int rank) {
  Tensor h = t;
  if (!t.device().is_cpu()) {
    SMAT_ASSIGN_OR_RETURN(h, Tensor::Empty(t.shape(), t.dtype()));
    SMAT_RETURN_IF_ERROR(backend.Copy(t, h));
    SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  }
  if (h.dtype() != DType::kF32) {
    SMAT_ASSIGN_OR_RETURN(h, ConvertDType(h, DType::kF32));
  }
  int64_t bad = 0, nonzero = 0;
  const float* x = h.data<float>();
  for (int64_t i = 0; i < h.numel(); ++i) {
    bad += std::isfinite(x[i]) ? 0 : 1;
    nonzero += x[i] != 0.f ? 1 : 0;
  }
  if (bad > 0 || nonzero == 0) {
    return absl::InternalError(absl::StrCat(
        "sequence-parallel SMat on rank ", rank, ": ", name, " has ", bad,
        " non-finite values and ", nonzero, " non-zero values of ", h.numel(),
        "; the op is broken here, run the tests in tests/parallel (nccl_communicator_test on "
        "GPUs)"));
  }
  return absl::OkStatus();
}

// --- the benchmark ----------------------------------------------------------------------

struct RankTimes {
  double fwd_ms = 0, all_ms = 0;      // medians over the timed runs
  double in_flight_ms = 0, waited_ms = 0;  // per run, summed over collectives (medians)
  std::vector<double> coll_in_flight, coll_waited;  // per collective (medians)
};

// Forward and forward+backward of the single-process op (kernels/smat.h) on the
// same inputs: what sequence parallelism at sp = 1 costs beyond the plain op.
absl::Status TimeSingleProcessOp(Backend& backend, const SmatPlan& plan, const SmatInputs& in,
                                 const Tensor& d_o, int warmup, int reps, double* fwd_ms,
                                 double* all_ms) {
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> e0, backend.CreateEvent());
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> e1, backend.CreateEvent());
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> e2, backend.CreateEvent());
  std::vector<double> f, a;
  for (int it = 0; it < warmup + reps; ++it) {
    SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
    SmatForwardOutputs fwd;
    SmatGradients g;
    SMAT_RETURN_IF_ERROR(backend.Record(*e0, nullptr));
    SMAT_RETURN_IF_ERROR(SmatForward(backend, plan, in, &fwd));
    SMAT_RETURN_IF_ERROR(backend.Record(*e1, nullptr));
    SMAT_RETURN_IF_ERROR(SmatBackward(backend, plan, in, fwd, d_o, &g));
    SMAT_RETURN_IF_ERROR(backend.Record(*e2, nullptr));
    SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
    if (it < warmup) continue;
    SMAT_ASSIGN_OR_RETURN(float ff, backend.ElapsedMs(*e0, *e1));
    SMAT_ASSIGN_OR_RETURN(float aa, backend.ElapsedMs(*e0, *e2));
    f.push_back(ff);
    a.push_back(aa);
  }
  *fwd_ms = Median(f);
  *all_ms = Median(a);
  return absl::OkStatus();
}

std::string Words(double w) {
  return absl::StrFormat("%.0f (%.2f MB)", w, w * 4 / 1e6);
}

absl::Status RunOnRanks(ProcessGroup& pg, const SmatBenchConfig& cfg, const SpBenchOptions& o) {
  const bool on_gpu = !o.device.is_cpu();
  const int reps = on_gpu ? std::max(cfg.reps, kMinGpuReps) : cfg.reps;
  const int warmup = on_gpu ? std::max(cfg.warmup, kMinGpuWarmup) : cfg.warmup;
  const Device device =
      on_gpu ? Device::Cuda(pg.device() >= 0 ? pg.device() : pg.local_rank()) : Device::Cpu();
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateBackend(device));
  MpiCommunicator& host = pg.host_world();
  const int sp = pg.sp(), me = pg.sp_rank();
  const int64_t B = cfg.batch, H = cfg.heads, r = cfg.r, dv = cfg.dv, p = dv + 1;
  const int64_t T = sp * o.T_per_rank;
  SMAT_ASSIGN_OR_RETURN(SmatPlan plan, MakeSmatPlan(T, o.d, cfg.chunk, cfg.q));
  SMAT_ASSIGN_OR_RETURN(std::vector<SmatSpan> spans, SplitSequence(plan, sp));
  const SmatSpan span = spans[me];
  const int64_t L = span.length();

  // Features in [0.05, 1] as after elu+1 of small projections, values in [-1, 1]
  // (the seeds of the single-GPU benchmark, tools/smat_bench_smat.cc).
  SmatInputs in;
  in.eps = 1e-6f;
  SMAT_ASSIGN_OR_RETURN(in.phi, SpanRandom(*backend, {B, L, H, r}, T, span, cfg.dtype, cfg.seed,
                                           0.05f, 1.f));
  SMAT_ASSIGN_OR_RETURN(in.psi, SpanRandom(*backend, {B, L, H, r}, T, span, cfg.dtype,
                                           cfg.seed + 1, 0.05f, 1.f));
  SMAT_ASSIGN_OR_RETURN(in.v, SpanRandom(*backend, {B, L, H, dv}, T, span, cfg.dtype,
                                         cfg.seed + 2, -1.f, 1.f));
  if (cfg.gated) {
    SMAT_ASSIGN_OR_RETURN(in.logg, SpanRandom(*backend, {B, L, H}, T, span, DType::kF32,
                                              cfg.seed + 3, -0.05f, 0.f));
  }
  SMAT_ASSIGN_OR_RETURN(Tensor d_o, SpanRandom(*backend, {B, L, H, dv}, T, span, DType::kF32,
                                               cfg.seed + 4, -1.f, 1.f));

  // Every collective of the op, recorded (parallel/comm_stats.h) so the tables
  // show exactly what it sends.
  CommRecorder log;
  RecordingCommunicator comm(pg.sequence(), &log);
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> e0, backend->CreateEvent());
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> e1, backend->CreateEvent());
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> e2, backend->CreateEvent());
  std::vector<double> fwd_ms, all_ms, in_flight, waited;
  std::vector<std::vector<double>> coll_in_flight, coll_waited;
  std::vector<CollectiveRecord> shape_of_run;  // the collectives of one run
  SpSmatForwardOutputs fwd;
  SmatGradients grads;
  for (int it = 0; it < warmup + reps; ++it) {
    fwd = SpSmatForwardOutputs();
    grads = SmatGradients();
    SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
    SMAT_RETURN_IF_ERROR(Annotate(host.Barrier(), "barrier before run ", it));
    log.Reset();
    SMAT_RETURN_IF_ERROR(backend->Record(*e0, nullptr));
    log.set_phase("forward");
    SMAT_RETURN_IF_ERROR(Annotate(
        SequenceParallelSmatForward(*backend, comm, plan, spans, in, &fwd), "forward"));
    SMAT_RETURN_IF_ERROR(backend->Record(*e1, nullptr));
    log.set_phase("backward");
    SMAT_RETURN_IF_ERROR(Annotate(
        SequenceParallelSmatBackward(*backend, comm, plan, spans, in, fwd, d_o, &grads),
        "backward"));
    SMAT_RETURN_IF_ERROR(backend->Record(*e2, nullptr));
    SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
    if (it < warmup) continue;
    SMAT_ASSIGN_OR_RETURN(float f, backend->ElapsedMs(*e0, *e1));
    SMAT_ASSIGN_OR_RETURN(float a, backend->ElapsedMs(*e0, *e2));
    fwd_ms.push_back(f);
    all_ms.push_back(a);
    if (shape_of_run.empty()) {
      shape_of_run = log.records();
      coll_in_flight.resize(shape_of_run.size());
      coll_waited.resize(shape_of_run.size());
    }
    if (log.records().size() != shape_of_run.size()) {
      return absl::InternalError(absl::StrCat("run ", it, " issued ", log.records().size(),
                                              " collectives, the first timed run ",
                                              shape_of_run.size()));
    }
    double fl = 0, wt = 0;
    for (size_t i = 0; i < log.records().size(); ++i) {
      coll_in_flight[i].push_back(1e3 * log.records()[i].in_flight_seconds);
      coll_waited[i].push_back(1e3 * log.records()[i].waited_seconds);
      fl += 1e3 * log.records()[i].in_flight_seconds;
      wt += 1e3 * log.records()[i].waited_seconds;
    }
    in_flight.push_back(fl);
    waited.push_back(wt);
  }
  SMAT_RETURN_IF_ERROR(CheckResult(*backend, fwd.o, "o", me));
  SMAT_RETURN_IF_ERROR(CheckResult(*backend, grads.phi, "dL/dphi", me));
  SMAT_RETURN_IF_ERROR(CheckResult(*backend, grads.v, "dL/dv", me));

  double ref_fwd = 0, ref_all = 0;
  if (sp == 1) {
    fwd = SpSmatForwardOutputs();
    grads = SmatGradients();
    SMAT_RETURN_IF_ERROR(Annotate(
        TimeSingleProcessOp(*backend, plan, in, d_o, warmup, reps, &ref_fwd, &ref_all),
        "single-process op"));
  }

  // Every rank's medians to rank 0, as fp32 through the host communicator:
  // [fwd, fwd+bwd, in flight, waited, then (in flight, waited) per collective].
  const int64_t nc = static_cast<int64_t>(shape_of_run.size());
  const int64_t row = 4 + 2 * nc;
  SMAT_ASSIGN_OR_RETURN(Tensor mine, Tensor::Empty({row}, DType::kF32));
  float* m = mine.data<float>();
  m[0] = static_cast<float>(Median(fwd_ms));
  m[1] = static_cast<float>(Median(all_ms));
  m[2] = static_cast<float>(Median(in_flight));
  m[3] = static_cast<float>(Median(waited));
  for (int64_t i = 0; i < nc; ++i) {
    m[4 + 2 * i] = static_cast<float>(Median(coll_in_flight[i]));
    m[5 + 2 * i] = static_cast<float>(Median(coll_waited[i]));
  }
  SMAT_ASSIGN_OR_RETURN(Tensor all, Tensor::Empty({sp * row}, DType::kF32));
  SMAT_RETURN_IF_ERROR(Annotate(host.AllGather(mine, all), "gathering the timings"));
  if (pg.world_rank() != 0) return host.Barrier();

  const float* g = all.data<float>();
  std::printf("# smat_bench --sp on %s: %d rank(s), communicator %s (%s)\n",
              backend->name().c_str(), sp, pg.sequence().name().c_str(),
              pg.sequence().device().ToString().c_str());
  std::printf("smat sp=%d T/rank=%lld T=%lld d=%d q=%lld P=%lld B=%lld n=%lld chunk=%lld "
              "batch=%lld heads=%lld r=%lld dv=%lld %s %s, median of %d after %d warm-up\n",
              sp, static_cast<long long>(o.T_per_rank), static_cast<long long>(T), o.d,
              static_cast<long long>(plan.geo.q), static_cast<long long>(plan.geo.P),
              static_cast<long long>(plan.geo.B), static_cast<long long>(plan.n),
              static_cast<long long>(plan.chunk), static_cast<long long>(B),
              static_cast<long long>(H), static_cast<long long>(r), static_cast<long long>(dv),
              DTypeName(cfg.dtype), cfg.gated ? "gated" : "ungated", reps, warmup);
  std::printf("\n| rank | span | blocks | forward ms | fwd+bwd ms | collectives in flight ms | "
              "waited ms |\n|---|---|---|---|---|---|---|\n");
  double worst_fwd = 0, worst_all = 0, worst_flight = 0, worst_wait = 0;
  for (int j = 0; j < sp; ++j) {
    const float* x = g + j * row;
    const char* blocks = spans[j].touches_distant(plan)
                             ? (spans[j].touches_recent(plan) ? "distant+recent" : "distant")
                             : "recent";
    std::printf("| %d | [%lld, %lld) | %s | %.3f | %.3f | %.3f | %.3f |\n", j,
                static_cast<long long>(spans[j].t0), static_cast<long long>(spans[j].t1), blocks,
                x[0], x[1], x[2], x[3]);
    worst_fwd = std::max(worst_fwd, static_cast<double>(x[0]));
    worst_all = std::max(worst_all, static_cast<double>(x[1]));
    worst_flight = std::max(worst_flight, static_cast<double>(x[2]));
    worst_wait = std::max(worst_wait, static_cast<double>(x[3]));
  }

  // Per collective: what was sent against the formulas, and its times (the
  // slowest rank's median).
  // The op's plan (positional maps): d = 1 has no table to all-reduce.
  const SpSmatVolume vol =
      SequenceParallelVolume(SmatOpPlan(plan, /*content_maps=*/false), sp, B, H, r, p);
  std::printf("\n| collective | what | words per rank | formula | formula words | match | "
              "ring bytes sent per rank | in flight ms | waited ms |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  double wire = 0;
  bool all_match = true;
  for (int64_t i = 0; i < nc; ++i) {
    const CollectiveRecord& c = shape_of_run[i];
    int k = 0;
    for (int64_t j = 0; j < i; ++j) {
      k += shape_of_run[j].phase == c.phase && shape_of_run[j].op == c.op ? 1 : 0;
    }
    const Expected e = ExpectedWords(c.phase, CollectiveOpName(c.op), k, vol, plan, sp, B, H, r, p);
    const bool match = e.words == c.words;
    all_match &= match;
    double fl = 0, wt = 0;
    for (int j = 0; j < sp; ++j) {
      fl = std::max(fl, static_cast<double>(g[j * row + 4 + 2 * i]));
      wt = std::max(wt, static_cast<double>(g[j * row + 5 + 2 * i]));
    }
    wire += c.wire_bytes;
    std::printf("| %s %s | %s | %s | %s | %s | %s | %.0f | %.3f | %.3f |\n", c.phase.c_str(),
                CollectiveOpName(c.op), e.what.empty() ? "?" : e.what.c_str(),
                Words(static_cast<double>(c.words)).c_str(),
                e.formula.empty() ? "none" : e.formula.c_str(),
                e.words < 0 ? "-" : absl::StrCat(e.words).c_str(), match ? "yes" : "NO",
                c.wire_bytes, fl, wt);
  }
  std::printf("\nSequenceParallelVolume: %s\n", vol.ToString().c_str());
  if (sp == 1) {
    std::printf("single-process op (kernels/smat.h SmatForward/SmatBackward, same inputs): "
                "forward %.3f ms, forward+backward %.3f ms\n",
                ref_fwd, ref_all);
  }
  std::string summary = absl::StrFormat(
      "SUMMARY sp=%d d=%d dtype=%s %s T_per_rank=%d T=%d device=%s comm=%s fwd_ms=%.4f "
      "fwd_bwd_ms=%.4f comm_in_flight_ms=%.4f comm_waited_ms=%.4f comm_ring_bytes=%.0f "
      "volumes_match=%d",
      sp, o.d, DTypeName(cfg.dtype), cfg.gated ? "gated" : "ungated", o.T_per_rank, T,
      device.is_cpu() ? "cpu" : "cuda", pg.sequence().name(), worst_fwd, worst_all, worst_flight,
      worst_wait, wire, all_match ? 1 : 0);
  if (sp == 1) {
    absl::StrAppendFormat(&summary, " op_fwd_ms=%.4f op_fwd_bwd_ms=%.4f", ref_fwd, ref_all);
  }
  if (o.baseline_ms > 0) {
    absl::StrAppendFormat(&summary, " baseline_ms=%.4f efficiency=%.4f", o.baseline_ms,
                          o.baseline_ms / worst_all);
  }
  if (o.baseline_fwd_ms > 0) {
    absl::StrAppendFormat(&summary, " baseline_fwd_ms=%.4f efficiency_fwd=%.4f",
                          o.baseline_fwd_ms, o.baseline_fwd_ms / worst_fwd);
  }
  std::printf("%s\n", summary.c_str());
  std::fflush(stdout);
  if (!all_match) {
    return absl::InternalError(
        "the collectives' sizes differ from SequenceParallelVolume's formulas (rows marked NO "
        "above); fix the op or the formulas in parallel/sequence_parallel_smat.h");
  }
  return host.Barrier();
}

}  // namespace

absl::Status ValidateSpBenchOptions(const SmatBenchConfig& cfg, const SpBenchOptions& opts) {
  if (opts.T_per_rank < 1 || cfg.chunk < 1 || opts.T_per_rank % cfg.chunk != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--sp: --T (tokens per rank) must be a positive multiple of --chunk so every rank holds "
        "the same whole chunks; got T = ", opts.T_per_rank, ", chunk = ", cfg.chunk, " (use T = ",
        std::max<int64_t>(1, opts.T_per_rank / std::max<int64_t>(1, cfg.chunk)) * cfg.chunk, ")"));
  }
  if (cfg.reps < 1 || cfg.warmup < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--reps must be >= 1 and --warmup >= 0; got ", cfg.reps, ", ", cfg.warmup));
  }
  if (opts.comm != "auto" && !ParseCommBackend(opts.comm).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--comm: '", opts.comm, "'; use auto, mpi or nccl"));
  }
  if (opts.comm == "nccl" && opts.device.is_cpu()) {
    return absl::InvalidArgumentError("--comm nccl needs --device cuda (NCCL moves device memory)");
  }
  if (opts.baseline_ms < 0 || opts.baseline_fwd_ms < 0) {
    return absl::InvalidArgumentError("--baseline_ms and --baseline_fwd_ms must be >= 0");
  }
  return absl::OkStatus();
}

int RunSmatBenchSp(const SmatBenchConfig& cfg, const SpBenchOptions& opts) {
  if (absl::Status s = ValidateSpBenchOptions(cfg, opts); !s.ok()) {
    std::fprintf(stderr, "smat_bench: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  absl::StatusOr<MpiSession> mpi = MpiSession::Init(nullptr, nullptr);
  if (!mpi.ok()) {
    std::fprintf(stderr, "smat_bench --sp: %s\n", std::string(mpi.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<CommOptions> comm_opts = CommOptions::FromEnvironment();
  if (!comm_opts.ok()) AbortJob(comm_opts.status());
  ProcessGroupOptions pgo;
  pgo.sp = mpi->world_size();
  pgo.comm = *comm_opts;
  pgo.backend = opts.device.is_cpu() ? CommBackend::kMpi : CommBackend::kNccl;
  if (opts.comm != "auto") pgo.backend = ParseCommBackend(opts.comm).value();
  absl::StatusOr<std::unique_ptr<ProcessGroup>> pg = ProcessGroup::Create(MPI_COMM_WORLD, pgo);
  if (!pg.ok()) {
    AbortJob(Annotate(pg.status(), "smat_bench --sp (rank ", mpi->world_rank(), " of ",
                      mpi->world_size(), "): creating the process group"));
  }
  absl::Status s = RunOnRanks(**pg, cfg, opts);
  if (!s.ok()) {
    AbortJob(Annotate(s, "smat_bench --sp (rank ", (*pg)->world_rank(), " of ",
                      (*pg)->world_size(), ")"));
  }
  return 0;
}

}  // namespace smat
