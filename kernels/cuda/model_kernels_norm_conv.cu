// CUDA model kernels over rows and columns (model_kernels_kernels.h): RMSNorm
// forward and backward, the fixed-order column sums their weight gradients
// use, and the width-K short causal depthwise convolution.
#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/model_kernels_device.cuh"

namespace smat {
namespace {

using namespace model_cuda;  // NOLINT: the shared launch shape and reductions

// ------------------------------------------------------------------ RMSNorm
constexpr int kRowWarps = 8;  // rows (warps) per block of the per-row kernels

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

int64_t RowsPerPartial(int64_t rows) {
  int64_t r = std::max<int64_t>(128, (rows + kMaxPartials - 1) / kMaxPartials);
  return (r + kRowGroups - 1) / kRowGroups * kRowGroups;
}

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

cudaError_t LaunchAddPartialsGrouped(const float* partials, int64_t P, int64_t cols, float* out,
                                     cudaStream_t stream) {
  if (P == 0 || cols == 0) return cudaSuccess;
  AddPartialsGroupedKernel<<<static_cast<unsigned>((cols + kWarp - 1) / kWarp),
                             kWarp * kSumGroups, 0, stream>>>(partials, P, cols, out);
  return cudaGetLastError();
}

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

// ------------------------------------------------------------------ short conv
// A thread walks a run of kConvRun consecutive rows t of one sequence for V
// consecutive channels (V = 4: float4 loads and stores, when C % 4 == 0 and
// every pointer is 16-byte aligned; else V = 1), keeping the last K-1 input
// rows in registers, so each input element is loaded about once. A block is
// kConvGroups warps: warp g takes run number blockIdx.x * kConvGroups + g (runs
// numbered over (b, run) in order, ConvRuns(L) per sequence), lane l the
// channel vector blockIdx.y * 32 + l, so a warp's loads are contiguous.
// Loads are issued kConvForwardBatch (kConvBackwardBatch) rows at a time.
constexpr int kConvRun = 16, kConvGroups = 8, kConvForwardBatch = 8, kConvBackwardBatch = 4;
static_assert(kConvRun % kConvForwardBatch == 0 && kConvRun % kConvBackwardBatch == 0 &&
                  kConvRun >= K - 1,
              "conv run layout");

// Runs per sequence; at least one, so that the backward kernel writes d_prefix
// (zeros) when L == 0.
__host__ __device__ __forceinline__ int64_t ConvRuns(int64_t L) {
  return std::max<int64_t>(1, (L + kConvRun - 1) / kConvRun);
}

template <int V>
struct Vec {
  float v[V];
};

template <int V>
__device__ __forceinline__ Vec<V> LoadVec(const float* p) {
  Vec<V> r;
  if constexpr (V == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    r.v[0] = f.x;
    r.v[1] = f.y;
    r.v[2] = f.z;
    r.v[3] = f.w;
  } else {
#pragma unroll
    for (int q = 0; q < V; ++q) r.v[q] = p[q];
  }
  return r;
}

template <int V>
__device__ __forceinline__ void StoreVec(float* p, const Vec<V>& r) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
  } else {
#pragma unroll
    for (int q = 0; q < V; ++q) p[q] = r.v[q];
  }
}

// bf16 bits of the V values (rounded as Cast): uint2 for V = 4.
template <int V>
__device__ __forceinline__ void StoreVec(uint16_t* p, const Vec<V>& r) {
  if constexpr (V == 4) {
    uint2 b;
    b.x = static_cast<uint32_t>(ToBf16Bits(r.v[0])) |
          (static_cast<uint32_t>(ToBf16Bits(r.v[1])) << 16);
    b.y = static_cast<uint32_t>(ToBf16Bits(r.v[2])) |
          (static_cast<uint32_t>(ToBf16Bits(r.v[3])) << 16);
    *reinterpret_cast<uint2*>(p) = b;
  } else {
#pragma unroll
    for (int q = 0; q < V; ++q) p[q] = ToBf16Bits(r.v[q]);
  }
}

template <int V>
__device__ __forceinline__ Vec<V> ZeroVec() {
  Vec<V> r;
#pragma unroll
  for (int q = 0; q < V; ++q) r.v[q] = 0.f;
  return r;
}

