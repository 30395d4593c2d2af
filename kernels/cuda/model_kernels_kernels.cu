// CUDA kernels of the model ops (model_kernels_kernels.h).
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/cuda/model_kernels_kernels.h"

namespace smat {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int K = kCudaShortConvWidth;

int Blocks(int64_t n, int max_blocks) {
  const int64_t needed = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, max_blocks)));
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridThreads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// The CPU's formulas (kernels/cpu/model_kernels_cpu.cc), with the accurate
// (not the fast-math) expf / log1pf.
__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float Softplus(float x) {
  return fmaxf(x, 0.f) + log1pf(expf(-fabsf(x)));
}

// Sum over a warp in a fixed tree, the result broadcast from lane 0 so every
// lane holds the same bits.
template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
  return __shfl_sync(0xffffffffu, v, 0);
}

// Sum over a block (blockDim.x a multiple of 32, at most 1024) in a fixed
// order: each warp's tree, then the warp sums in warp order by warp 0. Every
// thread gets the result. `shared` holds 32 values.
template <typename T>
__device__ T BlockSum(T v, T* shared) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = WarpSum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T s = lane < static_cast<int>(blockDim.x / kWarp) ? shared[lane] : T(0);
    s = WarpSum(s);
    if (lane == 0) shared[kWarp - 1] = s;  // lane 0 read shared[0..] already
  }
  __syncthreads();
  const T total = shared[kWarp - 1];
  __syncthreads();  // shared may be reused by the caller
  return total;
}

__device__ float BlockMax(float v, float* shared) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, o));
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < static_cast<int>(blockDim.x / kWarp) ? shared[lane] : -INFINITY;
    for (int o = kWarp / 2; o > 0; o /= 2) s = fmaxf(s, __shfl_down_sync(0xffffffffu, s, o));
    if (lane == 0) shared[kWarp - 1] = s;
  }
  __syncthreads();
  const float total = shared[kWarp - 1];
  __syncthreads();
  return total;
}

// ------------------------------------------------------------------ element-wise
// A map of NI fp32 inputs to NO fp32 outputs, element by element; outputs may
// alias inputs (each element is read before it is written, by one thread).
// With every pointer 16-byte aligned, four elements per float4 access.
template <int NI, int NO>
struct Pointers {
  const float* in[NI];
  float* out[NO];
};

__device__ __forceinline__ float Lane(const float4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}
__device__ __forceinline__ void SetLane(float4& v, int k, float x) {
  if (k == 0) v.x = x; else if (k == 1) v.y = x; else if (k == 2) v.z = x; else v.w = x;
}

template <int NI, int NO, class F>
__global__ void MapKernel(Pointers<NI, NO> p, int64_t n, bool vectorized, F f) {
  int64_t first_scalar = 0;
  if (vectorized) {
    const int64_t n4 = n / 4;
    for (int64_t i = GlobalThread(); i < n4; i += GridThreads()) {
      float4 a[NI], b[NO];
#pragma unroll
      for (int k = 0; k < NI; ++k) a[k] = reinterpret_cast<const float4*>(p.in[k])[i];
#pragma unroll
      for (int lane = 0; lane < 4; ++lane) {
        float x[NI], y[NO];
#pragma unroll
        for (int k = 0; k < NI; ++k) x[k] = Lane(a[k], lane);
        f(x, y);
#pragma unroll
        for (int k = 0; k < NO; ++k) SetLane(b[k], lane, y[k]);
      }
#pragma unroll
      for (int k = 0; k < NO; ++k) reinterpret_cast<float4*>(p.out[k])[i] = b[k];
    }
    first_scalar = n4 * 4;
  }
  for (int64_t i = first_scalar + GlobalThread(); i < n; i += GridThreads()) {
    float x[NI], y[NO];
#pragma unroll
    for (int k = 0; k < NI; ++k) x[k] = p.in[k][i];
    f(x, y);
#pragma unroll
    for (int k = 0; k < NO; ++k) p.out[k][i] = y[k];
  }
}

template <int NI, int NO, class F>
cudaError_t LaunchMap(const Pointers<NI, NO>& p, int64_t n, F f, int max_blocks,
                      cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  bool vectorized = true;
  for (int k = 0; k < NI; ++k) vectorized = vectorized && Aligned16(p.in[k]);
  for (int k = 0; k < NO; ++k) vectorized = vectorized && Aligned16(p.out[k]);
  const int blocks = Blocks(vectorized ? (n + 3) / 4 : n, max_blocks);
  MapKernel<NI, NO, F><<<blocks, kThreads, 0, stream>>>(p, n, vectorized, f);
  return cudaGetLastError();
}

