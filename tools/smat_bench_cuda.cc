// The GPU path of smat_bench (smat_bench_cuda.h): every SMat phase of the
// forward (and backward) pass, called through the backend's SmatKernels on
// buffers allocated once, timed with device events between phases, against
// the copy and GEMM ceilings measured in the same process (METHOD.md: measure
// the two ceilings on the device, count bytes and FLOPs, report the gap).
//
// Counts per phase are the fewest bytes the phase must move (each input read
// once, each output written once; fp32 states and tables, inputs in their
// dtype) and the FLOPs of its products (2 per multiply-add; the causal chunk
// tiles counted at half the square, as they must be computed). The roofline
// time of a phase is max(bytes / copy bandwidth, FLOPs / bf16 GEMM rate): the
// tensor-core ceiling the targets are set against; the fp32 line uses the fp32
// (CUDA-core) GEMM rate instead.
#include "tools/smat_bench_cuda.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "kernels/smat.h"
#include "kernels/smat_kernels.h"
#include "tools/smat_bench_util.h"

namespace smat {
namespace {

constexpr int kMinReps = 20;
constexpr int kMinWarmup = 2;

struct Phase {
  std::string name;
  double bytes = 0;
  double flops = 0;
  std::function<absl::Status()> run;
};

struct Ceilings {
  double copy_gbs = 0;        // device-to-device copy, bytes read + written
  double bf16_tflops = 0;     // Backend::Gemm, bf16 inputs, fp32 accumulation
  double fp32_tflops = 0;     // Backend::Gemm, fp32 (no TF32)
};

// Device buffers of the benchmark; `held` sums their bytes.
class Buffers {
 public:
  explicit Buffers(Backend& gpu) : gpu_(gpu) {}
  absl::StatusOr<Tensor> Zeros(Shape shape, DType dtype = DType::kF32) {
    SMAT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(std::move(shape), dtype, gpu_.allocator()));
    SMAT_RETURN_IF_ERROR(gpu_.Fill(t, 0.0));
    held_ += static_cast<double>(t.nbytes());
    return t;
  }
  absl::StatusOr<Tensor> Random(Shape shape, DType dtype, uint64_t seed, float lo, float hi) {
    SMAT_ASSIGN_OR_RETURN(Tensor t, RandomOnDevice(gpu_, std::move(shape), dtype, seed, lo, hi));
    held_ += static_cast<double>(t.nbytes());
    return t;
  }
  double held() const { return held_; }

 private:
  Backend& gpu_;
  double held_ = 0;
};

// Runs `phases` in order warmup + reps times with an event between phases;
// per-phase and whole-chain medians in ms.
absl::Status TimeChain(Backend& gpu, const std::vector<Phase>& phases, int warmup, int reps,
                       std::vector<double>* phase_ms, double* total_ms) {
  std::vector<std::unique_ptr<Event>> ev;
  for (size_t i = 0; i <= phases.size(); ++i) {
    SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> e, gpu.CreateEvent());
    ev.push_back(std::move(e));
  }
  std::vector<std::vector<double>> per(phases.size());
  std::vector<double> total;
  for (int it = 0; it < warmup + reps; ++it) {
    SMAT_RETURN_IF_ERROR(gpu.Synchronize(nullptr));
    SMAT_RETURN_IF_ERROR(gpu.Record(*ev[0], nullptr));
    for (size_t i = 0; i < phases.size(); ++i) {
      SMAT_RETURN_IF_ERROR(Annotate(phases[i].run(), phases[i].name));
      SMAT_RETURN_IF_ERROR(gpu.Record(*ev[i + 1], nullptr));
    }
    SMAT_RETURN_IF_ERROR(gpu.Synchronize(nullptr));
    if (it < warmup) continue;
    for (size_t i = 0; i < phases.size(); ++i) {
      SMAT_ASSIGN_OR_RETURN(float ms, gpu.ElapsedMs(*ev[i], *ev[i + 1]));
      per[i].push_back(ms);
    }
    SMAT_ASSIGN_OR_RETURN(float all, gpu.ElapsedMs(*ev[0], *ev[phases.size()]));
    total.push_back(all);
  }
  phase_ms->clear();
  for (auto& v : per) phase_ms->push_back(Median(v));
  *total_ms = Median(total);
  return absl::OkStatus();
}

absl::StatusOr<double> TimeOne(Backend& gpu, const std::function<absl::Status()>& body, int reps) {
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> a, gpu.CreateEvent());
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> b, gpu.CreateEvent());
  std::vector<double> ms;
  for (int i = 0; i < reps + 2; ++i) {
    SMAT_RETURN_IF_ERROR(gpu.Record(*a, nullptr));
    SMAT_RETURN_IF_ERROR(body());
    SMAT_RETURN_IF_ERROR(gpu.Record(*b, nullptr));
    SMAT_RETURN_IF_ERROR(gpu.Synchronize(nullptr));
    SMAT_ASSIGN_OR_RETURN(float t, gpu.ElapsedMs(*a, *b));
    if (i >= 2) ms.push_back(t);
  }
  return Median(ms);
}

