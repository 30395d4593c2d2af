// The SMat mixer, content routing and the short-conv halo exchange: see
// trainer/smat_mixer.h.
#include "trainer/smat_mixer.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/rng.h"
#include "core/status.h"
#include "trainer/layers.h"

namespace smat {
namespace {

// Philox streams of the routing hash, far from the parameter streams (0, 1,
// ... one per parameter) so the two never share numbers.
constexpr uint64_t kPointStream = 0x524f555445000001ull;      // "ROUTE" 1
constexpr uint64_t kDirectionStream = 0x524f555445000002ull;  // "ROUTE" 2

constexpr int64_t kHalo = kShortConvWidth - 1;  // rows before the span the conv reads

// Index of the token id in the hash streams: -1 ("no token") -> 0.
uint64_t HashIndex(int64_t token) { return static_cast<uint64_t>(token + 1); }

int64_t AddBytes(const Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

}  // namespace

int64_t MixerActivations::Bytes() const {
  int64_t b = 0;
  // q_in / k_in / v share the projection buffers without a conv: count once.
  for (const Tensor* t : {&q_proj, &k_proj, &v_proj, &q_prefix, &k_prefix, &v_prefix, &phi,
                          &psi_raw, &key_gate, &decay_in, &logg}) {
    b += AddBytes(*t);
  }
  if (q_in.defined() && q_in.raw() != q_proj.raw()) b += AddBytes(q_in);
  if (k_in.defined() && k_in.raw() != k_proj.raw()) b += AddBytes(k_in);
  if (v.defined() && v.raw() != v_proj.raw()) b += AddBytes(v);
  if (psi.defined() && psi.raw() != psi_raw.raw()) b += AddBytes(psi);
  const SpSmatSaved& s = smat.saved;
  for (const Tensor* t : {&smat.o, &s.local.lam, &s.local.chunk_decay, &s.local.S_in,
                          &s.local.U, &s.local.den, &s.span_decays, &s.recent_offset,
                          &s.distant_tail_decay}) {
    b += AddBytes(*t);
  }
  return b;
}

absl::StatusOr<SmatMixer> SmatMixer::Create(const TrainConfig& config, MixerParameters params,
                                            Backend& backend) {
  const ModelConfig& m = config.model();
  if (!ModelConfig::FeatureMap_IsValid(m.feature_map())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config: model.feature_map = ", m.feature_map(),
        " is not a feature map; expected ELU_PLUS_ONE, RELU, SOFTPLUS or EXP"));
  }
  SMAT_ASSIGN_OR_RETURN(ModelKernels * kernels, backend.model());
  SMAT_CHECK(params.wq && params.wk && params.wv && params.wo);
  SMAT_CHECK(!m.short_conv() || (params.conv_q && params.conv_k && params.conv_v));
  SMAT_CHECK(!m.gated() || (params.w_decay && params.b_decay));
  SMAT_CHECK(!m.key_gate() || (params.w_key_gate && params.b_key_gate));
  return SmatMixer(backend, *kernels, params, m.feature_map(), m.heads(), m.head_dim_qk(),
                   m.head_dim_v(), config.smat().eps());
}

absl::Status SmatMixer::Features(const Tensor& x, Tensor& y) {
  switch (features_) {
    case ModelConfig::ELU_PLUS_ONE:
      return FeatureMapForward(FeatureMap::kEluPlusOne, x, &y);
    case ModelConfig::RELU:
      return FeatureMapForward(FeatureMap::kReluEps, x, &y);
    case ModelConfig::SOFTPLUS:
      return kernels_->SoftplusForward(x, y);
    case ModelConfig::EXP: {
      // Per head: the max is taken over that head's r features.
      Tensor yr = y.View(0, {x.numel() / r_, r_});
      return kernels_->ExpRowMaxForward(x.View(0, {x.numel() / r_, r_}), yr);
    }
    default:
      break;
  }
  SMAT_CHECK(false);  // Create rejected every other value
  return absl::OkStatus();
}

