// CUDA kernels of the model ops (kernels/model_kernels.h; in model_kernels_elementwise.cu,
// model_kernels_loss.cu and model_kernels_norm_conv.cu), behind plain launch
// functions so that model_kernels_cuda.cc, which validates tensors and returns
// Status, is ordinary C++ and nvcc never parses Abseil.
//
// Every launcher enqueues its kernels on `stream` and returns the first
// cudaError_t of its launches (cudaGetLastError after each). Arguments are
// assumed valid (shapes checked by the caller). No kernel uses floating-point
// atomics: every sum runs in an order fixed by the sizes alone, so the same
// inputs give the same bits. Where a comment says "as the CPU", the kernel
// performs the CPU implementation's fp32 operations one by one (__fmul_rn,
// __fadd_rn: never contracted into a fused multiply-add) in the CPU's order, so
// the results are bitwise equal to kernels/cpu/model_kernels_cpu.cc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace smat {

// Width of the short convolution (kShortConvWidth in kernels/model_kernels.h,
// which this header cannot include).
inline constexpr int kCudaShortConvWidth = 4;

// FeatureMap and kReluFeatureFloor of kernels/feature_map.h (which includes
// Abseil); model_kernels_cuda.cc checks that they agree.
enum class CudaFeatureMap : int { kEluPlusOne = 0, kReluEps = 1 };
inline constexpr float kCudaReluFeatureFloor = 1e-3f;

// --- validation of data-dependent indices -----------------------------------------
// *first_bad = the smallest i < n with ids[i] outside [0, V) (and, when weights
// is not null, weights[i] != 0), or UINT64_MAX when there is none. first_bad
// is device memory; it is initialised here.
cudaError_t LaunchFirstBadIndex(const int32_t* ids, const float* weights, int64_t n, int64_t V,
                                unsigned long long* first_bad, int max_blocks,
                                cudaStream_t stream);

// --- embedding ---------------------------------------------------------------------
// out[i, :] = table[ids[i], :] (rows whose id is outside [0, V) are skipped).
cudaError_t LaunchEmbeddingForward(const float* table, const int32_t* ids, float* out, int64_t N,
                                   int64_t W, int64_t V, int max_blocks, cudaStream_t stream);
// Device scratch bytes LaunchEmbeddingBackward needs for N rows and ids below V.
cudaError_t EmbeddingBackwardScratchBytes(int64_t N, int64_t V, size_t* bytes);
// d_table[ids[i], :] += d_out[i, :] in increasing i per id, as the CPU: a
// stable radix sort of (id, row) pairs gives each id's rows in increasing
// order, then one thread per (id, column) adds them to the table in that order.
// ids must all be in [0, V).
cudaError_t LaunchEmbeddingBackward(const int32_t* ids, const float* d_out, float* d_table,
                                    int64_t N, int64_t W, int64_t V, void* scratch,
                                    size_t scratch_bytes, cudaStream_t stream);

// --- RMSNorm -----------------------------------------------------------------------
// One warp per row; the sum of squares in double (rstd as the CPU up to the
// order of that sum), y = (x * rstd) * w as the CPU: fp32, or (y_bf16) bf16
// bits rounded from it.
cudaError_t LaunchRmsNormForward(const float* x, const float* w, float eps, void* y, bool y_bf16,
                                 float* rstd, int64_t N, int64_t W, cudaStream_t stream);
// sum = a + b (as the residual add; sum may alias a or b), then y and rstd
// of sum exactly as LaunchRmsNormForward.
cudaError_t LaunchAddRmsNormForward(const float* a, const float* b, float* sum, const float* w,
                                    float eps, void* y, bool y_bf16, float* rstd, int64_t N,
                                    int64_t W, cudaStream_t stream);
// dx only (one warp per row); d_residual (when not null) added to each
// element last, as a separate residual add would.
cudaError_t LaunchRmsNormBackwardInput(const float* x, const float* w, const float* rstd,
                                       const float* dy, const float* d_residual, float* dx,
                                       int64_t N, int64_t W, cudaStream_t stream);

// Column sums over rows in two fixed stages: ColumnPartials(rows) blocks of
// consecutive rows each write a partial sum per column into `partials`
// [ColumnPartials(rows), cols], then out[j] += partial_0[j] + partial_1[j] + ...
// in block order.
int64_t ColumnPartials(int64_t rows);
// d_weight[j] += sum_i (dy[i, j] * x[i, j]) * rstd[i].
cudaError_t LaunchRmsNormWeightGrad(const float* x, const float* rstd, const float* dy,
                                    float* partials, float* d_weight, int64_t N, int64_t W,
                                    cudaStream_t stream);