// Start of input row s (negative: from the prefix) of sequence b.
__device__ __forceinline__ const float* ConvRow(const float* x, const float* prefix, int64_t b,
                                                int64_t s, int64_t L, int64_t C) {
  return s >= 0 ? x + (b * L + s) * C : prefix + (b * (K - 1) + (K - 1) + s) * C;
}

// y rows t0 .. t0 + kConvRun - 1 (those below L unless kFull: all of them).
// win[k] holds input row t0 - (K-1) + k for k < K-1 on entry. As the CPU:
// y = 0, then y += w[j] * in[t - (K-1) + j] for j = 0, 1, ..., K-1.
// TF: the type of a second output softplus(y) (SoftplusForward's operations),
// or NoFeatures (none).
struct NoFeatures {};

template <int V, bool kFull, typename TY, typename TF>
__device__ __forceinline__ void ConvForwardRun(const float* __restrict__ xb,
                                               TY* __restrict__ yb, TF* __restrict__ fb,
                                               int64_t rows_left, int64_t C,
                                               const Vec<V> (&wt)[K], Vec<V> (&win)[K]) {
#pragma unroll
  for (int k0 = 0; k0 < kConvRun; k0 += kConvForwardBatch) {
    Vec<V> in[kConvForwardBatch];  // the batch's loads first, then its outputs
#pragma unroll
    for (int k = 0; k < kConvForwardBatch; ++k) {
      in[k] = kFull || k0 + k < rows_left ? LoadVec<V>(xb + (k0 + k) * C) : ZeroVec<V>();
    }
#pragma unroll
    for (int k = 0; k < kConvForwardBatch; ++k) {
      if (kFull || k0 + k < rows_left) {
        win[K - 1] = in[k];
        Vec<V> out;
#pragma unroll
        for (int q = 0; q < V; ++q) {
          float o = 0.f;
#pragma unroll
          for (int j = 0; j < K; ++j) o = __fadd_rn(o, __fmul_rn(wt[j].v[q], win[j].v[q]));
          out.v[q] = o;
        }
        StoreVec<V>(yb + (k0 + k) * C, out);
        if constexpr (!std::is_same_v<TF, NoFeatures>) {
          Vec<V> f;
#pragma unroll
          for (int q = 0; q < V; ++q) f.v[q] = 1.f * Softplus(out.v[q]);
          StoreVec<V>(fb + (k0 + k) * C, f);
        }
#pragma unroll
        for (int j = 0; j < K - 1; ++j) win[j] = win[j + 1];
      }
    }
  }
}

template <int V, typename TY, typename TF>
__global__ void __launch_bounds__(kWarp * kConvGroups)
    ShortConvForwardKernel(const float* __restrict__ x, const float* __restrict__ prefix,
                           const float* __restrict__ w, TY* __restrict__ y,
                           TF* __restrict__ f, int64_t nb, int64_t L, int64_t C) {
  const int lane = threadIdx.x % kWarp, g = threadIdx.x / kWarp;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kWarp + lane) * V;
  const int64_t runs = ConvRuns(L);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kConvGroups + g;
  if (c >= C || r >= nb * runs) return;
  const int64_t b = r / runs, t0 = (r - b * runs) * kConvRun;
  Vec<V> wt[K], win[K];
#pragma unroll
  for (int j = 0; j < K; ++j) wt[j] = LoadVec<V>(w + j * C + c);
#pragma unroll
  for (int k = 0; k < K - 1; ++k) {
    win[k] = LoadVec<V>(ConvRow(x, prefix, b, t0 - (K - 1) + k, L, C) + c);
  }
  const float* xb = x + (b * L + t0) * C + c;
  TY* yb = y + (b * L + t0) * C + c;
  TF* fb = f != nullptr ? f + (b * L + t0) * C + c : nullptr;
  if (t0 + kConvRun <= L) {
    ConvForwardRun<V, true, TY, TF>(xb, yb, fb, L - t0, C, wt, win);
  } else {
    ConvForwardRun<V, false, TY, TF>(xb, yb, fb, L - t0, C, wt, win);
  }
}