absl::Status SmatMixer::FeaturesBackward(const Tensor& x, const Tensor& y, const Tensor& dy,
                                         Tensor& dx) {
  switch (features_) {
    case ModelConfig::ELU_PLUS_ONE:
      return FeatureMapBackward(FeatureMap::kEluPlusOne, x, dy, &dx);
    case ModelConfig::RELU:
      return FeatureMapBackward(FeatureMap::kReluEps, x, dy, &dx);
    case ModelConfig::SOFTPLUS:
      return kernels_->SoftplusBackward(x, dy, dx);
    case ModelConfig::EXP: {
      const int64_t M = x.numel() / r_;
      Tensor dxr = dx.View(0, {M, r_});
      return kernels_->ExpRowMaxBackward(x.View(0, {M, r_}), y.View(0, {M, r_}),
                                         dy.View(0, {M, r_}), dxr);
    }
    default:
      break;
  }
  SMAT_CHECK(false);
  return absl::OkStatus();
}

absl::Status SmatMixer::Forward(const MixerStep& step, const Tensor& x, MixerActivations* a,
                                Tensor* out) {
  Backend& be = *backend_;
  const int64_t N = x.dim(0), W = x.dim(1), nb = step.batch, L = step.L();
  SMAT_CHECK(N == nb * L);
  const int64_t Cq = H_ * r_, Cv = H_ * dv_;
  *a = MixerActivations();
  SMAT_ASSIGN_OR_RETURN(a->q_proj, NewActivation(be, {N, Cq}));
  SMAT_ASSIGN_OR_RETURN(a->k_proj, NewActivation(be, {N, Cq}));
  SMAT_ASSIGN_OR_RETURN(a->v_proj, NewActivation(be, {N, Cv}));
  SMAT_RETURN_IF_ERROR(LinearForward(be, x, *p_.wq, nullptr, a->q_proj));
  SMAT_RETURN_IF_ERROR(LinearForward(be, x, *p_.wk, nullptr, a->k_proj));
  SMAT_RETURN_IF_ERROR(LinearForward(be, x, *p_.wv, nullptr, a->v_proj));

  if (p_.conv_q != nullptr) {
    // The conv reads 3 rows before the span: one halo exchange for q, k, v.
    const std::vector<Tensor> proj = {a->q_proj.View(0, {nb, L, Cq}),
                                      a->k_proj.View(0, {nb, L, Cq}),
                                      a->v_proj.View(0, {nb, L, Cv})};
    SMAT_ASSIGN_OR_RETURN(std::vector<Tensor> prefix,
                          ExchangeConvPrefix(*step.comm, step.spans, proj));
    a->q_prefix = prefix[0];
    a->k_prefix = prefix[1];
    a->v_prefix = prefix[2];
    SMAT_ASSIGN_OR_RETURN(a->q_in, NewActivation(be, {N, Cq}));
    SMAT_ASSIGN_OR_RETURN(a->k_in, NewActivation(be, {N, Cq}));
    SMAT_ASSIGN_OR_RETURN(a->v, NewActivation(be, {N, Cv}));
    Tensor qy = a->q_in.View(0, {nb, L, Cq}), ky = a->k_in.View(0, {nb, L, Cq}),
           vy = a->v.View(0, {nb, L, Cv});
    SMAT_RETURN_IF_ERROR(kernels_->ShortConvForward(proj[0], prefix[0], p_.conv_q->value, qy));
    SMAT_RETURN_IF_ERROR(kernels_->ShortConvForward(proj[1], prefix[1], p_.conv_k->value, ky));
    SMAT_RETURN_IF_ERROR(kernels_->ShortConvForward(proj[2], prefix[2], p_.conv_v->value, vy));
  } else {
    a->q_in = a->q_proj;
    a->k_in = a->k_proj;
    a->v = a->v_proj;
  }

  SMAT_ASSIGN_OR_RETURN(a->phi, NewActivation(be, {N, Cq}));
  SMAT_ASSIGN_OR_RETURN(a->psi_raw, NewActivation(be, {N, Cq}));
  SMAT_RETURN_IF_ERROR(Features(a->q_in, a->phi));
  SMAT_RETURN_IF_ERROR(Features(a->k_in, a->psi_raw));
  if (p_.w_key_gate != nullptr) {
    SMAT_ASSIGN_OR_RETURN(a->key_gate, NewActivation(be, {N, H_}));
    SMAT_RETURN_IF_ERROR(LinearForward(be, x, *p_.w_key_gate, p_.b_key_gate, a->key_gate));
    SMAT_ASSIGN_OR_RETURN(a->psi, NewActivation(be, {N, H_, r_}));
    SMAT_RETURN_IF_ERROR(
        kernels_->SigmoidScaleForward(a->psi_raw.View(0, {N, H_, r_}), a->key_gate, a->psi));
    a->psi = a->psi.View(0, {N, Cq});
  } else {
    a->psi = a->psi_raw;
  }
  if (p_.w_decay != nullptr) {
    SMAT_ASSIGN_OR_RETURN(a->decay_in, NewActivation(be, {N, H_}));
    SMAT_RETURN_IF_ERROR(LinearForward(be, x, *p_.w_decay, p_.b_decay, a->decay_in));
    SMAT_ASSIGN_OR_RETURN(a->logg, NewActivation(be, {N, H_}));
    SMAT_RETURN_IF_ERROR(kernels_->NegSoftplusForward(a->decay_in, a->logg));
  }

  SmatInputs in;
  in.phi = a->phi.View(0, {nb, L, H_, r_});
  in.psi = a->psi.View(0, {nb, L, H_, r_});
  in.v = a->v.View(0, {nb, L, H_, dv_});
  if (a->logg.defined()) in.logg = a->logg.View(0, {nb, L, H_});
  in.prof = step.prof;
  in.type = step.type;
  in.eps = eps_;
  SMAT_RETURN_IF_ERROR(
      SequenceParallelSmatForward(be, *step.comm, *step.plan, step.spans, in, &a->smat));

  SMAT_ASSIGN_OR_RETURN(*out, NewActivation(be, {N, W}));
  return LinearForward(be, a->smat.o.View(0, {N, Cv}), *p_.wo, nullptr, *out);
}

