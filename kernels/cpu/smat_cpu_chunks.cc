// CPU SMat phases, part 2: the causal branch, chunk by chunk (paper eq. 10,
// Algorithm 1 steps 5-7, gating per Lemma 4) and its adjoint (Appendix E,
// eq. 19 and the suffix scan). One c x c tile is live at a time; every tile
// product is a cblas_sgemm reading the [batch, L, H, *] tensors in place
// through leading dimensions H*r / H*p (tokens of one head are H rows apart).
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/status.h"
#include "kernels/cpu/smat_cpu_internal.h"

namespace smat {
namespace smat_cpu {
namespace {

// Vbar rows [v_i, 1] of local tokens [i0, i0 + m) of (b, h), each scaled by
// scale[i - i0] (nullptr: 1), into out [m, p].
void GatherVbar(const SpanDims& s, const float* v, int64_t b, int64_t h, int64_t i0, int64_t m,
                const double* scale, std::vector<float>* out) {
  out->resize(m * s.p);
  for (int64_t i = 0; i < m; ++i) {
    const float w = scale ? static_cast<float>(scale[i]) : 1.f;
    const float* vi = v + s.Tok(b, i0 + i, h) * s.dv;
    float* o = out->data() + i * s.p;
    for (int64_t k = 0; k < s.dv; ++k) o[k] = w * vi[k];
    o[s.dv] = w;
  }
}

// Rows of x [.., width] (token stride H*width) of tokens [i0, i0 + m), scaled.
void GatherScaledRows(const SpanDims& s, const float* x, int64_t width, int64_t b, int64_t h,
                      int64_t i0, int64_t m, const double* scale, std::vector<float>* out) {
  out->resize(m * width);
  for (int64_t i = 0; i < m; ++i) {
    const float w = static_cast<float>(scale[i]);
    const float* xi = x + s.Tok(b, i0 + i, h) * width;
    for (int64_t k = 0; k < width; ++k) (*out)[i * width + k] = w * xi[k];
  }
}

// tile[t][s] <- tile[t][s] * exp(lam[t] - lam[s]) for s <= t, 0 above the
// diagonal (the gated causal tile of Lemma 4; t >= s so the exponent is <= 0).
void MaskTile(const HeadGates& g, int64_t i0, int64_t m, float* tile) {
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t u = 0; u < m; ++u) {
      float& x = tile[t * m + u];
      if (u > t) {
        x = 0.f;
      } else if (g.gated) {
        x *= static_cast<float>(std::exp(g.lam[i0 + t] - g.lam[i0 + u]));
      }
    }
  }
}

// exp of per-token log weights for tokens [i0, i0 + m): exp(lam) (decay from
// the chunk's incoming state) or exp(cd - lam) (decay to the chunk end).
std::vector<double> ExpFromStart(const HeadGates& g, int64_t i0, int64_t m) {
  std::vector<double> w(m, 1.0);
  if (g.gated) for (int64_t i = 0; i < m; ++i) w[i] = std::exp(g.lam[i0 + i]);
  return w;
}
std::vector<double> ExpToEnd(const HeadGates& g, int64_t j, int64_t i0, int64_t m) {
  std::vector<double> w(m, 1.0);
  if (g.gated) for (int64_t i = 0; i < m; ++i) w[i] = std::exp(g.cd[j] - g.lam[i0 + i]);
  return w;
}

// Local chunk ranges of the two blocks: [0, jd) distant, [jd, Lc) recent.
void BlockChunks(const SpanDims& s, int blk, int64_t* j0, int64_t* j1) {
  *j0 = blk == kDistantBlock ? 0 : s.jd;
  *j1 = blk == kDistantBlock ? s.jd : s.Lc;
}

absl::StatusOr<SpanDims> TokenDims(const SmatPlan& plan, const SmatSpan& span,
                                   const Tensor& phi_or_psi, const Tensor& v, const char* name) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, MakeSpanDims(plan, span, phi_or_psi, name));
  s.r = phi_or_psi.rank() == 4 ? phi_or_psi.dim(3) : 0;
  s.dv = v.defined() && v.rank() == 4 ? v.dim(3) : 0;
  s.p = s.dv + 1;
  return s;
}

}  // namespace

