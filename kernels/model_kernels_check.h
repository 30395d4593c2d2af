// Operand validation of the ModelKernels (kernels/model_kernels.h), shared by
// the CPU implementation (kernels/cpu/model_kernels_cpu.cc) and the CUDA one
// (kernels/cuda/model_kernels_cuda.cc, in libsmat_cuda.so), so both reject the
// same calls with the same messages. Each function checks the operands of one
// method (or of a group of methods with the same operands) in the order the
// method lists them and returns the sizes the method needs; a mismatch is
// InvalidArgument naming the method and the operand, e.g.
// "FeatureMapForward: y has shape [2, 3]; expected [2, 4]".
//
// `device` is where the operands must live: Device::Cpu() for the CPU kernels
// ("... is on cuda:0; the CPU model kernels need host tensors"), the backend's
// CUDA device for the CUDA kernels ("... is on cpu; the CUDA model kernels of
// cuda:0 need tensors there (Backend::Copy)"). Checks that only one
// implementation makes (the CUDA kernels' aliasing and 32-bit limits, the
// indices that come from data) stay with it.
//
//   SMAT_ASSIGN_OR_RETURN(RowsCols nw, CheckRmsNormForward(x, weight, y, rstd, Device::Cpu()));
#pragma once

#include <cstdint>
#include <initializer_list>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/tensor.h"
#include "kernels/feature_map.h"

namespace smat {

// An operand and its name in messages: {dy, "dy"}.
struct NamedTensor {
  const Tensor& tensor;
  const char* name;
};

// Sizes of a rank-2 operand [rows, cols].
struct RowsCols {
  int64_t rows = 0;
  int64_t cols = 0;
};

// Sizes of the ops between tokens and the vocabulary: the embedding (ids [N],
// table [V, W]) and the cross-entropy (h [N, W], w_head [V, W]).
struct VocabDims {
  int64_t n = 0;  // rows (tokens)
  int64_t v = 0;  // vocabulary
  int64_t w = 0;  // width
};

// Sizes of a rank-3 operand: [N, H, r] (SigmoidScale) or [batch, L, C] (ShortConv).
struct Dims3 {
  int64_t d0 = 0;
  int64_t d1 = 0;
  int64_t d2 = 0;
};

// Element-wise ops (ResidualAdd, the softplus gates, AdamWUpdate): every
// operand fp32 on `device` with the shape of the first.
absl::Status CheckElementwise(const char* op, std::initializer_list<NamedTensor> operands,
                              Device device);

// Row-wise ops on matrices (SwiGLU, ExpRowMax): the first operand fp32 of rank
// 2, the others of its shape, all on `device`. Returns its sizes.
absl::StatusOr<RowsCols> CheckMatrices(const char* op, std::initializer_list<NamedTensor> operands,
                                       Device device);

// FeatureMapForward / FeatureMapBackward: f one of the FeatureMap enumerators,
// then the operands as CheckElementwise.
absl::Status CheckFeatureMap(const char* op, FeatureMap f,
                             std::initializer_list<NamedTensor> operands, Device device);

// EmbeddingForward (matrix = table, rows = out) and EmbeddingBackward
// (matrix = d_table, rows = d_out): the matrix [V, W] fp32, ids int32 [N],
// rows fp32 [N, W].
absl::StatusOr<VocabDims> CheckEmbedding(const char* op, NamedTensor matrix, const Tensor& ids,
                                         NamedTensor rows, Device device);

// RmsNormForward: x [N, W], weight [W], y [N, W] (fp32 or bf16), rstd [N].
// Returns {N, W}.
absl::StatusOr<RowsCols> CheckRmsNormForward(const Tensor& x, const Tensor& weight, const Tensor& y,
                                             const Tensor& rstd, Device device);

// RmsNormBackward: x [N, W], weight [W], rstd [N], dy, dx [N, W], d_weight [W].
// Returns {N, W}.
absl::StatusOr<RowsCols> CheckRmsNormBackward(const Tensor& x, const Tensor& weight,
                                              const Tensor& rstd, const Tensor& dy,
                                              const Tensor& dx, const Tensor& d_weight,
                                              Device device);

// AddRmsNormForward: a, b, sum fp32 [N, W] (as CheckElementwise), then sum,
// weight, y, rstd as RmsNormForward's x, weight, y, rstd; y aliasing none of
// a, b, sum. Returns {N, W}.
absl::StatusOr<RowsCols> CheckAddRmsNormForward(const Tensor& a, const Tensor& b,
                                                const Tensor& weight, const Tensor& sum,
                                                const Tensor& y, const Tensor& rstd,
                                                Device device);

// RmsNormBackwardAdd: the operands of RmsNormBackward and d_residual fp32
// [N, W]; dx aliasing neither dy nor d_residual. Returns {N, W}.
absl::StatusOr<RowsCols> CheckRmsNormBackwardAdd(const Tensor& x, const Tensor& weight,
                                                 const Tensor& rstd, const Tensor& dy,
                                                 const Tensor& d_residual, const Tensor& dx,
                                                 const Tensor& d_weight, Device device);

// SigmoidScaleForward: x [N, H, r], g [N, H], y [N, H, r] fp32 or bf16 (aliasing
// x only when fp32). Returns {N, H, r}.
absl::StatusOr<Dims3> CheckSigmoidScaleForward(const Tensor& x, const Tensor& g, const Tensor& y,
                                               Device device);

// SigmoidScaleBackward: x [N, H, r], g [N, H], dy, dx [N, H, r], dg [N, H].
// Returns {N, H, r}.
absl::StatusOr<Dims3> CheckSigmoidScaleBackward(const Tensor& x, const Tensor& g, const Tensor& dy,
                                                const Tensor& dx, const Tensor& dg, Device device);

// ShortConvForward: x [batch, L, C], prefix [batch, K-1, C], w [K, C],
// y [batch, L, C] fp32 or bf16 (K = kShortConvWidth). Returns {batch, L, C}.
absl::StatusOr<Dims3> CheckShortConvForward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                            const Tensor& y, Device device);