absl::Status SmatMixer::Backward(const MixerStep& step, const Tensor& x,
                                 const MixerActivations& a, const Tensor& dout, Tensor* dx) {
  Backend& be = *backend_;
  const int64_t N = x.dim(0), W = x.dim(1), nb = step.batch, L = step.L();
  const int64_t Cq = H_ * r_, Cv = H_ * dv_;

  SMAT_ASSIGN_OR_RETURN(Tensor d_o, NewActivation(be, {N, Cv}));  // [N, H dv]
  SMAT_RETURN_IF_ERROR(
      LinearBackward(be, a.smat.o.View(0, {N, Cv}), dout, *p_.wo, nullptr, &d_o, false));

  SmatInputs in;
  in.phi = a.phi.View(0, {nb, L, H_, r_});
  in.psi = a.psi.View(0, {nb, L, H_, r_});
  in.v = a.v.View(0, {nb, L, H_, dv_});
  if (a.logg.defined()) in.logg = a.logg.View(0, {nb, L, H_});
  in.prof = step.prof;
  in.type = step.type;
  in.eps = eps_;
  SmatGradients g;
  SMAT_RETURN_IF_ERROR(SequenceParallelSmatBackward(be, *step.comm, *step.plan, step.spans, in,
                                                    a.smat, d_o.View(0, {nb, L, H_, dv_}), &g));

  SMAT_ASSIGN_OR_RETURN(*dx, NewZeros(be, {N, W}));
  if (p_.w_decay != nullptr) {
    SMAT_ASSIGN_OR_RETURN(Tensor d_decay, NewActivation(be, {N, H_}));  // [N, H]
    SMAT_RETURN_IF_ERROR(
        kernels_->NegSoftplusBackward(a.decay_in, g.logg.View(0, {N, H_}), d_decay));
    SMAT_RETURN_IF_ERROR(LinearBackward(be, x, d_decay, *p_.w_decay, p_.b_decay, dx, true));
  }
  Tensor d_psi_raw = g.psi.View(0, {N, Cq});  // [N, H r]
  if (p_.w_key_gate != nullptr) {
    SMAT_ASSIGN_OR_RETURN(Tensor d_raw, NewActivation(be, {N, H_, r_}));  // [N, H, r]
    SMAT_ASSIGN_OR_RETURN(Tensor d_gate, NewActivation(be, {N, H_}));     // [N, H]
    SMAT_RETURN_IF_ERROR(kernels_->SigmoidScaleBackward(a.psi_raw.View(0, {N, H_, r_}),
                                                        a.key_gate, g.psi.View(0, {N, H_, r_}),
                                                        d_raw, d_gate));
    SMAT_RETURN_IF_ERROR(
        LinearBackward(be, x, d_gate, *p_.w_key_gate, p_.b_key_gate, dx, true));
    d_psi_raw = d_raw.View(0, {N, Cq});
  }
  // Gradients of the feature-map inputs (conv outputs or projections).
  SMAT_ASSIGN_OR_RETURN(Tensor d_q_in, NewActivation(be, {N, Cq}));
  SMAT_ASSIGN_OR_RETURN(Tensor d_k_in, NewActivation(be, {N, Cq}));
  SMAT_RETURN_IF_ERROR(FeaturesBackward(a.q_in, a.phi, g.phi.View(0, {N, Cq}), d_q_in));
  SMAT_RETURN_IF_ERROR(FeaturesBackward(a.k_in, a.psi_raw, d_psi_raw, d_k_in));
  Tensor d_v_in = g.v.View(0, {N, Cv});

  Tensor d_q = d_q_in, d_k = d_k_in, d_v = d_v_in;  // gradients of the projections
  if (p_.conv_q != nullptr) {
    SMAT_ASSIGN_OR_RETURN(d_q, NewActivation(be, {N, Cq}));
    SMAT_ASSIGN_OR_RETURN(d_k, NewActivation(be, {N, Cq}));
    SMAT_ASSIGN_OR_RETURN(d_v, NewActivation(be, {N, Cv}));
    std::vector<Tensor> d_proj = {d_q.View(0, {nb, L, Cq}), d_k.View(0, {nb, L, Cq}),
                                  d_v.View(0, {nb, L, Cv})};
    std::vector<Tensor> d_prefix(3);
    const Tensor* xs[3] = {&a.q_proj, &a.k_proj, &a.v_proj};
    const Tensor* prefixes[3] = {&a.q_prefix, &a.k_prefix, &a.v_prefix};
    const Tensor* dys[3] = {&d_q_in, &d_k_in, &d_v_in};
    Parameter* ws[3] = {p_.conv_q, p_.conv_k, p_.conv_v};
    for (int i = 0; i < 3; ++i) {
      const int64_t C = i < 2 ? Cq : Cv;
      SMAT_ASSIGN_OR_RETURN(d_prefix[i], NewActivation(be, {nb, kHalo, C}));
      SMAT_RETURN_IF_ERROR(kernels_->ShortConvBackward(
          xs[i]->View(0, {nb, L, C}), *prefixes[i], ws[i]->value, dys[i]->View(0, {nb, L, C}),
          d_proj[i], d_prefix[i], ws[i]->grad));
    }
    SMAT_RETURN_IF_ERROR(ReturnConvPrefixGradients(*step.comm, step.spans, d_prefix, d_proj));
  }
  SMAT_RETURN_IF_ERROR(LinearBackward(be, x, d_q, *p_.wq, nullptr, dx, true));
  SMAT_RETURN_IF_ERROR(LinearBackward(be, x, d_k, *p_.wk, nullptr, dx, true));
  return LinearBackward(be, x, d_v, *p_.wv, nullptr, dx, true);
}