struct SwiGluForwardOp {
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    y[0] = x[0] * Sigmoid(x[0]) * x[1];
  }
};
struct SwiGluBackwardOp {  // in: gate, up, dy; out: d_gate, d_up
  __device__ void operator()(const float (&x)[3], float (&y)[2]) const {
    const float a = x[0], b = x[1], g = x[2], s = Sigmoid(a);
    y[1] = g * a * s;
    y[0] = g * b * s * (1.f + a * (1.f - s));
  }
};
struct AddOp {
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    y[0] = __fadd_rn(x[0], x[1]);
  }
};
struct SoftplusOp {
  float sign;
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const {
    y[0] = sign * Softplus(x[0]);
  }
};
struct SigmoidTimesOp {
  float sign;
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    y[0] = sign * Sigmoid(x[0]) * x[1];
  }
};
// The feature maps of kernels/feature_map.h, operation by operation as the
// host loops (kernels/cpu/feature_map_cpu.cc): __fadd_rn / __fmul_rn so that
// nothing is contracted, and the accurate expf (not __expf) for std::exp.
struct EluPlusOneForwardOp {
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const {
    y[0] = x[0] > 0.f ? __fadd_rn(x[0], 1.f) : expf(x[0]);
  }
};
struct EluPlusOneBackwardOp {  // in: x, dy; out: dx
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    y[0] = x[0] > 0.f ? x[1] : __fmul_rn(x[1], expf(x[0]));
  }
};
struct ReluEpsForwardOp {
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const {
    y[0] = __fadd_rn(x[0] > 0.f ? x[0] : 0.f, kCudaReluFeatureFloor);
  }
};
struct ReluEpsBackwardOp {  // in: x, dy; out: dx
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    y[0] = x[0] > 0.f ? x[1] : 0.f;
  }
};
// The AdamW update, each operation spelled out so nothing is fused.
struct AdamWOp {  // in: w, g, m, v; out: w, m, v
  CudaAdamWScalars s;
  __device__ void operator()(const float (&x)[4], float (&y)[3]) const {
    const float gk = __fmul_rn(x[1], s.grad_scale);
    const float m = __fadd_rn(__fmul_rn(s.beta1, x[2]), __fmul_rn(s.one_minus_beta1, gk));
    const float v =
        __fadd_rn(__fmul_rn(s.beta2, x[3]), __fmul_rn(__fmul_rn(s.one_minus_beta2, gk), gk));
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), s.inv_sqrt_bc2), s.eps);
    const float w1 = __fmul_rn(x[0], s.decay);
    const float w2 = __fdiv_rn(__fmul_rn(s.step_size, m), denom);
    y[0] = __fsub_rn(w1, w2);
    y[1] = m;
    y[2] = v;
  }
};

// ------------------------------------------------------------------ casts
// core FloatToBf16, bit for bit.
__device__ __forceinline__ uint16_t ToBf16Bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__global__ void CastF32ToBf16Kernel(const float* __restrict__ src, uint16_t* __restrict__ dst,
                                    int64_t n, bool vectorized) {
  int64_t first_scalar = 0;
  if (vectorized) {
    const int64_t n4 = n / 4;
    for (int64_t i = GlobalThread(); i < n4; i += GridThreads()) {
      const float4 a = reinterpret_cast<const float4*>(src)[i];
      uint2 b;
      b.x = static_cast<uint32_t>(ToBf16Bits(a.x)) | (static_cast<uint32_t>(ToBf16Bits(a.y)) << 16);
      b.y = static_cast<uint32_t>(ToBf16Bits(a.z)) | (static_cast<uint32_t>(ToBf16Bits(a.w)) << 16);
      reinterpret_cast<uint2*>(dst)[i] = b;
    }
    first_scalar = n4 * 4;
  }
  for (int64_t i = first_scalar + GlobalThread(); i < n; i += GridThreads()) {
    dst[i] = ToBf16Bits(src[i]);
  }
}

__global__ void CastBf16ToF32Kernel(const uint16_t* __restrict__ src, float* __restrict__ dst,
                                    int64_t n, bool vectorized) {
  int64_t first_scalar = 0;
  if (vectorized) {
    const int64_t n4 = n / 4;
    for (int64_t i = GlobalThread(); i < n4; i += GridThreads()) {
      const uint2 a = reinterpret_cast<const uint2*>(src)[i];
      float4 b;
      b.x = __uint_as_float(a.x << 16);
      b.y = __uint_as_float(a.x & 0xffff0000u);
      b.z = __uint_as_float(a.y << 16);
      b.w = __uint_as_float(a.y & 0xffff0000u);
      reinterpret_cast<float4*>(dst)[i] = b;
    }
    first_scalar = n4 * 4;
  }
  for (int64_t i = first_scalar + GlobalThread(); i < n; i += GridThreads()) {
    dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
  }
}

// ------------------------------------------------------------------ rows of r features
// One warp per row of r features (r is a head's feature count, tens of
// values): lanes stride over the row, so every access is coalesced.
constexpr int kFeatureRowWarps = 8;

__device__ __forceinline__ int64_t WarpRow() {
  return static_cast<int64_t>(blockIdx.x) * kFeatureRowWarps + threadIdx.x / kWarp;
}

__global__ void SigmoidScaleForwardKernel(const float* x, const float* __restrict__ g, float* y,
                                          int64_t rows, int64_t r) {
  const int64_t i = WarpRow();
  if (i >= rows) return;
  const float s = Sigmoid(g[i]);
  for (int64_t j = threadIdx.x % kWarp; j < r; j += kWarp) y[i * r + j] = x[i * r + j] * s;
}

