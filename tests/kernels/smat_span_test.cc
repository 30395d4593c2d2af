// Span semantics of kernels/smat_kernels.h: the sequence split into 2-3
// chunk-aligned spans (one straddling n), each span run through the phases on
// its own, the cross-span quantities folded by hand exactly as a
// sequence-parallel composer does (SPANS (i)-(iv) and the backward folds),
// must equal the single-span op: outputs and every gradient.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/smat_cpu.h"
#include "kernels/smat.h"
#include "tests/kernels/smat_test_util.h"

namespace smat {
namespace {

using testing_util::MaxAbs;
using testing_util::MaxRelError;
using testing_util::ProblemSpec;
using testing_util::RandomProblem;
using testing_util::RandomVector;
using testing_util::ToDouble;
using testing_util::ToF32;
using testing_util::ToI32;

// Both sides are the same fp32 kernels; only the grouping of the sums across
// span boundaries differs (a few extra roundings per state and table entry),
// so ARCHITECTURE.md's 1e-5 relative (P ranks vs 1 rank) applies.
constexpr double kSpanTol = 1e-5;

Tensor F32(Shape shape) {
  auto t = Tensor::Empty(shape, DType::kF32);
  SMAT_CHECK(t.ok());
  // Poison: every element a phase is meant to write must be written.
  std::fill(t->data<float>(), t->data<float>() + t->numel(), std::nanf(""));
  return *t;
}
Tensor ZerosF32(Shape shape) {
  auto t = Tensor::Zeros(shape, DType::kF32);
  SMAT_CHECK(t.ok());
  return *t;
}
bool AllFinite(const Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (!std::isfinite(t.data<float>()[i])) return false;
  }
  return true;
}

// Tokens [t0, t1) of a host tensor [batch, T, ...] as a new tensor.
Tensor Slice(const Tensor& full, const SmatSpan& sp) {
  if (!full.defined()) return Tensor();
  Shape shape = full.shape();
  const int64_t T = shape[1];
  int64_t row = DTypeSize(full.dtype());
  for (int i = 2; i < full.rank(); ++i) row *= shape[i];
  shape[1] = sp.length();
  auto out = Tensor::Empty(shape, full.dtype());
  SMAT_CHECK(out.ok());
  for (int64_t b = 0; b < shape[0]; ++b) {
    std::memcpy(static_cast<char*>(out->raw()) + b * sp.length() * row,
                static_cast<const char*>(full.raw()) + (b * T + sp.t0) * row,
                sp.length() * row);
  }
  return *out;
}
// Writes a span tensor back into its place in a full [batch, T, ...] vector.
void Place(const Tensor& part, const SmatSpan& sp, int64_t T, std::vector<double>* full) {
  const int64_t batch = part.dim(0), L = part.dim(1), row = part.numel() / (batch * L);
  full->resize(batch * T * row);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < L * row; ++i) {
      (*full)[(b * T + sp.t0) * row + i] = part.data<float>()[b * L * row + i];
    }
  }
}

struct SpanState {  // one rank's tensors
  SmatSpan span;
  SmatInputs in;
  Tensor lam, cd, D, S_in, state, decay, F, ybar, o, den;
  Tensor recent_offset, tail;
};