// --- routing -------------------------------------------------------------------------------

int64_t TokenPoint(const SmatGeometry& geo, uint64_t seed, int64_t token) {
  if (geo.P <= 1) return 0;
  return static_cast<int64_t>(PhiloxWord(seed, kPointStream, HashIndex(token)) %
                              static_cast<uint64_t>(geo.P));
}

int64_t TokenDirection(const SmatGeometry& geo, uint64_t seed, int64_t token) {
  if (geo.num_directions <= 1) return 0;
  return static_cast<int64_t>(PhiloxWord(seed, kDirectionStream, HashIndex(token)) %
                              static_cast<uint64_t>(geo.num_directions));
}

int64_t TokenType(const SmatGeometry& geo, uint64_t seed, int64_t token) {
  if (geo.d == 1) return 0;
  const int64_t x = TokenPoint(geo, seed, token);
  const int64_t e = TokenDirection(geo, seed, token);
  int64_t b = 0;  // a_e . x mod q: the offset of the hyperplane through x
  for (int k = 0; k < geo.D; ++k) {
    b = (b + int64_t{geo.directions[e * geo.D + k]} * geo.Coordinate(x, k)) % geo.q;
  }
  return geo.flat_to_type[e * geo.q + b];
}

absl::Status TokenHashRouting(const SmatPlan& plan, uint64_t seed, const Tensor& tokens,
                              const SmatSpan& span, int64_t heads, Tensor* prof, Tensor* type) {
  if (tokens.dtype() != DType::kI32 || tokens.rank() != 2 || tokens.dim(1) != plan.T ||
      !tokens.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat("token-hash routing: tokens must be int32 "
                                                   "[batch, T = ",
                                                   plan.T, "] on the host; got ",
                                                   tokens.DebugString()));
  }
  const int64_t nb = tokens.dim(0), T = plan.T, L = span.length();
  SMAT_ASSIGN_OR_RETURN(*prof, Tensor::Empty({nb, L, heads}, DType::kI32));
  SMAT_ASSIGN_OR_RETURN(*type, Tensor::Empty({nb, L, heads}, DType::kI32));
  const int32_t* tok = tokens.data<int32_t>();  // [batch, T]
  int32_t* pf = prof->data<int32_t>();          // [batch, L, H]
  int32_t* ty = type->data<int32_t>();          // [batch, L, H]
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i = 0; i < L; ++i) {
      const int64_t s = span.t0 + i;
      const int64_t before = s == 0 ? -1 : tok[b * T + s - 1];
      const int32_t p = static_cast<int32_t>(TokenPoint(plan.geo, seed, before));
      const int32_t h = static_cast<int32_t>(TokenType(plan.geo, seed, tok[b * T + s]));
      for (int64_t k = 0; k < heads; ++k) {
        pf[(b * L + i) * heads + k] = p;
        ty[(b * L + i) * heads + k] = h;
      }
    }
  }
  return absl::OkStatus();
}