// The input gradient of row s as the CPU: 0, then += w[j] * dy[s + (K-1) - j]
// for j = 0, 1, ..., K-1 where that row is in [0, L) (the others skipped).
// dyw[k] holds dy row s + k (k <= K-1); t_ok(k) says whether row s + k < L
// (and >= 0).
template <int V, class Ok>
__device__ __forceinline__ Vec<V> ConvInputGrad(const Vec<V> (&wt)[K], const Vec<V> (&dyw)[K],
                                                Ok t_ok) {
  Vec<V> out;
#pragma unroll
  for (int q = 0; q < V; ++q) {
    float o = 0.f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      if (t_ok(K - 1 - j)) o = __fadd_rn(o, __fmul_rn(wt[j].v[q], dyw[K - 1 - j].v[q]));
    }
    out.v[q] = o;
  }
  return out;
}

// Rows s = t0 .. t0 + kConvRun - 1 (those below L unless kFull, which also
// means s + K-1 < L for all of them): dx[s], and the d_w terms of output row
// s added to acc[j] (acc[j] += dy[s] * in[s - (K-1) + j], as the CPU's term).
// On entry xw[k] = input row t0 - (K-1) + k and dyw[k] = dy row t0 + k for
// k < K-1 (rows >= L: unused).
// The gradient at the conv's output: dy, or (z not null: the conv output that
// a softplus read) sigmoid(z) * dy, the operations of SoftplusBackward.
template <int V>
__device__ __forceinline__ Vec<V> LoadConvGrad(const float* __restrict__ dy,
                                               const float* __restrict__ z) {
  Vec<V> g = LoadVec<V>(dy);
  if (z != nullptr) {
    const Vec<V> zv = LoadVec<V>(z);
#pragma unroll
    for (int q = 0; q < V; ++q) g.v[q] = 1.f * Sigmoid(zv.v[q]) * g.v[q];
  }
  return g;
}

template <int V, bool kFull, typename TX>
__device__ __forceinline__ void ConvBackwardRun(const float* __restrict__ xb,
                                                const float* __restrict__ dyb,
                                                const float* __restrict__ zb,
                                                TX* __restrict__ dxb, int64_t rows_left,
                                                int64_t C, const Vec<V> (&wt)[K], Vec<V> (&xw)[K],
                                                Vec<V> (&dyw)[K], Vec<V> (&acc)[K]) {
#pragma unroll
  for (int k0 = 0; k0 < kConvRun; k0 += kConvBackwardBatch) {
    Vec<V> xin[kConvBackwardBatch], gin[kConvBackwardBatch];  // the batch's loads first
#pragma unroll
    for (int k = 0; k < kConvBackwardBatch; ++k) {
      const int s = k0 + k;  // row t0 + s
      xin[k] = kFull || s < rows_left ? LoadVec<V>(xb + s * C) : ZeroVec<V>();
      gin[k] = kFull || s + (K - 1) < rows_left
                   ? LoadConvGrad<V>(dyb + (s + (K - 1)) * C,
                                     zb != nullptr ? zb + (s + (K - 1)) * C : nullptr)
                   : ZeroVec<V>();
    }
#pragma unroll
    for (int k = 0; k < kConvBackwardBatch; ++k) {
      const int s = k0 + k;
      if (kFull || s < rows_left) {
        xw[K - 1] = xin[k];
        dyw[K - 1] = gin[k];
        StoreVec<V>(dxb + s * C, ConvInputGrad<V>(wt, dyw, [&](int d) {
                      return kFull || s + d < rows_left;
                    }));
#pragma unroll
        for (int j = 0; j < K; ++j) {
#pragma unroll
          for (int q = 0; q < V; ++q) {
            acc[j].v[q] = __fadd_rn(acc[j].v[q], __fmul_rn(dyw[0].v[q], xw[j].v[q]));
          }
        }
#pragma unroll
        for (int j = 0; j < K - 1; ++j) {
          xw[j] = xw[j + 1];
          dyw[j] = dyw[j + 1];
        }
      }
    }
  }
}

