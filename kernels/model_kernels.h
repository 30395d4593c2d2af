// ModelKernels: the dense operations of the language model around the SMat
// mixer (ARCHITECTURE.md section 2, "Model ops"), forward and backward side by
// side, behind one interface so a CUDA implementation can follow the CPU one
// (kernels/cpu/model_kernels_cpu.h) without touching trainer/model.
//
// Conventions. Tensors are fp32 on the backend's device unless said otherwise;
// token ids and targets are int32. Rows are tokens flattened over (batch,
// span): x [N, W]. Backward functions OVERWRITE the gradient of their inputs
// (dx) and ACCUMULATE (+=) into parameter gradients (dweight), so one gradient
// buffer serves every layer that shares a parameter (tied embeddings) and the
// steps of gradient accumulation. Every reduction runs in a fixed order (rows in
// increasing index, chunks in increasing index), never with floating-point
// atomics, so the same inputs give the same bits (ARCHITECTURE.md section 5).
// Matrix products go through Backend::Gemm.
//
//   ModelKernels* mk = ...;  // backend.model()
//   SMAT_RETURN_IF_ERROR(mk->RmsNormForward(x, w, 1e-6f, y, rstd));
//   SMAT_RETURN_IF_ERROR(mk->RmsNormBackward(x, w, rstd, dy, dx, dw));  // dw +=
//
// Shapes and dtypes are validated; a mismatch is InvalidArgument naming the
// operand.
//
// bf16 outputs (run.bf16). Where an op says "y fp32 or bf16", a bf16 output
// holds exactly Cast of the fp32 result (computed as in fp32, then rounded to
// nearest even), so an activation that only matrix products read is written
// once, in the dtype they read, instead of in fp32 and then cast. An output may
// alias an input only when both have one dtype.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/feature_map.h"

namespace smat {

// Width of the short causal depthwise convolution on q, k, v (paper Section
// 3.4: a width-4 token shift before the feature map).
inline constexpr int64_t kShortConvWidth = 4;

// The most outputs of a narrow linear layer (NarrowLinearForward).
inline constexpr int64_t kNarrowLinearMaxOut = 16;

class ModelKernels {
 public:
  virtual ~ModelKernels() = default;

  // --- embedding ----------------------------------------------------------------
  // out[i, :] = table[ids[i], :].  table [V, W], ids int32 [N] in [0, V), out [N, W].
  // An id outside [0, V) is InvalidArgument (it comes from data).
  virtual absl::Status EmbeddingForward(const Tensor& table, const Tensor& ids, Tensor& out,
                                        Stream* stream = nullptr) = 0;
  // d_table[ids[i], :] += d_out[i, :] for i = 0, 1, ..., N-1 in that order
  // (a scatter-add with a fixed order: deterministic). d_out [N, W].
  virtual absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& d_out, Tensor& d_table,
                                         Stream* stream = nullptr) = 0;