__global__ void SigmoidScaleBackwardKernel(const float* __restrict__ x, const float* __restrict__ g,
                                           const float* dy, float* dx, float* __restrict__ dg,
                                           int64_t rows, int64_t r) {
  const int64_t i = WarpRow();
  if (i >= rows) return;
  const int lane = threadIdx.x % kWarp;
  const float s = Sigmoid(g[i]);
  double dot = 0.0;
  for (int64_t j = lane; j < r; j += kWarp) dot += double{x[i * r + j]} * dy[i * r + j];
  dot = WarpSum(dot);  // every lane has read its dy before any dx is written
  for (int64_t j = lane; j < r; j += kWarp) dx[i * r + j] = s * dy[i * r + j];
  if (lane == 0) dg[i] = static_cast<float>(dot) * s * (1.f - s);
}

// The row's maximum and its first index (std::max_element): the larger value
// wins, the smaller index on a tie, so the reduction order does not matter.
__device__ __forceinline__ void WarpFirstMax(float& v, int64_t& a) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const float v2 = __shfl_down_sync(0xffffffffu, v, o);
    const int64_t a2 = __shfl_down_sync(0xffffffffu, a, o);
    if (v2 > v || (v2 == v && a2 < a)) {
      v = v2;
      a = a2;
    }
  }
  v = __shfl_sync(0xffffffffu, v, 0);
  a = __shfl_sync(0xffffffffu, a, 0);
}

__device__ __forceinline__ void RowFirstMax(const float* row, int64_t r, int lane, float& mx,
                                            int64_t& a) {
  mx = -INFINITY;
  a = INT64_MAX;
  for (int64_t j = lane; j < r; j += kWarp) {
    if (row[j] > mx || a == INT64_MAX) {
      mx = row[j];
      a = j;
    }
  }
  WarpFirstMax(mx, a);
}

__global__ void ExpRowMaxForwardKernel(const float* x, float* y, int64_t rows, int64_t r) {
  const int64_t i = WarpRow();
  if (i >= rows) return;
  const int lane = threadIdx.x % kWarp;
  const float* row = x + i * r;
  float mx;
  int64_t a;
  RowFirstMax(row, r, lane, mx, a);
  for (int64_t j = lane; j < r; j += kWarp) y[i * r + j] = expf(row[j] - mx);
}

__global__ void ExpRowMaxBackwardKernel(const float* __restrict__ x, const float* __restrict__ y,
                                        const float* dy, float* dx, int64_t rows, int64_t r) {
  const int64_t i = WarpRow();
  if (i >= rows) return;
  const int lane = threadIdx.x % kWarp;
  float mx;
  int64_t a;  // the first argmax
  RowFirstMax(x + i * r, r, lane, mx, a);
  double dot = 0.0;
  for (int64_t j = lane; j < r; j += kWarp) dot += double{y[i * r + j]} * dy[i * r + j];
  dot = WarpSum(dot);
  for (int64_t j = lane; j < r; j += kWarp) {
    const float p = __fmul_rn(y[i * r + j], dy[i * r + j]);
    dx[i * r + j] = j == a ? __fsub_rn(p, static_cast<float>(dot)) : p;
  }
}

// ------------------------------------------------------------------ index checks
__global__ void FirstBadIndexKernel(const int32_t* __restrict__ ids,
                                    const float* __restrict__ weights, int64_t n, int64_t V,
                                    unsigned long long* first_bad) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int32_t id = ids[i];
    if ((id < 0 || id >= V) && (weights == nullptr || weights[i] != 0.f)) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));  // integer: order-free
    }
  }
}

__global__ void SetKernel(unsigned long long* p, unsigned long long v) { *p = v; }

// ------------------------------------------------------------------ embedding
__global__ void EmbeddingForwardKernel(const float* __restrict__ table,
                                       const int32_t* __restrict__ ids, float* __restrict__ out,
                                       int64_t N, int64_t W, int64_t V, bool vectorized) {
  if (vectorized) {  // W % 4 == 0 and both pointers 16-byte aligned
    const int64_t w4 = W / 4, n = N * w4;
    for (int64_t e = GlobalThread(); e < n; e += GridThreads()) {
      const int64_t i = e / w4, j = e - i * w4;
      const int32_t id = ids[i];
      if (id < 0 || id >= V) continue;
      reinterpret_cast<float4*>(out)[e] = reinterpret_cast<const float4*>(table)[id * w4 + j];
    }
    return;
  }
  const int64_t n = N * W;
  for (int64_t e = GlobalThread(); e < n; e += GridThreads()) {
    const int64_t i = e / W, j = e - i * W;
    const int32_t id = ids[i];
    if (id < 0 || id >= V) continue;
    out[e] = table[id * W + j];
  }
}

__global__ void IotaKernel(int32_t* p, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) p[i] = static_cast<int32_t>(i);
}

