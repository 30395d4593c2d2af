// Token-by-token decoding of SMat-Attention at O(r p) work per token, and the
// stepped-window mask it serves beyond the training horizon.
//
// Two decoders, each stepping one token for every (sequence, head) of a batch at
// once. Both exist on the host (the classes below, cache in host memory) and on
// the GPU (kernels/cuda/decode_cuda.h, cache in device memory, one kernel launch
// per token); Backend::CreateDecoder returns the one of its device behind the
// Decoder interface, so callers need not know where the cache lives:
//
//  * FixedHorizonDecoder (paper Theorem 3.3, Section 3.3, and the note after
//    Lemma 4): T is known, so the boundary n of the plan is. Tokens of the
//    distant block [0, n) are answered by one running causal state and pooled
//    into the profile table F (each Z_s referred to Lambda_{n-1}); at n the
//    table is tabulated once, U = C F (Algorithm 2), and F is dropped. From then
//    on the cache is B type states plus one running recent state S:
//        S <- a_t S + Z_t,   g_t = exp(Lambda_t - Lambda_{n-1}),
//        ybar_t = phi_t^T [g_t U_type(t) + S_t].
//    It answers every position 0..T-1 exactly as the SMat op over length T does.
//
//  * SteppedWindowDecoder (Appendix F, Definition 1, Algorithm 3, Lemma 5):
//    horizon-free. The geometry comes from T_max, the window from a block
//    length c_dc (a multiple of the chunk). On 0-based positions:
//        b(t) = floor(t / c_dc),  n(t) = max(0, (b(t) - 1) c_dc),
//        type(t) = t mod B,  prof(s) = s mod P   (absolute positions),
//        M_ts = 1 for n(t) <= s <= t,  C[type(t)][prof(s)] for s < n(t),
//    gated: times exp(Lambda_t - Lambda_s). The cache is U (B states), the
//    profile deltas of the previous and current block (P states each) and two
//    recurrent states; one tabulation per block (amortised O(nnz(C) / c_dc r p)
//    per token). It runs past T_max.
//
// Gating: logg_t <= 0 per token, a_t = exp(logg_t). Only sums of logg over
// bounded ranges (a block or the recent part) are ever exponentiated, in
// double, and every factor is exp(Lambda_i - Lambda_j) with i >= j (<= 1).
// Content assignment: prof/type per token in [0, P) / [0, B); when absent the
// positional maps above (fixed horizon: those of core/geometry.h). The fixed-
// horizon decoder reads prof at distant tokens and type at recent ones only (as
// kernels/smat_kernels.h does); the stepped window reads both at every token,
// since every token is a query now and a distant key later.
//
//   SMAT_ASSIGN_OR_RETURN(SmatPlan plan, MakeSmatPlan(T, 2, 64));
//   SMAT_ASSIGN_OR_RETURN(FixedHorizonDecoder dec,
//                         FixedHorizonDecoder::Create(plan, {batch, H, r, dv}, eps));
//   SMAT_ASSIGN_OR_RETURN(Tensor o, Tensor::Empty({batch, H, dv}, DType::kF32));
//   for (int64_t t = 0; t < T; ++t) {
//     DecodeToken tok{.phi = phi_t, .psi = psi_t, .v = v_t};  // [batch, H, r|dv]
//     SMAT_RETURN_IF_ERROR(dec.Step(tok, &o));                // o_t [batch, H, dv]
//   }
//
// On any device (the same math on the GPU, tests/gpu/decode_gpu_test.cc):
//
//   DecoderSpec spec{.plan = plan, .window = 0, .dims = {batch, H, r, dv}, .eps = eps};
//   SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> dec, backend->CreateDecoder(spec));
//   SMAT_RETURN_IF_ERROR(dec->Step(tok, &o));  // tok and o on backend->device()
//
// The stepped-window mask as a forward pass (SteppedWindowForward, O(T r p) plus
// one tabulation per block) and a dense double reference of any mask
// (MaskedAttentionDenseReference, O(T^2 (r + p))) are here too, so the decoders
// are tested against forward passes of the same mask.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/smat.h"