// Partial rows LaunchRmsNormBackward needs (partials [that, W]).
int64_t RmsNormBackwardPartials(int64_t N, int64_t W);
// The whole backward: dx as LaunchRmsNormBackwardInput and d_weight[j] +=
// sum_i (dy[i, j] * x[i, j]) * rstd[i] in a fixed order. For W <= 512 one
// pass over x and dy (a block per fixed range of rows, a warp per row, the
// d_weight terms summed per warp in row order, the warps in order, then the
// block partials in fixed groups); wider rows use LaunchRmsNormWeightGrad and
// then LaunchRmsNormBackwardInput. dx may alias x. d_residual as
// LaunchRmsNormBackwardInput's (null: none).
cudaError_t LaunchRmsNormBackward(const float* x, const float* w, const float* rstd,
                                  const float* dy, const float* d_residual, float* dx,
                                  float* d_weight, float* partials, int64_t N, int64_t W,
                                  cudaStream_t stream);

// --- element-wise ------------------------------------------------------------------
// Operands typed void* are fp32, or bf16 bits where their flag says so (read
// exactly; written rounded to nearest even from the fp32 result, as Cast).
// gate and up share in_bf16; d_gate and d_up share out_bf16.
cudaError_t LaunchSwiGluForward(const void* gate, const void* up, bool in_bf16, void* y,
                                bool y_bf16, int64_t n, int max_blocks, cudaStream_t stream);
cudaError_t LaunchSwiGluBackward(const void* gate, const void* up, bool in_bf16, const void* dy,
                                 bool dy_bf16, void* d_gate, void* d_up, bool out_bf16, int64_t n,
                                 int max_blocks, cudaStream_t stream);
// out = a + b, as the CPU.
cudaError_t LaunchResidualAdd(const float* a, const float* b, float* out, int64_t n,
                              int max_blocks, cudaStream_t stream);
// y = sign * softplus(x), sign = -1 (negate) or +1.
cudaError_t LaunchSoftplus(const float* x, void* y, bool y_bf16, int64_t n, bool negate,
                           int max_blocks, cudaStream_t stream);
// dx = sign * sigmoid(x) * dy.
cudaError_t LaunchSigmoidTimes(const float* x, const float* dy, float* dx, int64_t n, bool negate,
                               int max_blocks, cudaStream_t stream);
// The feature maps of kernels/feature_map.h, as its host loops:
//   kEluPlusOne: y = x > 0 ? x + 1 : expf(x);  dx = x > 0 ? dy : dy * expf(x);
//   kReluEps:    y = (x > 0 ? x : 0) + floor;  dx = x > 0 ? dy : 0.
// Every fp32 operation is the host loop's (one add, one multiply, never
// fused), so the results are bitwise the CPU's except expf(x), the accurate
// CUDA expf (2 ulp, gradual underflow kept) where the CPU calls glibc's.
// y may alias x, dx may alias dy. cudaErrorInvalidValue for an unknown map.
cudaError_t LaunchFeatureMapForward(CudaFeatureMap f, const float* x, void* y, bool y_bf16,
                                    int64_t n, int max_blocks, cudaStream_t stream);
cudaError_t LaunchFeatureMapBackward(CudaFeatureMap f, const float* x, const float* dy,
                                     float* dx, int64_t n, int max_blocks, cudaStream_t stream);
// y[i, :] = x[i, :] * sigmoid(g[i]) over rows of r; y fp32 or (y_bf16) bf16 bits.
cudaError_t LaunchSigmoidScaleForward(const float* x, const float* g, void* y, bool y_bf16,
                                      int64_t rows, int64_t r, int max_blocks,
                                      cudaStream_t stream);
cudaError_t LaunchSigmoidScaleBackward(const float* x, const float* g, const float* dy, float* dx,
                                       float* dg, int64_t rows, int64_t r, int max_blocks,
                                       cudaStream_t stream);
cudaError_t LaunchExpRowMaxForward(const float* x, float* y, int64_t rows, int64_t r,
                                   int max_blocks, cudaStream_t stream);
cudaError_t LaunchExpRowMaxBackward(const float* x, const float* y, const float* dy, float* dx,
                                    int64_t rows, int64_t r, int max_blocks, cudaStream_t stream);

// --- short causal depthwise convolution --------------------------------------------
// Each thread walks a run of consecutive rows of one sequence for 4 channels
// (float4, when C % 4 == 0 and every pointer is 16-byte aligned) or 1, with
// the last K-1 input rows in registers.
// y as the CPU (taps in increasing order from 0); fp32, or (y_bf16) bf16 bits
// rounded from it (vectorized when y is 8-byte aligned).
cudaError_t LaunchShortConvForward(const float* x, const float* prefix, const float* w, void* y,
                                   bool y_bf16, int64_t nb, int64_t L, int64_t C,
                                   cudaStream_t stream);
// LaunchShortConvForward with y fp32 and a second output f = softplus(y)
// (SoftplusForward's operations): fp32, or (f_bf16) bf16 bits rounded from it.
cudaError_t LaunchShortConvSoftplusForward(const float* x, const float* prefix, const float* w,
                                           float* y, void* f, bool f_bf16, int64_t nb, int64_t L,
                                           int64_t C, cudaStream_t stream);