absl::Status CpuSmatKernels::ChunkSummaries(const SmatPlan& plan, const SmatSpan& span,
                                            const Tensor& psi, const Tensor& v, const Tensor& lam,
                                            const Tensor& chunk_decay, Tensor* D,
                                            Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, TokenDims(plan, span, psi, v, "psi"));
  SMAT_RETURN_IF_ERROR(CheckF32(psi, {s.batch, s.L, s.H, s.r}, "psi"));
  SMAT_RETURN_IF_ERROR(CheckF32(v, {s.batch, s.L, s.H, s.dv}, "v"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(lam, {s.batch, s.L, s.H}, "lam"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(chunk_decay, {s.batch, s.Lc, s.H}, "chunk_decay"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(D, {s.batch, s.Lc, s.H, s.r, s.p}, "D"));
  HeadGates g;
  std::vector<float> vw;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      LoadHeadGates(s, lam, chunk_decay, b, h, &g);
      for (int64_t j = 0; j < s.Lc; ++j) {
        const int64_t i0 = s.ChunkBegin(j), m = s.ChunkEnd(j) - i0;
        // D_j = Psi^T diag(exp(cd_j - lam)) Vbar (Lemma 4: referred to the chunk end).
        const std::vector<double> w = ExpToEnd(g, j, i0, m);
        GatherVbar(s, v.data<float>(), b, h, i0, m, w.data(), &vw);
        Sgemm(true, false, s.r, s.p, m, 1.f, psi.data<float>() + s.Tok(b, i0, h) * s.r,
              s.H * s.r, vw.data(), s.p, 0.f, D->data<float>() + s.Chk(b, j, h) * s.r * s.p,
              s.p);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::ChunkScan(const SmatPlan& plan, const SmatSpan& span,
                                       const Tensor& D, const Tensor& chunk_decay,
                                       const Tensor& incoming, Tensor* S_in, Tensor* span_state,
                                       Tensor* span_decay, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, MakeSpanDims(plan, span));
  if (!D.defined() || D.rank() != 5) {
    return absl::InvalidArgumentError("smat cpu: D must be [batch, Lc, H, r, p]");
  }
  s.batch = D.dim(0);
  s.H = D.dim(2);
  const int64_t W = D.dim(3) * D.dim(4);  // r p
  SMAT_RETURN_IF_ERROR(CheckF32(D, {s.batch, s.Lc, s.H, D.dim(3), D.dim(4)}, "D"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(chunk_decay, {s.batch, s.Lc, s.H}, "chunk_decay"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(incoming, {s.batch, 2, s.H, D.dim(3), D.dim(4)},
                                        "incoming"));
  if (S_in != nullptr) SMAT_RETURN_IF_ERROR(CheckOutF32(S_in, D.shape(), "S_in"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(span_state, {s.batch, 2, s.H, D.dim(3), D.dim(4)},
                                   "span_state"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(span_decay, {s.batch, 2, s.H}, "span_decay"));
  std::vector<float> X(W), Y(W);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      for (int blk : {kDistantBlock, kRecentBlock}) {
        int64_t j0, j1;
        BlockChunks(s, blk, &j0, &j1);
        if (incoming.defined() && j0 < j1) {
          const float* in = incoming.data<float>() + s.Blk(b, blk, h) * W;
          std::copy(in, in + W, X.begin());
        } else {
          std::fill(X.begin(), X.end(), 0.f);
        }
        std::fill(Y.begin(), Y.end(), 0.f);
        double decay = 0.0;
        for (int64_t j = j0; j < j1; ++j) {
          const double cd = chunk_decay.defined() ? chunk_decay.data<float>()[s.Chk(b, j, h)] : 0.0;
          const float a = static_cast<float>(std::exp(cd));
          const float* Dj = D.data<float>() + s.Chk(b, j, h) * W;
          // S_in[j+1] = exp(cd_j) S_in[j] + D_j (Lemma 4's carried state).
          if (S_in != nullptr) {
            std::copy(X.begin(), X.end(), S_in->data<float>() + s.Chk(b, j, h) * W);
            for (int64_t k = 0; k < W; ++k) X[k] = a * X[k] + Dj[k];
          }
          for (int64_t k = 0; k < W; ++k) Y[k] = a * Y[k] + Dj[k];
          decay += cd;
        }
        std::copy(Y.begin(), Y.end(), span_state->data<float>() + s.Blk(b, blk, h) * W);
        span_decay->data<float>()[s.Blk(b, blk, h)] = static_cast<float>(decay);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::ChunkOutputs(const SmatPlan& plan, const SmatSpan& span,
                                          const Tensor& phi, const Tensor& psi, const Tensor& v,
                                          const Tensor& lam, const Tensor& S_in, Tensor* ybar,
                                          Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, TokenDims(plan, span, phi, v, "phi"));
  SMAT_RETURN_IF_ERROR(CheckF32(phi, {s.batch, s.L, s.H, s.r}, "phi"));
  SMAT_RETURN_IF_ERROR(CheckF32(psi, {s.batch, s.L, s.H, s.r}, "psi"));
  SMAT_RETURN_IF_ERROR(CheckF32(v, {s.batch, s.L, s.H, s.dv}, "v"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(lam, {s.batch, s.L, s.H}, "lam"));
  SMAT_RETURN_IF_ERROR(CheckF32(S_in, {s.batch, s.Lc, s.H, s.r, s.p}, "S_in"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(ybar, {s.batch, s.L, s.H, s.p}, "ybar"));
  HeadGates g;
  std::vector<float> tile, vbar;
  const int64_t ldx = s.H * s.r, ldy = s.H * s.p;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      LoadHeadGates(s, lam, Tensor(), b, h, &g);
      for (int64_t j = 0; j < s.Lc; ++j) {
        const int64_t i0 = s.ChunkBegin(j), m = s.ChunkEnd(j) - i0;
        const float* Phi = phi.data<float>() + s.Tok(b, i0, h) * s.r;
        const float* Psi = psi.data<float>() + s.Tok(b, i0, h) * s.r;
        float* Y = ybar->data<float>() + s.Tok(b, i0, h) * s.p;
        // Earlier chunks: Y = diag(exp(lam)) Phi S_in[j].
        Sgemm(false, false, m, s.p, s.r, 1.f, Phi, ldx,
              S_in.data<float>() + s.Chk(b, j, h) * s.r * s.p, s.p, 0.f, Y, ldy);
        if (g.gated) {
          for (int64_t i = 0; i < m; ++i) {
            const float e = static_cast<float>(std::exp(g.lam[i0 + i]));
            for (int64_t k = 0; k < s.p; ++k) Y[i * ldy + k] *= e;
          }
        }
        // Within the chunk: Y += (W o tril(Phi Psi^T)) Vbar (eq. 10).
        tile.resize(m * m);
        Sgemm(false, true, m, m, s.r, 1.f, Phi, ldx, Psi, ldx, 0.f, tile.data(), m);
        MaskTile(g, i0, m, tile.data());
        GatherVbar(s, v.data<float>(), b, h, i0, m, nullptr, &vbar);
        Sgemm(false, false, m, s.p, m, 1.f, tile.data(), m, vbar.data(), s.p, 1.f, Y, ldy);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::ChunkStateGradients(const SmatPlan& plan, const SmatSpan& span,
                                                 const Tensor& phi, const Tensor& gbar,
                                                 const Tensor& lam, Tensor* S_in_bar,
                                                 Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, TokenDims(plan, span, phi, Tensor(), "phi"));
  s.p = gbar.defined() && gbar.rank() == 4 ? gbar.dim(3) : 0;
  s.dv = s.p - 1;
  SMAT_RETURN_IF_ERROR(CheckF32(phi, {s.batch, s.L, s.H, s.r}, "phi"));
  SMAT_RETURN_IF_ERROR(CheckF32(gbar, {s.batch, s.L, s.H, s.p}, "gbar"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(lam, {s.batch, s.L, s.H}, "lam"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(S_in_bar, {s.batch, s.Lc, s.H, s.r, s.p}, "S_in_bar"));
  HeadGates g;
  std::vector<float> phis;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      LoadHeadGates(s, lam, Tensor(), b, h, &g);
      for (int64_t j = 0; j < s.Lc; ++j) {
        const int64_t i0 = s.ChunkBegin(j), m = s.ChunkEnd(j) - i0;
        // S_in_bar[j] = (diag(exp(lam)) Phi)^T Gbar (eq. 19, gated).
        const float* Phi = phi.data<float>() + s.Tok(b, i0, h) * s.r;
        int64_t lda = s.H * s.r;
        if (g.gated) {
          const std::vector<double> w = ExpFromStart(g, i0, m);
          GatherScaledRows(s, phi.data<float>(), s.r, b, h, i0, m, w.data(), &phis);
          Phi = phis.data();
          lda = s.r;
        }
        Sgemm(true, false, s.r, s.p, m, 1.f, Phi, lda,
              gbar.data<float>() + s.Tok(b, i0, h) * s.p, s.H * s.p, 0.f,
              S_in_bar->data<float>() + s.Chk(b, j, h) * s.r * s.p, s.p);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::ChunkScanBackward(const SmatPlan& plan, const SmatSpan& span,
                                               const Tensor& S_in_bar, const Tensor& chunk_decay,
                                               const Tensor& incoming_grad, Tensor* D_bar,
                                               Tensor* span_state_grad, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, MakeSpanDims(plan, span));
  if (!S_in_bar.defined() || S_in_bar.rank() != 5) {
    return absl::InvalidArgumentError("smat cpu: S_in_bar must be [batch, Lc, H, r, p]");
  }
  s.batch = S_in_bar.dim(0);
  s.H = S_in_bar.dim(2);
  const int64_t r = S_in_bar.dim(3), p = S_in_bar.dim(4), W = r * p;
  SMAT_RETURN_IF_ERROR(CheckF32(S_in_bar, {s.batch, s.Lc, s.H, r, p}, "S_in_bar"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(chunk_decay, {s.batch, s.Lc, s.H}, "chunk_decay"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(incoming_grad, {s.batch, 2, s.H, r, p}, "incoming_grad"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(D_bar, {s.batch, s.Lc, s.H, r, p}, "D_bar"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(span_state_grad, {s.batch, 2, s.H, r, p}, "span_state_grad"));
  std::vector<float> R(W), Q(W);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      for (int blk : {kDistantBlock, kRecentBlock}) {
        int64_t j0, j1;
        BlockChunks(s, blk, &j0, &j1);
        // R: Sigma through this span's chunks only; Q: the incoming_grad path.
        std::fill(R.begin(), R.end(), 0.f);
        if (incoming_grad.defined() && j0 < j1) {
          const float* in = incoming_grad.data<float>() + s.Blk(b, blk, h) * W;
          std::copy(in, in + W, Q.begin());
        } else {
          std::fill(Q.begin(), Q.end(), 0.f);
        }
        for (int64_t j = j1 - 1; j >= j0; --j) {
          float* Db = D_bar->data<float>() + s.Chk(b, j, h) * W;
          for (int64_t k = 0; k < W; ++k) Db[k] = R[k] + Q[k];  // D_bar[j] = Sigma[j+1]
          const double cd = chunk_decay.defined() ? chunk_decay.data<float>()[s.Chk(b, j, h)] : 0.0;
          const float a = static_cast<float>(std::exp(cd));
          const float* Sb = S_in_bar.data<float>() + s.Chk(b, j, h) * W;
          for (int64_t k = 0; k < W; ++k) {
            R[k] = Sb[k] + a * R[k];
            Q[k] = a * Q[k];
          }
        }
        std::copy(R.begin(), R.end(), span_state_grad->data<float>() + s.Blk(b, blk, h) * W);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuSmatKernels::ChunkOutputsBackward(const SmatPlan& plan, const SmatSpan& span,
                                                  const Tensor& phi, const Tensor& psi,
                                                  const Tensor& v, const Tensor& lam,
                                                  const Tensor& chunk_decay, const Tensor& S_in,
                                                  const Tensor& gbar, const Tensor& D_bar,
                                                  Tensor* phi_bar, Tensor* psi_bar, Tensor* v_bar,
                                                  SmatWrite write, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SpanDims s, TokenDims(plan, span, phi, v, "phi"));
  const Shape tok_r = {s.batch, s.L, s.H, s.r}, tok_v = {s.batch, s.L, s.H, s.dv};
  const Shape chunk_state = {s.batch, s.Lc, s.H, s.r, s.p};
  SMAT_RETURN_IF_ERROR(CheckF32(phi, tok_r, "phi"));
  SMAT_RETURN_IF_ERROR(CheckF32(psi, tok_r, "psi"));
  SMAT_RETURN_IF_ERROR(CheckF32(v, tok_v, "v"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(lam, {s.batch, s.L, s.H}, "lam"));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(chunk_decay, {s.batch, s.Lc, s.H}, "chunk_decay"));
  SMAT_RETURN_IF_ERROR(CheckF32(S_in, chunk_state, "S_in"));
  SMAT_RETURN_IF_ERROR(CheckF32(gbar, {s.batch, s.L, s.H, s.p}, "gbar"));
  SMAT_RETURN_IF_ERROR(CheckF32(D_bar, chunk_state, "D_bar"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(phi_bar, tok_r, "phi_bar"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(psi_bar, tok_r, "psi_bar"));
  SMAT_RETURN_IF_ERROR(CheckOutF32(v_bar, tok_v, "v_bar"));
  if (write == SmatWrite::kAssign) {
    // Every token of the span belongs to one chunk below: zero, then add.
    for (Tensor* out : {phi_bar, psi_bar, v_bar}) {
      std::fill(out->data<float>(), out->data<float>() + out->numel(), 0.f);
    }
  }
  HeadGates g;
  std::vector<float> A, Bt, vbar, vw, gs, psw;
  const int64_t ldx = s.H * s.r, ldg = s.H * s.p, ldv = s.H * s.dv, W = s.r * s.p;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      LoadHeadGates(s, lam, chunk_decay, b, h, &g);
      for (int64_t j = 0; j < s.Lc; ++j) {
        const int64_t i0 = s.ChunkBegin(j), m = s.ChunkEnd(j) - i0, row = s.Tok(b, i0, h);
        const float* Phi = phi.data<float>() + row * s.r;
        const float* Psi = psi.data<float>() + row * s.r;
        const float* G = gbar.data<float>() + row * s.p;
        const float* Sj = S_in.data<float>() + s.Chk(b, j, h) * W;
        const float* Dbj = D_bar.data<float>() + s.Chk(b, j, h) * W;
        float* phib = phi_bar->data<float>() + row * s.r;
        float* psib = psi_bar->data<float>() + row * s.r;
        float* vb = v_bar->data<float>() + row * s.dv;
        GatherVbar(s, v.data<float>(), b, h, i0, m, nullptr, &vbar);
        // A = W o tril(Phi Psi^T), Bt = W o tril(Gbar Vbar^T): the rebuilt tiles.
        A.resize(m * m);
        Bt.resize(m * m);
        Sgemm(false, true, m, m, s.r, 1.f, Phi, ldx, Psi, ldx, 0.f, A.data(), m);
        MaskTile(g, i0, m, A.data());
        Sgemm(false, true, m, m, s.p, 1.f, G, ldg, vbar.data(), s.p, 0.f, Bt.data(), m);
        MaskTile(g, i0, m, Bt.data());
        // phi_bar += diag(exp(lam)) Gbar S_in^T + Bt Psi.
        const std::vector<double> from_start = ExpFromStart(g, i0, m);
        GatherScaledRows(s, gbar.data<float>(), s.p, b, h, i0, m, from_start.data(), &gs);
        Sgemm(false, true, m, s.r, s.p, 1.f, gs.data(), s.p, Sj, s.p, 1.f, phib, ldx);
        Sgemm(false, false, m, s.r, m, 1.f, Bt.data(), m, Psi, ldx, 1.f, phib, ldx);
        // Zbar_s = sum_t W[t,s] phi_t gbar_t^T + w_s D_bar[j], w_s = exp(cd_j - lam_s):
        // psi_bar += Bt^T Phi + diag(w) Vbar D_bar^T.
        const std::vector<double> to_end = ExpToEnd(g, j, i0, m);
        Sgemm(true, false, m, s.r, m, 1.f, Bt.data(), m, Phi, ldx, 1.f, psib, ldx);
        GatherVbar(s, v.data<float>(), b, h, i0, m, to_end.data(), &vw);
        Sgemm(false, true, m, s.r, s.p, 1.f, vw.data(), s.p, Dbj, s.p, 1.f, psib, ldx);
        // v_bar += [A^T Gbar + diag(w) Psi D_bar][:, 0:dv].
        Sgemm(true, false, m, s.dv, m, 1.f, A.data(), m, G, ldg, 1.f, vb, ldv);
        GatherScaledRows(s, psi.data<float>(), s.r, b, h, i0, m, to_end.data(), &psw);
        Sgemm(false, false, m, s.dv, s.r, 1.f, psw.data(), s.r, Dbj, s.p, 1.f, vb, ldv);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace smat_cpu
}  // namespace smat
