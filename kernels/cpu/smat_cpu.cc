// CPU SMat phases, part 1: argument checks, token grouping, gate helpers, and
// the scalar / table phases (log-decay prefix, tabulation, normalisation, the
// division's Jacobian, the gate gradient). The chunk phases are in
// smat_cpu_chunks.cc, pooling and per-type reads in smat_cpu_tables.cc.
#include "kernels/cpu/smat_cpu.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/cpu/smat_cpu_internal.h"

namespace smat {
namespace smat_cpu {

absl::Status CheckF32(const Tensor& t, const Shape& shape, const char* name) {
  if (!t.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat cpu: ", name, " is missing; expected fp32", ShapeToString(shape)));
  }
  if (t.dtype() != DType::kF32 || !t.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat("smat cpu: ", name, " must be an fp32 host tensor",
                                                   "; got ", t.DebugString()));
  }
  return CheckShape(t, shape, name);
}

absl::Status CheckOptionalF32(const Tensor& t, const Shape& shape, const char* name) {
  return t.defined() ? CheckF32(t, shape, name) : absl::OkStatus();
}

absl::Status CheckOutF32(const Tensor* t, const Shape& shape, const char* name) {
  if (t == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("smat cpu: output ", name, " is null"));
  }
  return CheckF32(*t, shape, name);
}

absl::Status CheckOptionalI32(const Tensor& t, const Shape& shape, const char* name) {
  if (!t.defined()) return absl::OkStatus();
  if (t.dtype() != DType::kI32 || !t.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat cpu: ", name, " must be an int32 host tensor; got ", t.DebugString()));
  }
  return CheckShape(t, shape, name);
}

absl::StatusOr<SpanDims> MakeSpanDims(const SmatPlan& plan, const SmatSpan& span) {
  SMAT_RETURN_IF_ERROR(ValidateSmatSpan(plan, span));
  SpanDims s;
  s.L = span.length();
  s.c = plan.chunk;
  s.Lc = span.num_chunks(plan);
  s.t0 = span.t0;
  s.n = plan.n;
  s.id = span.distant_end(plan) - span.t0;
  s.jd = s.id / s.c;  // n and t0 are multiples of c
  return s;
}

absl::StatusOr<SpanDims> MakeSpanDims(const SmatPlan& plan, const SmatSpan& span,
                                      const Tensor& tokens, const char* name) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, MakeSpanDims(plan, span));
  if (!tokens.defined() || tokens.rank() < 3 || tokens.dim(1) != span.length()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat cpu: ", name, " must be [batch, L = ", span.length(), ", H, ...] for span [",
        span.t0, ", ", span.t1, "); got ",
        tokens.defined() ? tokens.DebugString() : std::string("nothing")));
  }
  s.batch = tokens.dim(0);
  s.H = tokens.dim(2);
  return s;
}

void LoadHeadGates(const SpanDims& s, const Tensor& lam, const Tensor& chunk_decay, int64_t b,
                   int64_t h, HeadGates* g) {
  g->gated = lam.defined();
  g->lam.assign(s.L, 0.0);
  g->cd.assign(s.Lc, 0.0);
  if (!g->gated) return;
  const float* l = lam.data<float>();
  for (int64_t i = 0; i < s.L; ++i) g->lam[i] = l[s.Tok(b, i, h)];
  if (chunk_decay.defined()) {
    const float* cd = chunk_decay.data<float>();
    for (int64_t j = 0; j < s.Lc; ++j) g->cd[j] = cd[s.Chk(b, j, h)];
  } else {
    // Phases that only need lam: the chunk's total is lam at its last token.
    for (int64_t j = 0; j < s.Lc; ++j) g->cd[j] = g->lam[s.ChunkEnd(j) - 1];
  }
}

std::vector<double> DistantTailLog(const SpanDims& s, const HeadGates& g) {
  std::vector<double> tail(s.id, 0.0);
  if (!g.gated) return tail;
  double after = 0.0;  // sum of the chunk decays after chunk j (within the distant part)
  for (int64_t j = s.jd - 1; j >= 0; --j) {
    for (int64_t i = s.ChunkBegin(j); i < s.ChunkEnd(j); ++i) {
      tail[i] = (g.cd[j] - g.lam[i]) + after;
    }
    after += g.cd[j];
  }
  return tail;
}

std::vector<double> RecentHeadLog(const SpanDims& s, const HeadGates& g) {
  std::vector<double> head(s.L, 0.0);
  if (!g.gated) return head;
  double before = 0.0;  // sum of the chunk decays of the recent chunks before chunk j
  for (int64_t j = s.jd; j < s.Lc; ++j) {
    for (int64_t i = s.ChunkBegin(j); i < s.ChunkEnd(j); ++i) head[i] = before + g.lam[i];
    before += g.cd[j];
  }
  return head;
}