void CheckSpansEqualWhole(const ProblemSpec& s, const std::vector<int64_t>& cuts) {
  SCOPED_TRACE(s.Name());
  auto plan_or = MakeSmatPlan(s.T, s.d, s.chunk);
  ASSERT_TRUE(plan_or.ok()) << plan_or.status();
  const SmatPlan& plan = *plan_or;
  const SmatReferenceProblem pr = RandomProblem(plan, s);
  const int64_t batch = pr.batch, T = pr.T, H = pr.H, r = pr.r, dv = pr.dv, p = pr.p();
  const int64_t P = plan.geo.P, B = plan.geo.B, W = r * p;
  SmatInputs whole;
  whole.phi = ToF32(pr.phi, {batch, T, H, r});
  whole.psi = ToF32(pr.psi, {batch, T, H, r});
  whole.v = ToF32(pr.v, {batch, T, H, dv});
  if (s.gated) whole.logg = ToF32(pr.logg, {batch, T, H});
  if (s.content) {
    whole.prof = ToI32(pr.prof, {batch, T, H});
    whole.type = ToI32(pr.type, {batch, T, H});
  }
  whole.eps = static_cast<float>(pr.eps);
  const Tensor d_o = ToF32(RandomVector(batch * T * H * dv, s.seed + 5), {batch, T, H, dv});

  // The single-span op.
  auto backend = CreateBackend(Device::Cpu());
  ASSERT_TRUE(backend.ok());
  std::unique_ptr<SmatKernels> kp = MakeCpuSmatKernels();
  SmatKernels& k = *kp;
  SmatForwardOutputs fwd;
  ASSERT_TRUE(SmatForward(**backend, k, plan, whole, &fwd).ok());
  SmatGradients grads;
  ASSERT_TRUE(SmatBackward(**backend, k, plan, whole, fwd, d_o, &grads).ok());

  // The spans.
  std::vector<SpanState> R;
  int64_t t0 = 0;
  for (size_t i = 0; i <= cuts.size(); ++i) {
    SpanState st;
    st.span = {t0, i < cuts.size() ? cuts[i] : T};
    t0 = st.span.t1;
    ASSERT_TRUE(ValidateSmatSpan(plan, st.span).ok());
    st.in.phi = Slice(whole.phi, st.span);
    st.in.psi = Slice(whole.psi, st.span);
    st.in.v = Slice(whole.v, st.span);
    st.in.logg = Slice(whole.logg, st.span);
    st.in.prof = Slice(whole.prof, st.span);
    st.in.type = Slice(whole.type, st.span);
    R.push_back(st);
  }
  bool straddles = false, cut_at_n = false;
  for (const SpanState& st : R) {
    straddles |= st.span.t0 < plan.n && st.span.t1 > plan.n;
    cut_at_n |= st.span.t0 == plan.n;
  }
  EXPECT_TRUE(straddles || cut_at_n) << "the split should straddle or cut at n = " << plan.n;

  // Forward, local: gates, summaries, span totals (SPANS (i)).
  for (SpanState& st : R) {
    const int64_t L = st.span.length(), Lc = st.span.num_chunks(plan);
    if (s.gated) {
      st.lam = F32({batch, L, H});
      st.cd = F32({batch, Lc, H});
      ASSERT_TRUE(k.ChunkLogDecay(plan, st.span, st.in.logg, &st.lam, &st.cd, nullptr).ok());
    }
    st.D = F32({batch, Lc, H, r, p});
    ASSERT_TRUE(k.ChunkSummaries(plan, st.span, st.in.psi, st.in.v, st.lam, st.cd, &st.D,
                                 nullptr).ok());
    st.state = F32({batch, 2, H, r, p});
    st.decay = F32({batch, 2, H});
    ASSERT_TRUE(k.ChunkScan(plan, st.span, st.D, st.cd, Tensor(), nullptr, &st.state, &st.decay,
                            nullptr).ok());
    ASSERT_TRUE(AllFinite(st.state) && AllFinite(st.decay));
  }
  // Fold: incoming states (exclusive affine scan over ranks, rank order),
  // recent offsets (ii, iv) and distant tail decays (iii).
  const int64_t nbh = batch * H;
  Tensor F = ZerosF32({batch, H, P, r, p});
  for (size_t i = 0; i < R.size(); ++i) {
    Tensor incoming = ZerosF32({batch, 2, H, r, p});
    R[i].recent_offset = ZerosF32({batch, H});
    R[i].tail = ZerosF32({batch, H});
    for (int64_t b = 0; b < batch; ++b) {
      for (int blk : {kDistantBlock, kRecentBlock}) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t row = (b * 2 + blk) * H + h;
          float* X = incoming.data<float>() + row * W;
          for (size_t j = 0; j < i; ++j) {
            const float a = std::exp(R[j].decay.data<float>()[row]);
            const float* Sj = R[j].state.data<float>() + row * W;
            for (int64_t w = 0; w < W; ++w) X[w] = a * X[w] + Sj[w];
            if (blk == kRecentBlock) {
              R[i].recent_offset.data<float>()[b * H + h] += R[j].decay.data<float>()[row];
            }
          }
          if (blk == kDistantBlock) {
            for (size_t j = i + 1; j < R.size(); ++j) {
              R[i].tail.data<float>()[b * H + h] += R[j].decay.data<float>()[row];
            }
          }
        }
      }
    }
    SpanState& st = R[i];
    const int64_t Lc = st.span.num_chunks(plan);
    st.S_in = F32({batch, Lc, H, r, p});
    Tensor state2 = F32({batch, 2, H, r, p}), decay2 = F32({batch, 2, H});
    ASSERT_TRUE(k.ChunkScan(plan, st.span, st.D, st.cd, incoming, &st.S_in, &state2, &decay2,
                            nullptr).ok());
    ASSERT_TRUE(AllFinite(st.S_in));
    // Partial profile table, rescaled to Lambda_{n-1} and summed (all-reduce).
    st.F = F32({batch, H, P, r, p});
    ASSERT_TRUE(k.ProfilePooling(plan, st.span, st.in.psi, st.in.v, st.lam, st.cd, st.in.prof,
                                 &st.F, nullptr).ok());
    ASSERT_TRUE(AllFinite(st.F));
    for (int64_t bh = 0; bh < nbh; ++bh) {
      const float a = std::exp(st.tail.data<float>()[bh]);
      for (int64_t w = 0; w < P * W; ++w) {
        F.data<float>()[bh * P * W + w] += a * st.F.data<float>()[bh * P * W + w];
      }
    }
  }
  Tensor U = F32({batch, H, B, r, p});
  ASSERT_TRUE(k.Tabulate(plan, F, &U, nullptr).ok());
  std::vector<double> o_spans;
  for (SpanState& st : R) {
    const int64_t L = st.span.length();
    st.ybar = F32({batch, L, H, p});
    ASSERT_TRUE(k.ChunkOutputs(plan, st.span, st.in.phi, st.in.psi, st.in.v, st.lam, st.S_in,
                               &st.ybar, nullptr).ok());
    ASSERT_TRUE(k.TypeReads(plan, st.span, st.in.phi, U, st.lam, st.cd,
                            s.gated ? st.recent_offset : Tensor(), st.in.type, &st.ybar,
                            SmatWrite::kAdd, nullptr)
                    .ok());
    st.o = F32({batch, L, H, dv});
    st.den = F32({batch, L, H});
    ASSERT_TRUE(k.Normalize(st.ybar, whole.eps, &st.o, &st.den, nullptr).ok());
    ASSERT_TRUE(AllFinite(st.o));
    // The fused outputs equal the three phases. The reads start as NaN: their
    // recent rows must be written and their distant rows never read.
    Tensor reads = F32({batch, L, H, p});
    std::fill(reads.data<float>(), reads.data<float>() + reads.numel(), std::nanf(""));
    ASSERT_TRUE(k.TypeReads(plan, st.span, st.in.phi, U, st.lam, st.cd,
                            s.gated ? st.recent_offset : Tensor(), st.in.type, &reads,
                            SmatWrite::kAssign, nullptr)
                    .ok());
    Tensor o2 = F32({batch, L, H, dv}), den2 = F32({batch, L, H});
    ASSERT_TRUE(k.NormalizedOutputs(plan, st.span, st.in.phi, st.in.psi, st.in.v, st.lam, st.S_in,
                                    reads, whole.eps, &o2, &den2, nullptr)
                    .ok());
    for (int64_t e = 0; e < o2.numel(); ++e) {
      ASSERT_EQ(o2.data<float>()[e], st.o.data<float>()[e]) << "o element " << e;
    }
    for (int64_t e = 0; e < den2.numel(); ++e) {
      ASSERT_EQ(den2.data<float>()[e], st.den.data<float>()[e]) << "den element " << e;
    }
    Place(st.o, st.span, T, &o_spans);
  }
  const std::vector<double> o_whole = ToDouble(fwd.o);
  ASSERT_GT(MaxAbs(o_whole), 0.0);
  EXPECT_LT(MaxRelError(o_spans, o_whole), kSpanTol);

  // Backward, local: Jacobian of the division, the span's part of U_bar.
  Tensor U_bar = ZerosF32({batch, H, B, r, p});
  std::vector<Tensor> gbar(R.size()), row(R.size()), phib(R.size()), psib(R.size()),
      vb(R.size()), Sbar(R.size()), G(R.size()), gdecay(R.size());
  for (size_t i = 0; i < R.size(); ++i) {
    SpanState& st = R[i];
    const int64_t L = st.span.length(), Lc = st.span.num_chunks(plan);
    gbar[i] = F32({batch, L, H, p});
    row[i] = F32({batch, L, H});
    ASSERT_TRUE(k.NormalizeBackward(Slice(d_o, st.span), st.o, st.den, whole.eps, &gbar[i],
                                    &row[i], nullptr).ok());
    phib[i] = ZerosF32({batch, L, H, r});
    psib[i] = ZerosF32({batch, L, H, r});
    vb[i] = ZerosF32({batch, L, H, dv});
    Tensor Ub = F32({batch, H, B, r, p});
    ASSERT_TRUE(k.TypeReadsBackward(plan, st.span, st.in.phi, U, gbar[i], st.lam, st.cd,
                                    s.gated ? st.recent_offset : Tensor(), st.in.type, &phib[i],
                                    &Ub, SmatWrite::kAdd, nullptr)
                    .ok());
    ASSERT_TRUE(AllFinite(Ub));
    for (int64_t w = 0; w < Ub.numel(); ++w) U_bar.data<float>()[w] += Ub.data<float>()[w];
    Sbar[i] = F32({batch, Lc, H, r, p});
    ASSERT_TRUE(k.ChunkStateGradients(plan, st.span, st.in.phi, gbar[i], st.lam, &Sbar[i],
                                      nullptr).ok());
    // B1 + B5 in one pass: the same values as the two phases, from NaN.
    {
      Tensor g2 = F32({batch, L, H, p}), row2 = F32({batch, L, H}), S2 = F32({batch, Lc, H, r, p});
      ASSERT_TRUE(k.NormalizeBackwardStates(plan, st.span, Slice(d_o, st.span), st.o, st.den,
                                            whole.eps, st.in.phi, st.lam, &g2, &row2, &S2, nullptr)
                      .ok());
      for (const auto& [name, x, y] :
           {std::tuple{"gbar", &g2, &gbar[i]}, std::tuple{"dlam_row", &row2, &row[i]},
            std::tuple{"S_in_bar", &S2, &Sbar[i]}}) {
        if (std::strcmp(name, "dlam_row") != 0) {
          ASSERT_GT(MaxAbs(ToDouble(*y)), 0.0) << name;
        }
        for (int64_t e = 0; e < x->numel(); ++e) {
          ASSERT_EQ(x->data<float>()[e], y->data<float>()[e]) << name << " element " << e;
        }
      }
    }
    Tensor Dbar = F32({batch, Lc, H, r, p});
    G[i] = F32({batch, 2, H, r, p});
    ASSERT_TRUE(k.ChunkScanBackward(plan, st.span, Sbar[i], st.cd, Tensor(), &Dbar, &G[i],
                                    nullptr).ok());
    ASSERT_TRUE(AllFinite(G[i]));
  }
  Tensor F_bar = F32({batch, H, P, r, p});
  ASSERT_TRUE(k.TabulateBackward(plan, U_bar, &F_bar, nullptr).ok());
  // Fold: incoming state gradients from the later ranks, last first.
  std::vector<Tensor> span_sum(R.size());
  for (size_t i = 0; i < R.size(); ++i) {
    SpanState& st = R[i];
    const int64_t Lc = st.span.num_chunks(plan);
    Tensor incoming_grad = ZerosF32({batch, 2, H, r, p});
    for (int64_t q = 0; q < batch * 2 * H; ++q) {
      float* Y = incoming_grad.data<float>() + q * W;
      for (size_t j = R.size() - 1; j > i; --j) {
        const float a = std::exp(R[j].decay.data<float>()[q]);
        const float* Gj = G[j].data<float>() + q * W;
        for (int64_t w = 0; w < W; ++w) Y[w] = Gj[w] + a * Y[w];
      }
    }
    Tensor Dbar = F32({batch, Lc, H, r, p}), G2 = F32({batch, 2, H, r, p});
    ASSERT_TRUE(k.ChunkScanBackward(plan, st.span, Sbar[i], st.cd, incoming_grad, &Dbar, &G2,
                                    nullptr).ok());
    ASSERT_TRUE(AllFinite(Dbar));
    ASSERT_TRUE(k.ChunkOutputsBackward(plan, st.span, st.in.phi, st.in.psi, st.in.v, st.lam, st.cd,
                                       st.S_in, gbar[i], Dbar, &phib[i], &psib[i], &vb[i],
                                       SmatWrite::kAdd, nullptr)
                    .ok());
    ASSERT_TRUE(k.ProfilePoolingBackward(plan, st.span, st.in.psi, st.in.v, st.lam, st.cd,
                                         s.gated ? st.tail : Tensor(), st.in.prof, F_bar, &psib[i],
                                         &vb[i], SmatWrite::kAdd, nullptr)
                    .ok());
  }
  std::vector<double> dphi, dpsi, dv_spans, dlogg;
  for (size_t i = 0; i < R.size(); ++i) {
    Place(phib[i], R[i].span, T, &dphi);
    Place(psib[i], R[i].span, T, &dpsi);
    Place(vb[i], R[i].span, T, &dv_spans);
  }
  EXPECT_LT(MaxRelError(dphi, ToDouble(grads.phi)), kSpanTol);
  EXPECT_LT(MaxRelError(dpsi, ToDouble(grads.psi)), kSpanTol);
  EXPECT_LT(MaxRelError(dv_spans, ToDouble(grads.v)), kSpanTol);
  if (!s.gated) return;
  // Gate gradients: span sums of dL/dLambda, then the suffix over later ranks.
  for (size_t i = 0; i < R.size(); ++i) {
    const int64_t L = R[i].span.length();
    Tensor tmp = F32({batch, L, H});
    span_sum[i] = F32({batch, H});
    ASSERT_TRUE(k.LogDecayBackward(plan, R[i].span, R[i].in.psi, psib[i], row[i], Tensor(), &tmp,
                                   &span_sum[i], nullptr).ok());
  }
  for (size_t i = 0; i < R.size(); ++i) {
    Tensor suffix = ZerosF32({batch, H});
    for (size_t j = R.size() - 1; j > i; --j) {
      for (int64_t bh = 0; bh < nbh; ++bh) {
        suffix.data<float>()[bh] += span_sum[j].data<float>()[bh];
      }
    }
    Tensor lg = F32({batch, R[i].span.length(), H}), sum = F32({batch, H});
    ASSERT_TRUE(k.LogDecayBackward(plan, R[i].span, R[i].in.psi, psib[i], row[i], suffix, &lg,
                                   &sum, nullptr).ok());
    ASSERT_TRUE(AllFinite(lg));
    Place(lg, R[i].span, T, &dlogg);
  }
  const std::vector<double> logg_whole = ToDouble(grads.logg);
  ASSERT_GT(MaxAbs(logg_whole), 0.0);
  EXPECT_LT(MaxRelError(dlogg, logg_whole), kSpanTol);
}

