// CUDA model kernels of the narrow linear layer (model_kernels_kernels.h):
// y = x w^T + b for at most kCudaNarrowMaxOut outputs, one warp per row, and
// its backward (dx one warp per row; d_w and d_bias as fixed-order row sums).
#include <cstdint>

#include "kernels/cuda/model_kernels_device.cuh"

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
