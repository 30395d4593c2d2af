// The CPU SMat phases and the composed op (kernels/smat.h) against the double
// references: outputs and every gradient under random upstream gradients, at
// odd sizes, gated and not, positional and content maps; intermediate states
// and tables against direct double sums; argument errors; determinism.
#include "kernels/cpu/smat_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/smat_reference.h"
#include "kernels/smat.h"
#include "tests/kernels/smat_test_util.h"

namespace smat {
namespace {

using testing_util::MaxAbs;
using testing_util::MaxRelError;
using testing_util::ProblemSpec;
using testing_util::RandomProblem;
using testing_util::RandomVector;
using testing_util::RoundToF32;
using testing_util::ToDouble;
using testing_util::ToF32;
using testing_util::ToI32;

// fp32 against double on the same (fp32-rounded) inputs. Every sum the kernels
// form has nonnegative weights (features and gates are >= 0), so ybar's
// relative error grows like sqrt(K) u for K summed terms, u = 2^-24 = 6e-8
// (worst case K u): measured against max|o| the outputs stay below 2.3e-7 for
// T <= 1031 (r = 60, c = 128 the worst); 2e-6 leaves room for other seeds.
// Gradients chain more products and subtract terms of both signs (v and d_o
// have random signs): measured below 1.6e-6 (the logg gradient, a suffix sum
// of T row-minus-column terms); 1e-5.
constexpr double kOutputTol = 2e-6;
constexpr double kGradTol = 1e-5;

struct OpRun {
  std::vector<double> o, d_phi, d_psi, d_v, d_logg;
};

SmatInputs MakeInputs(const SmatReferenceProblem& pr) {
  SmatInputs in;
  const Shape tok = {pr.batch, pr.T, pr.H};
  in.phi = ToF32(pr.phi, {pr.batch, pr.T, pr.H, pr.r});
  in.psi = ToF32(pr.psi, {pr.batch, pr.T, pr.H, pr.r});
  in.v = ToF32(pr.v, {pr.batch, pr.T, pr.H, pr.dv});
  if (pr.gated()) in.logg = ToF32(pr.logg, tok);
  if (!pr.prof.empty()) in.prof = ToI32(pr.prof, tok);
  if (!pr.type.empty()) in.type = ToI32(pr.type, tok);
  in.eps = static_cast<float>(pr.eps);
  return in;
}

// The CPU backend and phases with a forward run on pr's inputs, for the tests
// that drive single backward phases from it.
struct CpuForward {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<SmatKernels> k;
  SmatInputs in;
  SmatForwardOutputs fwd;
};

absl::StatusOr<CpuForward> RunCpuForward(const SmatPlan& plan, const SmatReferenceProblem& pr) {
  CpuForward run;
  SMAT_ASSIGN_OR_RETURN(run.backend, CreateBackend(Device::Cpu()));
  run.k = MakeCpuSmatKernels();
  run.in = MakeInputs(pr);
  SMAT_RETURN_IF_ERROR(SmatForward(*run.backend, *run.k, plan, run.in, &run.fwd));
  return run;
}

OpRun RunOp(const SmatPlan& plan, const SmatReferenceProblem& pr, const std::vector<double>& d_o) {
  auto backend = CreateBackend(Device::Cpu());
  SMAT_CHECK(backend.ok());
  std::unique_ptr<SmatKernels> kernels = MakeCpuSmatKernels();
  const SmatInputs in = MakeInputs(pr);
  SmatForwardOutputs fwd;
  absl::Status st = SmatForward(**backend, *kernels, plan, in, &fwd);
  EXPECT_TRUE(st.ok()) << st;
  SmatGradients grads;
  st = SmatBackward(**backend, *kernels, plan, in, fwd, ToF32(d_o, {pr.batch, pr.T, pr.H, pr.dv}),
                    &grads);
  EXPECT_TRUE(st.ok()) << st;
  OpRun run;
  if (!st.ok()) return run;
  run.o = ToDouble(fwd.o);
  run.d_phi = ToDouble(grads.phi);
  run.d_psi = ToDouble(grads.psi);
  run.d_v = ToDouble(grads.v);
  if (pr.gated()) run.d_logg = ToDouble(grads.logg);
  return run;
}

void CheckOpAgainstReference(const ProblemSpec& s) {
  SCOPED_TRACE(s.Name());
  auto plan = MakeSmatPlan(s.T, s.d, s.chunk);
  ASSERT_TRUE(plan.ok()) << plan.status();
  SmatReferenceProblem pr = RandomProblem(*plan, s);
  RoundToF32(&pr);
  std::vector<double> d_o = RandomVector(pr.batch * pr.T * pr.H * pr.dv, s.seed + 99);
  for (double& x : d_o) x = static_cast<float>(x);
  const SmatReferenceOutputs ref = SmatDenseReference(*plan, pr);
  const SmatReferenceGradients gref = SmatDenseReferenceBackward(*plan, pr, d_o);
  const OpRun run = RunOp(*plan, pr, d_o);
  ASSERT_FALSE(run.o.empty());
  ASSERT_GT(MaxAbs(ref.o), 0.0);
  EXPECT_LT(MaxRelError(run.o, ref.o), kOutputTol);
  EXPECT_LT(MaxRelError(run.d_phi, gref.phi), kGradTol);
  EXPECT_LT(MaxRelError(run.d_psi, gref.psi), kGradTol);
  EXPECT_LT(MaxRelError(run.d_v, gref.v), kGradTol);
  if (s.gated && s.T == 1) {
    // logg_0 shifts every Lambda alike: its gradient is 0 up to the fp32
    // rounding of row - psi . psi_bar (terms of size ~1).
    EXPECT_LT(MaxAbs(run.d_logg), 1e-6);
  } else if (s.gated) {
    ASSERT_GT(MaxAbs(gref.logg), 0.0);
    EXPECT_LT(MaxRelError(run.d_logg, gref.logg), kGradTol);
  }
  if (getenv("SMAT_TEST_VERBOSE") != nullptr) {
    printf("%-50s o %.2e phi %.2e psi %.2e v %.2e logg %.2e\n", s.Name().c_str(),
           MaxRelError(run.o, ref.o), MaxRelError(run.d_phi, gref.phi),
           MaxRelError(run.d_psi, gref.psi), MaxRelError(run.d_v, gref.v),
           s.gated && s.T > 1 ? MaxRelError(run.d_logg, gref.logg) : 0.0);
  }
}

TEST(SmatCpuTest, OpMatchesDenseReferenceSmall) {
  for (bool gated : {false, true}) {
    for (bool content : {false, true}) {
      // T = 1 with eps > 0: with eps = 0, o_0 = v_0 and the phi/psi gradients vanish.
      CheckOpAgainstReference({.T = 1, .d = 1, .chunk = 16, .gated = gated, .content = content,
                               .eps = 0.5});
      CheckOpAgainstReference({.T = 63, .d = 1, .chunk = 16, .gated = gated, .content = content,
                               .eps = 0.25});
      CheckOpAgainstReference({.T = 63, .d = 2, .chunk = 16, .gated = gated, .content = content});
      CheckOpAgainstReference({.batch = 2, .T = 127, .H = 2, .r = 60, .dv = 7, .d = 2,
                               .chunk = 32, .gated = gated, .content = content});
      CheckOpAgainstReference({.T = 127, .H = 1, .r = 60, .dv = 5, .d = 3, .chunk = 16,
                               .gated = gated, .content = content, .eps = 0.1});
    }
  }
}

TEST(SmatCpuTest, OpMatchesDenseReferenceLong) {
  for (bool gated : {false, true}) {
    CheckOpAgainstReference({.T = 1000, .H = 1, .r = 8, .dv = 4, .d = 2, .chunk = 64,
                             .gated = gated, .seed = 3});
    for (bool content : {false, true}) {
      CheckOpAgainstReference({.T = 1000, .H = 1, .r = 6, .dv = 3, .d = 4, .chunk = 32,
                               .gated = gated, .content = content, .seed = 4});
    }
    CheckOpAgainstReference({.T = 1031, .H = 1, .r = 60, .dv = 3, .d = 3, .chunk = 128,
                             .gated = gated, .seed = 5});
    CheckOpAgainstReference({.T = 1031, .H = 1, .r = 5, .dv = 2, .d = 1, .chunk = 16,
                             .gated = gated, .content = true, .seed = 6});
    // Positional d = 1 runs as one causal block (SmatOpPlan), with a partial
    // last chunk.
    CheckOpAgainstReference({.batch = 2,
                             .T = 1031,
                             .H = 2,
                             .r = 7,
                             .dv = 3,
                             .d = 1,
                             .chunk = 32,
                             .gated = gated,
                             .eps = 0.01,
                             .seed = 7});
  }
}

// d = 1 with positional maps: the op runs one causal block without the
// long-range branch (its saved U is the zero table no token reads); content
// maps and d >= 2 keep the plan and the branch (U holds the pooled tokens).
TEST(SmatCpuTest, PositionalD1RunsAsOneCausalBlock) {
  auto d1 = MakeSmatPlan(1031, 1, 32);
  ASSERT_TRUE(d1.ok());
  ASSERT_GT(d1->n, 0);
  const SmatPlan causal = SmatOpPlan(*d1, /*content_maps=*/false);
  EXPECT_EQ(causal.n, 0);
  EXPECT_EQ(causal.m, 1031);
  EXPECT_EQ(causal.num_distant_chunks, 0);
  EXPECT_EQ(causal.num_chunks, d1->num_chunks);
  EXPECT_FALSE(SmatHasLongRange(causal));
  EXPECT_EQ(SmatOpPlan(*d1, /*content_maps=*/true).n, d1->n);
  auto d2 = MakeSmatPlan(1031, 2, 32);
  ASSERT_TRUE(d2.ok());
  EXPECT_EQ(SmatOpPlan(*d2, false).n, d2->n);
  EXPECT_TRUE(SmatHasLongRange(SmatOpPlan(*d2, false)));

  for (bool content : {false, true}) {
    SCOPED_TRACE(content ? "content maps" : "positional maps");
    const ProblemSpec s{
        .T = 1031, .H = 2, .r = 5, .dv = 3, .d = 1, .chunk = 32, .gated = true, .content = content};
    const SmatReferenceProblem pr = RandomProblem(*d1, s);
    auto run = RunCpuForward(*d1, pr);
    ASSERT_TRUE(run.ok()) << run.status();
    const std::vector<double> U = ToDouble(run->fwd.saved.U);
    ASSERT_EQ(U.size(), static_cast<size_t>(2 * 1 * 5 * 4));  // [batch, H, B = 1, r, p]
    if (content) {
      EXPECT_GT(MaxAbs(U), 0.0);
    } else {
      EXPECT_EQ(MaxAbs(U), 0.0);
    }
  }
}

// Intermediate states against direct double sums (phase by phase): chunk
// incoming states S_in (eq. 10, Lemma 4), the profile table F (eq. 9, referred
// to Lambda_{n-1}) and U = C F.
TEST(SmatCpuTest, PhaseStatesMatchDirectSums) {
  for (bool gated : {false, true}) {
    const ProblemSpec s{.batch = 1, .T = 203, .H = 2, .r = 4, .dv = 3, .d = 2, .chunk = 16,
                        .gated = gated, .content = true, .seed = 11};
    SCOPED_TRACE(s.Name());
    auto plan = MakeSmatPlan(s.T, s.d, s.chunk);
    ASSERT_TRUE(plan.ok()) << plan.status();
    SmatReferenceProblem pr = RandomProblem(*plan, s);
    RoundToF32(&pr);
    auto backend = CreateBackend(Device::Cpu());
    ASSERT_TRUE(backend.ok());
    std::unique_ptr<SmatKernels> k = MakeCpuSmatKernels();
    SmatForwardOutputs fwd;
    ASSERT_TRUE(SmatForward(**backend, *k, *plan, MakeInputs(pr), &fwd).ok());
    const int64_t p = pr.p(), r = pr.r, c = plan->chunk, n = plan->n, Nc = plan->num_chunks;
    const SmatGeometry& g = plan->geo;
    std::vector<double> S_ref(pr.batch * Nc * pr.H * r * p, 0.0), F_ref(pr.H * g.P * r * p, 0.0);
    for (int64_t h = 0; h < pr.H; ++h) {
      std::vector<double> Lambda(pr.T);
      double acc = 0.0;
      for (int64_t t = 0; t < pr.T; ++t) {
        acc += gated ? pr.logg[t * pr.H + h] : 0.0;
        Lambda[t] = acc;
      }
      auto add_z = [&](double* M, int64_t s2, double w) {
        for (int64_t i = 0; i < r; ++i) {
          for (int64_t kk = 0; kk < p; ++kk) {
            const double vb = kk < pr.dv ? pr.v[(s2 * pr.H + h) * pr.dv + kk] : 1.0;
            M[i * p + kk] += w * pr.psi[(s2 * pr.H + h) * r + i] * vb;
          }
        }
      };
      for (int64_t kc = 0; kc < Nc; ++kc) {
        const int64_t start = kc * c, block_start = start < n ? 0 : n;
        for (int64_t s2 = block_start; s2 < start; ++s2) {
          add_z(&S_ref[(kc * pr.H + h) * r * p], s2, std::exp(Lambda[start - 1] - Lambda[s2]));
        }
      }
      for (int64_t s2 = 0; s2 < n; ++s2) {
        add_z(&F_ref[(h * g.P + pr.Profile(*plan, 0, h, s2)) * r * p], s2,
              std::exp(Lambda[n - 1] - Lambda[s2]));
      }
    }
    EXPECT_LT(MaxRelError(ToDouble(fwd.saved.S_in), S_ref), kGradTol);  // v has both signs
    std::vector<double> U_ref(pr.H * g.B * r * p, 0.0);
    for (int64_t h = 0; h < pr.H; ++h) {
      for (int64_t y = 0; y < g.B; ++y) {
        for (int64_t x = 0; x < g.P; ++x) {
          if (!g.Incident(y, x)) continue;
          for (int64_t w = 0; w < r * p; ++w) {
            U_ref[(h * g.B + y) * r * p + w] += F_ref[(h * g.P + x) * r * p + w];
          }
        }
      }
    }
    ASSERT_GT(MaxAbs(U_ref), 0.0);
    EXPECT_LT(MaxRelError(ToDouble(fwd.saved.U), U_ref), kGradTol);
  }
}

// Backward intermediates against direct double sums (eq. 18, 19): gbar from
// the division's Jacobian, U_bar = sum_{type(t) = h} gate_t phi_t gbar_t^T,
// F_bar = C^T U_bar, and S_in_bar[k] = sum_{t in chunk k} exp(Lambda_t -
// Lambda_{start(k)-1}) phi_t gbar_t^T.
TEST(SmatCpuTest, BackwardPhaseTablesMatchDirectSums) {
  for (bool content : {false, true}) {
    const ProblemSpec s{.T = 211, .H = 1, .r = 5, .dv = 3, .d = 2, .chunk = 16, .gated = true,
                        .content = content, .eps = 0.1, .seed = 13};
    SCOPED_TRACE(s.Name());
    auto plan = MakeSmatPlan(s.T, s.d, s.chunk);
    ASSERT_TRUE(plan.ok()) << plan.status();
    SmatReferenceProblem pr = RandomProblem(*plan, s);
    RoundToF32(&pr);
    const int64_t T = pr.T, r = pr.r, dv = pr.dv, p = pr.p(), n = plan->n, c = plan->chunk;
    const SmatGeometry& g = plan->geo;
    std::vector<double> d_o = RandomVector(T * dv, 17);
    for (double& x : d_o) x = static_cast<float>(x);
    const SmatReferenceOutputs ref = SmatDenseReference(*plan, pr);
    std::vector<double> gref(T * p), Lambda(T);
    double acc = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      acc += pr.logg[t];
      Lambda[t] = acc;
      const double den = ref.ybar[t * p + dv] + pr.eps;
      double dot = 0.0;
      for (int64_t k = 0; k < dv; ++k) {
        gref[t * p + k] = d_o[t * dv + k] / den;
        dot += d_o[t * dv + k] * ref.o[t * dv + k];
      }
      gref[t * p + dv] = -dot / den;
    }
    std::vector<double> Ub_ref(g.B * r * p, 0.0), Sb_ref(plan->num_chunks * r * p, 0.0);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t start = (t / c) * c;
      const double w_state = std::exp(Lambda[t] - (start > 0 ? Lambda[start - 1] : 0.0));
      const double w_read = n > 0 ? std::exp(Lambda[t] - Lambda[n - 1]) : 0.0;
      for (int64_t i = 0; i < r; ++i) {
        for (int64_t k = 0; k < p; ++k) {
          const double pg = pr.phi[t * r + i] * gref[t * p + k];
          Sb_ref[((t / c) * r + i) * p + k] += w_state * pg;
          if (t >= n) Ub_ref[(pr.Type(*plan, 0, 0, t) * r + i) * p + k] += w_read * pg;
        }
      }
    }
    std::vector<double> Fb_ref(g.P * r * p, 0.0);
    for (int64_t y = 0; y < g.B; ++y) {
      for (int64_t x = 0; x < g.P; ++x) {
        if (!g.Incident(y, x)) continue;
        for (int64_t w = 0; w < r * p; ++w) Fb_ref[x * r * p + w] += Ub_ref[y * r * p + w];
      }
    }