TEST(SmatSpanTest, SpansComposeToTheWholeSequence) {
  for (bool gated : {false, true}) {
    for (bool content : {false, true}) {
      // T = 1031, c = 32: n = 512. Cuts 320 | 704: the middle span straddles n.
      CheckSpansEqualWhole({.batch = 2, .T = 1031, .H = 2, .r = 6, .dv = 3, .d = 2, .chunk = 32,
                            .gated = gated, .content = content, .eps = 0.05, .seed = 21},
                           {320, 704});
      // Two spans, the cut inside the recent block; and the cut exactly at n.
      CheckSpansEqualWhole({.T = 1000, .H = 1, .r = 60, .dv = 4, .d = 3, .chunk = 64,
                            .gated = gated, .content = content, .seed = 22},
                           {64, 768});
      CheckSpansEqualWhole({.T = 127, .H = 2, .r = 5, .dv = 2, .d = 2, .chunk = 16,
                            .gated = gated, .content = content, .seed = 23},
                           {48, 64});
      // d = 1 (causal mask) with three spans.
      CheckSpansEqualWhole({.T = 263, .H = 1, .r = 7, .dv = 5, .d = 1, .chunk = 16,
                            .gated = gated, .content = content, .seed = 24},
                           {32, 160, 256});
    }
  }
}

}  // namespace
}  // namespace smat
