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

// ------------------------------------------------------------------ short conv
// Input row s (negative: from the prefix) of sequence b, column c.
__device__ __forceinline__ float ConvInput(const float* x, const float* prefix, int64_t b,
                                           int64_t s, int64_t c, int64_t L, int64_t C) {
  return s >= 0 ? x[(b * L + s) * C + c] : prefix[(b * (K - 1) + (K - 1) + s) * C + c];
}

// Block-stride over rows (b, t) of the output, threads over channels c: every
// load and store is coalesced and no index is divided per element.
__global__ void ShortConvForwardKernel(const float* __restrict__ x, const float* __restrict__ prefix,
                                       const float* __restrict__ w, float* __restrict__ y,
                                       int64_t nb, int64_t L, int64_t C) {
  for (int64_t bt = blockIdx.x; bt < nb * L; bt += gridDim.x) {
    const int64_t b = bt / L, t = bt - b * L;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      float out = 0.f;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const int64_t s = t - (K - 1) + j;
        out = __fadd_rn(out, __fmul_rn(w[j * C + c], ConvInput(x, prefix, b, s, c, L, C)));
      }
      y[bt * C + c] = out;
    }
  }
}

// Rows (b, s) for s in [-(K-1), L): the outputs that read input row s.
__global__ void ShortConvBackwardInputKernel(const float* __restrict__ w,
                                             const float* __restrict__ dy, float* __restrict__ dx,
                                             float* __restrict__ d_prefix, int64_t nb, int64_t L,
                                             int64_t C) {
  const int64_t span = L + K - 1;
  for (int64_t bs = blockIdx.x; bs < nb * span; bs += gridDim.x) {
    const int64_t b = bs / span, s = bs - b * span - (K - 1);
    float* out = s >= 0 ? dx + (b * L + s) * C : d_prefix + (b * (K - 1) + (K - 1) + s) * C;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const int64_t t = s + (K - 1) - j;
        if (t < 0 || t >= L) continue;
        acc = __fadd_rn(acc, __fmul_rn(w[j * C + c], dy[(b * L + t) * C + c]));
      }
      out[c] = acc;
    }
  }
}

static_assert(K <= kRowGroups, "one warp per tap adds the group sums");

// d_w partials: block (row range of ColumnPartials, tile of 32 channels);
// thread (g, c) keeps the K taps of channel c over rows g, g + kRowGroups, ...
// of the range (in order), then the groups are added in group order.
// partials [blocks, K, C].
__global__ void ShortConvWeightPartialsKernel(const float* __restrict__ x,
                                              const float* __restrict__ prefix,
                                              const float* __restrict__ dy, int64_t nb, int64_t L,
                                              int64_t C, int64_t rows_per,
                                              float* __restrict__ partials) {
  const int lane = threadIdx.x % kColTile, g = threadIdx.x / kColTile;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kColTile + lane;
  const int64_t rows = nb * L;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * rows_per;
  const int64_t i1 = std::min(rows, i0 + rows_per);
  float acc[K];
#pragma unroll
  for (int j = 0; j < K; ++j) acc[j] = 0.f;
  if (c < C && i0 + g < i1) {
    int64_t b = (i0 + g) / L, t = (i0 + g) - b * L;
    for (int64_t i = i0 + g; i < i1; i += kRowGroups) {
      const float gy = dy[i * C + c];
#pragma unroll
      for (int j = 0; j < K; ++j) {
        acc[j] = __fadd_rn(acc[j], __fmul_rn(gy, ConvInput(x, prefix, b, t - (K - 1) + j, c, L, C)));
      }
      t += kRowGroups;
      while (t >= L) {
        t -= L;
        ++b;
      }
    }
  }
  __shared__ float sums[K][kRowGroups][kColTile];
#pragma unroll
  for (int j = 0; j < K; ++j) sums[j][g][lane] = acc[j];
  __syncthreads();
  if (g < K && c < C) {  // warp g adds tap g's group sums in group order
    float total = sums[g][0][lane];
    for (int k = 1; k < kRowGroups; ++k) total = __fadd_rn(total, sums[g][k][lane]);
    partials[(static_cast<int64_t>(blockIdx.x) * K + g) * C + c] = total;
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

cudaError_t LaunchShortConvForward(const float* x, const float* prefix, const float* w, float* y,
                                   int64_t nb, int64_t L, int64_t C, int max_blocks,
                                   cudaStream_t stream) {
  if (nb * L * C == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>(nb * L, max_blocks));
  ShortConvForwardKernel<<<blocks, kThreads, 0, stream>>>(x, prefix, w, y, nb, L, C);
  return cudaGetLastError();
}

cudaError_t LaunchShortConvBackwardInput(const float* w, const float* dy, float* dx,
                                         float* d_prefix, int64_t nb, int64_t L, int64_t C,
                                         int max_blocks, cudaStream_t stream) {
  const int64_t rows = nb * (L + K - 1);
  if (rows * C == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>(rows, max_blocks));
  ShortConvBackwardInputKernel<<<blocks, kThreads, 0, stream>>>(w, dy, dx, d_prefix, nb, L, C);
  return cudaGetLastError();
}

cudaError_t LaunchShortConvWeightGrad(const float* x, const float* prefix, const float* dy,
                                      float* partials, float* d_w, int64_t nb, int64_t L,
                                      int64_t C, cudaStream_t stream) {
  const int64_t rows = nb * L;
  if (rows == 0 || C == 0) return cudaSuccess;
  const int64_t rows_per = RowsPerPartial(rows);
  const int64_t blocks = (rows + rows_per - 1) / rows_per;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>((C + kColTile - 1) / kColTile));
  ShortConvWeightPartialsKernel<<<grid, kColTile * kRowGroups, 0, stream>>>(x, prefix, dy, nb, L, C,
                                                                          rows_per, partials);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  AddPartialsKernel<<<static_cast<int>((K * C + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      partials, blocks, K * C, d_w);
  return cudaGetLastError();
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
