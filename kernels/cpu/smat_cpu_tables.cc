// CPU SMat phases, part 3: the long-range branch (paper eq. 9, 15; Algorithm
// 1 steps 2 and 4) and its adjoint (Appendix E, eq. 18). Tokens are grouped by
// profile (distant) or type (recent) so each group is one dense product with
// its table entry: pooling F_x = Psi_x^T diag(w) Vbar_x, reads Phi_h U_h;
// gated per Lemma 4 by scaling one side with exp(sums of gates).
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/status.h"
#include "kernels/cpu/smat_cpu_internal.h"

namespace smat {
namespace smat_cpu {
namespace {

// Rows of x [.., width] (token stride H*width) for local tokens idx[0..g),
// each scaled by exp(log_scale[idx]) (nullptr: 1), into out [g, width].
void GatherRows(const SpanDims& s, const float* x, int64_t width, int64_t b, int64_t h,
                const int64_t* idx, int64_t g, const double* log_scale, double log_offset,
                std::vector<float>* out) {
  out->resize(g * width);
  for (int64_t k = 0; k < g; ++k) {
    const float w =
        log_scale ? static_cast<float>(std::exp(log_offset + log_scale[idx[k]])) : 1.f;
    const float* xi = x + s.Tok(b, idx[k], h) * width;
    for (int64_t c = 0; c < width; ++c) (*out)[k * width + c] = w * xi[c];
  }
}

// Vbar rows [v, 1] of idx[0..g), scaled like GatherRows.
void GatherVbarRows(const SpanDims& s, const float* v, int64_t b, int64_t h, const int64_t* idx,
                    int64_t g, const double* log_scale, double log_offset,
                    std::vector<float>* out) {
  out->resize(g * s.p);
  for (int64_t k = 0; k < g; ++k) {
    const float w =
        log_scale ? static_cast<float>(std::exp(log_offset + log_scale[idx[k]])) : 1.f;
    const float* vi = v + s.Tok(b, idx[k], h) * s.dv;
    float* o = out->data() + k * s.p;
    for (int64_t c = 0; c < s.dv; ++c) o[c] = w * vi[c];
    o[s.dv] = w;
  }
}

// dst row idx[k] (token stride H*ld, first `width` columns) += src[k, 0:width].
void ScatterAddRows(const SpanDims& s, const std::vector<float>& src, int64_t src_width,
                    int64_t width, int64_t ld, int64_t b, int64_t h, const int64_t* idx,
                    int64_t g, float* dst) {
  for (int64_t k = 0; k < g; ++k) {
    float* d = dst + s.Tok(b, idx[k], h) * ld;
    for (int64_t c = 0; c < width; ++c) d[c] += src[k * src_width + c];
  }
}

// Rows [i0, i1) of every (b, h) of dst ([batch, L, H, width]) set to 0.
void ZeroRows(const SpanDims& s, int64_t i0, int64_t i1, int64_t width, Tensor* dst) {
  if (i0 >= i1) return;
  for (int64_t b = 0; b < s.batch; ++b) {
    float* first = dst->data<float>() + s.Tok(b, i0, 0) * width;
    std::fill(first, first + (i1 - i0) * s.H * width, 0.f);
  }
}

}  // namespace

absl::Status CpuSmatKernels::ProfilePooling(const SmatPlan& plan, const SmatSpan& span,
                                            const Tensor& psi, const Tensor& v, const Tensor& lam,
                                            const Tensor& chunk_decay, const Tensor& prof,
                                            Tensor* F, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, MakeSpanDims(plan, span, psi, "psi"));
  s.r = psi.rank() == 4 ? psi.dim(3) : 0;
  s.dv = v.defined() && v.rank() == 4 ? v.dim(3) : 0;
  s.p = s.dv + 1;
  const int64_t P = plan.geo.P, W = s.r * s.p;
  SMAT_RETURN_IF_ERROR(CheckF32(psi, {s.batch, s.L, s.H, s.r}, "psi"));
  SMAT_RETURN_IF_ERROR(CheckF32(v, {s.batch, s.L, s.H, s.dv}, "v"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(lam, {s.batch, s.L, s.H}, "lam"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(chunk_decay, {s.batch, s.Lc, s.H}, "chunk_decay"));
  SMAT_RETURN_IF_ERROR(CheckOptionalI32(prof, {s.batch, s.L, s.H}, "prof"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(F, {s.batch, s.H, P, s.r, s.p}, "F"));
  HeadGates g;
  TokenGroups groups;
  std::vector<float> psi_g, vbar_g;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      LoadHeadGates(s, lam, chunk_decay, b, h, &g);
      // Key-side scalar of Lemma 4, referred to the end of the span's distant part.
      const std::vector<double> tail = DistantTailLog(s, g);
      SMAT_RETURN_IF_ERROR(GroupByProfile(plan, s, prof, b, h, &groups));
      for (int64_t x = 0; x < P; ++x) {
        const int64_t* idx = groups.idx.data() + groups.off[x];
        const int64_t cnt = groups.off[x + 1] - groups.off[x];
        GatherRows(s, psi.data<float>(), s.r, b, h, idx, cnt, nullptr, 0.0, &psi_g);
        GatherVbarRows(s, v.data<float>(), b, h, idx, cnt, g.gated ? tail.data() : nullptr, 0.0,
                       &vbar_g);
        // F_x = Psi_x^T diag(w) Vbar_x (zeros for an empty group).
        Sgemm(true, false, s.r, s.p, cnt, 1.f, psi_g.data(), s.r, vbar_g.data(), s.p, 0.f,
              F->data<float>() + (s.BH(b, h) * P + x) * W, s.p);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::TypeReads(const SmatPlan& plan, const SmatSpan& span,
                                       const Tensor& phi, const Tensor& U, const Tensor& lam,
                                       const Tensor& chunk_decay, const Tensor& recent_offset,
                                       const Tensor& type, Tensor* ybar, SmatWrite write,
                                       Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, MakeSpanDims(plan, span, phi, "phi"));
  s.r = phi.rank() == 4 ? phi.dim(3) : 0;
  s.p = U.defined() && U.rank() == 5 ? U.dim(4) : 0;
  s.dv = s.p - 1;
  const int64_t B = plan.geo.B, W = s.r * s.p;
  SMAT_RETURN_IF_ERROR(CheckF32(phi, {s.batch, s.L, s.H, s.r}, "phi"));
  SMAT_RETURN_IF_ERROR(CheckF32(U, {s.batch, s.H, B, s.r, s.p}, "U"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(lam, {s.batch, s.L, s.H}, "lam"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(chunk_decay, {s.batch, s.Lc, s.H}, "chunk_decay"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(recent_offset, {s.batch, s.H}, "recent_offset"));
  SMAT_RETURN_IF_ERROR(CheckOptionalI32(type, {s.batch, s.L, s.H}, "type"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(ybar, {s.batch, s.L, s.H, s.p}, "ybar"));
  // The recent rows start from 0; rows that read nothing stay 0.
  if (write == SmatWrite::kAssign) ZeroRows(s, s.id, s.L, s.p, ybar);
  if (s.id == s.L || plan.n == 0) return absl::OkStatus();  // no recent token reads U
  HeadGates g;
  TokenGroups groups;
  std::vector<float> phi_g, y_g;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      LoadHeadGates(s, lam, chunk_decay, b, h, &g);
      // Query-side scalar of Lemma 4: gate_t = exp(recent_offset + head[t]).
      const std::vector<double> head = RecentHeadLog(s, g);
      const double offset = HeadScalar(recent_offset, s, b, h);
      const bool scaled = g.gated || recent_offset.defined();
      SMAT_RETURN_IF_ERROR(GroupByType(plan, s, type, b, h, &groups));
      for (int64_t y = 0; y < B; ++y) {
        const int64_t* idx = groups.idx.data() + groups.off[y];
        const int64_t cnt = groups.off[y + 1] - groups.off[y];
        if (cnt == 0) continue;
        GatherRows(s, phi.data<float>(), s.r, b, h, idx, cnt, scaled ? head.data() : nullptr,
                   offset, &phi_g);
        y_g.resize(cnt * s.p);
        Sgemm(false, false, cnt, s.p, s.r, 1.f, phi_g.data(), s.r,
              U.data<float>() + (s.BH(b, h) * B + y) * W, s.p, 0.f, y_g.data(), s.p);
        ScatterAddRows(s, y_g, s.p, s.p, s.p, b, h, idx, cnt, ybar->data<float>());
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::TypeReadsBackward(
    const SmatPlan& plan, const SmatSpan& span, const Tensor& phi, const Tensor& U,
    const Tensor& gbar, const Tensor& lam, const Tensor& chunk_decay, const Tensor& recent_offset,
    const Tensor& type, Tensor* phi_bar, Tensor* U_bar, SmatWrite write, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, MakeSpanDims(plan, span, phi, "phi"));
  s.r = phi.rank() == 4 ? phi.dim(3) : 0;
  s.p = U.defined() && U.rank() == 5 ? U.dim(4) : 0;
  s.dv = s.p - 1;
  const int64_t B = plan.geo.B, W = s.r * s.p;
  SMAT_RETURN_IF_ERROR(CheckF32(phi, {s.batch, s.L, s.H, s.r}, "phi"));
  SMAT_RETURN_IF_ERROR(CheckF32(U, {s.batch, s.H, B, s.r, s.p}, "U"));
  SMAT_RETURN_IF_ERROR(CheckF32(gbar, {s.batch, s.L, s.H, s.p}, "gbar"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(lam, {s.batch, s.L, s.H}, "lam"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(chunk_decay, {s.batch, s.Lc, s.H}, "chunk_decay"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(recent_offset, {s.batch, s.H}, "recent_offset"));
  SMAT_RETURN_IF_ERROR(CheckOptionalI32(type, {s.batch, s.L, s.H}, "type"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(phi_bar, {s.batch, s.L, s.H, s.r}, "phi_bar"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(U_bar, {s.batch, s.H, B, s.r, s.p}, "U_bar"));
  if (write == SmatWrite::kAssign) ZeroRows(s, s.id, s.L, s.r, phi_bar);  // then added to
  HeadGates g;
  TokenGroups groups;
  std::vector<float> phi_g, g_g, tmp;
  const bool reads = s.id < s.L && plan.n > 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      float* Ub = U_bar->data<float>() + s.BH(b, h) * B * W;
      if (!reads) {
        std::fill(Ub, Ub + B * W, 0.f);
        continue;
      }
      LoadHeadGates(s, lam, chunk_decay, b, h, &g);
      const std::vector<double> head = RecentHeadLog(s, g);
      const double offset = HeadScalar(recent_offset, s, b, h);
      const bool scaled = g.gated || recent_offset.defined();
      SMAT_RETURN_IF_ERROR(GroupByType(plan, s, type, b, h, &groups));
      for (int64_t y = 0; y < B; ++y) {
        const int64_t* idx = groups.idx.data() + groups.off[y];
        const int64_t cnt = groups.off[y + 1] - groups.off[y];
        // eq. 18: U_bar_y = sum gate_t phi_t gbar_t^T; phi_bar_t += gate_t U_y gbar_t.
        GatherRows(s, phi.data<float>(), s.r, b, h, idx, cnt, nullptr, 0.0, &phi_g);
        GatherRows(s, gbar.data<float>(), s.p, b, h, idx, cnt, scaled ? head.data() : nullptr,
                   offset, &g_g);
        Sgemm(true, false, s.r, s.p, cnt, 1.f, phi_g.data(), s.r, g_g.data(), s.p, 0.f,
              Ub + y * W, s.p);
        if (cnt == 0) continue;
        tmp.resize(cnt * s.r);
        Sgemm(false, true, cnt, s.r, s.p, 1.f, g_g.data(), s.p,
              U.data<float>() + (s.BH(b, h) * B + y) * W, s.p, 0.f, tmp.data(), s.r);
        ScatterAddRows(s, tmp, s.r, s.r, s.r, b, h, idx, cnt, phi_bar->data<float>());
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::ProfilePoolingBackward(const SmatPlan& plan, const SmatSpan& span,
                                                    const Tensor& psi, const Tensor& v,
                                                    const Tensor& lam, const Tensor& chunk_decay,
                                                    const Tensor& distant_tail_decay,
                                                    const Tensor& prof, const Tensor& F_bar,
                                                    Tensor* psi_bar, Tensor* v_bar, SmatWrite write,
                                                    Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, MakeSpanDims(plan, span, psi, "psi"));
  s.r = psi.rank() == 4 ? psi.dim(3) : 0;
  s.dv = v.defined() && v.rank() == 4 ? v.dim(3) : 0;
  s.p = s.dv + 1;
  const int64_t P = plan.geo.P, W = s.r * s.p;
  SMAT_RETURN_IF_ERROR(CheckF32(psi, {s.batch, s.L, s.H, s.r}, "psi"));
  SMAT_RETURN_IF_ERROR(CheckF32(v, {s.batch, s.L, s.H, s.dv}, "v"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(lam, {s.batch, s.L, s.H}, "lam"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(chunk_decay, {s.batch, s.Lc, s.H}, "chunk_decay"));
  SMAT_RETURN_IF_ERROR(
      CheckOptionalF32(distant_tail_decay, {s.batch, s.H}, "distant_tail_decay"));
  SMAT_RETURN_IF_ERROR(CheckOptionalI32(prof, {s.batch, s.L, s.H}, "prof"));
  SMAT_RETURN_IF_ERROR(CheckF32(F_bar, {s.batch, s.H, P, s.r, s.p}, "F_bar"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(psi_bar, {s.batch, s.L, s.H, s.r}, "psi_bar"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(v_bar, {s.batch, s.L, s.H, s.dv}, "v_bar"));
  if (write == SmatWrite::kAssign) {  // then added to
    ZeroRows(s, 0, s.id, s.r, psi_bar);
    ZeroRows(s, 0, s.id, s.dv, v_bar);
  }
  HeadGates g;
  TokenGroups groups;
  std::vector<float> vbar_g, psi_g, tmp;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      LoadHeadGates(s, lam, chunk_decay, b, h, &g);
      // w_s = exp(Lambda_{n-1} - Lambda_s) = exp(distant_tail_decay + tail[s]).
      const std::vector<double> tail = DistantTailLog(s, g);
      const double offset = HeadScalar(distant_tail_decay, s, b, h);
      const bool scaled = g.gated || distant_tail_decay.defined();
      SMAT_RETURN_IF_ERROR(GroupByProfile(plan, s, prof, b, h, &groups));
      for (int64_t x = 0; x < P; ++x) {
        const int64_t* idx = groups.idx.data() + groups.off[x];
        const int64_t cnt = groups.off[x + 1] - groups.off[x];
        if (cnt == 0) continue;
        const float* Fb = F_bar.data<float>() + (s.BH(b, h) * P + x) * W;
        // Zbar_s = w_s F_bar_x (eq. 18): psi_bar_s += w_s F_bar_x vbar_s,
        // v_bar_s += w_s (F_bar_x^T psi_s)[0:dv].
        GatherVbarRows(s, v.data<float>(), b, h, idx, cnt, scaled ? tail.data() : nullptr,
                       offset, &vbar_g);
        tmp.resize(cnt * std::max(s.r, s.dv));
        Sgemm(false, true, cnt, s.r, s.p, 1.f, vbar_g.data(), s.p, Fb, s.p, 0.f, tmp.data(), s.r);
        ScatterAddRows(s, tmp, s.r, s.r, s.r, b, h, idx, cnt, psi_bar->data<float>());
        GatherRows(s, psi.data<float>(), s.r, b, h, idx, cnt, scaled ? tail.data() : nullptr,
                   offset, &psi_g);
        Sgemm(false, false, cnt, s.dv, s.r, 1.f, psi_g.data(), s.r, Fb, s.p, 0.f, tmp.data(),
              s.dv);
        ScatterAddRows(s, tmp, s.dv, s.dv, s.dv, b, h, idx, cnt, v_bar->data<float>());
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace smat_cpu
}  // namespace smat