// run_end[id] = one past the last sorted position holding id (written only
// for ids present).
__global__ void RunEndsKernel(const int32_t* __restrict__ sorted_ids, int64_t N,
                              int32_t* __restrict__ run_end) {
  for (int64_t p = GlobalThread(); p < N; p += GridThreads()) {
    if (p + 1 == N || sorted_ids[p + 1] != sorted_ids[p]) {
      run_end[sorted_ids[p]] = static_cast<int32_t>(p + 1);
    }
  }
}

// Block (p, column tile): when sorted position p starts a run of equal ids,
// adds the run's d_out rows (increasing row order, from the stable sort) to
// the table row, one column per thread: d = ((d + g_0) + g_1) + ..., as the CPU.
constexpr int kEmbedRows = 32;  // run rows staged in shared memory at a time
__global__ void EmbeddingAccumulateKernel(const int32_t* __restrict__ sorted_ids,
                                          const int32_t* __restrict__ sorted_rows,
                                          const int32_t* __restrict__ run_end,
                                          const float* __restrict__ d_out,
                                          float* __restrict__ d_table, int64_t W) {
  const int64_t p = blockIdx.x;
  const int32_t id = sorted_ids[p];
  if (p > 0 && sorted_ids[p - 1] == id) return;  // not the start of a run
  const int64_t end = run_end[id];
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  __shared__ int32_t rows[kEmbedRows];
  float acc = j < W ? d_table[id * W + j] : 0.f;
  for (int64_t q0 = p; q0 < end; q0 += kEmbedRows) {
    const int count = static_cast<int>(std::min<int64_t>(kEmbedRows, end - q0));
    __syncthreads();
    if (threadIdx.x < count) rows[threadIdx.x] = sorted_rows[q0 + threadIdx.x];
    __syncthreads();
    if (j < W) {
      float g[kEmbedRows];
#pragma unroll
      for (int k = 0; k < kEmbedRows; ++k) g[k] = k < count ? d_out[rows[k] * W + j] : 0.f;
#pragma unroll
      for (int k = 0; k < kEmbedRows; ++k) {
        if (k < count) acc = __fadd_rn(acc, g[k]);
      }
    }
  }
  if (j < W) d_table[id * W + j] = acc;
}

int SortBits(int64_t V) {
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) < V) ++bits;
  return bits;
}

size_t AlignUp(size_t v) { return (v + 255) & ~size_t{255}; }

// ------------------------------------------------------------------ RMSNorm
constexpr int kRowWarps = 8;  // rows (warps) per block of the per-row kernels

__global__ void RmsNormForwardKernel(const float* x, const float* __restrict__ w, float eps,
                                     float* y, float* __restrict__ rstd, int64_t N, int64_t W) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (i >= N) return;
  const float* row = x + i * W;
  double ss = 0.0;
  for (int64_t j = lane; j < W; j += kWarp) ss += double{row[j]} * row[j];
  ss = WarpSum(ss);
  const float r = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(W) + double{eps}));
  if (lane == 0) rstd[i] = r;
  for (int64_t j = lane; j < W; j += kWarp) y[i * W + j] = __fmul_rn(__fmul_rn(row[j], r), w[j]);
}

__global__ void RmsNormBackwardInputKernel(const float* __restrict__ x, const float* __restrict__ w,
                                           const float* __restrict__ rstd,
                                           const float* __restrict__ dy, float* __restrict__ dx,
                                           int64_t N, int64_t W) {
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
    dx[i * W + j] = __fsub_rn(__fmul_rn(__fmul_rn(r, w[j]), grow[j]), __fmul_rn(row[j], c));
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
                               float* dx, float* __restrict__ partials, int64_t N, int64_t W,
                               int64_t rows_per) {
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
        dx[i * W + j] = __fsub_rn(__fmul_rn(__fmul_rn(r, wr[k]), gr[k]), __fmul_rn(xr[k], c));
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
template <int V, bool kFull>
__device__ __forceinline__ void ConvForwardRun(const float* __restrict__ xb,
                                               float* __restrict__ yb, int64_t rows_left,
                                               int64_t C, const Vec<V> (&wt)[K],
                                               Vec<V> (&win)[K]) {
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
#pragma unroll
        for (int j = 0; j < K - 1; ++j) win[j] = win[j + 1];
      }
    }
  }
}