// dx, d_prefix and the d_w partials [gridDim.x, K, C] in one pass: each
// warp's run as above (the d_w terms of its rows summed in row order), then
// the block's kConvGroups run sums added in warp order. The thread of run 0
// of sequence b also writes d_prefix[b] for its channels.
template <int V, typename TX>
__global__ void __launch_bounds__(kWarp * kConvGroups, 2)
    ShortConvBackwardKernel(const float* __restrict__ x, const float* __restrict__ prefix,
                            const float* __restrict__ w, const float* __restrict__ dy,
                            const float* __restrict__ z, TX* __restrict__ dx,
                            float* __restrict__ d_prefix,
                            float* __restrict__ partials, int64_t nb, int64_t L, int64_t C) {
  const int lane = threadIdx.x % kWarp, g = threadIdx.x / kWarp;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kWarp + lane) * V;
  const int64_t runs = ConvRuns(L);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kConvGroups + g;
  Vec<V> acc[K];
#pragma unroll
  for (int j = 0; j < K; ++j) acc[j] = ZeroVec<V>();
  if (c < C && r < nb * runs) {
    const int64_t b = r / runs, t0 = (r - b * runs) * kConvRun;
    Vec<V> wt[K], xw[K], dyw[K];
#pragma unroll
    for (int j = 0; j < K; ++j) wt[j] = LoadVec<V>(w + j * C + c);
#pragma unroll
    for (int k = 0; k < K - 1; ++k) {
      xw[k] = LoadVec<V>(ConvRow(x, prefix, b, t0 - (K - 1) + k, L, C) + c);
      const int64_t off = (b * L + t0 + k) * C + c;
      dyw[k] = t0 + k < L ? LoadConvGrad<V>(dy + off, z != nullptr ? z + off : nullptr)
                          : ZeroVec<V>();
    }
    xw[K - 1] = ZeroVec<V>();
    dyw[K - 1] = ZeroVec<V>();
    if (t0 == 0) {
      // d_prefix rows s = -(K-1) .. -1 as the CPU: the dy rows t = s + (K-1) - j
      // in [0, L) for j = 0, 1, ..., K-1; t < K-1, so dy row t is dyw[t].
#pragma unroll
      for (int i = 0; i < K - 1; ++i) {
        const int s = i - (K - 1);
        Vec<V> out;
#pragma unroll
        for (int q = 0; q < V; ++q) {
          float o = 0.f;
#pragma unroll
          for (int j = 0; j < K; ++j) {
            const int t = s + (K - 1) - j;
            if (t >= 0 && t < L) o = __fadd_rn(o, __fmul_rn(wt[j].v[q], dyw[t].v[q]));
          }
          out.v[q] = o;
        }
        StoreVec<V>(d_prefix + (b * (K - 1) + i) * C + c, out);
      }
    }
    const float* xb = x + (b * L + t0) * C + c;
    const float* dyb = dy + (b * L + t0) * C + c;
    const float* zb = z != nullptr ? z + (b * L + t0) * C + c : nullptr;
    TX* dxb = dx + (b * L + t0) * C + c;
    if (t0 + kConvRun + (K - 1) <= L) {
      ConvBackwardRun<V, true, TX>(xb, dyb, zb, dxb, L - t0, C, wt, xw, dyw, acc);
    } else {
      ConvBackwardRun<V, false, TX>(xb, dyb, zb, dxb, L - t0, C, wt, xw, dyw, acc);
    }
  }
  __shared__ float sums[K][kConvGroups][kWarp * V];