    absl::StatusOr<CpuForward> run = RunCpuForward(*plan, pr);
    ASSERT_TRUE(run.ok()) << run.status();
    SmatKernels* k = run->k.get();
    const SmatInputs& in = run->in;
    const SmatForwardOutputs& fwd = run->fwd;
    const SmatSpan span = SmatSpan::Whole(*plan);
    Tensor gbar = ToF32(std::vector<double>(T * p), {1, T, 1, p});
    Tensor row = ToF32(std::vector<double>(T), {1, T, 1});
    ASSERT_TRUE(k->NormalizeBackward(ToF32(d_o, {1, T, 1, dv}), fwd.o, fwd.saved.den, in.eps,
                                     &gbar, &row, nullptr).ok());
    EXPECT_LT(MaxRelError(ToDouble(gbar), gref), kGradTol);
    Tensor phi_bar = ToF32(std::vector<double>(T * r), {1, T, 1, r});
    Tensor U_bar = ToF32(std::vector<double>(g.B * r * p), {1, 1, g.B, r, p});
    ASSERT_TRUE(k->TypeReadsBackward(*plan, span, in.phi, fwd.saved.U, gbar, fwd.saved.lam,
                                     fwd.saved.chunk_decay, Tensor(), in.type, &phi_bar, &U_bar,
                                     SmatWrite::kAdd, nullptr)
                    .ok());
    ASSERT_GT(MaxAbs(Ub_ref), 0.0);
    EXPECT_LT(MaxRelError(ToDouble(U_bar), Ub_ref), kGradTol);
    Tensor F_bar = ToF32(std::vector<double>(g.P * r * p), {1, 1, g.P, r, p});
    ASSERT_TRUE(k->TabulateBackward(*plan, U_bar, &F_bar, nullptr).ok());
    EXPECT_LT(MaxRelError(ToDouble(F_bar), Fb_ref), kGradTol);
    Tensor S_in_bar = ToF32(std::vector<double>(plan->num_chunks * r * p),
                            {1, plan->num_chunks, 1, r, p});
    ASSERT_TRUE(k->ChunkStateGradients(*plan, span, in.phi, gbar, fwd.saved.lam, &S_in_bar,
                                       nullptr).ok());
    EXPECT_LT(MaxRelError(ToDouble(S_in_bar), Sb_ref), kGradTol);
  }
}

