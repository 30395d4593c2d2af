// CPU implementation of kernels/decode.h: the fixed-horizon decoder (Theorem
// 3.3 with the gating of the note after Lemma 4), the stepped-window decoder
// (Appendix F, Algorithm 3, Lemma 5), the stepped-window forward pass and the
// dense double reference they are tested against.
//
// States are fp32 (ARCHITECTURE.md section 5); readouts accumulate in double;
// log-gate sums are double and only ever cover a bounded range (one block, or
// the recent part), so exp() of them loses nothing on long sequences.
#include "kernels/decode.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace smat {
namespace {

// ---- argument checks ------------------------------------------------------------

absl::Status CheckHost(const Tensor& t, DType dtype, absl::Span<const int64_t> shape,
                       const char* what) {
  if (!t.defined()) {
    return absl::InvalidArgumentError(absl::StrCat("decode: ", what, " is missing"));
  }
  if (!t.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat("decode: ", what, " is on ",
                                                   t.device().ToString(),
                                                   "; the host decoders keep their cache in host memory (a device decoder: "
                                                   "Backend::CreateDecoder of that device)"));
  }
  if (t.dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat("decode: ", what, " must be ",
                                                   DTypeName(dtype), "; got ",
                                                   DTypeName(t.dtype())));
  }
  return CheckShape(t, shape, what);
}