absl::StatusOr<Ceilings> MeasureCeilings(Backend& gpu) {
  Ceilings c;
  {
    Buffers buf(gpu);
    const int64_t n = int64_t{1} << 28;  // 1 GiB of fp32, far beyond the 60 MB L2
    SMAT_ASSIGN_OR_RETURN(Tensor src, buf.Random({n}, DType::kF32, 7, -1.f, 1.f));
    SMAT_ASSIGN_OR_RETURN(Tensor dst, buf.Zeros({n}));
    SMAT_ASSIGN_OR_RETURN(double ms, TimeOne(gpu, [&] { return gpu.Copy(src, dst); }, 10));
    c.copy_gbs = 2.0 * src.nbytes() / (ms * 1e-3) / 1e9;
  }
  for (DType dt : {DType::kBF16, DType::kF32}) {
    Buffers buf(gpu);
    const int64_t m = dt == DType::kBF16 ? 8192 : 4096;
    SMAT_ASSIGN_OR_RETURN(Tensor a, buf.Random({m, m}, dt, 8, -1.f, 1.f));
    SMAT_ASSIGN_OR_RETURN(Tensor b, buf.Random({m, m}, dt, 9, -1.f, 1.f));
    SMAT_ASSIGN_OR_RETURN(Tensor out, buf.Zeros({m, m}));
    SMAT_ASSIGN_OR_RETURN(double ms, TimeOne(gpu, [&] {
      return gpu.Gemm(Transpose::kNo, Transpose::kNo, 1.f, a, b, 0.f, out);
    }, 10));
    const double tf = 2.0 * m * m * m / (ms * 1e-3) / 1e12;
    (dt == DType::kBF16 ? c.bf16_tflops : c.fp32_tflops) = tf;
  }
  return c;
}

void PrintTable(const char* pass, const std::vector<Phase>& phases, const std::vector<double>& ms,
                double total_ms, const Ceilings& c) {
  std::printf("| %-24s | %9s | %9s | %8s | %8s | %9s | %9s |\n", pass, "ms", "MB", "GB/s",
              "GFLOP", "TFLOP/s", "roofline");
  std::printf("|%s|%s|%s|%s|%s|%s|%s|\n", std::string(26, '-').c_str(),
              std::string(11, '-').c_str(), std::string(11, '-').c_str(),
              std::string(10, '-').c_str(), std::string(10, '-').c_str(),
              std::string(11, '-').c_str(), std::string(11, '-').c_str());
  double bytes = 0, flops = 0;
  for (size_t i = 0; i < phases.size(); ++i) {
    const Phase& p = phases[i];
    bytes += p.bytes;
    flops += p.flops;
    const double floor_s = std::max(p.bytes / (c.copy_gbs * 1e9), p.flops / (c.bf16_tflops * 1e12));
    std::printf("| %-24s | %9.3f | %9.1f | %8.0f | %8.2f | %9.2f | %8.1f%% |\n", p.name.c_str(),
                ms[i], p.bytes / 1e6, p.bytes / (ms[i] * 1e-3) / 1e9, p.flops / 1e9,
                p.flops / (ms[i] * 1e-3) / 1e12, 100.0 * floor_s / (ms[i] * 1e-3));
  }
  const double floor_s = std::max(bytes / (c.copy_gbs * 1e9), flops / (c.bf16_tflops * 1e12));
  const double floor32 = std::max(bytes / (c.copy_gbs * 1e9), flops / (c.fp32_tflops * 1e12));
  std::printf("| %-24s | %9.3f | %9.1f | %8.0f | %8.2f | %9.2f | %8.1f%% |\n", "total (chain)",
              total_ms, bytes / 1e6, bytes / (total_ms * 1e-3) / 1e9, flops / 1e9,
              flops / (total_ms * 1e-3) / 1e12, 100.0 * floor_s / (total_ms * 1e-3));
  std::printf("roofline %s: %.3f ms (bf16 tensor-core rate), %.3f ms (fp32 CUDA-core rate); "
              "measured %.3f ms\n\n",
              pass, floor_s * 1e3, floor32 * 1e3, total_ms);
}

}  // namespace