// B7 with SmatWrite::kAssign writes every gradient element of the span
// (from NaN-filled outputs) and equals kAdd from zeros, bit for bit; kAdd
// adds to what is there.
TEST(SmatCpuTest, ChunkOutputsBackwardWritesOrAdds) {
  const ProblemSpec s{.batch = 2, .T = 151, .H = 2, .r = 7, .dv = 5, .d = 2, .chunk = 32,
                      .gated = true, .seed = 21};
  auto plan = MakeSmatPlan(s.T, s.d, s.chunk);
  ASSERT_TRUE(plan.ok());
  SmatReferenceProblem pr = RandomProblem(*plan, s);
  RoundToF32(&pr);
  absl::StatusOr<CpuForward> fwd_run = RunCpuForward(*plan, pr);
  ASSERT_TRUE(fwd_run.ok()) << fwd_run.status();
  SmatKernels* k = fwd_run->k.get();
  const SmatInputs& in = fwd_run->in;
  const SmatForwardOutputs& fwd = fwd_run->fwd;
  const SmatSpan span = SmatSpan::Whole(*plan);
  const int64_t b = s.batch, T = s.T, H = s.H, r = s.r, dv = s.dv, p = dv + 1,
                Lc = plan->num_chunks;
  const Tensor gbar = ToF32(RandomVector(b * T * H * p, 22), {b, T, H, p});
  const Tensor D_bar = ToF32(RandomVector(b * Lc * H * r * p, 23), {b, Lc, H, r, p});
  auto run = [&](SmatWrite write, const std::vector<double>& start_r,
                 const std::vector<double>& start_v) {
    std::vector<Tensor> out = {ToF32(start_r, {b, T, H, r}), ToF32(start_r, {b, T, H, r}),
                               ToF32(start_v, {b, T, H, dv})};
    const absl::Status st =
        k->ChunkOutputsBackward(*plan, span, in.phi, in.psi, in.v, fwd.saved.lam,
                                fwd.saved.chunk_decay, fwd.saved.S_in, gbar, D_bar, &out[0],
                                &out[1], &out[2], write, nullptr);
    EXPECT_TRUE(st.ok()) << st;
    return std::vector<std::vector<double>>{ToDouble(out[0]), ToDouble(out[1]),
                                            ToDouble(out[2])};
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const auto set = run(SmatWrite::kAssign, std::vector<double>(b * T * H * r, nan),
                       std::vector<double>(b * T * H * dv, nan));
  const auto from_zero = run(SmatWrite::kAdd, std::vector<double>(b * T * H * r, 0.0),
                             std::vector<double>(b * T * H * dv, 0.0));
  const std::vector<double> xr = RandomVector(b * T * H * r, 24), xv = RandomVector(b * T * H * dv, 25);
  const auto added = run(SmatWrite::kAdd, xr, xv);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    const std::vector<double>& x = i < 2 ? xr : xv;
    ASSERT_GT(MaxAbs(set[i]), 0.0);
    for (double e : set[i]) ASSERT_TRUE(std::isfinite(e));
    EXPECT_EQ(set[i], from_zero[i]);
    std::vector<double> minus(x.size());
    for (size_t j = 0; j < x.size(); ++j) minus[j] = added[i][j] - static_cast<float>(x[j]);
    EXPECT_LT(MaxRelError(minus, set[i]), 1e-5);
  }
}