// Partial rows LaunchShortConvBackward needs (partials [that, K, C]).
int64_t ShortConvBackwardPartials(int64_t nb, int64_t L);
// One pass over x, prefix and dy: dx and d_prefix as the CPU; d_w[j, c] +=
// sum over rows (b, t) of dy[b, t, c] * in[b, t - (K-1) + j, c] in a fixed
// order: each run's rows in order, the runs of a block in order (a partial),
// then the partials in fixed groups (out += the sum). d_w is unchanged when
// L == 0 (d_prefix is then zeros). dx fp32, or (dx_bf16) bf16 bits rounded
// from the fp32 value. z (when not null, of dy's layout): the gradient at the
// conv's output is sigmoid(z) * dy (a softplus of the output z), as
// LaunchSigmoidTimes computes it, instead of dy.
cudaError_t LaunchShortConvBackward(const float* x, const float* prefix, const float* w,
                                    const float* dy, const float* z, void* dx, bool dx_bf16,
                                    float* d_prefix, float* d_w, float* partials, int64_t nb,
                                    int64_t L, int64_t C, cudaStream_t stream);

// --- narrow linear layer (out <= kCudaNarrowMaxOut) ---------------------------------
inline constexpr int kCudaNarrowMaxOut = 16;
// y [N, out] = x [N, in] w [out, in]^T (+ bias [out] when not null): one warp
// per row, each lane's terms in column order, the lanes added in a fixed tree.
// x and w fp32, or (their flag) bf16 bits.
cudaError_t LaunchNarrowLinearForward(const void* x, bool x_bf16, const void* w, bool w_bf16,
                                      const float* bias, float* y, int64_t N, int64_t in, int out,
                                      cudaStream_t stream);
// Partial rows LaunchNarrowLinearBackward needs (partials [that, out * (in + 1)]).
int64_t NarrowLinearPartials(int64_t N);
// dx = dy w (accumulate_dx: dx += dy w), one warp per row, the outputs in
// order per element;
// d_w [out, in] += dy^T x and (d_bias not null) d_bias += column sums of dy:
// each block's fixed range of rows summed in fixed row groups (a partial),
// then the partials in fixed groups (out += the sum).
cudaError_t LaunchNarrowLinearBackward(const void* x, bool x_bf16, const void* w, bool w_bf16,
                                       const float* dy, float* dx, bool accumulate_dx,
                                       float* d_w, float* d_bias, float* partials, int64_t N,
                                       int64_t in, int out, cudaStream_t stream);

// --- cross-entropy ------------------------------------------------------------------
// One block per row of logits [m, V]: lse[i] = max + log(sum exp(logit - max))
// (the sum in double), terms[i] = weights[i] * (lse - logit[target]) in double
// (0 where weights[i] == 0).
cudaError_t LaunchCrossEntropyRows(const float* logits, int64_t m, int64_t V,
                                   const int32_t* targets, const float* weights, float* lse,
                                   double* terms, cudaStream_t stream);
// In place: logits[i, v] = a * exp(logits[i, v] - lse[i]) - a [v = target],
// a = scale * weights[i] (rows with a == 0 become zeros), as the CPU.
cudaError_t LaunchCrossEntropyRowGrads(float* logits, int64_t m, int64_t V,
                                       const int32_t* targets, const float* weights,
                                       const float* lse, float scale, cudaStream_t stream);

// --- sums in double -----------------------------------------------------------------
// Blocks that SumOfSquaresPartials uses for n elements.
int64_t SumOfSquaresBlocks(int64_t n);
// partials[b] = sum of x^2 over block b's fixed range of elements (double).
cudaError_t LaunchSumOfSquaresPartials(const float* x, int64_t n, double* partials,
                                       cudaStream_t stream);
// *out = sum of in[0..n) in a fixed order (one block).
cudaError_t LaunchSumDoubles(const double* in, int64_t n, double* out, cudaStream_t stream);

// --- dtype conversion and the optimizer ---------------------------------------------
// Round to nearest even, NaN kept (quiet), as core FloatToBf16.
cudaError_t LaunchCastF32ToBf16(const float* src, uint16_t* dst, int64_t n, int max_blocks,
                                cudaStream_t stream);
cudaError_t LaunchCastBf16ToF32(const uint16_t* src, float* dst, int64_t n, int max_blocks,
                                cudaStream_t stream);

// The AdamW scalars of ModelKernels::AdamWScalars.
struct CudaAdamWScalars {
  float grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, inv_sqrt_bc2,
      decay;
};
// The update of ModelKernels::AdamWUpdate, operation by operation as the CPU.
cudaError_t LaunchAdamW(float* value, const float* grad, float* m, float* v, int64_t n,
                        const CudaAdamWScalars& s, int max_blocks, cudaStream_t stream);

}  // namespace smat