template <int V>
__global__ void __launch_bounds__(kWarp * kConvGroups)
    ShortConvForwardKernel(const float* __restrict__ x, const float* __restrict__ prefix,
                           const float* __restrict__ w, float* __restrict__ y, int64_t nb,
                           int64_t L, int64_t C) {
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
  float* yb = y + (b * L + t0) * C + c;
  if (t0 + kConvRun <= L) {
    ConvForwardRun<V, true>(xb, yb, L - t0, C, wt, win);
  } else {
    ConvForwardRun<V, false>(xb, yb, L - t0, C, wt, win);
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
template <int V, bool kFull>
__device__ __forceinline__ void ConvBackwardRun(const float* __restrict__ xb,
                                                const float* __restrict__ dyb,
                                                float* __restrict__ dxb, int64_t rows_left,
                                                int64_t C, const Vec<V> (&wt)[K], Vec<V> (&xw)[K],
                                                Vec<V> (&dyw)[K], Vec<V> (&acc)[K]) {
#pragma unroll
  for (int k0 = 0; k0 < kConvRun; k0 += kConvBackwardBatch) {
    Vec<V> xin[kConvBackwardBatch], gin[kConvBackwardBatch];  // the batch's loads first
#pragma unroll
    for (int k = 0; k < kConvBackwardBatch; ++k) {
      const int s = k0 + k;  // row t0 + s
      xin[k] = kFull || s < rows_left ? LoadVec<V>(xb + s * C) : ZeroVec<V>();
      gin[k] = kFull || s + (K - 1) < rows_left ? LoadVec<V>(dyb + (s + (K - 1)) * C)
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
template <int V>
__global__ void __launch_bounds__(kWarp * kConvGroups, 2)
    ShortConvBackwardKernel(const float* __restrict__ x, const float* __restrict__ prefix,
                            const float* __restrict__ w, const float* __restrict__ dy,
                            float* __restrict__ dx, float* __restrict__ d_prefix,
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
      dyw[k] = t0 + k < L ? LoadVec<V>(dy + (b * L + t0 + k) * C + c) : ZeroVec<V>();
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
    float* dxb = dx + (b * L + t0) * C + c;
    if (t0 + kConvRun + (K - 1) <= L) {
      ConvBackwardRun<V, true>(xb, dyb, dxb, L - t0, C, wt, xw, dyw, acc);
    } else {
      ConvBackwardRun<V, false>(xb, dyb, dxb, L - t0, C, wt, xw, dyw, acc);
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

// ------------------------------------------------------------------ cross-entropy
constexpr int kRowThreads = 256;

__global__ void CrossEntropyRowsKernel(const float* __restrict__ logits, int64_t V,
                                       const int32_t* __restrict__ targets,
                                       const float* __restrict__ weights, float* __restrict__ lse,
                                       double* __restrict__ terms) {
  __shared__ float fshared[kWarp];
  __shared__ double dshared[kWarp];
  const int64_t i = blockIdx.x;
  const float* row = logits + i * V;
  float mx = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, row[v]);
  mx = BlockMax(mx, fshared);
  double s = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += exp(double{row[v]} - mx);
  s = BlockSum(s, dshared);
  if (threadIdx.x == 0) {
    const double l = mx + log(s);
    lse[i] = static_cast<float>(l);
    const float wt = weights[i];
    terms[i] = wt != 0.f ? double{wt} * (l - row[targets[i]]) : 0.0;
  }
}

__global__ void CrossEntropyRowGradsKernel(float* __restrict__ logits, int64_t V,
                                           const int32_t* __restrict__ targets,
                                           const float* __restrict__ weights,
                                           const float* __restrict__ lse, float scale) {
  const int64_t i = blockIdx.x;
  float* row = logits + i * V;
  const float a = __fmul_rn(scale, weights[i]);
  if (a == 0.f) {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) row[v] = 0.f;
    return;
  }
  const float l = lse[i];
  const int64_t tg = targets[i];
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float p = __fmul_rn(a, expf(__fsub_rn(row[v], l)));
    row[v] = v == tg ? __fsub_rn(p, a) : p;
  }
}

// ------------------------------------------------------------------ sums in double
constexpr int64_t kSquaresPerBlock = 16 * kThreads;

__global__ void SumOfSquaresPartialsKernel(const float* __restrict__ x, int64_t n,
                                           double* __restrict__ partials) {
  __shared__ double shared[kWarp];
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kSquaresPerBlock;
  const int64_t i1 = std::min(n, i0 + kSquaresPerBlock);
  double s = 0.0;
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) s += double{x[i]} * x[i];
  s = BlockSum(s, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

// One block: thread t sums a contiguous range in order, then BlockSum.
__global__ void SumDoublesKernel(const double* __restrict__ in, int64_t n, double* out) {
  __shared__ double shared[kWarp];
  const int64_t per = (n + blockDim.x - 1) / blockDim.x;
  const int64_t i0 = threadIdx.x * per, i1 = std::min(n, i0 + per);
  double s = 0.0;
  for (int64_t i = i0; i < i1; ++i) s += in[i];
  s = BlockSum(s, shared);
  if (threadIdx.x == 0) *out = s;
}

unsigned FeatureRowBlocks(int64_t rows) {
  return static_cast<unsigned>((rows + kFeatureRowWarps - 1) / kFeatureRowWarps);
}

}  // namespace

// ================================================================== launchers

cudaError_t LaunchFirstBadIndex(const int32_t* ids, const float* weights, int64_t n, int64_t V,
                                unsigned long long* first_bad, int max_blocks,
                                cudaStream_t stream) {
  SetKernel<<<1, 1, 0, stream>>>(first_bad, ULLONG_MAX);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || n == 0) return err;
  FirstBadIndexKernel<<<Blocks(n, max_blocks), kThreads, 0, stream>>>(ids, weights, n, V,
                                                                      first_bad);
  return cudaGetLastError();
}

cudaError_t LaunchEmbeddingForward(const float* table, const int32_t* ids, float* out, int64_t N,
                                   int64_t W, int64_t V, int max_blocks, cudaStream_t stream) {
  if (N == 0 || W == 0) return cudaSuccess;
  const bool vectorized = W % 4 == 0 && Aligned16(table) && Aligned16(out);
  EmbeddingForwardKernel<<<Blocks(vectorized ? N * W / 4 : N * W, max_blocks), kThreads, 0,
                           stream>>>(table, ids, out, N, W, V, vectorized);
  return cudaGetLastError();
}

cudaError_t EmbeddingBackwardScratchBytes(int64_t N, int64_t V, size_t* bytes) {
  size_t sort_bytes = 0;
  cudaError_t err = cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<int>(std::max<int64_t>(N, 1)), 0, SortBits(V));
  if (err != cudaSuccess) return err;
  *bytes = 3 * AlignUp(static_cast<size_t>(std::max<int64_t>(N, 1)) * sizeof(int32_t)) +
           AlignUp(static_cast<size_t>(std::max<int64_t>(V, 1)) * sizeof(int32_t)) +
           AlignUp(sort_bytes);
  return cudaSuccess;
}

cudaError_t LaunchEmbeddingBackward(const int32_t* ids, const float* d_out, float* d_table,
                                    int64_t N, int64_t W, int64_t V, void* scratch,
                                    size_t scratch_bytes, cudaStream_t stream) {
  if (N == 0 || W == 0) return cudaSuccess;
  char* p = static_cast<char*>(scratch);
  const size_t ints = AlignUp(static_cast<size_t>(N) * sizeof(int32_t));
  int32_t* rows_in = reinterpret_cast<int32_t*>(p);               // [N] 0, 1, ..., N-1
  int32_t* sorted_ids = reinterpret_cast<int32_t*>(p + ints);     // [N]
  int32_t* sorted_rows = reinterpret_cast<int32_t*>(p + 2 * ints);  // [N]
  int32_t* run_end = reinterpret_cast<int32_t*>(p + 3 * ints);    // [V]
  const size_t ends = AlignUp(static_cast<size_t>(V) * sizeof(int32_t));
  void* temp = p + 3 * ints + ends;
  size_t temp_bytes = scratch_bytes - 3 * ints - ends;
  IotaKernel<<<Blocks(N, 1024), kThreads, 0, stream>>>(rows_in, N);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  // LSD radix sort is stable: equal ids keep their rows in increasing order.
  err = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ids, sorted_ids, rows_in, sorted_rows,
                                        static_cast<int>(N), 0, SortBits(V), stream);
  if (err != cudaSuccess) return err;
  RunEndsKernel<<<Blocks(N, 1024), kThreads, 0, stream>>>(sorted_ids, N, run_end);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>((W + 127) / 128));
  EmbeddingAccumulateKernel<<<grid, 128, 0, stream>>>(sorted_ids, sorted_rows, run_end, d_out,
                                                      d_table, W);
  return cudaGetLastError();
}