// The long-range branch's adjoints with SmatWrite::kAssign write their rows
// (TypeReadsBackward phi_bar's recent ones, ProfilePoolingBackward psi_bar's
// and v_bar's distant ones) from NaN-filled outputs, equal to kAdd from zeros
// bit for bit, and leave the others as they were; kAdd adds to what is there.
// Positional and content maps, gated and not.
TEST(SmatCpuTest, LongRangeBackwardWritesOrAdds) {
  for (const bool content : {false, true}) {
    SCOPED_TRACE(content ? "content maps" : "positional maps");
    const ProblemSpec s{.batch = 2,
                        .T = 163,
                        .H = 2,
                        .r = 7,
                        .dv = 5,
                        .d = 2,
                        .chunk = 16,
                        .gated = content,
                        .content = content,
                        .seed = 31};
    auto plan = MakeSmatPlan(s.T, s.d, s.chunk);
    ASSERT_TRUE(plan.ok());
    SmatReferenceProblem pr = RandomProblem(*plan, s);
    RoundToF32(&pr);
    absl::StatusOr<CpuForward> fwd_run = RunCpuForward(*plan, pr);
    ASSERT_TRUE(fwd_run.ok()) << fwd_run.status();
    SmatKernels* k = fwd_run->k.get();
    const SmatInputs& in = fwd_run->in;
    const SmatSaved& sv = fwd_run->fwd.saved;
    const SmatSpan span = SmatSpan::Whole(*plan);
    const int64_t b = s.batch, T = s.T, H = s.H, r = s.r, dv = s.dv, p = dv + 1, n = plan->n;
    ASSERT_GT(n, 0);
    ASSERT_LT(n, T);
    const Tensor gbar = ToF32(RandomVector(b * T * H * p, 32), {b, T, H, p});
    const Tensor F_bar =
        ToF32(RandomVector(b * H * plan->geo.P * r * p, 33), {b, H, plan->geo.P, r, p});
    // Each phase from `start` (one vector per output), its outputs back.
    auto reads = [&](SmatWrite write, const std::vector<std::vector<double>>& start) {
      Tensor phi_bar = ToF32(start[0], {b, T, H, r});
      Tensor U_bar =
          ToF32(std::vector<double>(b * H * plan->geo.B * r * p), {b, H, plan->geo.B, r, p});
      const absl::Status st =
          k->TypeReadsBackward(*plan, span, in.phi, sv.U, gbar, sv.lam, sv.chunk_decay, Tensor(),
                               in.type, &phi_bar, &U_bar, write, nullptr);
      EXPECT_TRUE(st.ok()) << st;
      return std::vector<std::vector<double>>{ToDouble(phi_bar)};
    };
    auto pooling = [&](SmatWrite write, const std::vector<std::vector<double>>& start) {
      Tensor psi_bar = ToF32(start[0], {b, T, H, r});
      Tensor v_bar = ToF32(start[1], {b, T, H, dv});
      const absl::Status st =
          k->ProfilePoolingBackward(*plan, span, in.psi, in.v, sv.lam, sv.chunk_decay, Tensor(),
                                    in.prof, F_bar, &psi_bar, &v_bar, write, nullptr);
      EXPECT_TRUE(st.ok()) << st;
      return std::vector<std::vector<double>>{ToDouble(psi_bar), ToDouble(v_bar)};
    };
    using Phase = std::function<std::vector<std::vector<double>>(
        SmatWrite, const std::vector<std::vector<double>>&)>;
    const double nan = std::numeric_limits<double>::quiet_NaN();
    auto check = [&](const char* name, const Phase& phase, std::vector<int64_t> widths,
                     bool recent) {
      SCOPED_TRACE(name);
      std::vector<std::vector<double>> nans, zeros, xs;
      for (size_t i = 0; i < widths.size(); ++i) {
        nans.emplace_back(b * T * H * widths[i], nan);
        zeros.emplace_back(b * T * H * widths[i], 0.0);
        xs.push_back(RandomVector(b * T * H * widths[i], 40 + static_cast<int>(i)));
      }
      const auto set = phase(SmatWrite::kAssign, nans);
      const auto from_zero = phase(SmatWrite::kAdd, zeros);
      const auto added = phase(SmatWrite::kAdd, xs);
      for (size_t i = 0; i < widths.size(); ++i) {
        const int64_t w = widths[i];
        double written_max = 0;
        for (int64_t e = 0; e < b * T * H * w; ++e) {
          const int64_t t = (e / (H * w)) % T;
          const bool mine = recent ? t >= n : t < n;
          if (!mine) {
            ASSERT_TRUE(std::isnan(set[i][e])) << "row " << t << " outside the phase was written";
            ASSERT_EQ(added[i][e], static_cast<float>(xs[i][e])) << "row " << t;
            continue;
          }
          ASSERT_TRUE(std::isfinite(set[i][e])) << "row " << t << " was not written";
          ASSERT_EQ(set[i][e], from_zero[i][e]) << "row " << t;
          const double sum = static_cast<double>(static_cast<float>(xs[i][e])) + set[i][e];
          ASSERT_NEAR(added[i][e], sum, 1e-6 * (1.0 + std::abs(sum))) << "row " << t;
          written_max = std::max(written_max, std::abs(set[i][e]));
        }
        EXPECT_GT(written_max, 0.0);
      }
    };
    check("TypeReadsBackward", reads, {r}, /*recent=*/true);
    check("ProfilePoolingBackward", pooling, {r, dv}, /*recent=*/false);
  }
}

