// CUDA model kernels over rows (model_kernels_kernels.h): RMSNorm forward
// (also with the residual add before it) and backward (also with the residual
// gradient added to dx), the fixed-order column sums its weight gradient uses,
// and the grouped partial sums (LaunchAddPartialsGrouped) that the fused
// backward kernels here, in model_kernels_conv.cu and in model_kernels_linear.cu
// finish with.
#include <climits>
#include <cstdint>

#include "kernels/cuda/model_kernels_device.cuh"

namespace smat {
namespace {

using namespace model_cuda;  // NOLINT: the shared launch shape and reductions

// ------------------------------------------------------------------ RMSNorm

template <typename TY>
__global__ void RmsNormForwardKernel(const float* x, const float* __restrict__ w, float eps,
                                     TY* y, float* __restrict__ rstd, int64_t N, int64_t W) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= N) return;
  const float* row = x + i * W;
  double ss = 0.0;
  for (int64_t j = lane; j < W; j += kWarp) ss += double{row[j]} * row[j];
  ss = WarpSum(ss);
  const float r = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(W) + double{eps}));
  if (lane == 0) rstd[i] = r;
  for (int64_t j = lane; j < W; j += kWarp) {
    StoreAs(y + i * W + j, __fmul_rn(__fmul_rn(row[j], r), w[j]));
  }
}

// sum = a + b (the residual add, may alias a or b), then RmsNormForwardKernel
// on sum's values: the same operations in the same order. Rows of at most
// kAddNormPerLane * 32 columns are read whole into registers before the first
// store (sum may alias a or b, so a later load could not pass an earlier store).
constexpr int kAddNormPerLane = 16;

template <typename TY>
__global__ void AddRmsNormForwardKernel(const float* a, const float* b, float* sum,
                                        const float* __restrict__ w, float eps, TY* y,
                                        float* __restrict__ rstd, int64_t N, int64_t W) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= N) return;
  float* row = sum + i * W;
  double ss = 0.0;
  if (W <= int64_t{kWarp} * kAddNormPerLane) {
    float v[kAddNormPerLane];
#pragma unroll
    for (int k = 0; k < kAddNormPerLane; ++k) {
      const int64_t j = lane + int64_t{kWarp} * k;
      v[k] = j < W ? __fadd_rn(a[i * W + j], b[i * W + j]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kAddNormPerLane; ++k) {
      const int64_t j = lane + int64_t{kWarp} * k;
      if (j < W) {
        row[j] = v[k];
        ss += double{v[k]} * v[k];
      }
    }
  } else {
    for (int64_t j = lane; j < W; j += kWarp) {
      const float s = __fadd_rn(a[i * W + j], b[i * W + j]);
      row[j] = s;
      ss += double{s} * s;
    }
  }
  ss = WarpSum(ss);
  const float r = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(W) + double{eps}));
  if (lane == 0) rstd[i] = r;
  for (int64_t j = lane; j < W; j += kWarp) {  // this lane's own writes above
    StoreAs(y + i * W + j, __fmul_rn(__fmul_rn(row[j], r), w[j]));
  }
}

// dx (+ res when not null: the residual path's gradient, added last). res
// never overlaps dx (CheckRmsNormBackwardAdd), so its loads need not wait for
// the stores to dx.
__global__ void RmsNormBackwardInputKernel(const float* __restrict__ x, const float* __restrict__ w,
                                           const float* __restrict__ rstd,
                                           const float* __restrict__ dy,
                                           const float* __restrict__ res,
                                           float* __restrict__ dx, int64_t N, int64_t W) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= N) return;
  const float* row = x + i * W;
  const float* grow = dy + i * W;
  const float r = rstd[i];
  double dot = 0.0;
  for (int64_t j = lane; j < W; j += kWarp) dot += double{grow[j]} * w[j] * row[j];
  dot = WarpSum(dot);
  const float c = static_cast<float>(dot * r * r * r / static_cast<double>(W));
  for (int64_t j = lane; j < W; j += kWarp) {
    float v = __fsub_rn(__fmul_rn(__fmul_rn(r, w[j]), grow[j]), __fmul_rn(row[j], c));
    if (res != nullptr) v = __fadd_rn(v, res[i * W + j]);
    dx[i * W + j] = v;
  }
}