cudaError_t LaunchRmsNormForward(const float* x, const float* w, float eps, float* y, float* rstd,
                                 int64_t N, int64_t W, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  RmsNormForwardKernel<<<static_cast<unsigned>((N + kRowWarps - 1) / kRowWarps),
                         kRowWarps * kWarp, 0, stream>>>(x, w, eps, y, rstd, N, W);
  return cudaGetLastError();
}

cudaError_t LaunchRmsNormBackwardInput(const float* x, const float* w, const float* rstd,
                                       const float* dy, float* dx, int64_t N, int64_t W,
                                       cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  RmsNormBackwardInputKernel<<<static_cast<unsigned>((N + kRowWarps - 1) / kRowWarps),
                               kRowWarps * kWarp, 0, stream>>>(x, w, rstd, dy, dx, N, W);
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
                                  const float* dy, float* dx, float* d_weight, float* partials,
                                  int64_t N, int64_t W, cudaStream_t stream) {
  if (N == 0 || W == 0) return cudaSuccess;
  if (W > kNormMaxW) {  // d_weight first, while x is intact (dx may overwrite x)
    const cudaError_t err = LaunchRmsNormWeightGrad(x, rstd, dy, partials, d_weight, N, W, stream);
    if (err != cudaSuccess) return err;
    return LaunchRmsNormBackwardInput(x, w, rstd, dy, dx, N, W, stream);
  }
  const int64_t rows_per = NormRowsPerBlock(N);
  const int64_t blocks = (N + rows_per - 1) / rows_per;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  RmsNormBackwardFusedKernel<<<static_cast<unsigned>(blocks), kWarp * kNormWarps, 0, stream>>>(
      x, w, rstd, dy, dx, partials, N, W, rows_per);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return LaunchAddPartialsGrouped(partials, blocks, W, d_weight, stream);
}