TEST(SmatCpuTest, RepeatedRunsAreBitwiseEqual) {
  const ProblemSpec s{.batch = 2, .T = 301, .H = 2, .r = 9, .dv = 4, .d = 2, .chunk = 32,
                      .gated = true, .content = true};
  auto plan = MakeSmatPlan(s.T, s.d, s.chunk);
  ASSERT_TRUE(plan.ok());
  const SmatReferenceProblem pr = RandomProblem(*plan, s);
  const std::vector<double> d_o = RandomVector(pr.batch * pr.T * pr.H * pr.dv, 5);
  const OpRun a = RunOp(*plan, pr, d_o), b = RunOp(*plan, pr, d_o);
  ASSERT_GT(MaxAbs(a.o), 0.0);
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(a.d_phi, b.d_phi);
  EXPECT_EQ(a.d_psi, b.d_psi);
  EXPECT_EQ(a.d_v, b.d_v);
  EXPECT_EQ(a.d_logg, b.d_logg);
}

// Backend::smat() of the CPU backend serves these phases: the op through the
// backend equals the op with explicit kernels, bit for bit.
TEST(SmatCpuTest, CpuBackendServesTheCpuPhases) {
  const ProblemSpec s{.T = 200, .H = 2, .r = 7, .dv = 3, .d = 2, .chunk = 16, .gated = true};
  auto plan = MakeSmatPlan(s.T, s.d, s.chunk);
  ASSERT_TRUE(plan.ok());
  const SmatReferenceProblem pr = RandomProblem(*plan, s);
  auto backend = CreateBackend(Device::Cpu());
  ASSERT_TRUE(backend.ok());
  auto hooked = (*backend)->smat();
  ASSERT_TRUE(hooked.ok()) << hooked.status();
  const SmatInputs in = MakeInputs(pr);
  SmatForwardOutputs via_backend;
  ASSERT_TRUE(SmatForward(**backend, *plan, in, &via_backend).ok());
  const Tensor d_o = ToF32(RandomVector(pr.batch * pr.T * pr.H * pr.dv, 8),
                           {pr.batch, pr.T, pr.H, pr.dv});
  SmatGradients grads;
  ASSERT_TRUE(SmatBackward(**backend, *plan, in, via_backend, d_o, &grads).ok());
  const std::vector<double> d_o_host = ToDouble(d_o);
  const OpRun direct = RunOp(*plan, pr, d_o_host);
  ASSERT_GT(MaxAbs(direct.o), 0.0);
  EXPECT_EQ(ToDouble(via_backend.o), direct.o);
  EXPECT_EQ(ToDouble(grads.logg), direct.d_logg);
}

