// The SMat mixer, content routing and the short-conv halo exchange: see
// trainer/smat_mixer.h.
#include "trainer/smat_mixer.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/rng.h"
#include "core/status.h"
#include "kernels/smat.h"
#include "trainer/layers.h"
#include "trainer/phase_timer.h"

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
  if (smat_phi.defined() && smat_phi.raw() != phi.raw()) b += AddBytes(smat_phi);
  if (smat_psi.defined() && smat_psi.raw() != psi.raw()) b += AddBytes(smat_psi);
  if (smat_v.defined() && smat_v.raw() != v.raw()) b += AddBytes(smat_v);
  const SpSmatSaved& s = smat.saved;
  for (const Tensor* t : {&smat.o, &s.local.lam, &s.local.chunk_decay, &s.local.S_in,
                          &s.local.U, &s.local.den, &s.span_decays, &s.recent_offset,
                          &s.distant_tail_decay}) {
    b += AddBytes(*t);
  }
  return b;
}

absl::StatusOr<SmatMixer> SmatMixer::Create(const TrainConfig& config, MixerParameters params,
                                            Backend& backend, Dense& dense) {
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
  return SmatMixer(backend, *kernels, dense, params, m.feature_map(), m.heads(), m.head_dim_qk(),
                   m.head_dim_v(), config.smat().eps());
}