// Content ids must name a point / a type of the geometry.
absl::Status CheckIds(const int32_t* ids, int64_t count, int64_t limit, const char* what,
                      const char* range) {
  for (int64_t i = 0; i < count; ++i) {
    if (ids[i] < 0 || ids[i] >= limit) {
      return absl::InvalidArgumentError(absl::StrCat("decode: ", what, "[", i, "] = ", ids[i],
                                                     " is outside [0, ", limit, ") (", range,
                                                     ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckLogGates(const float* logg, int64_t count, const char* what) {
  for (int64_t i = 0; i < count; ++i) {
    if (!(logg[i] <= 0.f) || !std::isfinite(logg[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "decode: ", what, "[", i, "] = ", logg[i],
          " but log-gates must be finite and <= 0 (decay a = exp(logg) in (0, 1])"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckToken(const DecodeDims& d, const SmatGeometry& g, const DecodeToken& tok) {
  const int64_t bh = d.batch * d.heads;
  SMAT_RETURN_IF_ERROR(CheckHost(tok.phi, DType::kF32, {d.batch, d.heads, d.r}, "phi"));
  SMAT_RETURN_IF_ERROR(CheckHost(tok.psi, DType::kF32, {d.batch, d.heads, d.r}, "psi"));
  SMAT_RETURN_IF_ERROR(CheckHost(tok.v, DType::kF32, {d.batch, d.heads, d.dv}, "v"));
  if (tok.logg.defined()) {
    SMAT_RETURN_IF_ERROR(CheckHost(tok.logg, DType::kF32, {d.batch, d.heads}, "logg"));
    SMAT_RETURN_IF_ERROR(CheckLogGates(tok.logg.data<float>(), bh, "logg"));
  }
  if (tok.prof.defined()) {
    SMAT_RETURN_IF_ERROR(CheckHost(tok.prof, DType::kI32, {d.batch, d.heads}, "prof"));
  }
  if (tok.type.defined()) {
    SMAT_RETURN_IF_ERROR(CheckHost(tok.type, DType::kI32, {d.batch, d.heads}, "type"));
  }
  return absl::OkStatus();
}

absl::Status PrepareOutput(const DecodeDims& d, Tensor* o) {
  if (!o->defined()) {
    SMAT_ASSIGN_OR_RETURN(*o, Tensor::Empty({d.batch, d.heads, d.dv}, DType::kF32));
    return absl::OkStatus();
  }
  return CheckHost(*o, DType::kF32, {d.batch, d.heads, d.dv}, "o");
}

absl::Status CheckDims(const DecodeDims& d) {
  if (d.batch < 1 || d.heads < 1 || d.r < 1 || d.dv < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode: batch, heads, r and dv must all be >= 1; got batch = ", d.batch,
        ", heads = ", d.heads, ", r = ", d.r, ", dv = ", d.dv));
  }
  return absl::OkStatus();
}

// ---- state arithmetic (one state = r x p, row-major) ------------------------------

// S <- a S + psi vbar^T, vbar = [v, 1] (eq. 2; gated recurrence of Lemma 4).
void DecayAddOuter(float* S, float a, const float* psi, const float* v, int64_t r, int64_t dv) {
  const int64_t p = dv + 1;
  for (int64_t i = 0; i < r; ++i) {
    float* row = S + i * p;
    const float k = psi[i];
    if (a != 1.f) {
      for (int64_t j = 0; j < p; ++j) row[j] *= a;
    }
    for (int64_t j = 0; j < dv; ++j) row[j] += k * v[j];
    row[dv] += k;
  }
}

void Scale(float* x, float a, int64_t n) {
  if (a == 1.f) return;
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}

// ybar += w * phi^T S, in double.
void ReadState(const float* phi, const float* S, double w, int64_t r, int64_t p, double* ybar) {
  for (int64_t i = 0; i < r; ++i) {
    const double f = w * static_cast<double>(phi[i]);
    const float* row = S + i * p;
    for (int64_t j = 0; j < p; ++j) ybar[j] += f * static_cast<double>(row[j]);
  }
}

// o = ybar[0:dv] / (ybar[dv] + eps) (eq. 3).
void Normalize(const double* ybar, int64_t dv, float eps, float* o) {
  const double den = ybar[dv] + static_cast<double>(eps);
  for (int64_t j = 0; j < dv; ++j) o[j] = static_cast<float>(ybar[j] / den);
}

}  // namespace

// ==================================================================================
// Fixed horizon (Theorem 3.3).

absl::StatusOr<FixedHorizonDecoder> FixedHorizonDecoder::Create(const SmatPlan& plan,
                                                                DecodeDims dims, float eps) {
  SMAT_RETURN_IF_ERROR(CheckDims(dims));
  FixedHorizonDecoder dec;
  dec.plan_ = plan;
  dec.dims_ = dims;
  dec.eps_ = eps;
  dec.rp_ = dims.r * (dims.dv + 1);
  const int64_t bh = dims.batch * dims.heads;
  dec.S_.assign(bh * dec.rp_, 0.f);
  dec.lam_.assign(bh, 0.0);
  if (plan.n > 0) {
    dec.F_.assign(bh * plan.geo.P * dec.rp_, 0.f);
    dec.F_lam_.assign(bh * plan.geo.P, 0.0);
  }
  return dec;
}

int64_t FixedHorizonDecoder::StateBytes() const {
  return static_cast<int64_t>((S_.size() + F_.size() + U_.size()) * sizeof(float) +
                              (F_lam_.size() + lam_.size()) * sizeof(double));
}

void FixedHorizonDecoder::Tabulate() {
  const SmatGeometry& g = plan_.geo;
  const int64_t bh = dims_.batch * dims_.heads;
  U_.assign(bh * g.B * rp_, 0.f);
  if (plan_.n > 0) {
    for (int64_t i = 0; i < bh; ++i) {
      float* F = &F_[i * g.P * rp_];
      // Refer every F[x] from the last token that touched it to n - 1 (Lemma 4:
      // the key-side factor exp(Lambda_{n-1} - Lambda_s), applied lazily).
      for (int64_t x = 0; x < g.P; ++x) {
        Scale(F + x * rp_, static_cast<float>(std::exp(lam_[i] - F_lam_[i * g.P + x])), rp_);
      }
      TabulateIncidence(g, F, &U_[i * g.B * rp_], rp_);  // Algorithm 2
    }
  }
  // The profile table is no longer needed (Section 3.3): the cache is U + S.
  std::vector<float>().swap(F_);
  std::vector<double>().swap(F_lam_);
  std::fill(S_.begin(), S_.end(), 0.f);  // the recent block starts from zero at n
  std::fill(lam_.begin(), lam_.end(), 0.0);
}

absl::Status FixedHorizonDecoder::Step(const DecodeToken& tok, Tensor* o, Stream*) {
  if (t_ >= plan_.T) {
    return absl::OutOfRangeError(absl::StrCat(
        "decode: the fixed-horizon decoder was planned for T = ", plan_.T,
        " tokens and all of them have been decoded; plan a longer T or use the "
        "stepped-window decoder (--window) to decode past the horizon"));
  }
  SMAT_RETURN_IF_ERROR(CheckToken(dims_, plan_.geo, tok));
  const bool distant = t_ < plan_.n;
  const int64_t bh = dims_.batch * dims_.heads;
  // Content ids are read only in their own block (as in kernels/smat_kernels.h).
  if (distant && tok.prof.defined()) {
    SMAT_RETURN_IF_ERROR(CheckIds(tok.prof.data<int32_t>(), bh, plan_.geo.P, "prof",
                                  "a point of the geometry: [0, P)"));
  }
  if (!distant && tok.type.defined()) {
    SMAT_RETURN_IF_ERROR(CheckIds(tok.type.data<int32_t>(), bh, plan_.geo.B, "type",
                                  "a hyperplane of the geometry: [0, B)"));
  }
  SMAT_RETURN_IF_ERROR(PrepareOutput(dims_, o));
  if (t_ == plan_.n) Tabulate();

  const int64_t r = dims_.r, dv = dims_.dv, p = dv + 1;
  const SmatGeometry& g = plan_.geo;
  const float* phi = tok.phi.data<float>();  // [batch, H, r]
  const float* psi = tok.psi.data<float>();  // [batch, H, r]
  const float* v = tok.v.data<float>();      // [batch, H, dv]
  const float* logg = tok.logg.defined() ? tok.logg.data<float>() : nullptr;  // [batch, H]
  float* out = o->data<float>();             // [batch, H, dv]
  std::vector<double> ybar(p);
  for (int64_t i = 0; i < bh; ++i) {
    const double lg = logg ? static_cast<double>(logg[i]) : 0.0;
    const float a = logg ? static_cast<float>(std::exp(lg)) : 1.f;
    lam_[i] += lg;
    float* S = &S_[i * rp_];
    DecayAddOuter(S, a, psi + i * r, v + i * dv, r, dv);
    std::fill(ybar.begin(), ybar.end(), 0.0);
    if (distant) {
      // Pool Z_t into F[prof(t)], referring the entry to t first (lazy gating).
      const int64_t x = tok.prof.defined() ? tok.prof.data<int32_t>()[i]
                                           : PositionalProfile(g, t_);
      float* F = &F_[(i * g.P + x) * rp_];
      double& F_lam = F_lam_[i * g.P + x];
      DecayAddOuter(F, static_cast<float>(std::exp(lam_[i] - F_lam)), psi + i * r, v + i * dv,
                    r, dv);
      F_lam = lam_[i];
      ReadState(phi + i * r, S, 1.0, r, p, ybar.data());  // causal over [0, t]
    } else {
      const int64_t h = tok.type.defined() ? tok.type.data<int32_t>()[i]
                                           : PositionalType(g, plan_.n, t_);
      // g_t = exp(Lambda_t - Lambda_{n-1}); lam_ holds the sum of logg over [n, t].
      ReadState(phi + i * r, &U_[(i * g.B + h) * rp_], std::exp(lam_[i]), r, p, ybar.data());
      ReadState(phi + i * r, S, 1.0, r, p, ybar.data());
    }
    Normalize(ybar.data(), dv, eps_, out + i * dv);
  }
  ++t_;
  return absl::OkStatus();
}

// ==================================================================================
// Stepped window (Algorithm 3, Lemma 5).

absl::StatusOr<SteppedWindowDecoder> SteppedWindowDecoder::Create(const SmatPlan& plan,
                                                                  int64_t window,
                                                                  DecodeDims dims, float eps) {
  SMAT_RETURN_IF_ERROR(CheckDims(dims));
  if (window < 1 || window % plan.chunk != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode: the stepped window c_dc = ", window, " must be a positive multiple of the chunk ",
        plan.chunk, " (Definition 1); e.g. --window ", plan.chunk * std::max<int64_t>(1, plan.T / (4 * plan.chunk)),
        " (about T_max / 4, as in Lemma 5)"));
  }
  SteppedWindowDecoder dec;
  dec.plan_ = plan;
  dec.window_ = window;
  dec.dims_ = dims;
  dec.eps_ = eps;
  dec.rp_ = dims.r * (dims.dv + 1);
  const int64_t bh = dims.batch * dims.heads;
  const SmatGeometry& g = plan.geo;
  dec.U_.assign(bh * g.B * dec.rp_, 0.f);
  dec.U_scratch_.assign(g.B * dec.rp_, 0.f);
  dec.delta_old_.assign(bh * g.P * dec.rp_, 0.f);
  dec.delta_cur_.assign(bh * g.P * dec.rp_, 0.f);
  dec.delta_lam_.assign(bh * g.P, 0.0);
  dec.R_old_.assign(bh * dec.rp_, 0.f);
  dec.R_cur_.assign(bh * dec.rp_, 0.f);
  dec.lam_block_.assign(bh, 0.0);
  dec.prev_block_total_.assign(bh, 0.0);
  return dec;
}

int64_t SteppedWindowDecoder::StateBytes() const {
  return static_cast<int64_t>(
      (U_.size() + U_scratch_.size() + delta_old_.size() + delta_cur_.size() + R_old_.size() +
       R_cur_.size()) * sizeof(float) +
      (delta_lam_.size() + lam_block_.size() + prev_block_total_.size()) * sizeof(double));
}

// Lines 3-5 of Algorithm 3 at the first token of block `block` (>= 1), gated per
// Lemma 5. With N = (block - 2) c_dc and N' = (block - 1) c_dc:
//   U <- exp(Lambda_{N'-1} - Lambda_{N-1}) U + C Delta_old
// where Delta_old holds block (block - 2) referred to its last token N' - 1, and
// the decay is the sum of logg over block (block - 2), i.e. prev_block_total_
// before it moves on. Then Delta_cur (block - 1) is referred to its last token
// and becomes Delta_old, and R_cur (started at (block - 1) c_dc = n(t)) becomes R_old.
void SteppedWindowDecoder::EnterBlock(int64_t block) {
  const SmatGeometry& g = plan_.geo;
  const int64_t bh = dims_.batch * dims_.heads;
  for (int64_t i = 0; i < bh; ++i) {
    float* U = &U_[i * g.B * rp_];
    if (block >= 2) {
      TabulateIncidence(g, &delta_old_[i * g.P * rp_], U_scratch_.data(), rp_);
      const float f = static_cast<float>(std::exp(prev_block_total_[i]));
      for (int64_t k = 0; k < g.B * rp_; ++k) U[k] = f * U[k] + U_scratch_[k];
    }
    const double completed = lam_block_[i];  // sum of logg over block - 1
    float* D = &delta_cur_[i * g.P * rp_];
    for (int64_t x = 0; x < g.P; ++x) {
      Scale(D + x * rp_, static_cast<float>(std::exp(completed - delta_lam_[i * g.P + x])), rp_);
    }
    prev_block_total_[i] = completed;
    lam_block_[i] = 0.0;
  }
  delta_old_.swap(delta_cur_);
  std::fill(delta_cur_.begin(), delta_cur_.end(), 0.f);
  std::fill(delta_lam_.begin(), delta_lam_.end(), 0.0);
  R_old_.swap(R_cur_);
  std::fill(R_cur_.begin(), R_cur_.end(), 0.f);
}

absl::Status SteppedWindowDecoder::Step(const DecodeToken& tok, Tensor* o, Stream*) {
  SMAT_RETURN_IF_ERROR(CheckToken(dims_, plan_.geo, tok));
  const int64_t bh = dims_.batch * dims_.heads;
  // Every token is read as a query (type) now and pooled as a key (prof).
  if (tok.prof.defined()) {
    SMAT_RETURN_IF_ERROR(CheckIds(tok.prof.data<int32_t>(), bh, plan_.geo.P, "prof",
                                  "a point of the geometry: [0, P)"));
  }
  if (tok.type.defined()) {
    SMAT_RETURN_IF_ERROR(CheckIds(tok.type.data<int32_t>(), bh, plan_.geo.B, "type",
                                  "a hyperplane of the geometry: [0, B)"));
  }
  SMAT_RETURN_IF_ERROR(PrepareOutput(dims_, o));
  const int64_t block = t_ / window_;
  if (t_ > 0 && t_ % window_ == 0) EnterBlock(block);

  const int64_t r = dims_.r, dv = dims_.dv, p = dv + 1;
  const SmatGeometry& g = plan_.geo;
  const float* phi = tok.phi.data<float>();  // [batch, H, r]
  const float* psi = tok.psi.data<float>();  // [batch, H, r]
  const float* v = tok.v.data<float>();      // [batch, H, dv]
  const float* logg = tok.logg.defined() ? tok.logg.data<float>() : nullptr;  // [batch, H]
  float* out = o->data<float>();             // [batch, H, dv]
  std::vector<double> ybar(p);
  for (int64_t i = 0; i < bh; ++i) {
    const double lg = logg ? static_cast<double>(logg[i]) : 0.0;
    const float a = logg ? static_cast<float>(std::exp(lg)) : 1.f;
    lam_block_[i] += lg;
    float* R_old = &R_old_[i * rp_];
    DecayAddOuter(R_old, a, psi + i * r, v + i * dv, r, dv);
    // In block 0 both recurrences start at 0 and coincide; R_cur is kept
    // anyway so that it holds block 0 when block 1 starts.
    DecayAddOuter(&R_cur_[i * rp_], a, psi + i * r, v + i * dv, r, dv);
    const int64_t x = tok.prof.defined() ? tok.prof.data<int32_t>()[i] : t_ % g.P;
    double& D_lam = delta_lam_[i * g.P + x];
    DecayAddOuter(&delta_cur_[(i * g.P + x) * rp_],
                  static_cast<float>(std::exp(lam_block_[i] - D_lam)), psi + i * r, v + i * dv,
                  r, dv);
    D_lam = lam_block_[i];
    std::fill(ybar.begin(), ybar.end(), 0.0);
    ReadState(phi + i * r, R_old, 1.0, r, p, ybar.data());  // window [n(t), t]
    if (block >= 2) {
      const int64_t h = tok.type.defined() ? tok.type.data<int32_t>()[i] : t_ % g.B;
      // exp(Lambda_t - Lambda_{n(t)-1}): logg summed over block - 1 and this block up to t.
      ReadState(phi + i * r, &U_[(i * g.B + h) * rp_],
                std::exp(prev_block_total_[i] + lam_block_[i]), r, p, ybar.data());
    }
    Normalize(ybar.data(), dv, eps_, out + i * dv);
  }
  ++t_;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Decoder>> CreateHostDecoder(const DecoderSpec& spec) {
  if (spec.window == 0) {
    SMAT_ASSIGN_OR_RETURN(FixedHorizonDecoder dec,
                          FixedHorizonDecoder::Create(spec.plan, spec.dims, spec.eps));
    return std::make_unique<FixedHorizonDecoder>(std::move(dec));
  }
  SMAT_ASSIGN_OR_RETURN(SteppedWindowDecoder dec, SteppedWindowDecoder::Create(
                                                      spec.plan, spec.window, spec.dims, spec.eps));
  return std::make_unique<SteppedWindowDecoder>(std::move(dec));
}

// ==================================================================================
// Forward passes.

bool SteppedWindowMaskEntry(const SmatPlan& plan, int64_t window, int64_t t, int64_t s,
                            int64_t type_t, int64_t prof_s) {
  if (s > t) return false;
  const int64_t n_t = std::max<int64_t>(0, (t / window - 1) * window);
  if (s >= n_t) return true;
  return plan.geo.Incident(type_t, prof_s);
}

namespace {

struct SeqDims {
  int64_t batch, T, H, r, dv;
};

absl::StatusOr<SeqDims> CheckSequenceInputs(const SmatInputs& in, const SmatGeometry& g) {
  if (!in.phi.defined() || in.phi.rank() != 4) {
    return absl::InvalidArgumentError("stepped window: phi must be [batch, T, H, r]");
  }
  SeqDims d{in.phi.dim(0), in.phi.dim(1), in.phi.dim(2), in.phi.dim(3), 0};
  if (!in.v.defined() || in.v.rank() != 4) {
    return absl::InvalidArgumentError("stepped window: v must be [batch, T, H, dv]");
  }
  d.dv = in.v.dim(3);
  SMAT_RETURN_IF_ERROR(CheckHost(in.phi, DType::kF32, {d.batch, d.T, d.H, d.r}, "phi"));
  SMAT_RETURN_IF_ERROR(CheckHost(in.psi, DType::kF32, {d.batch, d.T, d.H, d.r}, "psi"));
  SMAT_RETURN_IF_ERROR(CheckHost(in.v, DType::kF32, {d.batch, d.T, d.H, d.dv}, "v"));
  const int64_t bth = d.batch * d.T * d.H;
  if (in.logg.defined()) {
    SMAT_RETURN_IF_ERROR(CheckHost(in.logg, DType::kF32, {d.batch, d.T, d.H}, "logg"));
    SMAT_RETURN_IF_ERROR(CheckLogGates(in.logg.data<float>(), bth, "logg"));
  }
  if (in.prof.defined()) {
    SMAT_RETURN_IF_ERROR(CheckHost(in.prof, DType::kI32, {d.batch, d.T, d.H}, "prof"));
    SMAT_RETURN_IF_ERROR(CheckIds(in.prof.data<int32_t>(), bth, g.P, "prof", "[0, P)"));
  }
  if (in.type.defined()) {
    SMAT_RETURN_IF_ERROR(CheckHost(in.type, DType::kI32, {d.batch, d.T, d.H}, "type"));
    SMAT_RETURN_IF_ERROR(CheckIds(in.type.data<int32_t>(), bth, g.B, "type", "[0, B)"));
  }
  if (d.batch < 1 || d.T < 1 || d.H < 1 || d.r < 1 || d.dv < 1) {
    return absl::InvalidArgumentError(absl::StrCat("stepped window: empty input ",
                                                   in.phi.DebugString()));
  }
  return d;
}

}  // namespace

absl::Status SteppedWindowForward(const SmatPlan& plan, int64_t window, const SmatInputs& in,
                                  Tensor* o) {
  if (window < 1 || window % plan.chunk != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stepped window: c_dc = ", window, " must be a positive multiple of the chunk ",
        plan.chunk));
  }
  const SmatGeometry& g = plan.geo;
  SMAT_ASSIGN_OR_RETURN(SeqDims d, CheckSequenceInputs(in, g));
  if (!o->defined()) {
    SMAT_ASSIGN_OR_RETURN(*o, Tensor::Empty({d.batch, d.T, d.H, d.dv}, DType::kF32));
  } else {
    SMAT_RETURN_IF_ERROR(CheckHost(*o, DType::kF32, {d.batch, d.T, d.H, d.dv}, "o"));
  }
  const int64_t r = d.r, dv = d.dv, p = dv + 1, rp = r * p;
  const float* phi = in.phi.data<float>();  // [batch, T, H, r]
  const float* psi = in.psi.data<float>();  // [batch, T, H, r]
  const float* v = in.v.data<float>();      // [batch, T, H, dv]
  const float* logg = in.logg.defined() ? in.logg.data<float>() : nullptr;     // [batch, T, H]
  const int32_t* prof = in.prof.defined() ? in.prof.data<int32_t>() : nullptr;  // [batch, T, H]
  const int32_t* type = in.type.defined() ? in.type.data<int32_t>() : nullptr;  // [batch, T, H]
  float* out = o->data<float>();            // [batch, T, H, dv]

  std::vector<float> U(g.B * rp), tab(g.B * rp);   // type table, C Delta
  std::vector<float> delta1(g.P * rp), delta2(g.P * rp);  // blocks b-1, b-2 (referred to their ends)
  std::vector<float> S1(rp), W(rp);                 // block b-1 total, within-block running state
  std::vector<double> L(window);                     // block-local log-decay prefix
  std::vector<double> ybar(p);
  const int64_t num_blocks = (d.T + window - 1) / window;
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.H; ++h) {
      std::fill(U.begin(), U.end(), 0.f);
      std::fill(delta1.begin(), delta1.end(), 0.f);
      std::fill(delta2.begin(), delta2.end(), 0.f);
      std::fill(S1.begin(), S1.end(), 0.f);
      double G1 = 0, G2 = 0;  // sums of logg over blocks b-1 and b-2
      for (int64_t blk = 0; blk < num_blocks; ++blk) {
        const int64_t start = blk * window, end = std::min(d.T, start + window);
        if (blk >= 2) {
          // U = C F~^((blk-1) c_dc): decay the old table over block blk-2, add its deltas.
          TabulateIncidence(g, delta2.data(), tab.data(), rp);
          const float f = static_cast<float>(std::exp(G2));
          for (int64_t k = 0; k < g.B * rp; ++k) U[k] = f * U[k] + tab[k];
        }
        double acc = 0;
        for (int64_t t = start; t < end; ++t) {
          acc += logg ? logg[(b * d.T + t) * d.H + h] : 0.0;
          L[t - start] = acc;
        }
        std::fill(W.begin(), W.end(), 0.f);
        for (int64_t t = start; t < end; ++t) {
          const int64_t row = (b * d.T + t) * d.H + h;
          const float a = logg ? static_cast<float>(std::exp(static_cast<double>(logg[row]))) : 1.f;
          DecayAddOuter(W.data(), a, psi + row * r, v + row * dv, r, dv);
          std::fill(ybar.begin(), ybar.end(), 0.0);
          ReadState(phi + row * r, W.data(), 1.0, r, p, ybar.data());
          if (blk >= 1) ReadState(phi + row * r, S1.data(), std::exp(L[t - start]), r, p, ybar.data());
          if (blk >= 2) {
            const int64_t ty = type ? type[row] : t % g.B;
            ReadState(phi + row * r, &U[ty * rp], std::exp(G1 + L[t - start]), r, p, ybar.data());
          }
          Normalize(ybar.data(), dv, in.eps, out + row * dv);
        }
        // This block's per-profile sums referred to its last token.
        std::swap(delta1, delta2);  // delta2 <- block blk-1; delta1 is rebuilt for blk
        std::fill(delta1.begin(), delta1.end(), 0.f);
        const double Le = L[end - 1 - start];
        for (int64_t s = start; s < end; ++s) {
          const int64_t row = (b * d.T + s) * d.H + h;
          const int64_t x = prof ? prof[row] : s % g.P;
          float* D = &delta1[x * rp];
          const float w = static_cast<float>(std::exp(Le - L[s - start]));
          for (int64_t i = 0; i < r; ++i) {
            const float k = w * psi[row * r + i];
            for (int64_t j = 0; j < dv; ++j) D[i * p + j] += k * v[row * dv + j];
            D[i * p + dv] += k;
          }
        }
        S1 = W;
        G2 = G1;
        G1 = Le;
      }
    }
  }
  return absl::OkStatus();
}

DenseReferenceOutputs MaskedAttentionDenseReference(const SmatInputs& in, const MaskFn& mask) {
  const int64_t batch = in.phi.dim(0), T = in.phi.dim(1), H = in.phi.dim(2), r = in.phi.dim(3);
  const int64_t dv = in.v.dim(3), p = dv + 1;
  SMAT_CHECK(in.psi.shape() == in.phi.shape() && in.v.dim(1) == T);
  const float* phi = in.phi.data<float>();  // [batch, T, H, r]
  const float* psi = in.psi.data<float>();  // [batch, T, H, r]
  const float* v = in.v.data<float>();      // [batch, T, H, dv]
  const float* logg = in.logg.defined() ? in.logg.data<float>() : nullptr;  // [batch, T, H]
  DenseReferenceOutputs out;
  out.ybar.assign(batch * T * H * p, 0.0);
  out.o.assign(batch * T * H * dv, 0.0);
  std::vector<double> Lam(T);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      double acc = 0;
      for (int64_t t = 0; t < T; ++t) {
        acc += logg ? logg[(b * T + t) * H + h] : 0.0;
        Lam[t] = acc;
      }
      for (int64_t t = 0; t < T; ++t) {
        const int64_t rt = (b * T + t) * H + h;
        double* y = &out.ybar[rt * p];
        for (int64_t s = 0; s <= t; ++s) {
          if (!mask(b, h, t, s)) continue;
          const int64_t rs = (b * T + s) * H + h;
          double k = 0;
          for (int64_t i = 0; i < r; ++i) k += double(phi[rt * r + i]) * double(psi[rs * r + i]);
          k *= std::exp(Lam[t] - Lam[s]);  // eq. 13
          for (int64_t j = 0; j < dv; ++j) y[j] += k * double(v[rs * dv + j]);
          y[dv] += k;
        }
        for (int64_t j = 0; j < dv; ++j) out.o[rt * dv + j] = y[j] / (y[dv] + double(in.eps));
      }
    }
  }
  return out;
}