// SmatKeep::kNothing (inference): the same o bits, nothing kept, and a
// backward from it fails saying why. Positional d = 2 (the long-range
// branch) and gated d = 3 with content maps (tabulation, lam, chunk decays).
TEST(SmatCpuTest, ForwardWithoutBackwardKeepsNothingAndGivesTheSameOutputs) {
  const ProblemSpec specs[] = {{.T = 300, .H = 2, .r = 7, .dv = 5, .d = 2, .chunk = 16},
                               {.batch = 2,
                                .T = 250,
                                .H = 3,
                                .r = 6,
                                .dv = 4,
                                .d = 3,
                                .chunk = 32,
                                .gated = true,
                                .content = true}};
  auto backend = CreateBackend(Device::Cpu());
  ASSERT_TRUE(backend.ok());
  for (const ProblemSpec& s : specs) {
    auto plan = MakeSmatPlan(s.T, s.d, s.chunk);
    ASSERT_TRUE(plan.ok());
    const SmatReferenceProblem pr = RandomProblem(*plan, s);
    const SmatInputs in = MakeInputs(pr);
    SmatForwardOutputs train, infer;
    ASSERT_TRUE(SmatForward(**backend, *plan, in, &train).ok());
    ASSERT_TRUE(SmatForward(**backend, *plan, in, &infer, nullptr, SmatKeep::kNothing).ok());
    ASSERT_TRUE(train.saved.S_in.defined() && train.saved.U.defined());
    const std::vector<double> o = ToDouble(infer.o);
    ASSERT_GT(MaxAbs(o), 0.0) << s.Name();
    EXPECT_EQ(o, ToDouble(train.o)) << s.Name();
    EXPECT_FALSE(infer.saved.S_in.defined() || infer.saved.U.defined() ||
                 infer.saved.den.defined() || infer.saved.lam.defined() ||
                 infer.saved.chunk_decay.defined())
        << s.Name();
    const Tensor d_o =
        ToF32(RandomVector(pr.batch * pr.T * pr.H * pr.dv, 9), {pr.batch, pr.T, pr.H, pr.dv});
    SmatGradients grads;
    const absl::Status st = SmatBackward(**backend, *plan, in, infer, d_o, &grads);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find("SmatKeep::kNothing"), std::string::npos) << st;
  }
}