absl::Status SmatMixer::Features(const Tensor& x, Tensor& y) {
  switch (features_) {
    case ModelConfig::ELU_PLUS_ONE:
      return kernels_->FeatureMapForward(FeatureMap::kEluPlusOne, x, y);
    case ModelConfig::RELU:
      return kernels_->FeatureMapForward(FeatureMap::kReluEps, x, y);
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
      return kernels_->FeatureMapBackward(FeatureMap::kEluPlusOne, x, dy, dx);
    case ModelConfig::RELU:
      return kernels_->FeatureMapBackward(FeatureMap::kReluEps, x, dy, dx);
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

absl::StatusOr<Tensor> SmatMixer::SmatOperand(const Tensor& t) {
  if (!dense_->bf16()) return t;
  Tensor t16 = t;  // written in bf16 by its kernel already, or cast here
  if (t.dtype() != DType::kBF16) {
    SMAT_ASSIGN_OR_RETURN(t16, Tensor::Empty(t.shape(), DType::kBF16, backend_->allocator()));
    SMAT_RETURN_IF_ERROR(kernels_->Cast(t, t16));
  }
  // The CUDA SMat kernels read bf16 features; the CPU ones are fp32, so there
  // they get the same bf16-rounded values in fp32 (the rounding, not the
  // storage, is what the precision changes).
  if (!backend_->device().is_cpu()) return t16;
  SMAT_ASSIGN_OR_RETURN(Tensor wide, NewActivation(*backend_, t.shape()));
  SMAT_RETURN_IF_ERROR(kernels_->Cast(t16, wide));
  return wide;
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
  // One bf16 cast of x (run.bf16) serves the five products that read it.
  SMAT_ASSIGN_OR_RETURN(const Tensor xs, dense_->Operand(x, Dense::kInput));
  {
    PhaseScope phase(be, "fwd.mixer.qkv");
    SMAT_RETURN_IF_ERROR(dense_->Forward(xs, *p_.wq, nullptr, a->q_proj));
    SMAT_RETURN_IF_ERROR(dense_->Forward(xs, *p_.wk, nullptr, a->k_proj));
    SMAT_RETURN_IF_ERROR(dense_->Forward(xs, *p_.wv, nullptr, a->v_proj));
  }

  std::optional<PhaseScope> stage(std::in_place, be, "fwd.mixer.conv_features");
  // The features are read only by the SMat op unless a backward needs them
  // (EXP's reads y; the key gate's reads psi_raw): then fp32, else written in
  // the op's dtype.
  const bool y_free = features_ != ModelConfig::EXP;
  SMAT_ASSIGN_OR_RETURN(a->phi, y_free ? dense_->NewOperand({N, Cq}) : NewActivation(be, {N, Cq}));
  SMAT_ASSIGN_OR_RETURN(a->psi_raw, y_free && p_.w_key_gate == nullptr
                                        ? dense_->NewOperand({N, Cq})
                                        : NewActivation(be, {N, Cq}));
  // Softplus features of conv outputs: the conv writes them beside its output
  // (ShortConvSoftplusForward, the same operations).
  const bool fused = p_.conv_q != nullptr && features_ == ModelConfig::SOFTPLUS;
  if (p_.conv_q != nullptr) {
    // The conv reads 3 rows before the span: one halo exchange for q, k, v.
    const std::vector<Tensor> proj = {a->q_proj.View(0, {nb, L, Cq}),
                                      a->k_proj.View(0, {nb, L, Cq}),
                                      a->v_proj.View(0, {nb, L, Cv})};
    SMAT_ASSIGN_OR_RETURN(std::vector<Tensor> prefix,
                          ExchangeConvPrefix(be, *step.comm, step.spans, proj));
    a->q_prefix = prefix[0];
    a->k_prefix = prefix[1];
    a->v_prefix = prefix[2];
    SMAT_ASSIGN_OR_RETURN(a->q_in, NewActivation(be, {N, Cq}));
    SMAT_ASSIGN_OR_RETURN(a->k_in, NewActivation(be, {N, Cq}));
    // v is read only by the SMat op (the conv's backward reads v_proj): in
    // the op's dtype.
    SMAT_ASSIGN_OR_RETURN(a->v, dense_->NewOperand({N, Cv}));
    Tensor qy = a->q_in.View(0, {nb, L, Cq}), ky = a->k_in.View(0, {nb, L, Cq}),
           vy = a->v.View(0, {nb, L, Cv});
    if (fused) {
      Tensor qf = a->phi.View(0, {nb, L, Cq}), kf = a->psi_raw.View(0, {nb, L, Cq});
      SMAT_RETURN_IF_ERROR(
          kernels_->ShortConvSoftplusForward(proj[0], prefix[0], p_.conv_q->value, qy, qf));
      SMAT_RETURN_IF_ERROR(
          kernels_->ShortConvSoftplusForward(proj[1], prefix[1], p_.conv_k->value, ky, kf));
    } else {
      SMAT_RETURN_IF_ERROR(kernels_->ShortConvForward(proj[0], prefix[0], p_.conv_q->value, qy));
      SMAT_RETURN_IF_ERROR(kernels_->ShortConvForward(proj[1], prefix[1], p_.conv_k->value, ky));
    }
    SMAT_RETURN_IF_ERROR(kernels_->ShortConvForward(proj[2], prefix[2], p_.conv_v->value, vy));
  } else {
    a->q_in = a->q_proj;
    a->k_in = a->k_proj;
    a->v = a->v_proj;
  }

  if (!fused) {
    SMAT_RETURN_IF_ERROR(Features(a->q_in, a->phi));
    SMAT_RETURN_IF_ERROR(Features(a->k_in, a->psi_raw));
  }
  stage.emplace(be, "fwd.mixer.gates");
  if (p_.w_key_gate != nullptr) {
    SMAT_ASSIGN_OR_RETURN(a->key_gate, NewActivation(be, {N, H_}));
    SMAT_RETURN_IF_ERROR(dense_->NarrowForward(xs, *p_.w_key_gate, p_.b_key_gate, a->key_gate));
    // psi is read only by the SMat op (the gate's backward reads psi_raw): in
    // the op's dtype.
    SMAT_ASSIGN_OR_RETURN(a->psi, dense_->NewOperand({N, H_, r_}));
    SMAT_RETURN_IF_ERROR(
        kernels_->SigmoidScaleForward(a->psi_raw.View(0, {N, H_, r_}), a->key_gate, a->psi));
    a->psi = a->psi.View(0, {N, Cq});
  } else {
    a->psi = a->psi_raw;
  }
  if (p_.w_decay != nullptr) {
    SMAT_ASSIGN_OR_RETURN(a->decay_in, NewActivation(be, {N, H_}));
    SMAT_RETURN_IF_ERROR(dense_->NarrowForward(xs, *p_.w_decay, p_.b_decay, a->decay_in));
    SMAT_ASSIGN_OR_RETURN(a->logg, NewActivation(be, {N, H_}));
    SMAT_RETURN_IF_ERROR(kernels_->NegSoftplusForward(a->decay_in, a->logg));
  }

  SMAT_ASSIGN_OR_RETURN(a->smat_phi, SmatOperand(a->phi));
  SMAT_ASSIGN_OR_RETURN(a->smat_psi, SmatOperand(a->psi));
  SMAT_ASSIGN_OR_RETURN(a->smat_v, SmatOperand(a->v));
  stage.reset();
  SmatInputs in;
  in.phi = a->smat_phi.View(0, {nb, L, H_, r_});
  in.psi = a->smat_psi.View(0, {nb, L, H_, r_});
  in.v = a->smat_v.View(0, {nb, L, H_, dv_});
  if (a->logg.defined()) in.logg = a->logg.View(0, {nb, L, H_});
  in.prof = step.prof;
  in.type = step.type;
  in.eps = eps_;
  {
    PhaseScope phase(be, "fwd.mixer.smat");
    if (step.comm->size() == 1) {
      // The whole sequence on this rank: the single-device op, without the
      // sequence-parallel exchanges (host round trips of the span states and
      // collectives over one rank) that a span of a longer sequence needs.
      SmatForwardOutputs f;
      SMAT_RETURN_IF_ERROR(SmatForward(be, *step.plan, in, &f));
      a->smat.o = f.o;
      a->smat.saved.local = f.saved;
    } else {
      SMAT_RETURN_IF_ERROR(
          SequenceParallelSmatForward(be, *step.comm, *step.plan, step.spans, in, &a->smat));
    }
  }

  PhaseScope wo_phase(be, "fwd.mixer.wo");
  SMAT_ASSIGN_OR_RETURN(*out, NewActivation(be, {N, W}));
  return dense_->Forward(a->smat.o.View(0, {N, Cv}), *p_.wo, nullptr, *out);
}

absl::Status SmatMixer::Backward(const MixerStep& step, const Tensor& x,
                                 const MixerActivations& a, const Tensor& dout, Tensor* dx) {
  Backend& be = *backend_;
  const int64_t N = x.dim(0), W = x.dim(1), nb = step.batch, L = step.L();
  const int64_t Cq = H_ * r_, Cv = H_ * dv_;

  SMAT_ASSIGN_OR_RETURN(Tensor d_o, NewActivation(be, {N, Cv}));  // [N, H dv]
  {
    PhaseScope phase(be, "bwd.mixer.wo");
    SMAT_RETURN_IF_ERROR(
        dense_->Backward(a.smat.o.View(0, {N, Cv}), dout, *p_.wo, nullptr, &d_o, false));
  }

  SmatInputs in;
  in.phi = a.smat_phi.View(0, {nb, L, H_, r_});
  in.psi = a.smat_psi.View(0, {nb, L, H_, r_});
  in.v = a.smat_v.View(0, {nb, L, H_, dv_});
  if (a.logg.defined()) in.logg = a.logg.View(0, {nb, L, H_});
  in.prof = step.prof;
  in.type = step.type;
  in.eps = eps_;
  SmatGradients g;
  {
    PhaseScope phase(be, "bwd.mixer.smat");
    if (step.comm->size() == 1) {
      SmatForwardOutputs f;
      f.o = a.smat.o;
      f.saved = a.smat.saved.local;
      SMAT_RETURN_IF_ERROR(
          SmatBackward(be, *step.plan, in, f, d_o.View(0, {nb, L, H_, dv_}), &g));
    } else {
      SMAT_RETURN_IF_ERROR(SequenceParallelSmatBackward(be, *step.comm, *step.plan, step.spans,
                                                        in, a.smat,
                                                        d_o.View(0, {nb, L, H_, dv_}), &g));
    }
  }

  std::optional<PhaseScope> phase(std::in_place, be, "bwd.mixer.gates");
  // fp32 mode: dx zero-filled, every product accumulates into it. With
  // run.bf16 the first product writes it.
  bool dx_written = !dense_->bf16();
  SMAT_ASSIGN_OR_RETURN(*dx, dx_written ? NewZeros(be, {N, W}) : NewActivation(be, {N, W}));
  SMAT_ASSIGN_OR_RETURN(const Tensor xs, dense_->Operand(x, Dense::kInput));
  if (p_.w_decay != nullptr) {
    SMAT_ASSIGN_OR_RETURN(Tensor d_decay, NewActivation(be, {N, H_}));  // [N, H]
    SMAT_RETURN_IF_ERROR(
        kernels_->NegSoftplusBackward(a.decay_in, g.logg.View(0, {N, H_}), d_decay));
    SMAT_RETURN_IF_ERROR(
        dense_->NarrowBackward(xs, d_decay, *p_.w_decay, p_.b_decay, dx, dx_written));
    dx_written = true;
  }
  Tensor d_psi_raw = g.psi.View(0, {N, Cq});  // [N, H r]
  if (p_.w_key_gate != nullptr) {
    SMAT_ASSIGN_OR_RETURN(Tensor d_raw, NewActivation(be, {N, H_, r_}));  // [N, H, r]
    SMAT_ASSIGN_OR_RETURN(Tensor d_gate, NewActivation(be, {N, H_}));     // [N, H]
    SMAT_RETURN_IF_ERROR(kernels_->SigmoidScaleBackward(a.psi_raw.View(0, {N, H_, r_}),
                                                        a.key_gate, g.psi.View(0, {N, H_, r_}),
                                                        d_raw, d_gate));
    SMAT_RETURN_IF_ERROR(
        dense_->NarrowBackward(xs, d_gate, *p_.w_key_gate, p_.b_key_gate, dx, dx_written));
    dx_written = true;
    d_psi_raw = d_raw.View(0, {N, Cq});
  }
  phase.emplace(be, "bwd.mixer.features_conv");
  // Softplus features on conv outputs: the conv's backward applies the
  // softplus derivative as it reads the gradient (ShortConvSoftplusBackward,
  // the same operations), so the gradients at the conv outputs are never
  // written. Otherwise the gradients of the feature-map inputs (conv outputs
  // or projections) first.
  const bool fused = p_.conv_q != nullptr && features_ == ModelConfig::SOFTPLUS;
  Tensor d_q_in = g.phi.View(0, {N, Cq}), d_k_in = d_psi_raw;  // at the feature maps' outputs
  if (!fused) {
    SMAT_ASSIGN_OR_RETURN(d_q_in, NewActivation(be, {N, Cq}));
    SMAT_ASSIGN_OR_RETURN(d_k_in, NewActivation(be, {N, Cq}));
    SMAT_RETURN_IF_ERROR(FeaturesBackward(a.q_in, a.phi, g.phi.View(0, {N, Cq}), d_q_in));
    SMAT_RETURN_IF_ERROR(FeaturesBackward(a.k_in, a.psi_raw, d_psi_raw, d_k_in));
  }
  Tensor d_v_in = g.v.View(0, {N, Cv});

  Tensor d_q = d_q_in, d_k = d_k_in, d_v = d_v_in;  // gradients of the projections
  if (p_.conv_q != nullptr) {
    // On one rank only the products below read them: in their dtype. Across
    // ranks the halo's gradients are added into them (fp32).
    auto grad = [&](int64_t C) {
      return step.comm->size() == 1 ? dense_->NewOperand({N, C}) : NewActivation(be, {N, C});
    };
    SMAT_ASSIGN_OR_RETURN(d_q, grad(Cq));
    SMAT_ASSIGN_OR_RETURN(d_k, grad(Cq));
    SMAT_ASSIGN_OR_RETURN(d_v, grad(Cv));
    std::vector<Tensor> d_proj = {d_q.View(0, {nb, L, Cq}), d_k.View(0, {nb, L, Cq}),
                                  d_v.View(0, {nb, L, Cv})};
    std::vector<Tensor> d_prefix(3);
    const Tensor* xs[3] = {&a.q_proj, &a.k_proj, &a.v_proj};
    const Tensor* prefixes[3] = {&a.q_prefix, &a.k_prefix, &a.v_prefix};
    const Tensor* dys[3] = {&d_q_in, &d_k_in, &d_v_in};
    const Tensor* zs[3] = {&a.q_in, &a.k_in, nullptr};  // the softplus inputs (fused)
    Parameter* ws[3] = {p_.conv_q, p_.conv_k, p_.conv_v};
    for (int i = 0; i < 3; ++i) {
      const int64_t C = i < 2 ? Cq : Cv;
      SMAT_ASSIGN_OR_RETURN(d_prefix[i], NewActivation(be, {nb, kHalo, C}));
      const Tensor xi = xs[i]->View(0, {nb, L, C}), dyi = dys[i]->View(0, {nb, L, C});
      if (fused && zs[i] != nullptr) {
        SMAT_RETURN_IF_ERROR(kernels_->ShortConvSoftplusBackward(
            xi, *prefixes[i], ws[i]->value, zs[i]->View(0, {nb, L, C}), dyi, d_proj[i],
            d_prefix[i], ws[i]->grad));
      } else {
        SMAT_RETURN_IF_ERROR(kernels_->ShortConvBackward(xi, *prefixes[i], ws[i]->value, dyi,
                                                         d_proj[i], d_prefix[i], ws[i]->grad));
      }
    }
    SMAT_RETURN_IF_ERROR(
        ReturnConvPrefixGradients(be, *step.comm, step.spans, d_prefix, d_proj));
  }
  phase.emplace(be, "bwd.mixer.qkv");
  SMAT_RETURN_IF_ERROR(dense_->Backward(xs, d_q, *p_.wq, nullptr, dx, dx_written));
  SMAT_RETURN_IF_ERROR(dense_->Backward(xs, d_k, *p_.wk, nullptr, dx, true));
  return dense_->Backward(xs, d_v, *p_.wv, nullptr, dx, true);
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

namespace {

// Memory for a collective's buffers: where the communicator reads and writes
// (host for MPI, the device for NCCL).
Allocator& CommAllocator(Backend& backend, const Communicator& comm) {
  return comm.device().is_cpu() ? CpuAllocator() : backend.allocator();
}

// One [rows, C_i] block of a [batch, rows, C_i] tensor, as a flat view: rows
// [r0, r0 + n) of batch entry b.
Tensor Rows(const Tensor& t, int64_t b, int64_t r0, int64_t n) {
  const int64_t rows = t.dim(1), C = t.dim(2);
  return t.View((b * rows + r0) * C, {n * C});
}

}  // namespace

// The halo travels as one flat buffer per rank: for each projection i, its
// [batch, K-1, C_i] block (the rank's last K-1 rows), blocks side by side, so
// every (projection, batch entry) piece is one contiguous copy.
absl::StatusOr<std::vector<Tensor>> ExchangeConvPrefix(Backend& backend, Communicator& comm,
                                                       const std::vector<SmatSpan>& spans,
                                                       const std::vector<Tensor>& proj) {
  const int W = comm.size(), me = comm.rank();
  const int64_t nb = proj[0].dim(0), L = proj[0].dim(1);
  std::vector<Tensor> prefix;
  std::vector<int64_t> offset;  // of projection i's block in a rank's buffer
  int64_t per_rank = 0;
  for (const Tensor& t : proj) {
    SMAT_ASSIGN_OR_RETURN(Tensor p, NewZeros(backend, {nb, kHalo, t.dim(2)}));
    prefix.push_back(p);
    offset.push_back(per_rank);
    per_rank += nb * kHalo * t.dim(2);
  }
  if (W == 1) return prefix;  // the rows before the sequence are zeros
  Allocator& alloc = CommAllocator(backend, comm);
  SMAT_ASSIGN_OR_RETURN(Tensor send, Tensor::Empty({per_rank}, DType::kF32, alloc));
  SMAT_ASSIGN_OR_RETURN(Tensor recv, Tensor::Empty({W * per_rank}, DType::kF32, alloc));
  // Rows before the span (L < K-1) are never read (see below): zeros.
  SMAT_RETURN_IF_ERROR(backend.Fill(send, 0.0));
  const int64_t have = std::min<int64_t>(L, kHalo);
  for (size_t i = 0; i < proj.size(); ++i) {
    const int64_t Ci = proj[i].dim(2);
    for (int64_t b = 0; b < nb; ++b) {
      Tensor dst = send.View(offset[i] + (b * kHalo + kHalo - have) * Ci, {have * Ci});
      SMAT_RETURN_IF_ERROR(backend.Copy(Rows(proj[i], b, L - have, have), dst));
    }
  }
  // The communicator runs on its own stream (NCCL) or reads host memory (MPI):
  // the copies above must be complete first.
  SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  SMAT_RETURN_IF_ERROR(Annotate(comm.AllGather(send, recv), "short conv halo"));
  const int64_t t0 = spans[me].t0;
  // Runs of prefix rows [i0, i1) that come from one owner k, at consecutive
  // rows j0.. of its block: one copy per run, projection and batch entry.
  int64_t i = 0;
  while (i < kHalo) {
    const int64_t s = t0 - kHalo + i;
    if (s < 0) {  // before the sequence: zeros
      ++i;
      continue;
    }
    // The owner k of row s ends at or before t0, so s >= t1_k - (K-1): the row
    // is among the last K-1 rows the owner sent.
    int k = 0;
    while (k < W && !(spans[k].t0 <= s && s < spans[k].t1)) ++k;
    SMAT_CHECK(k < me);
    const int64_t j0 = s - (spans[k].t1 - kHalo);
    SMAT_CHECK(j0 >= 0 && j0 < kHalo);
    int64_t n = 1;
    while (i + n < kHalo && t0 - kHalo + i + n < spans[k].t1) ++n;
    for (size_t p = 0; p < proj.size(); ++p) {
      const int64_t Ci = prefix[p].dim(2);
      for (int64_t b = 0; b < nb; ++b) {
        Tensor dst = Rows(prefix[p], b, i, n);
        const Tensor src =
            recv.View(int64_t{k} * per_rank + offset[p] + (b * kHalo + j0) * Ci, {n * Ci});
        SMAT_RETURN_IF_ERROR(backend.Copy(src, dst));
      }
    }
    i += n;
  }
  return prefix;
}

absl::Status ReturnConvPrefixGradients(Backend& backend, Communicator& comm,
                                       const std::vector<SmatSpan>& spans,
                                       const std::vector<Tensor>& d_prefix,
                                       std::vector<Tensor>& d_proj) {
  const int W = comm.size(), me = comm.rank();
  // One rank: the prefix rows precede the sequence and have no owner.
  if (W == 1) return absl::OkStatus();
  const int64_t nb = d_proj[0].dim(0);
  std::vector<int64_t> offset;
  int64_t per_rank = 0;
  for (const Tensor& t : d_prefix) {
    offset.push_back(per_rank);
    per_rank += t.numel();
  }
  Allocator& alloc = CommAllocator(backend, comm);
  SMAT_ASSIGN_OR_RETURN(Tensor send, Tensor::Empty({per_rank}, DType::kF32, alloc));
  SMAT_ASSIGN_OR_RETURN(Tensor recv, Tensor::Empty({W * per_rank}, DType::kF32, alloc));
  for (size_t p = 0; p < d_prefix.size(); ++p) {
    Tensor dst = send.View(offset[p], {d_prefix[p].numel()});
    SMAT_RETURN_IF_ERROR(backend.Copy(d_prefix[p].View(0, {d_prefix[p].numel()}), dst));
  }
  SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  SMAT_RETURN_IF_ERROR(Annotate(comm.AllGather(send, recv), "short conv halo gradients"));
  Tensor recv_dev = recv;  // Axpy reads device memory on a device backend
  if (!(recv.device() == backend.device())) {
    SMAT_ASSIGN_OR_RETURN(recv_dev, Tensor::Empty(recv.shape(), DType::kF32, backend.allocator()));
    SMAT_RETURN_IF_ERROR(backend.Copy(recv, recv_dev));
  }
  const SmatSpan mine = spans[me];
  // Later ranks in increasing order, rows in increasing order: a fixed sum.
  for (int j = me + 1; j < W; ++j) {
    for (int64_t i = 0; i < kHalo; ++i) {
      const int64_t s = spans[j].t0 - kHalo + i;
      if (s < mine.t0 || s >= mine.t1) continue;
      const int64_t row = s - mine.t0;
      for (size_t p = 0; p < d_proj.size(); ++p) {
        const int64_t Ci = d_proj[p].dim(2);
        for (int64_t b = 0; b < nb; ++b) {
          Tensor dst = Rows(d_proj[p], b, row, 1);
          const Tensor src =
              recv_dev.View(int64_t{j} * per_rank + offset[p] + (b * kHalo + i) * Ci, {Ci});
          SMAT_RETURN_IF_ERROR(backend.Axpy(1.f, src, dst));
        }
      }
    }
  }
  // recv (host, MPI) must outlive the copies that read it.
  return backend.Synchronize(nullptr);
}

}  // namespace smat
