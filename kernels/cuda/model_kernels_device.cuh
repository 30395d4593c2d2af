// Device pieces shared by the CUDA model kernels (model_kernels_*.cu): the
// launch shape, grid-stride indexing, the column sums' shared stages, the
// CPU's sigmoid and softplus formulas with the accurate expf / log1pf, and
// fixed-order warp and block reductions (every lane or thread gets the same
// bits).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/model_kernels_kernels.h"

namespace smat {
namespace model_cuda {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int K = kCudaShortConvWidth;

inline int Blocks(int64_t n, int max_blocks) {
  const int64_t needed = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, max_blocks)));
}

inline bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

constexpr int kRowWarps = 8;  // rows (warps) per block of the per-row kernels

// Shared by the RMSNorm, short conv and narrow linear kernels; defined in
// model_kernels_norm.cu. Rows per block of the two-stage column sums (a
// multiple of their row groups), and the grouped stage 2 of the fused backward
// kernels: out[j] += the sum of partials[p, j] over p < P in a fixed order.
int64_t RowsPerPartial(int64_t rows);
cudaError_t LaunchAddPartialsGrouped(const float* partials, int64_t P, int64_t cols, float* out,
                                     cudaStream_t stream);

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

// core FloatToBf16, bit for bit: round to nearest even, NaN kept (quiet).
__device__ __forceinline__ uint16_t ToBf16Bits(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float Bf16BitsToFloat(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// Stores v into an fp32 element, or (uint16_t: bf16 bits) its rounding.
__device__ __forceinline__ void StoreAs(float* p, float v) { *p = v; }
__device__ __forceinline__ void StoreAs(uint16_t* p, float v) { *p = ToBf16Bits(v); }

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

__device__ inline float BlockMax(float v, float* shared) {
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

}  // namespace model_cuda
}  // namespace smat