cudaError_t LaunchSwiGluForward(const float* gate, const float* up, float* y, int64_t n,
                                int max_blocks, cudaStream_t stream) {
  return LaunchMap(Pointers<2, 1>{{gate, up}, {y}}, n, SwiGluForwardOp{}, max_blocks, stream);
}

cudaError_t LaunchSwiGluBackward(const float* gate, const float* up, const float* dy,
                                 float* d_gate, float* d_up, int64_t n, int max_blocks,
                                 cudaStream_t stream) {
  return LaunchMap(Pointers<3, 2>{{gate, up, dy}, {d_gate, d_up}}, n, SwiGluBackwardOp{},
                   max_blocks, stream);
}

cudaError_t LaunchResidualAdd(const float* a, const float* b, float* out, int64_t n,
                              int max_blocks, cudaStream_t stream) {
  return LaunchMap(Pointers<2, 1>{{a, b}, {out}}, n, AddOp{}, max_blocks, stream);
}

cudaError_t LaunchSoftplus(const float* x, float* y, int64_t n, bool negate, int max_blocks,
                           cudaStream_t stream) {
  return LaunchMap(Pointers<1, 1>{{x}, {y}}, n, SoftplusOp{negate ? -1.f : 1.f}, max_blocks,
                   stream);
}

cudaError_t LaunchSigmoidTimes(const float* x, const float* dy, float* dx, int64_t n, bool negate,
                               int max_blocks, cudaStream_t stream) {
  return LaunchMap(Pointers<2, 1>{{x, dy}, {dx}}, n, SigmoidTimesOp{negate ? -1.f : 1.f},
                   max_blocks, stream);
}