// Two-stage column sums. Stage 1: block (b, column tile of 32) sums rows
// [b R, (b+1) R) in kRowGroups interleaved groups (thread (g, c) takes rows
// g, g + kRowGroups, ... of the range, in order), then adds the group sums in
// group order. Stage 2: out[j] += partials in block order.
constexpr int kColTile = 32, kRowGroups = 8;
constexpr int64_t kMaxPartials = 256;

}  // namespace

// Declared in model_kernels_device.cuh (the narrow linear layer uses it too).
int64_t model_cuda::RowsPerPartial(int64_t rows) {
  int64_t r = std::max<int64_t>(128, (rows + kMaxPartials - 1) / kMaxPartials);
  return (r + kRowGroups - 1) / kRowGroups * kRowGroups;
}

namespace {

template <class Term>
__global__ void ColumnPartialsKernel(Term term, int64_t rows, int64_t cols, int64_t rows_per,
                                     float* __restrict__ partials) {
  const int c = threadIdx.x % kColTile, g = threadIdx.x / kColTile;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * kColTile + c;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * rows_per;
  const int64_t i1 = std::min(rows, i0 + rows_per);
  float acc = 0.f;
  if (j < cols) {
    for (int64_t i = i0 + g; i < i1; i += kRowGroups) acc = __fadd_rn(acc, term(i, j));
  }
  __shared__ float sums[kRowGroups][kColTile];
  sums[g][c] = acc;
  __syncthreads();
  if (g == 0 && j < cols) {
    float s = sums[0][c];
    for (int k = 1; k < kRowGroups; ++k) s = __fadd_rn(s, sums[k][c]);
    partials[blockIdx.x * cols + j] = s;
  }
}

__global__ void AddPartialsKernel(const float* __restrict__ partials, int64_t blocks, int64_t cols,
                                  float* __restrict__ out) {
  for (int64_t j = GlobalThread(); j < cols; j += GridThreads()) {
    float acc = out[j];
    for (int64_t b = 0; b < blocks; ++b) acc = __fadd_rn(acc, partials[b * cols + j]);
    out[j] = acc;
  }
}

template <class Term>
cudaError_t LaunchColumnSums(Term term, int64_t rows, int64_t cols, float* partials, float* out,
                             cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const int64_t rows_per = RowsPerPartial(rows);
  const int64_t blocks = (rows + rows_per - 1) / rows_per;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>((cols + kColTile - 1) / kColTile));
  ColumnPartialsKernel<<<grid, kColTile * kRowGroups, 0, stream>>>(term, rows, cols, rows_per,
                                                                   partials);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  AddPartialsKernel<<<static_cast<int>((cols + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      partials, blocks, cols, out);
  return cudaGetLastError();
}

struct RmsNormWeightTerm {
  const float* x;
  const float* rstd;
  const float* dy;
  int64_t W;
  __device__ float operator()(int64_t i, int64_t j) const {
    return __fmul_rn(__fmul_rn(dy[i * W + j], x[i * W + j]), rstd[i]);
  }
};

// ------------------------------------------------------------------ fused backward sums
// Stage 2 of the fused backward kernels below: out[j] += the sum of
// partials[p, j] over p < P in a fixed order. Block = 32 columns x
// kSumGroups groups; group q sums the partials [q ceil(P / kSumGroups), ...)
// in increasing p, then the group sums are added in group order and the total
// is added to out[j].
constexpr int kSumGroups = 8;

__global__ void __launch_bounds__(kWarp * kSumGroups)
    AddPartialsGroupedKernel(const float* __restrict__ partials, int64_t P, int64_t cols,
                             float* __restrict__ out) {
  const int lane = threadIdx.x % kWarp, q = threadIdx.x / kWarp;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kWarp + lane;
  const int64_t chunk = (P + kSumGroups - 1) / kSumGroups;
  const int64_t p0 = q * chunk, p1 = std::min(P, p0 + chunk);
  float s = 0.f;
  if (j < cols) {
#pragma unroll 8
    for (int64_t p = p0; p < p1; ++p) s = __fadd_rn(s, partials[p * cols + j]);
  }
  __shared__ float sums[kSumGroups][kWarp];
  sums[q][lane] = s;
  __syncthreads();
  if (q == 0 && j < cols) {
    float total = sums[0][lane];
    for (int k = 1; k < kSumGroups; ++k) total = __fadd_rn(total, sums[k][lane]);
    out[j] = __fadd_rn(out[j], total);
  }
}

}  // namespace