// --- short-conv halo ----------------------------------------------------------------------

absl::StatusOr<std::vector<Tensor>> ExchangeConvPrefix(Communicator& comm,
                                                       const std::vector<SmatSpan>& spans,
                                                       const std::vector<Tensor>& proj) {
  const int W = comm.size(), me = comm.rank();
  const int64_t nb = proj[0].dim(0), L = proj[0].dim(1);
  int64_t C = 0;
  for (const Tensor& t : proj) C += t.dim(2);
  // send [batch, K-1, C]: this rank's last K-1 rows of every projection, side
  // by side (rows before the span, when L < K-1, are never read: see below).
  SMAT_ASSIGN_OR_RETURN(Tensor send, Tensor::Zeros({nb, kHalo, C}, DType::kF32));
  SMAT_ASSIGN_OR_RETURN(Tensor recv, Tensor::Empty({W, nb, kHalo, C}, DType::kF32));
  float* sp = send.data<float>();
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i = 0; i < kHalo; ++i) {
      const int64_t row = L - kHalo + i;
      if (row < 0) continue;
      int64_t c0 = 0;
      for (const Tensor& t : proj) {
        const int64_t Ci = t.dim(2);
        std::memcpy(sp + (b * kHalo + i) * C + c0, t.data<float>() + (b * L + row) * Ci,
                    sizeof(float) * Ci);
        c0 += Ci;
      }
    }
  }
  SMAT_RETURN_IF_ERROR(Annotate(comm.AllGather(send, recv), "short conv halo"));
  std::vector<Tensor> prefix;
  for (const Tensor& t : proj) {
    SMAT_ASSIGN_OR_RETURN(Tensor p, Tensor::Zeros({nb, kHalo, t.dim(2)}, DType::kF32));
    prefix.push_back(p);
  }
  const float* rp = recv.data<float>();  // [W, batch, K-1, C]
  const int64_t t0 = spans[me].t0;
  for (int64_t i = 0; i < kHalo; ++i) {
    const int64_t s = t0 - kHalo + i;
    if (s < 0) continue;  // before the sequence: zeros
    // The owner k of row s ends at or before t0, so s >= t1_k - (K-1): the row
    // is among the last K-1 rows the owner sent.
    int k = 0;
    while (k < W && !(spans[k].t0 <= s && s < spans[k].t1)) ++k;
    SMAT_CHECK(k < me);
    const int64_t j = s - (spans[k].t1 - kHalo);
    SMAT_CHECK(j >= 0 && j < kHalo);
    for (int64_t b = 0; b < nb; ++b) {
      int64_t c0 = 0;
      for (Tensor& p : prefix) {
        const int64_t Ci = p.dim(2);
        std::memcpy(p.data<float>() + (b * kHalo + i) * Ci,
                    rp + ((int64_t{k} * nb + b) * kHalo + j) * C + c0, sizeof(float) * Ci);
        c0 += Ci;
      }
    }
  }
  return prefix;
}