TEST(SmatCpuTest, RejectsBadSpansShapesAndIds) {
  auto plan = MakeSmatPlan(100, 2, 16);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(ValidateSmatSpan(*plan, {0, 100}).code(), absl::StatusCode::kOk);
  EXPECT_EQ(ValidateSmatSpan(*plan, {16, 48}).code(), absl::StatusCode::kOk);
  EXPECT_EQ(ValidateSmatSpan(*plan, {8, 48}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSmatSpan(*plan, {16, 40}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSmatSpan(*plan, {32, 32}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateSmatSpan(*plan, {0, 101}).code(), absl::StatusCode::kInvalidArgument);

  const ProblemSpec s{.T = 100, .d = 2, .chunk = 16, .content = true};
  SmatReferenceProblem pr = RandomProblem(*plan, s);
  auto backend = CreateBackend(Device::Cpu());
  ASSERT_TRUE(backend.ok());
  std::unique_ptr<SmatKernels> k = MakeCpuSmatKernels();
  SmatForwardOutputs fwd;
  // A profile id outside [0, P) at a distant token.
  pr.prof[3 * pr.H] = static_cast<int32_t>(plan->geo.P);
  absl::Status st = SmatForward(**backend, *k, *plan, MakeInputs(pr), &fwd);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  pr.prof[3 * pr.H] = 0;
  // A type id outside [0, B) at a recent token.
  pr.type[(pr.T - 1) * pr.H] = -1;
  st = SmatForward(**backend, *k, *plan, MakeInputs(pr), &fwd);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  pr.type[(pr.T - 1) * pr.H] = 0;
  EXPECT_TRUE(SmatForward(**backend, *k, *plan, MakeInputs(pr), &fwd).ok());
  // Shapes: v with the wrong T.
  SmatInputs bad = MakeInputs(pr);
  bad.v = ToF32(std::vector<double>(pr.batch * (pr.T - 1) * pr.H * pr.dv, 0.5),
                {pr.batch, pr.T - 1, pr.H, pr.dv});
  st = SmatForward(**backend, *k, *plan, bad, &fwd);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  // A phase output of the wrong shape.
  Tensor lam = ToF32(std::vector<double>(pr.T * pr.H), {1, pr.T, pr.H});
  Tensor cd = ToF32(std::vector<double>(3 * pr.H), {1, 3, pr.H});  // needs 7 chunks
  Tensor logg = ToF32(std::vector<double>(pr.T * pr.H, -0.1), {1, pr.T, pr.H});
  st = k->ChunkLogDecay(*plan, SmatSpan::Whole(*plan), logg, &lam, &cd, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  // A positive log-gate (a "decay" above 1) is rejected.
  cd = ToF32(std::vector<double>(7 * pr.H), {1, 7, pr.H});
  ASSERT_TRUE(k->ChunkLogDecay(*plan, SmatSpan::Whole(*plan), logg, &lam, &cd, nullptr).ok());
  logg.data<float>()[5] = 0.01f;
  st = k->ChunkLogDecay(*plan, SmatSpan::Whole(*plan), logg, &lam, &cd, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
}

}  // namespace
}  // namespace smat