// Declared in model_kernels_device.cuh (the short conv and the narrow linear
// layer use it too).
cudaError_t model_cuda::LaunchAddPartialsGrouped(const float* partials, int64_t P,
                                                 int64_t cols, float* out,
                                                 cudaStream_t stream) {
  if (P == 0 || cols == 0) return cudaSuccess;
  AddPartialsGroupedKernel<<<static_cast<unsigned>((cols + kWarp - 1) / kWarp),
                             kWarp * kSumGroups, 0, stream>>>(partials, P, cols, out);
  return cudaGetLastError();
}

namespace {

// ------------------------------------------------------------------ RMSNorm backward, fused
// One pass over x and dy for W <= kNormMaxW: block = kNormWarps warps over a
// fixed range of NormRowsPerBlock(N) rows, warp g takes rows i0 + g,
// i0 + g + kNormWarps, ... in order, lane l the columns l, l + 32, ... (held in
// registers). dx is RmsNormBackwardInputKernel's (the same operations, the
// same order); the d_weight term (dy * x) * rstd is added per column, in the
// warp's row order, to the warp's row of `acc` in shared memory, then the
// warps' sums in warp order give the block's partial [blocks, W]. Each
// element of x is read and dx written by one thread, reads first, so dx may
// alias x.
constexpr int kNormWarps = 8, kNormPerLane = 16;
constexpr int64_t kNormMaxW = int64_t{kWarp} * kNormPerLane;

int64_t NormRowsPerBlock(int64_t N) {
  const int64_t r = std::max<int64_t>(32, (N + 511) / 512);
  return (r + kNormWarps - 1) / kNormWarps * kNormWarps;
}

__global__ void __launch_bounds__(kWarp * kNormWarps, 3)
    RmsNormBackwardFusedKernel(const float* x, const float* __restrict__ w,
                               const float* __restrict__ rstd, const float* __restrict__ dy,
                               const float* __restrict__ res, float* dx,
                               float* __restrict__ partials,
                               int64_t N, int64_t W, int64_t rows_per) {
  const int lane = threadIdx.x % kWarp, g = threadIdx.x / kWarp;
  __shared__ float acc[kNormWarps][kNormMaxW];
  float wr[kNormPerLane];
#pragma unroll
  for (int k = 0; k < kNormPerLane; ++k) {
    const int64_t j = lane + int64_t{kWarp} * k;
    wr[k] = j < W ? w[j] : 0.f;
    if (j < W) acc[g][j] = 0.f;
  }
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * rows_per;
  const int64_t i1 = std::min(N, i0 + rows_per);
  for (int64_t i = i0 + g; i < i1; i += kNormWarps) {  // warp-uniform
    const float* row = x + i * W;
    const float* grow = dy + i * W;
    float xr[kNormPerLane], gr[kNormPerLane];
#pragma unroll
    for (int k = 0; k < kNormPerLane; ++k) {
      const int64_t j = lane + int64_t{kWarp} * k;
      xr[k] = j < W ? row[j] : 0.f;
      gr[k] = j < W ? grow[j] : 0.f;
    }
    double dot = 0.0;
#pragma unroll
    for (int k = 0; k < kNormPerLane; ++k) {
      if (lane + int64_t{kWarp} * k < W) dot += double{gr[k]} * wr[k] * xr[k];
    }
    dot = WarpSum(dot);
    const float r = rstd[i];
    const float c = static_cast<float>(dot * r * r * r / static_cast<double>(W));
#pragma unroll
    for (int k = 0; k < kNormPerLane; ++k) {
      const int64_t j = lane + int64_t{kWarp} * k;
      if (j < W) {
        float v = __fsub_rn(__fmul_rn(__fmul_rn(r, wr[k]), gr[k]), __fmul_rn(xr[k], c));
        if (res != nullptr) v = __fadd_rn(v, res[i * W + j]);
        dx[i * W + j] = v;
        acc[g][j] = __fadd_rn(acc[g][j], __fmul_rn(__fmul_rn(gr[k], xr[k]), r));
      }
    }
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < W; j += blockDim.x) {
    float s = acc[0][j];
    for (int k = 1; k < kNormWarps; ++k) s = __fadd_rn(s, acc[k][j]);
    partials[static_cast<int64_t>(blockIdx.x) * W + j] = s;
  }
}

}  // namespace

