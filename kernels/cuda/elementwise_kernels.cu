// Element-wise CUDA kernels (elementwise_kernels.h).
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/elementwise_kernels.h"

namespace smat {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t n, int max_blocks) {
  const int64_t needed = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, max_blocks)));
}

template <typename T>
__global__ void FillKernel(T* __restrict__ p, int64_t n, T value) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    p[i] = value;
  }
}

template <typename X>
__device__ __forceinline__ float ToFloat(X x);
template <>
__device__ __forceinline__ float ToFloat<float>(float x) { return x; }
template <>
__device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename X>
__global__ void AxpyKernel(float alpha, const X* __restrict__ x, float* __restrict__ y, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    y[i] = fmaf(alpha, ToFloat(x[i]), y[i]);
  }
}

__global__ void ScaleKernel(float beta, float* __restrict__ c, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    c[i] = beta == 0.f ? 0.f : beta * c[i];
  }
}

}  // namespace

cudaError_t LaunchFill(void* p, int64_t n, int elem_size, uint64_t bits, int max_blocks,
                       cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int blocks = Blocks(n, max_blocks);
  switch (elem_size) {
    case 2:
      FillKernel<<<blocks, kThreads, 0, stream>>>(static_cast<uint16_t*>(p), n,
                                                  static_cast<uint16_t>(bits));
      break;
    case 4:
      FillKernel<<<blocks, kThreads, 0, stream>>>(static_cast<uint32_t*>(p), n,
                                                  static_cast<uint32_t>(bits));
      break;
    case 8:
      FillKernel<<<blocks, kThreads, 0, stream>>>(static_cast<uint64_t*>(p), n, bits);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchAxpy(float alpha, const void* x, bool x_is_bf16, float* y, int64_t n,
                       int max_blocks, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int blocks = Blocks(n, max_blocks);
  if (x_is_bf16) {
    AxpyKernel<<<blocks, kThreads, 0, stream>>>(alpha, static_cast<const __nv_bfloat16*>(x), y, n);
  } else {
    AxpyKernel<<<blocks, kThreads, 0, stream>>>(alpha, static_cast<const float*>(x), y, n);
  }
  return cudaGetLastError();
}

cudaError_t LaunchScale(float beta, float* c, int64_t n, int max_blocks, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  ScaleKernel<<<Blocks(n, max_blocks), kThreads, 0, stream>>>(beta, c, n);
  return cudaGetLastError();
}

}  // namespace smat