double HeadScalar(const Tensor& t, const SpanDims& s, int64_t b, int64_t h) {
  return t.defined() ? static_cast<double>(t.data<float>()[s.BH(b, h)]) : 0.0;
}

namespace {

// Stable counting sort of local tokens [begin, end) by key(i) in [0, groups).
template <typename KeyFn>
absl::Status CountingSort(int64_t begin, int64_t end, int64_t groups, KeyFn key,
                          const char* what, TokenGroups* out) {
  out->off.assign(groups + 1, 0);
  out->idx.resize(std::max<int64_t>(end - begin, 0));
  for (int64_t i = begin; i < end; ++i) {
    const int64_t k = key(i);
    if (k < 0 || k >= groups) {
      return absl::InvalidArgumentError(absl::StrCat(
          "smat cpu: ", what, " id ", k, " at span token ", i, " is out of range [0, ", groups,
          "); content ids must come from the same plan (P points, B types)"));
    }
    ++out->off[k + 1];
  }
  for (int64_t k = 0; k < groups; ++k) out->off[k + 1] += out->off[k];
  std::vector<int64_t> fill(out->off.begin(), out->off.end() - 1);
  for (int64_t i = begin; i < end; ++i) out->idx[fill[key(i)]++] = i;
  return absl::OkStatus();
}

// Local tokens i in [begin, end) grouped by (t0 + i + shift) mod period: each
// group is an arithmetic progression with step `period`, no sort needed.
void ArithmeticGroups(int64_t begin, int64_t end, int64_t t0, int64_t shift, int64_t period,
                      TokenGroups* out) {
  out->off.assign(period + 1, 0);
  out->idx.clear();
  out->idx.reserve(std::max<int64_t>(end - begin, 0));
  // Key of token `begin`; group x starts at begin + ((x - k0) mod period).
  const int64_t k0 = ((t0 + begin + shift) % period + period) % period;
  for (int64_t x = 0; x < period; ++x) {
    for (int64_t i = begin + (x - k0 + period) % period; i < end; i += period) {
      out->idx.push_back(i);
    }
    out->off[x + 1] = static_cast<int64_t>(out->idx.size());
  }
}

}  // namespace

absl::Status GroupByProfile(const SmatPlan& plan, const SpanDims& s, const Tensor& prof,
                            int64_t b, int64_t h, TokenGroups* groups) {
  const SmatGeometry& g = plan.geo;
  if (prof.defined()) {
    const int32_t* p = prof.data<int32_t>();
    return CountingSort(0, s.id, g.P, [&](int64_t i) { return int64_t{p[s.Tok(b, i, h)]}; },
                        "profile", groups);
  }
  // Positional prof(s) = s mod P (core/geometry.h).
  ArithmeticGroups(0, s.id, s.t0, 0, g.P, groups);
  return absl::OkStatus();
}

absl::Status GroupByType(const SmatPlan& plan, const SpanDims& s, const Tensor& type,
                         int64_t b, int64_t h, TokenGroups* groups) {
  const SmatGeometry& g = plan.geo;
  if (type.defined()) {
    const int32_t* p = type.data<int32_t>();
    return CountingSort(s.id, s.L, g.B, [&](int64_t i) { return int64_t{p[s.Tok(b, i, h)]}; },
                        "type", groups);
  }
  // Positional type(t) = (t - n) mod B.
  ArithmeticGroups(s.id, s.L, s.t0, -s.n, g.B, groups);
  return absl::OkStatus();
}

void Sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : beta * C[i * ldc + j];
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), alpha, A,
              static_cast<int>(lda), B, static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
}