#pragma unroll
  for (int j = 0; j < K; ++j) {
#pragma unroll
    for (int q = 0; q < V; ++q) sums[j][g][lane * V + q] = acc[j].v[q];
  }
  __syncthreads();
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kWarp * V;
  for (int e = threadIdx.x; e < K * kWarp * V; e += blockDim.x) {
    const int j = e / (kWarp * V), col = e % (kWarp * V);
    if (c0 + col >= C) continue;
    float total = sums[j][0][col];
    for (int k = 1; k < kConvGroups; ++k) total = __fadd_rn(total, sums[j][k][col]);
    partials[(static_cast<int64_t>(blockIdx.x) * K + j) * C + c0 + col] = total;
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

int64_t ShortConvBackwardPartials(int64_t nb, int64_t L) {
  return std::max<int64_t>(1, (nb * ConvRuns(L) + kConvGroups - 1) / kConvGroups);
}

namespace {

template <typename TY, typename TF>
cudaError_t ShortConvForwardAs(const float* x, const float* prefix, const float* w, TY* y, TF* f,
                               bool vec, int64_t nb, int64_t L, int64_t C, cudaStream_t stream) {
  const int64_t tiles = (C / (vec ? 4 : 1) + kWarp - 1) / kWarp;
  const int64_t blocks = (nb * ConvRuns(L) + kConvGroups - 1) / kConvGroups;
  if (tiles > 65535 || blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
  const unsigned threads = kWarp * kConvGroups;
  if (vec) {
    ShortConvForwardKernel<4, TY, TF><<<grid, threads, 0, stream>>>(x, prefix, w, y, f, nb, L, C);
  } else {
    ShortConvForwardKernel<1, TY, TF><<<grid, threads, 0, stream>>>(x, prefix, w, y, f, nb, L, C);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchShortConvForward(const float* x, const float* prefix, const float* w, void* y,
                                   bool y_bf16, int64_t nb, int64_t L, int64_t C,
                                   cudaStream_t stream) {
  if (nb * L * C == 0) return cudaSuccess;
  const bool y_aligned = (reinterpret_cast<uintptr_t>(y) & (y_bf16 ? 7u : 15u)) == 0;
  const bool vec = C % 4 == 0 && Aligned16(x) && Aligned16(prefix) && Aligned16(w) && y_aligned;
  NoFeatures* none = nullptr;
  if (y_bf16) {
    return ShortConvForwardAs(x, prefix, w, static_cast<uint16_t*>(y), none, vec, nb, L, C, stream);
  }
  return ShortConvForwardAs(x, prefix, w, static_cast<float*>(y), none, vec, nb, L, C, stream);
}

cudaError_t LaunchShortConvSoftplusForward(const float* x, const float* prefix, const float* w,
                                           float* y, void* f, bool f_bf16, int64_t nb, int64_t L,
                                           int64_t C, cudaStream_t stream) {
  if (nb * L * C == 0) return cudaSuccess;
  const bool f_aligned = (reinterpret_cast<uintptr_t>(f) & (f_bf16 ? 7u : 15u)) == 0;
  const bool vec = C % 4 == 0 && Aligned16(x) && Aligned16(prefix) && Aligned16(w) &&
                   Aligned16(y) && f_aligned;
  if (f_bf16) {
    return ShortConvForwardAs(x, prefix, w, y, static_cast<uint16_t*>(f), vec, nb, L, C, stream);
  }
  return ShortConvForwardAs(x, prefix, w, y, static_cast<float*>(f), vec, nb, L, C, stream);
}

cudaError_t LaunchShortConvBackward(const float* x, const float* prefix, const float* w,
                                    const float* dy, const float* z, void* dx, bool dx_bf16,
                                    float* d_prefix, float* d_w, float* partials, int64_t nb,
                                    int64_t L, int64_t C, cudaStream_t stream) {
  if (nb * C == 0) return cudaSuccess;
  const bool dx_aligned = (reinterpret_cast<uintptr_t>(dx) & (dx_bf16 ? 7u : 15u)) == 0;
  const bool vec = C % 4 == 0 && Aligned16(x) && Aligned16(prefix) && Aligned16(w) &&
                   Aligned16(dy) && (z == nullptr || Aligned16(z)) && dx_aligned &&
                   Aligned16(d_prefix);
  const int64_t tiles = (C / (vec ? 4 : 1) + kWarp - 1) / kWarp;
  const int64_t blocks = ShortConvBackwardPartials(nb, L);
  if (tiles > 65535 || blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
  uint16_t* dxh = static_cast<uint16_t*>(dx);
  float* dxf = static_cast<float*>(dx);
  const unsigned threads = kWarp * kConvGroups;
  if (vec && dx_bf16) {
    ShortConvBackwardKernel<4><<<grid, threads, 0, stream>>>(x, prefix, w, dy, z, dxh,
                                                             d_prefix, partials, nb, L, C);
  } else if (vec) {
    ShortConvBackwardKernel<4><<<grid, threads, 0, stream>>>(x, prefix, w, dy, z, dxf,
                                                             d_prefix, partials, nb, L, C);
  } else if (dx_bf16) {
    ShortConvBackwardKernel<1><<<grid, threads, 0, stream>>>(x, prefix, w, dy, z, dxh,
                                                             d_prefix, partials, nb, L, C);
  } else {
    ShortConvBackwardKernel<1><<<grid, threads, 0, stream>>>(x, prefix, w, dy, z, dxf,
                                                             d_prefix, partials, nb, L, C);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || L == 0) return err;  // no rows: d_w unchanged
  return LaunchAddPartialsGrouped(partials, blocks, K * C, d_w, stream);
}

}  // namespace smat

// ------------------------------------------------------------------ narrow linear layer
namespace smat {
namespace {

using namespace model_cuda;  // NOLINT

constexpr int kNarrowOut = kCudaNarrowMaxOut;
constexpr int kNarrowCols = 32, kNarrowGroups = 8;  // the weight partials' block

__device__ __forceinline__ float Widen(float v) { return v; }
__device__ __forceinline__ float Widen(uint16_t b) { return Bf16BitsToFloat(b); }

template <typename TX, typename TW>
__global__ void __launch_bounds__(kRowWarps * kWarp)
    NarrowForwardKernel(const TX* __restrict__ x, const TW* __restrict__ w,
                        const float* __restrict__ bias, float* __restrict__ y, int64_t N,
                        int64_t in, int out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= N) return;  // the whole warp
  float acc[kNarrowOut];
#pragma unroll
  for (int o = 0; o < kNarrowOut; ++o) acc[o] = 0.f;
  const TX* xr = x + i * in;
  for (int64_t j = lane; j < in; j += kWarp) {
    const float xv = Widen(xr[j]);
#pragma unroll
    for (int o = 0; o < kNarrowOut; ++o) {
      if (o < out) acc[o] = fmaf(xv, Widen(w[o * in + j]), acc[o]);
    }
  }
#pragma unroll
  for (int o = 0; o < kNarrowOut; ++o) {
    if (o < out) {
      const float s = WarpSum(acc[o]);
      if (lane == o) y[i * out + o] = bias != nullptr ? s + bias[o] : s;
    }
  }
}

// One warp per row: the row's dy in registers, lane l the columns l, l + 32, ...
template <typename TW>
__global__ void __launch_bounds__(kRowWarps * kWarp)
    NarrowInputGradKernel(const TW* __restrict__ w, const float* __restrict__ dy,
                          float* __restrict__ dx, int64_t N, int64_t in, int out,
                          bool accumulate) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= N) return;
  float g[kNarrowOut];
#pragma unroll
  for (int o = 0; o < kNarrowOut; ++o) g[o] = o < out ? dy[i * out + o] : 0.f;
  float* row = dx + i * in;
  for (int64_t j = lane; j < in; j += kWarp) {
    float s = 0.f;
#pragma unroll
    for (int o = 0; o < kNarrowOut; ++o) {
      if (o < out) s = fmaf(g[o], Widen(w[o * in + j]), s);
    }
    row[j] = accumulate ? row[j] + s : s;
  }
}

// Block (p, t): rows [p rows_per, (p + 1) rows_per), columns t * 32 + c of
// x, column `in` standing for the bias (x = 1). Group g sums rows
// i0 + g, i0 + g + kNarrowGroups, ... in order; the group sums are added in
// group order into pw[p, o, j] (pb[p, o] for the bias column).
template <typename TX>
__global__ void __launch_bounds__(kNarrowCols * kNarrowGroups)
    NarrowWeightPartialsKernel(const TX* __restrict__ x, const float* __restrict__ dy, int64_t N,
                               int64_t in, int out, int64_t rows_per, float* __restrict__ pw,
                               float* __restrict__ pb) {
  const int c = threadIdx.x % kNarrowCols, g = threadIdx.x / kNarrowCols;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * kNarrowCols + c;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * rows_per;
  const int64_t i1 = i0 + rows_per < N ? i0 + rows_per : N;
  const bool active = j < in || (j == in && pb != nullptr);
  float acc[kNarrowOut];
#pragma unroll
  for (int o = 0; o < kNarrowOut; ++o) acc[o] = 0.f;
  if (active) {
    for (int64_t i = i0 + g; i < i1; i += kNarrowGroups) {
      const float xv = j < in ? Widen(x[i * in + j]) : 1.f;
#pragma unroll
      for (int o = 0; o < kNarrowOut; ++o) {
        if (o < out) acc[o] = fmaf(dy[i * out + o], xv, acc[o]);
      }
    }
  }
  __shared__ float sums[kNarrowGroups][kNarrowOut][kNarrowCols];
#pragma unroll
  for (int o = 0; o < kNarrowOut; ++o) sums[g][o][c] = acc[o];
  __syncthreads();
  if (g != 0 || !active) return;
  for (int o = 0; o < out; ++o) {
    float s = sums[0][o][c];
    for (int k = 1; k < kNarrowGroups; ++k) s = __fadd_rn(s, sums[k][o][c]);
    if (j < in) {
      pw[(static_cast<int64_t>(blockIdx.x) * out + o) * in + j] = s;
    } else {
      pb[static_cast<int64_t>(blockIdx.x) * out + o] = s;
    }
  }
}

template <typename TX, typename TW>
cudaError_t NarrowForward(const void* x, const void* w, const float* bias, float* y, int64_t N,
                          int64_t in, int out, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((N + kRowWarps - 1) / kRowWarps);
  NarrowForwardKernel<<<blocks, kRowWarps * kWarp, 0, stream>>>(
      static_cast<const TX*>(x), static_cast<const TW*>(w), bias, y, N, in, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchNarrowLinearForward(const void* x, bool x_bf16, const void* w, bool w_bf16,
                                      const float* bias, float* y, int64_t N, int64_t in, int out,
                                      cudaStream_t stream) {
  if (N == 0 || out == 0) return cudaSuccess;
  if (x_bf16) {
    return w_bf16 ? NarrowForward<uint16_t, uint16_t>(x, w, bias, y, N, in, out, stream)
                  : NarrowForward<uint16_t, float>(x, w, bias, y, N, in, out, stream);
  }
  return w_bf16 ? NarrowForward<float, uint16_t>(x, w, bias, y, N, in, out, stream)
                : NarrowForward<float, float>(x, w, bias, y, N, in, out, stream);
}

int64_t NarrowLinearPartials(int64_t N) { return ColumnPartials(N); }

cudaError_t LaunchNarrowLinearBackward(const void* x, bool x_bf16, const void* w, bool w_bf16,
                                       const float* dy, float* dx, bool accumulate_dx,
                                       float* d_w, float* d_bias, float* partials, int64_t N,
                                       int64_t in, int out, cudaStream_t stream) {
  if (N == 0 || out == 0) return cudaSuccess;  // dx empty, d_w and d_bias unchanged
  if (in > 0) {
    const unsigned blocks = static_cast<unsigned>((N + kRowWarps - 1) / kRowWarps);
    if (w_bf16) {
      NarrowInputGradKernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint16_t*>(w), dy,
                                                             dx, N, in, out, accumulate_dx);
    } else {
      NarrowInputGradKernel<<<blocks, kThreads, 0, stream>>>(static_cast<const float*>(w), dy, dx,
                                                             N, in, out, accumulate_dx);
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const int64_t rows_per = RowsPerPartial(N);
  const int64_t P = (N + rows_per - 1) / rows_per;
  const int64_t cols = d_bias != nullptr ? in + 1 : in;
  if (cols == 0) return cudaSuccess;
  float* pw = partials;
  float* pb = partials + P * out * in;
  const dim3 grid(static_cast<unsigned>(P),
                  static_cast<unsigned>((cols + kNarrowCols - 1) / kNarrowCols));
  if (x_bf16) {
    NarrowWeightPartialsKernel<<<grid, kNarrowCols * kNarrowGroups, 0, stream>>>(
        static_cast<const uint16_t*>(x), dy, N, in, out, rows_per, pw,
        d_bias != nullptr ? pb : nullptr);
  } else {
    NarrowWeightPartialsKernel<<<grid, kNarrowCols * kNarrowGroups, 0, stream>>>(
        static_cast<const float*>(x), dy, N, in, out, rows_per, pw,
        d_bias != nullptr ? pb : nullptr);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (in > 0) {
    err = LaunchAddPartialsGrouped(pw, P, out * in, d_w, stream);
    if (err != cudaSuccess) return err;
  }
  if (d_bias == nullptr) return cudaSuccess;
  return LaunchAddPartialsGrouped(pb, P, out, d_bias, stream);
}

}  // namespace smat