MaskFn SmatMaskFn(const SmatPlan& plan, const SmatInputs& in) {
  const int64_t T = in.phi.dim(1), H = in.phi.dim(2);
  const int32_t* prof = in.prof.defined() ? in.prof.data<int32_t>() : nullptr;
  const int32_t* type = in.type.defined() ? in.type.data<int32_t>() : nullptr;
  return [plan, T, H, prof, type](int64_t b, int64_t h, int64_t t, int64_t s) {
    if (s > t) return false;
    if (t < plan.n || s >= plan.n) return true;  // L_n, L_m (eq. 4)
    const int64_t ty = type ? type[(b * T + t) * H + h] : PositionalType(plan.geo, plan.n, t);
    const int64_t x = prof ? prof[(b * T + s) * H + h] : PositionalProfile(plan.geo, s);
    return plan.geo.Incident(ty, x);  // G = R C E^T (eq. 6, 8)
  };
}

MaskFn SteppedWindowMaskFn(const SmatPlan& plan, int64_t window, const SmatInputs& in) {
  const int64_t T = in.phi.dim(1), H = in.phi.dim(2);
  const int32_t* prof = in.prof.defined() ? in.prof.data<int32_t>() : nullptr;
  const int32_t* type = in.type.defined() ? in.type.data<int32_t>() : nullptr;
  return [plan, window, T, H, prof, type](int64_t b, int64_t h, int64_t t, int64_t s) {
    const int64_t ty = type ? type[(b * T + t) * H + h] : t % plan.geo.B;
    const int64_t x = prof ? prof[(b * T + s) * H + h] : s % plan.geo.P;
    return SteppedWindowMaskEntry(plan, window, t, s, ty, x);
  };
}

}  // namespace smat