// ShortConvBackward: the operands of the forward, then dy, dx [batch, L, C]
// (dx fp32 or bf16), d_prefix [batch, K-1, C], d_w [K, C]. Returns {batch, L, C}.
absl::StatusOr<Dims3> CheckShortConvBackward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                             const Tensor& dy, const Tensor& dx,
                                             const Tensor& d_prefix, const Tensor& d_w,
                                             Device device);

// ShortConvSoftplusForward: x, prefix, w as ShortConvForward's, y fp32 and f
// fp32 or bf16 [batch, L, C]; x, y, f pairwise distinct. Returns {batch, L, C}.
absl::StatusOr<Dims3> CheckShortConvSoftplusForward(const Tensor& x, const Tensor& prefix,
                                                    const Tensor& w, const Tensor& y,
                                                    const Tensor& f, Device device);

// ShortConvSoftplusBackward: the operands of ShortConvBackward and z fp32
// [batch, L, C]; dx aliasing none of x, z, dy. Returns {batch, L, C}.
absl::StatusOr<Dims3> CheckShortConvSoftplusBackward(const Tensor& x, const Tensor& prefix,
                                                     const Tensor& w, const Tensor& z,
                                                     const Tensor& dy, const Tensor& dx,
                                                     const Tensor& d_prefix, const Tensor& d_w,
                                                     Device device);

// CrossEntropyForward: h [N, W], w_head [V, W], targets int32 [N], weights and
// lse fp32 [N], chunk_tokens >= 1 and a loss_sum to write. The targets' values
// are checked by the implementations (they live on `device`).
absl::StatusOr<VocabDims> CheckCrossEntropyForward(const Tensor& h, const Tensor& w_head,
                                                   const Tensor& targets, const Tensor& weights,
                                                   int64_t chunk_tokens, const Tensor& lse,
                                                   const double* loss_sum, Device device);

// CrossEntropyBackward: the operands of the forward, then dh [N, W] and
// d_w_head [V, W], chunk_tokens >= 1.
absl::StatusOr<VocabDims> CheckCrossEntropyBackward(const Tensor& h, const Tensor& w_head,
                                                    const Tensor& targets, const Tensor& weights,
                                                    const Tensor& lse, int64_t chunk_tokens,
                                                    const Tensor& dh, const Tensor& d_w_head,
                                                    Device device);

// The forward maps with an output that may be bf16 (SoftplusForward,
// NegSoftplusForward): x fp32, y fp32 or bf16 of x's shape; y may alias x
// only when both are fp32.
absl::Status CheckUnaryForward(const char* op, const Tensor& x, const Tensor& y, Device device);

// FeatureMapForward: f as CheckFeatureMap, then x and y as CheckUnaryForward.
absl::Status CheckFeatureMapForward(FeatureMap f, const Tensor& x, const Tensor& y, Device device);

// SwiGluForward: gate [N, F] fp32 or bf16, up of gate's dtype and shape, y
// [N, F] fp32 or bf16 (aliasing an input only of its dtype). Returns {N, F}.
absl::StatusOr<RowsCols> CheckSwiGluForward(const Tensor& gate, const Tensor& up, const Tensor& y,
                                            Device device);

// SwiGluBackward: gate, up as the forward's; dy fp32 or bf16 [N, F]; d_gate fp32 or
// bf16 [N, F], d_up of d_gate's dtype (aliasing an input only of its dtype).
// Returns {N, F}.
absl::StatusOr<RowsCols> CheckSwiGluBackward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                                             const Tensor& d_gate, const Tensor& d_up,
                                             Device device);

// NarrowLinearForward: x [N, in] and w [out, in] fp32 or bf16 with
// 1 <= out <= kNarrowLinearMaxOut, bias fp32 [out] or undefined, y fp32
// [N, out] not aliasing x. Returns {N, in, out}.
absl::StatusOr<Dims3> CheckNarrowLinearForward(const Tensor& x, const Tensor& w,
                                               const Tensor& bias, const Tensor& y,
                                               Device device);

// NarrowLinearBackward: x, w as the forward's, dy fp32 [N, out], dx fp32
// [N, in] aliasing neither x nor dy, d_w fp32 [out, in], d_bias fp32 [out] or
// undefined. Returns {N, in, out}.
absl::StatusOr<Dims3> CheckNarrowLinearBackward(const Tensor& x, const Tensor& w,
                                                const Tensor& dy, const Tensor& dx,
                                                const Tensor& d_w, const Tensor& d_bias,
                                                Device device);

// Cast: src and dst defined, fp32 or bf16, on `device`, with one element count.
absl::Status CheckCast(const Tensor& src, const Tensor& dst, Device device);

// SumOfSquares: every tensor fp32 on `device` ("tensor <k>" in messages).
absl::Status CheckSumOfSquares(absl::Span<const Tensor> tensors, Device device);

}  // namespace smat