absl::Status RunSmatBenchCuda(Backend& gpu, const SmatBenchConfig& cfg, int64_t T, int d,
                              bool backward) {
  const int reps = std::max(cfg.reps, kMinReps), warmup = std::max(cfg.warmup, kMinWarmup);
  SMAT_ASSIGN_OR_RETURN(Ceilings ceil, MeasureCeilings(gpu));
  gpu.allocator().ResetPeak();  // the peak printed last is the benchmark's, not the ceiling runs'
  std::printf("ceilings on %s: copy %.0f GB/s (read + write), GEMM bf16 %.0f TFLOP/s, "
              "GEMM fp32 %.1f TFLOP/s\n",
              gpu.name().c_str(), ceil.copy_gbs, ceil.bf16_tflops, ceil.fp32_tflops);

  SMAT_ASSIGN_OR_RETURN(const SmatPlan geometry_plan, MakeSmatPlan(T, d, cfg.chunk, cfg.q));
  // The plan the op runs (positional maps): d = 1 as one causal block, with
  // no long-range phases (SmatOpPlan, kernels/smat.h).
  const SmatPlan plan = SmatOpPlan(geometry_plan, /*content_maps=*/false);
  const bool long_range = SmatHasLongRange(plan);
  SMAT_ASSIGN_OR_RETURN(SmatKernels * k, gpu.smat());
  const SmatSpan span = SmatSpan::Whole(plan);
  const int64_t B = cfg.batch, H = cfg.heads, r = cfg.r, dv = cfg.dv, p = dv + 1;
  const int64_t Lc = span.num_chunks(plan), P = plan.geo.P, Bt = plan.geo.B, c = plan.chunk;
  const double es = static_cast<double>(DTypeSize(cfg.dtype));
  const double es_do = static_cast<double>(DTypeSize(cfg.do_dtype));  // d_o's element
  const double N = static_cast<double>(B * T * H), NC = static_cast<double>(B * Lc * H);
  const double BH = static_cast<double>(B * H), W = static_cast<double>(r * p);
  const double nd = static_cast<double>(B * plan.n * H), nr = static_cast<double>(B * plan.m * H);
  const double nnz = static_cast<double>(plan.geo.nnz_C());
  std::printf("smat %s T=%lld d=%d q=%lld P=%lld B=%lld n=%lld chunk=%lld batch=%lld heads=%lld "
              "r=%lld dv=%lld %s, median of %d after %d warm-up\n",
              backward ? "forward+backward" : "forward", static_cast<long long>(T), d,
              static_cast<long long>(plan.geo.q), static_cast<long long>(P),
              static_cast<long long>(Bt), static_cast<long long>(plan.n),
              static_cast<long long>(c), static_cast<long long>(B), static_cast<long long>(H),
              static_cast<long long>(r), static_cast<long long>(dv),
              cfg.gated ? "gated" : "ungated", reps, warmup);
  if (!long_range) {
    std::printf(
        "d = %d with positional maps: one causal block, no long-range phases (the "
        "geometry's n = %lld)\n",
        d, static_cast<long long>(geometry_plan.n));
  }

  Buffers buf(gpu);
  SMAT_ASSIGN_OR_RETURN(Tensor phi, buf.Random({B, T, H, r}, cfg.dtype, cfg.seed, 0.05f, 1.f));
  SMAT_ASSIGN_OR_RETURN(Tensor psi, buf.Random({B, T, H, r}, cfg.dtype, cfg.seed + 1, 0.05f, 1.f));
  SMAT_ASSIGN_OR_RETURN(Tensor v, buf.Random({B, T, H, dv}, cfg.dtype, cfg.seed + 2, -1.f, 1.f));
  Tensor logg, lam, cd;
  if (cfg.gated) {
    SMAT_ASSIGN_OR_RETURN(logg, buf.Random({B, T, H}, DType::kF32, cfg.seed + 3, -0.05f, 0.f));
    SMAT_ASSIGN_OR_RETURN(lam, buf.Zeros({B, T, H}));
    SMAT_ASSIGN_OR_RETURN(cd, buf.Zeros({B, Lc, H}));
  }
  SMAT_ASSIGN_OR_RETURN(Tensor D, buf.Zeros({B, Lc, H, r, p}));
  SMAT_ASSIGN_OR_RETURN(Tensor S_in, buf.Zeros({B, Lc, H, r, p}));
  SMAT_ASSIGN_OR_RETURN(Tensor span_state, buf.Zeros({B, 2, H, r, p}));
  SMAT_ASSIGN_OR_RETURN(Tensor span_decay, buf.Zeros({B, 2, H}));
  SMAT_ASSIGN_OR_RETURN(Tensor F, buf.Zeros({B, H, P, r, p}));
  SMAT_ASSIGN_OR_RETURN(Tensor U, buf.Zeros({B, H, Bt, r, p}));
  SMAT_ASSIGN_OR_RETURN(Tensor ybar, buf.Zeros({B, T, H, p}));
  SMAT_ASSIGN_OR_RETURN(Tensor reads, buf.Zeros({B, T, H, p}));
  // What the outputs add: the reads of the recent tokens, none without the
  // long-range branch.
  const Tensor op_reads = long_range ? reads : Tensor();
  const double nreads = long_range ? nr : 0.0;
  SMAT_ASSIGN_OR_RETURN(Tensor o, buf.Zeros({B, T, H, dv}, cfg.dtype));
  SMAT_ASSIGN_OR_RETURN(Tensor den, buf.Zeros({B, T, H}));
  const float eps = 1e-6f;

  const double gate_bytes = cfg.gated ? N * 4 + NC * 4 : 0;
  // The causal states and the outputs as SmatForward computes them
  // (kernels/smat.cc): one walk over the chunks where the backend has one
  // (ChunkStatesAndOutputs: the summaries' reads of psi and v, then the
  // outputs' reads, S_in written once), else summaries, scan and
  // NormalizedOutputs, which are timed for comparison either way.
  auto walk = [&]() -> absl::Status {
    SMAT_ASSIGN_OR_RETURN(const bool walked,
                          k->ChunkStatesAndOutputs(plan, span, phi, psi, v, lam, cd, Tensor(),
                                                   op_reads, eps, &S_in, &o, &den, nullptr));
    if (!walked) return absl::InternalError("ChunkStatesAndOutputs did not run");
    return absl::OkStatus();
  };
  SMAT_ASSIGN_OR_RETURN(const bool walks,
                        k->ChunkStatesAndOutputs(plan, span, phi, psi, v, lam, cd, Tensor(),
                                                 op_reads, eps, &S_in, &o, &den, nullptr));
  const double out_bytes = N * (2 * r + dv) * es + gate_bytes + NC * W * 4;
  std::vector<Phase> states;
  states.push_back({"ChunkSummaries", N * (r + dv) * es + gate_bytes + NC * W * 4, 2 * N * W,
                    [&] { return k->ChunkSummaries(plan, span, psi, v, lam, cd, &D, nullptr); }});
  states.push_back({"ChunkScan", NC * W * 8, 2 * NC * W, [&] {
                      return k->ChunkScan(plan, span, D, cd, Tensor(), &S_in, &span_state,
                                          &span_decay, nullptr);
                    }});
  states.push_back({"NormalizedOutputs", out_bytes + nreads * p * 4 + N * (dv * es + 4),
                    N * c * (r + p) + 2 * N * W + N * dv, [&] {
                      return k->NormalizedOutputs(plan, span, phi, psi, v, lam, S_in, op_reads, eps,
                                                  &o, &den, nullptr);
                    }});
  std::vector<Phase> fwd;
  if (cfg.gated) {
    fwd.push_back({"ChunkLogDecay", N * 8 + NC * 4, 0,
                   [&] { return k->ChunkLogDecay(plan, span, logg, &lam, &cd, nullptr); }});
  }
  // Where C is the identity (d <= 2) the op pools into U and runs no
  // tabulation, forward or backward (kernels/smat.cc).
  const bool tabulate = !plan.geo.IncidenceIsIdentity();
  if (long_range) {
    Tensor* pooled = tabulate ? &F : &U;
    fwd.push_back({"ProfilePooling", nd * (r + dv) * es + BH * P * W * 4, 2 * nd * W, [&, pooled] {
                     return k->ProfilePooling(plan, span, psi, v, lam, cd, Tensor(), pooled,
                                              nullptr);
                   }});
    if (tabulate) {
      fwd.push_back({"Tabulate", BH * (P + Bt) * W * 4, BH * nnz * W,
                     [&] { return k->Tabulate(plan, F, &U, nullptr); }});
    }
    fwd.push_back({"TypeReads (=)", nr * (r * es + p * 4) + BH * Bt * W * 4, 2 * nr * W, [&] {
                     return k->TypeReads(plan, span, phi, U, lam, cd, Tensor(), Tensor(), &reads,
                                         SmatWrite::kAssign, nullptr);
                   }});
  }
  if (walks) {
    fwd.push_back({"ChunkStatesAndOutputs",
                   N * (r + dv) * es + N * (2 * r + dv) * es + NC * W * 4 + nreads * p * 4 +
                       N * (dv * es + 4),
                   N * c * (r + p) + 4 * N * W + N * dv, walk});
  } else {
    fwd.insert(fwd.end(), states.begin(), states.end());
  }
  // The same outputs as three phases with ybar in memory (the sequence-parallel
  // composer's order, which overlaps the table's all-reduce with ChunkOutputs):
  // timed for comparison, not part of the forward.
  std::vector<Phase> three;
  three.push_back({"ChunkOutputs", out_bytes + N * p * 4, N * c * (r + p) + 2 * N * W, [&] {
                     return k->ChunkOutputs(plan, span, phi, psi, v, lam, S_in, &ybar, nullptr);
                   }});
  if (long_range) {
    three.push_back({"TypeReads (+=)", nr * (r * es + p * 8) + BH * Bt * W * 4, 2 * nr * W, [&] {
                       return k->TypeReads(plan, span, phi, U, lam, cd, Tensor(), Tensor(), &ybar,
                                           SmatWrite::kAdd, nullptr);
                     }});
  }
  three.push_back({"Normalize", N * (p * 4 + dv * es + 4), N * dv,
                   [&] { return k->Normalize(ybar, eps, &o, &den, nullptr); }});
  std::vector<double> fwd_ms;
  double fwd_total = 0;
  SMAT_RETURN_IF_ERROR(TimeChain(gpu, fwd, warmup, reps, &fwd_ms, &fwd_total));
  PrintTable("forward", fwd, fwd_ms, fwd_total, ceil);
  // The forward as SmatForward issues it: the long-range phases on the
  // backend's side stream (SmatKernels::ForkSide) beside the causal states,
  // joined before the outputs read the reads. The table above times the same
  // phases one after another on one stream, for their shares; this is the
  // forward's time.
  double fwd_op = fwd_total;
  if (long_range) {
    auto op = [&]() -> absl::Status {
      if (cfg.gated) SMAT_RETURN_IF_ERROR(k->ChunkLogDecay(plan, span, logg, &lam, &cd, nullptr));
      SMAT_ASSIGN_OR_RETURN(Stream * side, k->ForkSide(nullptr));
      SMAT_RETURN_IF_ERROR(
          k->ProfilePooling(plan, span, psi, v, lam, cd, Tensor(), tabulate ? &F : &U, side));
      if (tabulate) SMAT_RETURN_IF_ERROR(k->Tabulate(plan, F, &U, side));
      SMAT_RETURN_IF_ERROR(k->TypeReads(plan, span, phi, U, lam, cd, Tensor(), Tensor(), &reads,
                                        SmatWrite::kAssign, side));
      if (walks) {
        SMAT_RETURN_IF_ERROR(walk());
        return k->JoinSide(nullptr);
      }
      SMAT_RETURN_IF_ERROR(k->ChunkSummaries(plan, span, psi, v, lam, cd, &D, nullptr));
      SMAT_RETURN_IF_ERROR(
          k->ChunkScan(plan, span, D, cd, Tensor(), &S_in, &span_state, &span_decay, nullptr));
      SMAT_RETURN_IF_ERROR(k->JoinSide(nullptr));
      return k->NormalizedOutputs(plan, span, phi, psi, v, lam, S_in, op_reads, eps, &o, &den,
                                  nullptr);
    };
    SMAT_ASSIGN_OR_RETURN(fwd_op, TimeOne(gpu, op, reps));
    double bytes = 0, flops = 0;
    for (const Phase& ph : fwd) {
      bytes += ph.bytes;
      flops += ph.flops;
    }
    const double floor_ms =
        1e3 * std::max(bytes / (ceil.copy_gbs * 1e9), flops / (ceil.bf16_tflops * 1e12));
    std::printf(
        "forward as the op issues it (the long-range phases on a side stream beside the "
        "causal states): %.3f ms, %.1f%% of the roofline (%.3f ms); one stream: %.3f ms\n\n",
        fwd_op, 100.0 * floor_ms / fwd_op, floor_ms, fwd_total);
  }
  if (walks) {
    std::vector<double> states_ms;
    double states_total = 0;
    SMAT_RETURN_IF_ERROR(TimeChain(gpu, states, warmup, reps, &states_ms, &states_total));
    PrintTable("states and outputs in 3 phases", states, states_ms, states_total, ceil);
  }
  {
    std::vector<double> three_ms;
    double three_total = 0;
    SMAT_RETURN_IF_ERROR(TimeChain(gpu, three, warmup, reps, &three_ms, &three_total));
    PrintTable("outputs in 3 phases", three, three_ms, three_total, ceil);
  }

  double bwd_total = 0;
  if (backward) {
    SMAT_ASSIGN_OR_RETURN(Tensor d_o,
                          buf.Random({B, T, H, dv}, cfg.do_dtype, cfg.seed + 4, -1.f, 1.f));
    SMAT_ASSIGN_OR_RETURN(Tensor gbar, buf.Zeros({B, T, H, p}));
    SMAT_ASSIGN_OR_RETURN(Tensor gden, buf.Zeros({B, T, H}));
    SMAT_ASSIGN_OR_RETURN(Tensor dlam_row, buf.Zeros({B, T, H}));
    SMAT_ASSIGN_OR_RETURN(Tensor phi_bar, buf.Zeros({B, T, H, r}));
    SMAT_ASSIGN_OR_RETURN(Tensor psi_bar, buf.Zeros({B, T, H, r}));
    SMAT_ASSIGN_OR_RETURN(Tensor v_bar, buf.Zeros({B, T, H, dv}));
    SMAT_ASSIGN_OR_RETURN(Tensor U_bar, buf.Zeros({B, H, Bt, r, p}));
    SMAT_ASSIGN_OR_RETURN(Tensor F_bar, buf.Zeros({B, H, P, r, p}));
    SMAT_ASSIGN_OR_RETURN(Tensor S_in_bar, buf.Zeros({B, Lc, H, r, p}));
    SMAT_ASSIGN_OR_RETURN(Tensor D_bar, buf.Zeros({B, Lc, H, r, p}));
    SMAT_ASSIGN_OR_RETURN(Tensor state_grad, buf.Zeros({B, 2, H, r, p}));
    SMAT_ASSIGN_OR_RETURN(Tensor logg_bar, buf.Zeros({B, T, H}));
    SMAT_ASSIGN_OR_RETURN(Tensor span_sum, buf.Zeros({B, H}));
    std::vector<Phase> bwd;
    // The order of SmatBackward (kernels/smat.cc): gbar, the state gradients,
    // their scan and the chunk tiles in one call where the backend has one
    // (ChunkBackward, writing gbar's column dv alone where the backend takes
    // the rest from d_o and den, else gbar), which runs the long-range branch
    // too, before its tiles (the branch writing, the tiles adding) or after
    // them (adding), else as the phases below and the branch after them.
    bool column_only = true;
    SmatLongRangeBackward branch;  // set below where there is a long-range part
    auto chunk_backward = [&](const SmatLongRangeBackward& lr) -> absl::StatusOr<bool> {
      return k->ChunkBackward(plan, span, d_o, o, den, eps, phi, psi, v, lam, cd, S_in,
                              column_only ? &gden : &gbar, cfg.gated ? &dlam_row : nullptr,
                              &phi_bar, &psi_bar, &v_bar, lr, nullptr);
    };
    SMAT_ASSIGN_OR_RETURN(bool fused_backward, chunk_backward(SmatLongRangeBackward()));
    if (!fused_backward) {
      column_only = false;
      SMAT_ASSIGN_OR_RETURN(fused_backward, chunk_backward(SmatLongRangeBackward()));
    }
    std::vector<Phase> four;
    four.push_back({"NormalizeBackwardStates",
                    N * (dv * (es_do + es) + 8 + p * 4 + 4 + r * es) + gate_bytes + NC * W * 4,
                    4 * N * dv + 2 * N * W, [&] {
                      return k->NormalizeBackwardStates(plan, span, d_o, o, den, eps, phi, lam,
                                                        &gbar, cfg.gated ? &dlam_row : nullptr,
                                                        &S_in_bar, nullptr);
                    }});
    // The same as two phases, timed for comparison, not part of the backward.
    std::vector<Phase> two;
    two.push_back({"NormalizeBackward", N * (dv * (es_do + es) + 8 + p * 4 + 4), 4 * N * dv, [&] {
                     return k->NormalizeBackward(d_o, o, den, eps, &gbar,
                                                 cfg.gated ? &dlam_row : nullptr, nullptr);
                   }});
    two.push_back(
        {"ChunkStateGradients", N * (r * es + p * 4) + gate_bytes + NC * W * 4, 2 * N * W,
         [&] { return k->ChunkStateGradients(plan, span, phi, gbar, lam, &S_in_bar, nullptr); }});
    four.push_back({"ChunkScanBackward", NC * W * 8, 2 * NC * W, [&] {
                      return k->ChunkScanBackward(plan, span, S_in_bar, cd, Tensor(), &D_bar,
                                                  &state_grad, nullptr);
                    }});
    const double b7_bytes =
        N * ((2 * r + dv) * es + p * 4 + (2 * r + dv) * 4) + gate_bytes + NC * W * 8;
    const double b7_flops = 2 * N * c * (r + p) + 6 * N * W;
    four.push_back({"ChunkOutputsBackward", b7_bytes, b7_flops, [&] {
                      return k->ChunkOutputsBackward(plan, span, phi, psi, v, lam, cd, S_in, gbar,
                                                     D_bar, &phi_bar, &psi_bar, &v_bar,
                                                     SmatWrite::kAssign, nullptr);
                    }});
    // Its bytes: the first pass's (gbar, D_bar's local part) and B7's; with
    // bf16 d_o, B7 reads d_o, den and gbar[:, dv] instead of gbar, and the
    // first pass writes gbar's column dv alone.
    const double b7_gbar = cfg.do_dtype == DType::kBF16 ? dv * es_do + 8 : p * 4;
    const double gbar_out = column_only ? 4 : p * 4;
    const Phase chunk_phase{"ChunkBackward",
                            N * (dv * (es_do + es) + 8 + gbar_out + 4 + r * es) + NC * W * 4 +
                                b7_bytes - N * p * 4 + N * b7_gbar,
                            4 * N * dv + 2 * N * W + b7_flops, [&]() -> absl::Status {
                              SMAT_ASSIGN_OR_RETURN(const bool ran,
                                                    chunk_backward(SmatLongRangeBackward()));
                              if (!ran) return absl::InternalError("ChunkBackward did not run");
                              return absl::OkStatus();
                            }};
    // The long-range branch, in the mode `lr_write` says. Its phases' bytes
    // leave out the read-back of the rows they add to (+=), counted below.
    SmatWrite lr_write = SmatWrite::kAdd;
    std::vector<Phase> lr;
    // The reads' gradients from gbar's factors (d_o, den and gbar's column
    // dv) where the backend takes them so, else, as SmatBackward does, from
    // the whole gbar formed first: asked once here, before the timing.
    auto reads_by_factors = [&]() -> absl::StatusOr<bool> {
      return k->TypeReadsBackwardFromFactors(plan, span, phi, U, d_o, den, gden, lam, cd, Tensor(),
                                             Tensor(), &phi_bar, &U_bar, lr_write, nullptr);
    };
    bool by_factors = false;
    if (long_range && fused_backward && column_only) {
      SMAT_ASSIGN_OR_RETURN(by_factors, reads_by_factors());
    }
    if (by_factors) {
      lr.push_back({"TypeReadsBackward", nr * (r * es + dv * es_do + 8 + r * 4) + BH * Bt * W * 8,
                    4 * nr * W, [&]() -> absl::Status {
                      SMAT_ASSIGN_OR_RETURN(const bool ran, reads_by_factors());
                      if (!ran)
                        return absl::InternalError("TypeReadsBackward by factors did not run");
                      return absl::OkStatus();
                    }});
    } else if (long_range) {
      if (column_only) lr.push_back(two.front());  // the whole gbar, as SmatBackward forms it
      lr.push_back(
          {"TypeReadsBackward", nr * (r * es + p * 4 + r * 4) + BH * Bt * W * 8, 4 * nr * W, [&] {
             return k->TypeReadsBackward(plan, span, phi, U, gbar, lam, cd, Tensor(), Tensor(),
                                         &phi_bar, &U_bar, lr_write, nullptr);
           }});
    }
    if (long_range) {
      if (tabulate) {
        lr.push_back({"TabulateBackward", BH * (P + Bt) * W * 4, BH * nnz * W,
                      [&] { return k->TabulateBackward(plan, U_bar, &F_bar, nullptr); }});
      }
      const Tensor* gathered = tabulate ? &F_bar : &U_bar;
      lr.push_back({"ProfilePoolingBackward", nd * ((r + dv) * es + (r + dv) * 4) + BH * P * W * 4,
                    4 * nd * W, [&, gathered] {
                      return k->ProfilePoolingBackward(plan, span, psi, v, lam, cd, Tensor(),
                                                       Tensor(), *gathered, &psi_bar, &v_bar,
                                                       lr_write, nullptr);
                    }});
      branch = [&](SmatWrite write) -> absl::Status {
        lr_write = write;
        for (const Phase& ph : lr) SMAT_RETURN_IF_ERROR(ph.run());
        return absl::OkStatus();
      };
    }
    // The read-back of the += rows (phi_bar's recent ones, psi_bar's and
    // v_bar's distant ones), counted once: by the branch, or by B7 where it
    // adds to what the branch wrote.
    const double lr_readback = nr * r * 4 + nd * (r + dv) * 4;
    double lr_bytes = lr_readback, lr_flops = 0;
    for (const Phase& ph : lr) {
      lr_bytes += ph.bytes;
      lr_flops += ph.flops;
    }
    // Where the branch adds after the phases: their read-back in their bytes.
    std::vector<Phase> lr_adding = lr;
    for (Phase& ph : lr_adding) {
      if (ph.name == "TypeReadsBackward") ph.bytes += nr * r * 4;
      if (ph.name == "ProfilePoolingBackward") ph.bytes += nd * (r + dv) * 4;
    }
    if (fused_backward && long_range) {
      bwd.push_back({"ChunkBackward+long-range", chunk_phase.bytes + lr_bytes,
                     chunk_phase.flops + lr_flops, [&]() -> absl::Status {
                       SMAT_ASSIGN_OR_RETURN(const bool ran, chunk_backward(branch));
                       if (!ran) return absl::InternalError("ChunkBackward did not run");
                       return absl::OkStatus();
                     }});
    } else {
      if (fused_backward) {
        bwd.push_back(chunk_phase);
      } else {
        bwd.insert(bwd.end(), four.begin(), four.end());
      }
      bwd.insert(bwd.end(), lr_adding.begin(), lr_adding.end());
    }
    if (cfg.gated) {
      bwd.push_back({"LogDecayBackward", N * (r * es + r * 4 + 12), 2 * N * r, [&] {
                       return k->LogDecayBackward(plan, span, psi, psi_bar, dlam_row, Tensor(),
                                                  &logg_bar, &span_sum, nullptr);
                     }});
    }
    std::vector<double> bwd_ms;
    SMAT_RETURN_IF_ERROR(TimeChain(gpu, bwd, warmup, reps, &bwd_ms, &bwd_total));
    PrintTable("backward", bwd, bwd_ms, bwd_total, ceil);
    if (fused_backward && long_range) {
      // For the shares: ChunkBackward alone, then the branch adding (+=), as
      // the op issued them before it ran the branch first; and the branch
      // alone, writing (=).
      std::vector<Phase> pieces = {chunk_phase};
      pieces.insert(pieces.end(), lr_adding.begin(), lr_adding.end());
      std::vector<double> pieces_ms;
      double pieces_total = 0;
      lr_write = SmatWrite::kAdd;
      SMAT_RETURN_IF_ERROR(TimeChain(gpu, pieces, warmup, reps, &pieces_ms, &pieces_total));
      PrintTable("backward, branch after", pieces, pieces_ms, pieces_total, ceil);
      std::vector<double> lr_ms;
      double lr_total = 0;
      lr_write = SmatWrite::kAssign;
      SMAT_RETURN_IF_ERROR(TimeChain(gpu, lr, warmup, reps, &lr_ms, &lr_total));
      PrintTable("long-range branch (=)", lr, lr_ms, lr_total, ceil);
    }
    std::vector<double> two_ms;
    double two_total = 0;
    SMAT_RETURN_IF_ERROR(TimeChain(gpu, two, warmup, reps, &two_ms, &two_total));
    PrintTable("state gradients in 2 phases", two, two_ms, two_total, ceil);
    if (fused_backward) {
      std::vector<double> four_ms;
      double four_total = 0;
      SMAT_RETURN_IF_ERROR(TimeChain(gpu, four, warmup, reps, &four_ms, &four_total));
      PrintTable("ChunkBackward as its phases", four, four_ms, four_total, ceil);
    }
  }
  // The peak of the phases above, before the op allocates its own tensors.
  const double peak_gib =
      static_cast<double>(gpu.allocator().stats().peak_bytes) / (1024.0 * 1024 * 1024);
  // The op itself (SmatForward, its tensors from the backend's caching
  // allocator): keeping what backward needs, and for inference
  // (SmatKeep::kNothing: where the chunks are walked, no chunk states are
  // written).
  double op_train = 0, op_infer = 0;
  {
    const SmatInputs in{.phi = phi,
                        .psi = psi,
                        .v = v,
                        .logg = logg,
                        .prof = Tensor(),
                        .type = Tensor(),
                        .eps = eps};
    SmatForwardOutputs f;
    SMAT_ASSIGN_OR_RETURN(op_train,
                          TimeOne(
                              gpu, [&] { return SmatForward(gpu, *k, plan, in, &f); }, reps));
    SMAT_ASSIGN_OR_RETURN(
        op_infer,
        TimeOne(
            gpu, [&] { return SmatForward(gpu, *k, plan, in, &f, nullptr, SmatKeep::kNothing); },
            reps));
    std::printf(
        "SmatForward: %.3f ms keeping what backward needs, %.3f ms for inference "
        "(SmatKeep::kNothing)\n\n",
        op_train, op_infer);
  }
  std::printf("SUMMARY d=%d %s %s T=%lld: forward %.3f ms", d, DTypeName(cfg.dtype),
              cfg.gated ? "gated" : "ungated", static_cast<long long>(T), fwd_op);
  if (backward)
    std::printf(", backward %.3f ms (d_o %s), forward+backward %.3f ms", bwd_total,
                DTypeName(cfg.do_dtype), fwd_op + bwd_total);
  std::printf("; SmatForward %.3f ms, for inference %.3f ms", op_train, op_infer);
  std::printf(
      "; device memory held by the benchmark's tensors %.2f GiB, peak through the "
      "backend's allocator %.2f GiB (the phases' own scratch comes from the CUDA "
      "stream-ordered pool and is not included)\n",
      buf.held() / (1024.0 * 1024 * 1024), peak_gib);
  return absl::OkStatus();
}

}  // namespace smat