cudaError_t LaunchRmsNormForward(const float* x, const float* w, float eps, void* y, bool y_bf16,
                                 float* rstd, int64_t N, int64_t W, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((N + kRowWarps - 1) / kRowWarps);
  if (y_bf16) {
    RmsNormForwardKernel<<<blocks, kRowWarps * kWarp, 0, stream>>>(
        x, w, eps, static_cast<uint16_t*>(y), rstd, N, W);
  } else {
    RmsNormForwardKernel<<<blocks, kRowWarps * kWarp, 0, stream>>>(
        x, w, eps, static_cast<float*>(y), rstd, N, W);
  }
  return cudaGetLastError();
}

cudaError_t LaunchAddRmsNormForward(const float* a, const float* b, float* sum, const float* w,
                                    float eps, void* y, bool y_bf16, float* rstd, int64_t N,
                                    int64_t W, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((N + kRowWarps - 1) / kRowWarps);
  if (y_bf16) {
    AddRmsNormForwardKernel<<<blocks, kRowWarps * kWarp, 0, stream>>>(
        a, b, sum, w, eps, static_cast<uint16_t*>(y), rstd, N, W);
  } else {
    AddRmsNormForwardKernel<<<blocks, kRowWarps * kWarp, 0, stream>>>(
        a, b, sum, w, eps, static_cast<float*>(y), rstd, N, W);
  }
  return cudaGetLastError();
}

cudaError_t LaunchRmsNormBackwardInput(const float* x, const float* w, const float* rstd,
                                       const float* dy, const float* d_residual, float* dx,
                                       int64_t N, int64_t W, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  RmsNormBackwardInputKernel<<<static_cast<unsigned>((N + kRowWarps - 1) / kRowWarps),
                               kRowWarps * kWarp, 0, stream>>>(x, w, rstd, dy, d_residual, dx, N,
                                                               W);
  return cudaGetLastError();
}

int64_t ColumnPartials(int64_t rows) {
  if (rows == 0) return 1;
  const int64_t per = RowsPerPartial(rows);
  return (rows + per - 1) / per;
}

cudaError_t LaunchRmsNormWeightGrad(const float* x, const float* rstd, const float* dy,
                                    float* partials, float* d_weight, int64_t N, int64_t W,
                                    cudaStream_t stream) {
  return LaunchColumnSums(RmsNormWeightTerm{x, rstd, dy, W}, N, W, partials, d_weight, stream);
}

int64_t RmsNormBackwardPartials(int64_t N, int64_t W) {
  if (W > kNormMaxW) return ColumnPartials(N);
  if (N == 0) return 1;
  const int64_t per = NormRowsPerBlock(N);
  return (N + per - 1) / per;
}

cudaError_t LaunchRmsNormBackward(const float* x, const float* w, const float* rstd,
                                  const float* dy, const float* d_residual, float* dx,
                                  float* d_weight, float* partials, int64_t N, int64_t W,
                                  cudaStream_t stream) {
  if (N == 0 || W == 0) return cudaSuccess;
  if (W > kNormMaxW) {  // d_weight first, while x is intact (dx may overwrite x)
    const cudaError_t err = LaunchRmsNormWeightGrad(x, rstd, dy, partials, d_weight, N, W, stream);
    if (err != cudaSuccess) return err;
    return LaunchRmsNormBackwardInput(x, w, rstd, dy, d_residual, dx, N, W, stream);
  }
  const int64_t rows_per = NormRowsPerBlock(N);
  const int64_t blocks = (N + rows_per - 1) / rows_per;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  RmsNormBackwardFusedKernel<<<static_cast<unsigned>(blocks), kWarp * kNormWarps, 0, stream>>>(
      x, w, rstd, dy, d_residual, dx, partials, N, W, rows_per);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return LaunchAddPartialsGrouped(partials, blocks, W, d_weight, stream);
}

}  // namespace smat