absl::Status CpuSmatKernels::ChunkLogDecay(const SmatPlan& plan, const SmatSpan& span,
                                           const Tensor& logg, Tensor* lam, Tensor* chunk_decay,
                                           Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, MakeSpanDims(plan, span, logg, "logg"));
  SMAT_RETURN_IF_ERROR(CheckF32(logg, {s.batch, s.L, s.H}, "logg"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(lam, {s.batch, s.L, s.H}, "lam"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(chunk_decay, {s.batch, s.Lc, s.H}, "chunk_decay"));
  const float* g = logg.data<float>();
  float* l = lam->data<float>();
  float* cd = chunk_decay->data<float>();
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      for (int64_t j = 0; j < s.Lc; ++j) {
        // Double accumulation: lam sits in an exponent (absolute error there is
        // relative error of every weight), and this is O(T) work.
        double acc = 0.0;
        for (int64_t i = s.ChunkBegin(j); i < s.ChunkEnd(j); ++i) {
          const float gi = g[s.Tok(b, i, h)];
          if (!(gi <= 0.f)) {  // also NaN
            return absl::InvalidArgumentError(absl::StrCat(
                "smat cpu: logg must be <= 0 (the log of a decay in (0, 1]); got ", gi,
                " at batch ", b, ", span token ", i, ", head ", h,
                "; compute it as log_sigmoid or -softplus"));
          }
          acc += gi;
          l[s.Tok(b, i, h)] = static_cast<float>(acc);
        }
        cd[s.Chk(b, j, h)] = static_cast<float>(acc);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::Tabulate(const SmatPlan& plan, const Tensor& F, Tensor* U,
                                      Stream* stream) {
  const SmatGeometry& g = plan.geo;
  if (!F.defined() || F.rank() != 5) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat cpu: F must be [batch, H, P = ", g.P, ", r, p]; got ", F.DebugString()));
  }
  const int64_t batch = F.dim(0), H = F.dim(1), r = F.dim(3), p = F.dim(4);
  SMAT_RETURN_IF_ERROR(CheckF32(F, {batch, H, g.P, r, p}, "F"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(U, {batch, H, g.B, r, p}, "U"));
  for (int64_t bh = 0; bh < batch * H; ++bh) {
    TabulateIncidence(g, F.data<float>() + bh * g.P * r * p, U->data<float>() + bh * g.B * r * p,
                      r * p);
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::TabulateBackward(const SmatPlan& plan, const Tensor& U_bar,
                                              Tensor* F_bar, Stream* stream) {
  const SmatGeometry& g = plan.geo;
  if (!U_bar.defined() || U_bar.rank() != 5) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat cpu: U_bar must be [batch, H, B = ", g.B, ", r, p]; got ", U_bar.DebugString()));
  }
  const int64_t batch = U_bar.dim(0), H = U_bar.dim(1), r = U_bar.dim(3), p = U_bar.dim(4);
  SMAT_RETURN_IF_ERROR(CheckF32(U_bar, {batch, H, g.B, r, p}, "U_bar"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(F_bar, {batch, H, g.P, r, p}, "F_bar"));
  for (int64_t bh = 0; bh < batch * H; ++bh) {
    TabulateIncidenceAdjoint(g, U_bar.data<float>() + bh * g.B * r * p,
                             F_bar->data<float>() + bh * g.P * r * p, r * p);
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::Normalize(const Tensor& ybar, float eps, Tensor* o, Tensor* den,
                                       Stream* stream) {
  if (!ybar.defined() || ybar.rank() != 4 || ybar.dim(3) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat cpu: ybar must be [batch, L, H, p]; got ", ybar.DebugString()));
  }
  const int64_t batch = ybar.dim(0), L = ybar.dim(1), H = ybar.dim(2), p = ybar.dim(3);
  const int64_t dv = p - 1;
  SMAT_RETURN_IF_ERROR(CheckF32(ybar, {batch, L, H, p}, "ybar"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(o, {batch, L, H, dv}, "o"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(den, {batch, L, H}, "den"));
  const float* y = ybar.data<float>();
  float* out = o->data<float>();
  float* d = den->data<float>();
  for (int64_t i = 0; i < batch * L * H; ++i) {
    const float dn = y[i * p + dv] + eps;  // eq. 3: one division per row
    d[i] = dn;
    for (int64_t k = 0; k < dv; ++k) out[i * dv + k] = y[i * p + k] / dn;
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::NormalizedOutputs(const SmatPlan& plan, const SmatSpan& span,
                                               const Tensor& phi, const Tensor& psi,
                                               const Tensor& v, const Tensor& lam,
                                               const Tensor& S_in, const Tensor& reads, float eps,
                                               Tensor* o, Tensor* den, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, MakeSpanDims(plan, span, phi, "phi"));
  s.dv = v.defined() && v.rank() == 4 ? v.dim(3) : 0;
  s.p = s.dv + 1;
  // reads undefined: none (the op leaves the long-range branch out).
  if (reads.defined()) {
    SMAT_RETURN_IF_ERROR(CheckF32(reads, {s.batch, s.L, s.H, s.p}, "reads"));
  }
  // The three phases in turn, on a ybar of this call's own.
  SMAT_ASSIGN_OR_RETURN(Tensor ybar, Tensor::Empty({s.batch, s.L, s.H, s.p}, DType::kF32));
  SMAT_RETURN_IF_ERROR(ChunkOutputs(plan, span, phi, psi, v, lam, S_in, &ybar, stream));
  for (int64_t b = 0; b < s.batch && reads.defined(); ++b) {
    const int64_t first = s.Tok(b, s.id, 0) * s.p, count = (s.L - s.id) * s.H * s.p;
    float* y = ybar.data<float>() + first;
    const float* x = reads.data<float>() + first;
    for (int64_t e = 0; e < count; ++e) y[e] += x[e];
  }
  return Normalize(ybar, eps, o, den, stream);
}

absl::Status CpuSmatKernels::NormalizeBackwardStates(const SmatPlan& plan, const SmatSpan& span,
                                                     const Tensor& d_o, const Tensor& o,
                                                     const Tensor& den, float eps,
                                                     const Tensor& phi, const Tensor& lam,
                                                     Tensor* gbar, Tensor* dlam_row,
                                                     Tensor* S_in_bar, Stream* stream) {
  // The two phases in turn.
  SMAT_RETURN_IF_ERROR(NormalizeBackward(d_o, o, den, eps, gbar, dlam_row, stream));
  return ChunkStateGradients(plan, span, phi, *gbar, lam, S_in_bar, stream);
}

absl::Status CpuSmatKernels::NormalizeBackward(const Tensor& d_o, const Tensor& o,
                                               const Tensor& den, float eps, Tensor* gbar,
                                               Tensor* dlam_row, Stream* stream) {
  if (!o.defined() || o.rank() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat cpu: o must be [batch, L, H, dv]; got ", o.DebugString()));
  }
  const int64_t batch = o.dim(0), L = o.dim(1), H = o.dim(2), dv = o.dim(3), p = dv + 1;
  SMAT_RETURN_IF_ERROR(CheckF32(o, {batch, L, H, dv}, "o"));
  SMAT_RETURN_IF_ERROR(CheckF32(d_o, {batch, L, H, dv}, "d_o"));
  SMAT_RETURN_IF_ERROR(CheckF32(den, {batch, L, H}, "den"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(gbar, {batch, L, H, p}, "gbar"));
  if (dlam_row != nullptr) SMAT_RETURN_IF_ERROR(CheckOutF32(dlam_row, {batch, L, H}, "dlam_row"));
  const float *go = d_o.data<float>(), *out = o.data<float>(), *d = den.data<float>();
  float* g = gbar->data<float>();
  for (int64_t i = 0; i < batch * L * H; ++i) {
    // Appendix E: gbar[0:dv] = do / den, gbar[dv] = -(do . o) / den.
    double dot = 0.0;
    for (int64_t k = 0; k < dv; ++k) dot += double{go[i * dv + k]} * out[i * dv + k];
    const double inv = 1.0 / d[i];
    for (int64_t k = 0; k < dv; ++k) g[i * p + k] = static_cast<float>(go[i * dv + k] * inv);
    g[i * p + dv] = static_cast<float>(-dot * inv);
    // gbar . ybar with ybar = [o den, den - eps]: the o-terms cancel exactly.
    if (dlam_row != nullptr) dlam_row->data<float>()[i] = static_cast<float>(eps * dot * inv);
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::LogDecayBackward(const SmatPlan& plan, const SmatSpan& span,
                                              const Tensor& psi, const Tensor& psi_bar,
                                              const Tensor& dlam_row, const Tensor& suffix_in,
                                              Tensor* logg_bar, Tensor* span_sum,
                                              Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, MakeSpanDims(plan, span, psi, "psi"));
  s.r = psi.rank() == 4 ? psi.dim(3) : 0;
  SMAT_RETURN_IF_ERROR(CheckF32(psi, {s.batch, s.L, s.H, s.r}, "psi"));
  SMAT_RETURN_IF_ERROR(CheckF32(psi_bar, {s.batch, s.L, s.H, s.r}, "psi_bar"));
  SMAT_RETURN_IF_ERROR(CheckF32(dlam_row, {s.batch, s.L, s.H}, "dlam_row"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(suffix_in, {s.batch, s.H}, "suffix_in"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(logg_bar, {s.batch, s.L, s.H}, "logg_bar"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(span_sum, {s.batch, s.H}, "span_sum"));
  const float *ps = psi.data<float>(), *pb = psi_bar.data<float>(), *row = dlam_row.data<float>();
  float* out = logg_bar->data<float>();
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      // dL/dLambda_t = row_t - psi_t . psi_bar_t; dL/dlogg_s = sum_{t >= s}.
      double own = 0.0;
      const double after = HeadScalar(suffix_in, s, b, h);
      for (int64_t i = s.L - 1; i >= 0; --i) {
        const int64_t t = s.Tok(b, i, h);
        double col = 0.0;
        for (int64_t k = 0; k < s.r; ++k) col += double{ps[t * s.r + k]} * pb[t * s.r + k];
        own += row[t] - col;
        out[t] = static_cast<float>(own + after);
      }
      span_sum->data<float>()[s.BH(b, h)] = static_cast<float>(own);
    }
  }
  return absl::OkStatus();
}

}  // namespace smat_cpu

std::unique_ptr<SmatKernels> MakeCpuSmatKernels() {
  return std::make_unique<smat_cpu::CpuSmatKernels>();
}

}  // namespace smat