namespace smat {

// One token for every (sequence, head) of the batch: fp32 / int32 tensors on the
// decoder's device (the CUDA decoder also takes bf16 phi, psi and v, all three
// of one dtype; its states stay fp32).
struct DecodeToken {
  Tensor phi;   // [batch, H, r]  query features >= 0
  Tensor psi;   // [batch, H, r]  key features >= 0
  Tensor v;     // [batch, H, dv] values
  Tensor logg;  // [batch, H] log-gate <= 0, or undefined: a_t = 1
  Tensor prof;  // [batch, H] int32 in [0, P), or undefined: positional
  Tensor type;  // [batch, H] int32 in [0, B), or undefined: positional
};

struct DecodeDims {
  int64_t batch = 1;
  int64_t heads = 1;
  int64_t r = 0;
  int64_t dv = 0;
};

// What to decode: the plan (T, or T_max for the stepped window, and the
// geometry), the window (0: the fixed-horizon decoder; else the stepped-window
// decoder with c_dc = window, a multiple of plan.chunk), sizes and the eps of
// o = ybar[0:dv] / (ybar[dv] + eps).
struct DecoderSpec {
  SmatPlan plan;
  int64_t window = 0;
  DecodeDims dims;
  float eps = 1e-6f;
};

// A decoder of either kind on one device: the host classes below, or the CUDA
// decoder (created by CudaBackend::CreateDecoder). Tokens and outputs live on
// the decoder's device; Step is asynchronous on `stream` there (nullptr: the
// backend's default stream) and synchronous on the CPU. Content ids and
// log-gates are validated on the host; the CUDA decoder cannot read them
// without a synchronisation, so there an out-of-range id makes that (sequence,
// head)'s output NaN and leaves its cache untouched, and gates are not checked.
class Decoder {
 public:
  virtual ~Decoder() = default;
  // Consumes token position() for every (sequence, head) and writes its output
  // to *o ([batch, H, dv] fp32 on the decoder's device, allocated when
  // undefined). InvalidArgument for a wrong shape/dtype/device; OutOfRange for
  // the fixed horizon once T tokens have been decoded.
  virtual absl::Status Step(const DecodeToken& token, Tensor* o, Stream* stream = nullptr) = 0;
  virtual int64_t position() const = 0;
  // Bytes of decoder state held now.
  virtual int64_t StateBytes() const = 0;
};

// The host decoder for `spec` (what CpuBackend::CreateDecoder returns).
absl::StatusOr<std::unique_ptr<Decoder>> CreateHostDecoder(const DecoderSpec& spec);

// Fixed-horizon decoder (Theorem 3.3). Movable, not copyable.
class FixedHorizonDecoder final : public Decoder {
 public:
  // The plan fixes T, n and the geometry. InvalidArgument for empty dims.
  static absl::StatusOr<FixedHorizonDecoder> Create(const SmatPlan& plan, DecodeDims dims,
                                                    float eps);

  FixedHorizonDecoder(FixedHorizonDecoder&&) = default;
  FixedHorizonDecoder& operator=(FixedHorizonDecoder&&) = default;

  // Consumes token position() for every (sequence, head) and writes its output
  // to *o ([batch, H, dv] fp32 host, allocated when undefined). InvalidArgument
  // for a wrong shape/dtype or a content id out of range; OutOfRange once T
  // tokens have been decoded (the horizon: use SteppedWindowDecoder beyond it).
  // (Host tensors; `stream` is ignored: the work is done when Step returns.)
  absl::Status Step(const DecodeToken& token, Tensor* o, Stream* stream = nullptr) override;

  int64_t position() const override { return t_; }
  // Bytes of decoder state held now (F during the distant block, then U + S).
  int64_t StateBytes() const override;

 private:
  FixedHorizonDecoder() = default;
  void Tabulate();  // at t = n: refer F to Lambda_{n-1}, U = C F, drop F

  SmatPlan plan_;
  DecodeDims dims_;
  float eps_ = 0.f;
  int64_t t_ = 0;
  int64_t rp_ = 0;  // r * p, one state
  std::vector<float> S_;         // [batch*H, r, p] running state (distant, then recent)
  std::vector<float> F_;         // [batch*H, P, r, p] profile table while t < n
  std::vector<double> F_lam_;    // [batch*H, P] lam at which F[x] is referred
  std::vector<double> lam_;      // [batch*H] sum of logg over [0, t] (t < n) or [n, t]
  std::vector<float> U_;         // [batch*H, B, r, p] type table, referred to Lambda_{n-1}
};

// Stepped-window decoder (Algorithm 3, gated per Lemma 5). Movable.
class SteppedWindowDecoder final : public Decoder {
 public:
  // plan: the geometry from T_max (MakeSmatPlan(T_max, d, chunk, q)); window:
  // c_dc, a positive multiple of plan.chunk.
  static absl::StatusOr<SteppedWindowDecoder> Create(const SmatPlan& plan, int64_t window,
                                                     DecodeDims dims, float eps);