absl::Status ReturnConvPrefixGradients(Communicator& comm, const std::vector<SmatSpan>& spans,
                                       const std::vector<Tensor>& d_prefix,
                                       std::vector<Tensor>& d_proj) {
  const int W = comm.size(), me = comm.rank();
  const int64_t nb = d_proj[0].dim(0), L = d_proj[0].dim(1);
  int64_t C = 0;
  for (const Tensor& t : d_prefix) C += t.dim(2);
  SMAT_ASSIGN_OR_RETURN(Tensor send, Tensor::Empty({nb, kHalo, C}, DType::kF32));
  SMAT_ASSIGN_OR_RETURN(Tensor recv, Tensor::Empty({W, nb, kHalo, C}, DType::kF32));
  float* sp = send.data<float>();
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t i = 0; i < kHalo; ++i) {
      int64_t c0 = 0;
      for (const Tensor& t : d_prefix) {
        const int64_t Ci = t.dim(2);
        std::memcpy(sp + (b * kHalo + i) * C + c0, t.data<float>() + (b * kHalo + i) * Ci,
                    sizeof(float) * Ci);
        c0 += Ci;
      }
    }
  }
  SMAT_RETURN_IF_ERROR(Annotate(comm.AllGather(send, recv), "short conv halo gradients"));
  const float* rp = recv.data<float>();  // [W, batch, K-1, C]
  const SmatSpan mine = spans[me];
  // Later ranks in increasing order, rows in increasing order: a fixed sum.
  for (int j = me + 1; j < W; ++j) {
    for (int64_t i = 0; i < kHalo; ++i) {
      const int64_t s = spans[j].t0 - kHalo + i;
      if (s < mine.t0 || s >= mine.t1) continue;
      const int64_t row = s - mine.t0;
      for (int64_t b = 0; b < nb; ++b) {
        int64_t c0 = 0;
        for (Tensor& d : d_proj) {
          const int64_t Ci = d.dim(2);
          float* dst = d.data<float>() + (b * L + row) * Ci;
          const float* src = rp + ((int64_t{j} * nb + b) * kHalo + i) * C + c0;
          for (int64_t c = 0; c < Ci; ++c) dst[c] += src[c];
          c0 += Ci;
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace smat