  // --- RMSNorm --------------------------------------------------------------------
  // y = x * rstd * weight, rstd[i] = 1 / sqrt(mean_j x[i, j]^2 + eps).
  // x [N, W], weight [W], y [N, W] fp32 or bf16, rstd [N] (saved for backward).
  virtual absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                                      Tensor& rstd, Stream* stream = nullptr) = 0;
  // dx = d/dx of sum(dy * y) (overwritten), d_weight += sum_i dy[i] * x[i] * rstd[i].
  // dx may not alias dy.
  virtual absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                       const Tensor& dy, Tensor& dx, Tensor& d_weight,
                                       Stream* stream = nullptr) = 0;

  // The residual add before a norm and the add of the residual path's gradient
  // after its backward, each in the norm's pass over the rows (the same bits
  // as the separate ops):
  // sum = a + b (ResidualAdd; sum may alias a or b), then RmsNormForward(sum,
  // weight, eps, y, rstd). y aliases none of a, b, sum.
  virtual absl::Status AddRmsNormForward(const Tensor& a, const Tensor& b, const Tensor& weight,
                                         float eps, Tensor& sum, Tensor& y, Tensor& rstd,
                                         Stream* stream = nullptr) = 0;
  // RmsNormBackward(x, weight, rstd, dy, dx, d_weight), then dx += d_residual
  // (ResidualAdd(dx, d_residual, dx)). d_residual fp32 [N, W]; dx aliases
  // neither dy nor d_residual.
  virtual absl::Status RmsNormBackwardAdd(const Tensor& x, const Tensor& weight,
                                          const Tensor& rstd, const Tensor& dy,
                                          const Tensor& d_residual, Tensor& dx,
                                          Tensor& d_weight, Stream* stream = nullptr) = 0;

  // --- SwiGLU ---------------------------------------------------------------------
  // y = silu(gate) * up, silu(a) = a * sigmoid(a).  gate, up, y [N, F]; gate
  // and up fp32 or bf16 (one dtype; bf16 read exactly), y fp32 or bf16.
  virtual absl::Status SwiGluForward(const Tensor& gate, const Tensor& up, Tensor& y,
                                     Stream* stream = nullptr) = 0;
  // d_gate, d_up overwritten from dy [N, F] (fp32 or bf16, read exactly: the
  // product that writes it may round it once on the way out). gate and up as
  // the forward's; d_gate and d_up fp32 or bf16 (one dtype).
  virtual absl::Status SwiGluBackward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                                      Tensor& d_gate, Tensor& d_up, Stream* stream = nullptr) = 0;

  // --- residual ---------------------------------------------------------------------
  // out = a + b (same shape; out may alias a or b). Its backward is the identity
  // into both inputs, so it has no kernel.
  virtual absl::Status ResidualAdd(const Tensor& a, const Tensor& b, Tensor& out,
                                   Stream* stream = nullptr) = 0;

  // --- elementwise gates of the mixer -------------------------------------------------
  // y = -softplus(x) (the log-decay of paper Eq. 13: logg = -softplus(w.x + b) <= 0).
  // x, y same shape (y fp32 or bf16); y may alias x.
  virtual absl::Status NegSoftplusForward(const Tensor& x, Tensor& y, Stream* stream = nullptr) = 0;
  // dx = -sigmoid(x) * dy (overwritten; dx may alias dy).
  virtual absl::Status NegSoftplusBackward(const Tensor& x, const Tensor& dy, Tensor& dx,
                                           Stream* stream = nullptr) = 0;
  // y[i, h, :] = x[i, h, :] * sigmoid(g[i, h]).  x [N, H, r], g [N, H], y [N, H, r]
  // fp32 or bf16 (the key gate folded into psi; y may alias x when fp32).
  virtual absl::Status SigmoidScaleForward(const Tensor& x, const Tensor& g, Tensor& y,
                                           Stream* stream = nullptr) = 0;
  // dx = sigmoid(g) dy, dg[i, h] = sigmoid'(g) sum_j x[i, h, j] dy[i, h, j]
  // (both overwritten).
  virtual absl::Status SigmoidScaleBackward(const Tensor& x, const Tensor& g, const Tensor& dy,
                                            Tensor& dx, Tensor& dg, Stream* stream = nullptr) = 0;

  // --- the feature maps of kernels/feature_map.h (model.feature_map ELU_PLUS_ONE, RELU)
  // y = f(x) element by element, the very functions of kernels/feature_map.h:
  //   kEluPlusOne: x + 1 (x > 0), exp(x) (x <= 0);  kReluEps: max(x, 0) + 1e-3.
  // x fp32, y fp32 or bf16 of x's shape; y may alias x. The CPU runs the host loops of
  // feature_map.h; the CUDA kernels give the same bits except where
  // kEluPlusOne takes exp(x) (x <= 0): CUDA's expf is within 2 ulp of glibc's.
  //   SMAT_RETURN_IF_ERROR(mk->FeatureMapForward(FeatureMap::kEluPlusOne, q, phi, stream));
  virtual absl::Status FeatureMapForward(FeatureMap f, const Tensor& x, Tensor& y,
                                         Stream* stream = nullptr) = 0;
  // dx = f'(x) dy (overwritten; dx may alias dy): dy where x > 0; where x <= 0,
  // exp(x) dy (kEluPlusOne) or 0 (kReluEps).
  virtual absl::Status FeatureMapBackward(FeatureMap f, const Tensor& x, const Tensor& dy,
                                          Tensor& dx, Stream* stream = nullptr) = 0;

  // --- feature maps beyond kernels/feature_map.h (model.feature_map) ------------------
  // SOFTPLUS: y = softplus(x) = log(1 + e^x) > 0. x, y same shape (y fp32 or
  // bf16; y may alias x).
  virtual absl::Status SoftplusForward(const Tensor& x, Tensor& y, Stream* stream = nullptr) = 0;
  // dx = sigmoid(x) dy (overwritten; dx may alias dy).
  virtual absl::Status SoftplusBackward(const Tensor& x, const Tensor& dy, Tensor& dx,
                                        Stream* stream = nullptr) = 0;
  // EXP: y[i, :] = exp(x[i, :] - max_j x[i, j]) over rows of r features
  // (x, y [M, r]; positive, at most 1, so exp never overflows).
  virtual absl::Status ExpRowMaxForward(const Tensor& x, Tensor& y, Stream* stream = nullptr) = 0;
  // dx[i, j] = y[i, j] dy[i, j] - [j = a_i] sum_k y[i, k] dy[i, k], a_i the first
  // argmax of row i (the max is a function of x too). dx overwritten.
  virtual absl::Status ExpRowMaxBackward(const Tensor& x, const Tensor& y, const Tensor& dy,
                                         Tensor& dx, Stream* stream = nullptr) = 0;

  // --- short causal depthwise convolution (width K = kShortConvWidth) ----------------
  // y[b, t, c] = sum_{j<K} w[j, c] x[b, t - (K-1) + j, c], where rows before the
  // span (t - (K-1) + j < 0) come from prefix[b, K-1 + (t - (K-1) + j), c]: the
  // K-1 rows that precede the span (zeros at the start of the sequence).
  // x [batch, L, C], prefix [batch, K-1, C], w [K, C], y [batch, L, C] fp32 or bf16.
  virtual absl::Status ShortConvForward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                        Tensor& y, Stream* stream = nullptr) = 0;
  // dx [batch, L, C] (fp32 or bf16) and d_prefix [batch, K-1, C] overwritten,
  // d_w [K, C] +=.
  virtual absl::Status ShortConvBackward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                         const Tensor& dy, Tensor& dx, Tensor& d_prefix,
                                         Tensor& d_w, Stream* stream = nullptr) = 0;

  // --- narrow linear layer (the mixer's decay and key-gate projections, run.bf16) ------
  // A product with a handful of outputs and a long row reduction in the
  // backward, which general matrix-product kernels serve poorly.
  // y [N, out] = x [N, in] w [out, in]^T + bias [out], summed in fp32.
  // 1 <= out <= kNarrowLinearMaxOut; x and w fp32 or bf16 (each read exactly);
  // bias fp32 [out] or undefined (none); y fp32 [N, out], not aliasing x.
  virtual absl::Status NarrowLinearForward(const Tensor& x, const Tensor& w, const Tensor& bias,
                                           Tensor& y, Stream* stream = nullptr) = 0;
  // Backward of NarrowLinearForward for dy [N, out] (fp32):
  // dx [N, in] fp32 = dy w (accumulate_dx: dx += dy w), d_w [out, in] += dy^T x
  // and d_bias [out] += column sums of dy (d_bias undefined: none), the sums
  // over rows in a fixed order. x and w as the forward's; dx may not alias
  // x or dy.
  virtual absl::Status NarrowLinearBackward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                            Tensor& dx, bool accumulate_dx, Tensor& d_w,
                                            Tensor& d_bias, Stream* stream = nullptr) = 0;

  // y = ShortConv(x) (fp32) and f = softplus(y) (fp32 or bf16) in one pass:
  // exactly ShortConvForward(x, prefix, w, y) then SoftplusForward(y, f).
  // x, y, f pairwise distinct.
  virtual absl::Status ShortConvSoftplusForward(const Tensor& x, const Tensor& prefix,
                                                const Tensor& w, Tensor& y, Tensor& f,
                                                Stream* stream = nullptr) = 0;
  // The backward of y = softplus(ShortConv(x)) in one pass: exactly
  // SoftplusBackward(z, dy, g) then ShortConvBackward(x, prefix, w, g, ...),
  // z [batch, L, C] fp32 the conv's output (the softplus input the forward
  // kept), dy the gradient at y; the other operands as ShortConvBackward's.
  // dx aliases none of x, z, dy.
  virtual absl::Status ShortConvSoftplusBackward(const Tensor& x, const Tensor& prefix,
                                                 const Tensor& w, const Tensor& z,
                                                 const Tensor& dy, Tensor& dx, Tensor& d_prefix,
                                                 Tensor& d_w, Stream* stream = nullptr) = 0;

  // --- fused, chunked cross-entropy ----------------------------------------------------
  // Loss of the LM head without a [N, V] logits tensor: tokens are processed in
  // chunks of `chunk_tokens` rows; per chunk logits = h W^T go to a
  // [chunk_tokens, V] scratch (Backend::Gemm), then log-softmax.
  //   h [N, W], w_head [V, W], targets int32 [N] in [0, V), weights fp32 [N]
  //   (0: not counted; rows with weight 0 may hold any target), lse [N] (out:
  //   log-sum-exp of each row's logits, saved for backward).
  // *loss_sum = sum_i weights[i] * (lse[i] - logit[i, targets[i]]), accumulated in
  // double in row order.
  virtual absl::Status CrossEntropyForward(Backend& backend, const Tensor& h, const Tensor& w_head,
                                           const Tensor& targets, const Tensor& weights,
                                           int64_t chunk_tokens, Tensor& lse, double* loss_sum,
                                           Stream* stream = nullptr) = 0;
  // Gradient of scale * loss_sum: logits recomputed per chunk, dlogits =
  // scale * weights[i] * (softmax - onehot(target)); dh = dlogits W (overwritten),
  // d_w_head += dlogits^T h (chunks in order).
  virtual absl::Status CrossEntropyBackward(Backend& backend, const Tensor& h,
                                            const Tensor& w_head, const Tensor& targets,
                                            const Tensor& weights, const Tensor& lse, float scale,
                                            int64_t chunk_tokens, Tensor& dh, Tensor& d_w_head,
                                            Stream* stream = nullptr) = 0;

  // --- dtype conversion (bf16 compute, run.bf16) ----------------------------------------
  // dst = src converted elementwise: fp32 -> bf16 rounds to nearest even (NaN
  // stays NaN), bf16 -> fp32 is exact; same dtype is a copy. Same element count;
  // shapes may differ (a reshape).
  virtual absl::Status Cast(const Tensor& src, Tensor& dst, Stream* stream = nullptr) = 0;

  // --- AdamW update of one parameter (trainer/optimizer) ------------------------------
  // For every element k, in fp32, with exactly these operations (no fused
  // multiply-add, so every backend gives the same bits):
  //   g    = grad[k] * grad_scale
  //   m[k] = beta1 * m[k] + one_minus_beta1 * g
  //   v[k] = beta2 * v[k] + one_minus_beta2 * (g * g)
  //   w[k] = w[k] * decay - step_size * m[k] / (sqrt(v[k]) * inv_sqrt_bc2 + eps)
  // (one_minus_beta2 * g * g evaluates as (one_minus_beta2 * g) * g.)
  // value, grad, m, v fp32 of one shape; value, m, v updated in place.
  struct AdamWScalars {
    float grad_scale = 1.f;       // global-norm clipping factor (1: none)
    float beta1 = 0.9f, one_minus_beta1 = 0.1f;
    float beta2 = 0.95f, one_minus_beta2 = 0.05f;
    float eps = 1e-8f;
    float step_size = 0.f;        // lr / (1 - beta1^t), computed in double
    float inv_sqrt_bc2 = 1.f;     // 1 / sqrt(1 - beta2^t), computed in double
    float decay = 1.f;            // 1 - lr * weight_decay, or 1 (no decay)
  };
  virtual absl::Status AdamWUpdate(Tensor& value, const Tensor& grad, Tensor& m, Tensor& v,
                                   const AdamWScalars& s, Stream* stream = nullptr) = 0;

  // --- gradient norm ------------------------------------------------------------------
  // sum over tensors (in the given order) of sum over elements (in order) of x^2,
  // accumulated in double: the square of the global norm. fp32 tensors.
  virtual absl::StatusOr<double> SumOfSquares(absl::Span<const Tensor> tensors,
                                              Stream* stream = nullptr) = 0;
};

}  // namespace smat
