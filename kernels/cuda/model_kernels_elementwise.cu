// CUDA model kernels, element-wise and per-row (model_kernels_kernels.h):
// the grid-stride maps (SwiGLU, residual add, softplus and sigmoid gates, the
// feature maps, AdamW), fp32 <-> bf16 casts, the rows of r features (key gate,
// exp feature map) and the fixed-order sums of squares in double.
#include <climits>
#include <cstdint>

#include "kernels/cuda/model_kernels_device.cuh"

namespace smat {
namespace {

using namespace model_cuda;  // NOLINT: the shared launch shape and reductions

// ------------------------------------------------------------------ element-wise
// A map of NI inputs to NO outputs, element by element, computed in fp32;
// each operand is fp32 or (bit k of in_bf16 / out_bf16) bf16, read exactly
// and written rounded to nearest even (ToBf16Bits). Outputs may alias inputs
// of their dtype (each element is read before it is written, by one thread).
// With every fp32 pointer 16-byte and every bf16 pointer 8-byte aligned, four
// elements per access.
template <int NI, int NO>
struct Pointers {
  const void* in[NI];
  void* out[NO];
  unsigned in_bf16 = 0;
  unsigned out_bf16 = 0;
};

__device__ __forceinline__ float4 Load4(const void* p, bool bf16, int64_t i) {
  if (bf16) {
    const uint2 a = reinterpret_cast<const uint2*>(p)[i];
    return make_float4(__uint_as_float(a.x << 16), __uint_as_float(a.x & 0xffff0000u),
                       __uint_as_float(a.y << 16), __uint_as_float(a.y & 0xffff0000u));
  }
  return reinterpret_cast<const float4*>(p)[i];
}
__device__ __forceinline__ void Store4(void* p, bool bf16, int64_t i, const float4& v) {
  if (bf16) {
    uint2 b;
    b.x = static_cast<uint32_t>(ToBf16Bits(v.x)) | (static_cast<uint32_t>(ToBf16Bits(v.y)) << 16);
    b.y = static_cast<uint32_t>(ToBf16Bits(v.z)) | (static_cast<uint32_t>(ToBf16Bits(v.w)) << 16);
    reinterpret_cast<uint2*>(p)[i] = b;
  } else {
    reinterpret_cast<float4*>(p)[i] = v;
  }
}
__device__ __forceinline__ float Load1(const void* p, bool bf16, int64_t i) {
  return bf16 ? Bf16BitsToFloat(static_cast<const uint16_t*>(p)[i])
              : static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void Store1(void* p, bool bf16, int64_t i, float v) {
  if (bf16) {
    static_cast<uint16_t*>(p)[i] = ToBf16Bits(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

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
      for (int k = 0; k < NI; ++k) a[k] = Load4(p.in[k], (p.in_bf16 >> k) & 1u, i);
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
      for (int k = 0; k < NO; ++k) Store4(p.out[k], (p.out_bf16 >> k) & 1u, i, b[k]);
    }
    first_scalar = n4 * 4;
  }
  for (int64_t i = first_scalar + GlobalThread(); i < n; i += GridThreads()) {
    float x[NI], y[NO];
#pragma unroll
    for (int k = 0; k < NI; ++k) x[k] = Load1(p.in[k], (p.in_bf16 >> k) & 1u, i);
    f(x, y);
#pragma unroll
    for (int k = 0; k < NO; ++k) Store1(p.out[k], (p.out_bf16 >> k) & 1u, i, y[k]);
  }
}

template <int NI, int NO, class F>
cudaError_t LaunchMap(const Pointers<NI, NO>& p, int64_t n, F f, int max_blocks,
                      cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  auto aligned = [](const void* q, bool bf16) {
    return (reinterpret_cast<uintptr_t>(q) & (bf16 ? 7u : 15u)) == 0;
  };
  bool vectorized = true;
  for (int k = 0; k < NI; ++k) vectorized = vectorized && aligned(p.in[k], (p.in_bf16 >> k) & 1u);
  for (int k = 0; k < NO; ++k) {
    vectorized = vectorized && aligned(p.out[k], (p.out_bf16 >> k) & 1u);
  }
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

template <typename TY>
__global__ void SigmoidScaleForwardKernel(const float* x, const float* __restrict__ g, TY* y,
                                          int64_t rows, int64_t r) {
  const int64_t i = WarpRow();
  if (i >= rows) return;
  const float s = Sigmoid(g[i]);
  for (int64_t j = threadIdx.x % kWarp; j < r; j += kWarp) {
    StoreAs(y + i * r + j, x[i * r + j] * s);
  }
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

cudaError_t LaunchSwiGluForward(const void* gate, const void* up, bool in_bf16, void* y,
                                bool y_bf16, int64_t n, int max_blocks, cudaStream_t stream) {
  return LaunchMap(Pointers<2, 1>{{gate, up}, {y}, in_bf16 ? 3u : 0u, y_bf16 ? 1u : 0u}, n,
                   SwiGluForwardOp{}, max_blocks, stream);
}

cudaError_t LaunchSwiGluBackward(const void* gate, const void* up, bool in_bf16, const void* dy,
                                 bool dy_bf16, void* d_gate, void* d_up, bool out_bf16, int64_t n,
                                 int max_blocks, cudaStream_t stream) {
  return LaunchMap(Pointers<3, 2>{{gate, up, dy},
                                  {d_gate, d_up},
                                  (in_bf16 ? 3u : 0u) | (dy_bf16 ? 4u : 0u),
                                  out_bf16 ? 3u : 0u},
                   n,
      SwiGluBackwardOp{}, max_blocks, stream);
}

cudaError_t LaunchResidualAdd(const float* a, const float* b, float* out, int64_t n,
                              int max_blocks, cudaStream_t stream) {
  return LaunchMap(Pointers<2, 1>{{a, b}, {out}}, n, AddOp{}, max_blocks, stream);
}

cudaError_t LaunchSoftplus(const float* x, void* y, bool y_bf16, int64_t n, bool negate,
                           int max_blocks, cudaStream_t stream) {
  return LaunchMap(Pointers<1, 1>{{x}, {y}, 0u, y_bf16 ? 1u : 0u}, n,
                   SoftplusOp{negate ? -1.f : 1.f}, max_blocks, stream);
}

cudaError_t LaunchSigmoidTimes(const float* x, const float* dy, float* dx, int64_t n, bool negate,
                               int max_blocks, cudaStream_t stream) {
  return LaunchMap(Pointers<2, 1>{{x, dy}, {dx}}, n, SigmoidTimesOp{negate ? -1.f : 1.f},
                   max_blocks, stream);
}

cudaError_t LaunchFeatureMapForward(CudaFeatureMap f, const float* x, void* y, bool y_bf16,
                                    int64_t n, int max_blocks, cudaStream_t stream) {
  const Pointers<1, 1> p{{x}, {y}, 0u, y_bf16 ? 1u : 0u};
  switch (f) {
    case CudaFeatureMap::kEluPlusOne:
      return LaunchMap(p, n, EluPlusOneForwardOp{}, max_blocks, stream);
    case CudaFeatureMap::kReluEps:
      return LaunchMap(p, n, ReluEpsForwardOp{}, max_blocks, stream);
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

cudaError_t LaunchSigmoidScaleForward(const float* x, const float* g, void* y, bool y_bf16,
                                      int64_t rows, int64_t r, int max_blocks,
                                      cudaStream_t stream) {
  if (rows * r == 0) return cudaSuccess;
  if (y_bf16) {
    SigmoidScaleForwardKernel<<<FeatureRowBlocks(rows), kFeatureRowWarps * kWarp, 0, stream>>>(
        x, g, static_cast<uint16_t*>(y), rows, r);
  } else {
    SigmoidScaleForwardKernel<<<FeatureRowBlocks(rows), kFeatureRowWarps * kWarp, 0, stream>>>(
        x, g, static_cast<float*>(y), rows, r);
  }
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