cudaError_t LaunchFeatureMapForward(CudaFeatureMap f, const float* x, float* y, int64_t n,
                                    int max_blocks, cudaStream_t stream) {
  switch (f) {
    case CudaFeatureMap::kEluPlusOne:
      return LaunchMap(Pointers<1, 1>{{x}, {y}}, n, EluPlusOneForwardOp{}, max_blocks, stream);
    case CudaFeatureMap::kReluEps:
      return LaunchMap(Pointers<1, 1>{{x}, {y}}, n, ReluEpsForwardOp{}, max_blocks, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchFeatureMapBackward(CudaFeatureMap f, const float* x, const float* dy,
                                     float* dx, int64_t n, int max_blocks, cudaStream_t stream) {
  switch (f) {
    case CudaFeatureMap::kEluPlusOne:
      return LaunchMap(Pointers<2, 1>{{x, dy}, {dx}}, n, EluPlusOneBackwardOp{}, max_blocks,
                       stream);
    case CudaFeatureMap::kReluEps:
      return LaunchMap(Pointers<2, 1>{{x, dy}, {dx}}, n, ReluEpsBackwardOp{}, max_blocks, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchSigmoidScaleForward(const float* x, const float* g, float* y, int64_t rows,
                                      int64_t r, int max_blocks, cudaStream_t stream) {
  if (rows * r == 0) return cudaSuccess;
  SigmoidScaleForwardKernel<<<FeatureRowBlocks(rows), kFeatureRowWarps * kWarp, 0, stream>>>(
      x, g, y, rows, r);
  return cudaGetLastError();
}

cudaError_t LaunchSigmoidScaleBackward(const float* x, const float* g, const float* dy, float* dx,
                                       float* dg, int64_t rows, int64_t r, int max_blocks,
                                       cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  SigmoidScaleBackwardKernel<<<FeatureRowBlocks(rows), kFeatureRowWarps * kWarp, 0, stream>>>(
      x, g, dy, dx, dg, rows, r);
  return cudaGetLastError();
}

cudaError_t LaunchExpRowMaxForward(const float* x, float* y, int64_t rows, int64_t r,
                                   int max_blocks, cudaStream_t stream) {
  if (rows == 0 || r == 0) return cudaSuccess;
  ExpRowMaxForwardKernel<<<FeatureRowBlocks(rows), kFeatureRowWarps * kWarp, 0, stream>>>(
      x, y, rows, r);
  return cudaGetLastError();
}

cudaError_t LaunchExpRowMaxBackward(const float* x, const float* y, const float* dy, float* dx,
                                    int64_t rows, int64_t r, int max_blocks, cudaStream_t stream) {
  if (rows == 0 || r == 0) return cudaSuccess;
  ExpRowMaxBackwardKernel<<<FeatureRowBlocks(rows), kFeatureRowWarps * kWarp, 0, stream>>>(
      x, y, dy, dx, rows, r);
  return cudaGetLastError();
}

int64_t ShortConvBackwardPartials(int64_t nb, int64_t L) {
  return std::max<int64_t>(1, (nb * ConvRuns(L) + kConvGroups - 1) / kConvGroups);
}

cudaError_t LaunchShortConvForward(const float* x, const float* prefix, const float* w, float* y,
                                   int64_t nb, int64_t L, int64_t C, cudaStream_t stream) {
  if (nb * L * C == 0) return cudaSuccess;
  const bool vec = C % 4 == 0 && Aligned16(x) && Aligned16(prefix) && Aligned16(w) && Aligned16(y);
  const int64_t tiles = (C / (vec ? 4 : 1) + kWarp - 1) / kWarp;
  const int64_t blocks = (nb * ConvRuns(L) + kConvGroups - 1) / kConvGroups;
  if (tiles > 65535 || blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
  if (vec) {
    ShortConvForwardKernel<4><<<grid, kWarp * kConvGroups, 0, stream>>>(x, prefix, w, y, nb, L, C);
  } else {
    ShortConvForwardKernel<1><<<grid, kWarp * kConvGroups, 0, stream>>>(x, prefix, w, y, nb, L, C);
  }
  return cudaGetLastError();
}

cudaError_t LaunchShortConvBackward(const float* x, const float* prefix, const float* w,
                                    const float* dy, float* dx, float* d_prefix, float* d_w,
                                    float* partials, int64_t nb, int64_t L, int64_t C,
                                    cudaStream_t stream) {
  if (nb * C == 0) return cudaSuccess;
  const bool vec = C % 4 == 0 && Aligned16(x) && Aligned16(prefix) && Aligned16(w) &&
                   Aligned16(dy) && Aligned16(dx) && Aligned16(d_prefix);
  const int64_t tiles = (C / (vec ? 4 : 1) + kWarp - 1) / kWarp;
  const int64_t blocks = ShortConvBackwardPartials(nb, L);
  if (tiles > 65535 || blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
  if (vec) {
    ShortConvBackwardKernel<4><<<grid, kWarp * kConvGroups, 0, stream>>>(
        x, prefix, w, dy, dx, d_prefix, partials, nb, L, C);
  } else {
    ShortConvBackwardKernel<1><<<grid, kWarp * kConvGroups, 0, stream>>>(
        x, prefix, w, dy, dx, d_prefix, partials, nb, L, C);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || L == 0) return err;  // no rows: d_w unchanged
  return LaunchAddPartialsGrouped(partials, blocks, K * C, d_w, stream);
}

cudaError_t LaunchCrossEntropyRows(const float* logits, int64_t m, int64_t V,
                                   const int32_t* targets, const float* weights, float* lse,
                                   double* terms, cudaStream_t stream) {
  if (m == 0) return cudaSuccess;
  CrossEntropyRowsKernel<<<static_cast<unsigned>(m), kRowThreads, 0, stream>>>(
      logits, V, targets, weights, lse, terms);
  return cudaGetLastError();
}

cudaError_t LaunchCrossEntropyRowGrads(float* logits, int64_t m, int64_t V,
                                       const int32_t* targets, const float* weights,
                                       const float* lse, float scale, cudaStream_t stream) {
  if (m == 0) return cudaSuccess;
  CrossEntropyRowGradsKernel<<<static_cast<unsigned>(m), kRowThreads, 0, stream>>>(
      logits, V, targets, weights, lse, scale);
  return cudaGetLastError();
}

int64_t SumOfSquaresBlocks(int64_t n) {
  return std::max<int64_t>(1, (n + kSquaresPerBlock - 1) / kSquaresPerBlock);
}

cudaError_t LaunchSumOfSquaresPartials(const float* x, int64_t n, double* partials,
                                       cudaStream_t stream) {
  SumOfSquaresPartialsKernel<<<static_cast<unsigned>(SumOfSquaresBlocks(n)), kThreads, 0,
                               stream>>>(x, n, partials);
  return cudaGetLastError();
}

cudaError_t LaunchSumDoubles(const double* in, int64_t n, double* out, cudaStream_t stream) {
  SumDoublesKernel<<<1, 1024, 0, stream>>>(in, n, out);
  return cudaGetLastError();
}

cudaError_t LaunchCastF32ToBf16(const float* src, uint16_t* dst, int64_t n, int max_blocks,
                                cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vectorized = Aligned16(src) && (reinterpret_cast<uintptr_t>(dst) & 7u) == 0;
  CastF32ToBf16Kernel<<<Blocks(vectorized ? (n + 3) / 4 : n, max_blocks), kThreads, 0, stream>>>(
      src, dst, n, vectorized);
  return cudaGetLastError();
}

cudaError_t LaunchCastBf16ToF32(const uint16_t* src, float* dst, int64_t n, int max_blocks,
                                cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vectorized = Aligned16(dst) && (reinterpret_cast<uintptr_t>(src) & 7u) == 0;
  CastBf16ToF32Kernel<<<Blocks(vectorized ? (n + 3) / 4 : n, max_blocks), kThreads, 0, stream>>>(
      src, dst, n, vectorized);
  return cudaGetLastError();
}

cudaError_t LaunchAdamW(float* value, const float* grad, float* m, float* v, int64_t n,
                        const CudaAdamWScalars& s, int max_blocks, cudaStream_t stream) {
  return LaunchMap(Pointers<4, 3>{{value, grad, m, v}, {value, m, v}}, n, AdamWOp{s}, max_blocks,
                   stream);
}

}  // namespace smat