  SteppedWindowDecoder(SteppedWindowDecoder&&) = default;
  SteppedWindowDecoder& operator=(SteppedWindowDecoder&&) = default;

  // As FixedHorizonDecoder::Step, without a horizon.
  absl::Status Step(const DecodeToken& token, Tensor* o, Stream* stream = nullptr) override;

  int64_t position() const override { return t_; }
  int64_t StateBytes() const override;

 private:
  SteppedWindowDecoder() = default;
  void EnterBlock(int64_t block);  // lines 3-5 of Algorithm 3 at t = block * c_dc

  SmatPlan plan_;
  int64_t window_ = 0;
  DecodeDims dims_;
  float eps_ = 0.f;
  int64_t t_ = 0;
  int64_t rp_ = 0;
  std::vector<float> U_;           // [batch*H, B, r, p] = C F~^(n(t)), referred to n(t) - 1
  std::vector<float> U_scratch_;   // [B, r, p] C Delta_old before it is added
  std::vector<float> delta_old_;   // [batch*H, P, r, p] block b-1, referred to its last token
  std::vector<float> delta_cur_;   // [batch*H, P, r, p] block b so far (lazily referred)
  std::vector<double> delta_lam_;  // [batch*H, P] block-local lam at which delta_cur[x] is referred
  std::vector<float> R_old_;       // [batch*H, r, p] recurrence started at n(t)
  std::vector<float> R_cur_;       // [batch*H, r, p] recurrence started at b(t) c_dc
  std::vector<double> lam_block_;  // [batch*H] sum of logg over the current block up to t
  std::vector<double> prev_block_total_;  // [batch*H] sum of logg over block b(t) - 1
};

// ---- forward passes of the same masks ---------------------------------------------

// Stepped-window mask entry (Definition 1, 0-based): true iff s <= t and
// (s >= n(t) or C[type][prof]) with the given type of t and profile of s.
bool SteppedWindowMaskEntry(const SmatPlan& plan, int64_t window, int64_t t, int64_t s,
                            int64_t type_t, int64_t prof_s);

// On any device (the same math on the GPU, tests/gpu/decode_gpu_test.cc):
//
//   DecoderSpec spec{.plan = plan, .window = 0, .dims = {batch, H, r, dv}, .eps = eps};
//   SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> dec, backend->CreateDecoder(spec));
//   SMAT_RETURN_IF_ERROR(dec->Step(tok, &o));  // tok and o on backend->device()
//
// The stepped-window mask as a forward pass over in.phi/psi/v [batch, T, H, *]
// (fp32 host; T may exceed plan.T): per block, U = exp(decay) U + C Delta (one
// tabulation per block), the previous block's total state and a within-block
// running state; O(T r p + (T / c_dc) nnz(C) r p). Writes *o [batch, T, H, dv]
// (allocated when undefined). InvalidArgument for inconsistent inputs.
absl::Status SteppedWindowForward(const SmatPlan& plan, int64_t window, const SmatInputs& in,
                                  Tensor* o);

// Dense double reference of masked linear attention (eq. 3 with eq. 13):
// ybar_t = sum_{s <= t, mask(b, h, t, s)} exp(Lambda_t - Lambda_s) (phi_t . psi_s) vbar_s,
// o_t = ybar_t[0:dv] / (ybar_t[dv] + eps). O(T^2 (r + p)) per (sequence, head):
// a test utility; inputs must be consistent (programmer error otherwise).
struct DenseReferenceOutputs {
  std::vector<double> ybar;  // [batch, T, H, p]
  std::vector<double> o;     // [batch, T, H, dv]
};
using MaskFn = std::function<bool(int64_t b, int64_t h, int64_t t, int64_t s)>;
DenseReferenceOutputs MaskedAttentionDenseReference(const SmatInputs& in, const MaskFn& mask);

// Mask predicates for the reference, content maps read from in.prof / in.type
// when defined, else positional.
MaskFn SmatMaskFn(const SmatPlan& plan, const SmatInputs& in);
MaskFn SteppedWindowMaskFn(const SmatPlan& plan, int64_t window, const SmatInputs& in);

}  // namespace smat
