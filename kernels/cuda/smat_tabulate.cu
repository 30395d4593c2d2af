// The incidence tabulation of Algorithm 2 and its adjoint on the GPU:
//   U[h] = sum_{x on h} F[x]             (Tabulate: types h, points x)
//   F_bar[x] = sum_{h through x} U_bar[h]  (TabulateBackward)
// for rows of W floats per (b, h), both summed in the CPU's order (points in
// increasing index for a type; directions in increasing order for a point:
// TabulateIncidence in core/geometry.cc), no atomics.
//
// Two forms. From the incidence lists (CSR, built once per geometry by
// smat_cuda_groups.cc): any d, a column tile of the input per block in shared
// memory where it fits. From the geometry itself for d = 3 (the plane F_q^2,
// whose types are its lines; the paper's richer setting): the points of a
// line follow from its direction and offset, so no list is read, and the
// lanes of a warp take lines (or points) whose shared-memory rows are
// consecutive, so the loads are free of bank conflicts. The list form reads
// a list entry and a row of the tile per term, and the tile rows of a warp's
// terms are scattered. H200, T = 524288, d = 3 (q = 67), 8 heads, W = 4160
// (2026-12-01): Tabulate 4.91 -> 2.70 ms, TabulateBackward 5.42 -> 2.81 ms;
// with a row's four columns staged and stored as one 16-byte access where the
// rows allow it (2026-12-02): 2.70 -> 2.14 and 2.79 -> 2.23 ms. Both give the
// CPU's bits (tests/gpu/smat_tabulate_gpu_test.cc).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/smat_cuda_kernels.h"
#include "kernels/cuda/smat_device.cuh"

namespace smat {
namespace {

using cuda_detail::Add4;
using cuda_detail::Aligned16;
using cuda_detail::kThreads;

// ---- from the incidence lists ---------------------------------------------------------

// grid (ceil(W / 256), g_out, batch_heads).
__global__ void TabulateKernel(int64_t W, int64_t g_in, int64_t g_out,
                               const int32_t* __restrict__ offsets,
                               const int32_t* __restrict__ items, const float* __restrict__ in,
                               float* __restrict__ out) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= W) return;
  const int64_t g = blockIdx.y, bh = blockIdx.z;
  const float* base = in + bh * g_in * W + w;
  float acc = 0.f;
  for (int32_t j = offsets[g]; j < offsets[g + 1]; ++j)
    acc += base[static_cast<int64_t>(items[j]) * W];
  out[(bh * g_out + g) * W + w] = acc;
}

// grid (ceil(W / kTabCols), batch_heads), kTabThreads threads: the block holds
// in[bh, :, w0 : w0 + kTabCols] (g_in x kTabCols floats) in shared memory and
// forms every output group from it, so `in` is read from memory once rather
// than once per list entry. Same sums, same order as TabulateKernel.
constexpr int kTabCols = 8;
constexpr int kTabThreads = 512;

template <int kColsPerThread>
__global__ void __launch_bounds__(kTabThreads)
    TabulateColumnsKernel(int64_t W, int64_t g_in, int64_t g_out,
                          const int32_t* __restrict__ offsets, const int32_t* __restrict__ items,
                          const float* __restrict__ in, float* __restrict__ out) {
  extern __shared__ float tab[];  // [g_in][kTabCols]
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * kTabCols, bh = blockIdx.y;
  const int nc = static_cast<int>(cuda_detail::Min64(kTabCols, W - w0));
  const float* base = in + bh * g_in * W + w0;
  const int64_t total = g_in * kTabCols;
  constexpr int kUnroll = 8;  // loads in flight per thread
  for (int64_t e0 = threadIdx.x; e0 < total; e0 += kTabThreads * kUnroll) {
    float x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t e = e0 + u * kTabThreads;
      const int c = static_cast<int>(e & (kTabCols - 1));
      x[u] = e < total && c < nc ? __ldg(&base[(e / kTabCols) * W + c]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t e = e0 + u * kTabThreads;
      if (e < total) tab[e] = x[u];
    }
  }
  __syncthreads();
  // kColsPerThread = 4: a thread sums four of the tile's columns of one
  // output, each list entry one 16-byte shared-memory load, so a warp
  // instruction serves 16 outputs instead of 4 (long lists, d >= 3: the
  // loads limit the loop). 1: a thread per column (lists of a point or two,
  // d = 2: more threads per output row, fewer registers). Either way each
  // column is summed alone, in list order.
  constexpr int kPer = kTabCols / kColsPerThread;  // threads per output
  const int c0 = kColsPerThread * (threadIdx.x % kPer);
  for (int64_t g = threadIdx.x / kPer; g < g_out; g += kTabThreads / kPer) {
    float acc[kColsPerThread] = {};
    for (int32_t j = offsets[g]; j < offsets[g + 1]; ++j) {
      const float* x = &tab[items[j] * kTabCols + c0];
      if constexpr (kColsPerThread == 4) {
        const float4 x4 = *reinterpret_cast<const float4*>(x);
        acc[0] += x4.x;
        acc[1] += x4.y;
        acc[2] += x4.z;
        acc[3] += x4.w;
      } else {
#pragma unroll
        for (int u = 0; u < kColsPerThread; ++u) acc[u] += x[u];
      }
    }
    float* o = out + (bh * g_out + g) * W + w0 + c0;
#pragma unroll
    for (int u = 0; u < kColsPerThread; ++u) {
      if (c0 + u < nc) o[u] = acc[u];
    }
  }
}
// ---- d = 3, from the geometry ------------------------------------------------------
// Points x = (x0, x1) of F_q^2 have index x0 q + x1; directions (MakeGeometry:
// first nonzero coordinate 1, in increasing index) are e = 0: a = (0, 1) and
// e = 1 + m: a = (1, m), m = 0 .. q - 1; line (e, b) = {x : a . x = b} is the
// type flat_to_type[e q + b]. On line (e, b), in increasing point index:
//   e = 0:      (k, b),                  k = 0 .. q - 1
//   e = 1:      (b, k)
//   e = 1 + m:  (k, (b - k) / m),        m >= 1 (division mod q)
// Tabulate gives lane j of direction e >= 2 the line b = j m, whose points
// are (k, j - k / m): at every step k the lanes' points are consecutive in
// x1, so their tile rows k q + x1 are consecutive too. e = 0 and e = 1 read
// rows k q + b and b q + k: consecutive and q apart (q odd: distinct banks).
// TabulateBackward gives the lanes consecutive x0 at one x1; the line of
// point x in direction e = 1 + m is b = x0 + m x1, consecutive in x0.
//
// The block holds 4 columns of every input row (in flat type order for the
// adjoint) as one float4 per row, and each thread sums the float4 of an
// output row: 72 KB at q = 67, three blocks per SM, so that one block's
// staging overlaps the others' sums (8 columns, 144 KB and one block per SM:
// 3.03 and 3.41 ms against 2.70 and 2.81 ms). 512 threads.
constexpr int kPlaneThreads = 512;
constexpr int kPlaneCols = 4;

// grid (ceil(W / kPlaneCols), batch_heads), kPlaneThreads threads, 16 n_in
// bytes of shared memory (n_in = P, or B for the adjoint). inverses[m] =
// 1 / m mod q.
// vec: W a multiple of 4 and in, out 16-byte aligned, so each block's four
// columns of a row are one aligned float4: one 16-byte load per row staged and
// one 16-byte store per output row.
template <bool kAdjoint>
__global__ void __launch_bounds__(kPlaneThreads)
    TabulatePlaneKernel(int64_t W, int q, bool vec, const int32_t* __restrict__ flat_to_type,
                        const int32_t* __restrict__ inverses, const float* __restrict__ in,
                        float* __restrict__ out) {
  extern __shared__ float4 tab4[];  // [n_in]
  const int P = q * q, B = q * (q + 1);
  const int n_in = kAdjoint ? B : P, n_out = kAdjoint ? P : B;
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * kPlaneCols, bh = blockIdx.y;
  const int nc = static_cast<int>(cuda_detail::Min64(kPlaneCols, W - w0));
  const float* src = in + bh * n_in * W + w0;
  float* tab = reinterpret_cast<float*>(tab4);

  // Stage: element e = row kPlaneCols + c (a row's columns read together);
  // the adjoint's rows in flat order (row f from type flat_to_type[f]).
  if (vec) {
    constexpr int kRows = 5;  // rows in flight per thread
    for (int f0 = threadIdx.x; f0 < n_in; f0 += kPlaneThreads * kRows) {
      float4 x[kRows];
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        const int f = f0 + u * kPlaneThreads;
        const int from = f < n_in ? (kAdjoint ? __ldg(&flat_to_type[f]) : f) : 0;
        x[u] = f < n_in
                   ? __ldg(reinterpret_cast<const float4*>(src + static_cast<int64_t>(from) * W))
                   : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        const int f = f0 + u * kPlaneThreads;
        if (f < n_in) tab4[f] = x[u];
      }
    }
  }
  // Else one float at a time, a row's four columns on four threads.
  const int total = vec ? 0 : n_in * kPlaneCols;
  constexpr int kUnroll = 8;  // loads in flight per thread
  for (int e0 = threadIdx.x; e0 < total; e0 += kPlaneThreads * kUnroll) {
    float x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e = e0 + u * kPlaneThreads, row = e / kPlaneCols, c = e % kPlaneCols;
      const int from = e < total ? (kAdjoint ? __ldg(&flat_to_type[row]) : row) : 0;
      x[u] = e < total && c < nc ? __ldg(&src[static_cast<int64_t>(from) * W + c]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int e = e0 + u * kPlaneThreads;
      if (e < total) tab[e] = x[u];
    }
  }
  __syncthreads();

  const float4* t = tab4;
  for (int f = threadIdx.x; f < n_out; f += kPlaneThreads) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    int row_out;
    if (!kAdjoint) {
      const int e = f / q, j = f - e * q;
      int b = j;
      if (e == 0) {
        for (int x = b; x < P; x += q) Add4(acc, t[x]);
      } else if (e == 1) {
        const float4* line = t + b * q;
        for (int k = 0; k < q; ++k) Add4(acc, line[k]);
      } else {
        const int m = e - 1, step = __ldg(&inverses[m]);  // x1 falls by 1 / m per step
        b = (j * m) % q;
        int x1 = j;
        for (int row = 0; row < P; row += q) {
          Add4(acc, t[row + x1]);
          x1 -= step;
          if (x1 < 0) x1 += q;
        }
      }
      row_out = __ldg(&flat_to_type[e * q + b]);
    } else {
      const int x1 = f / q, x0 = f - x1 * q;  // lanes: consecutive x0
      Add4(acc, t[x1]);                       // e = 0: a . x = x1
      int b = x0;                             // e = 1 + m: a . x = x0 + m x1
      for (const float4* line = t + q; line < t + B; line += q) {
        Add4(acc, line[b]);
        b += x1;
        if (b >= q) b -= q;
      }
      row_out = x0 * q + x1;
    }
    float* o = out + (bh * n_out + row_out) * W + w0;
    if (vec) {
      *reinterpret_cast<float4*>(o) = acc;
      continue;
    }
    if (nc > 0) o[0] = acc.x;
    if (nc > 1) o[1] = acc.y;
    if (nc > 2) o[2] = acc.z;
    if (nc > 3) o[3] = acc.w;
  }
}

template <bool kAdjoint>
cudaError_t LaunchPlane(int64_t batch_heads, int64_t W, int q, const int32_t* flat_to_type,
                        const int32_t* inverses, const float* in, float* out, cudaStream_t stream) {
  auto kernel = TabulatePlaneKernel<kAdjoint>;
  const int smem = static_cast<int>(sizeof(float4)) * (kAdjoint ? q * (q + 1) : q * q);
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((W + kPlaneCols - 1) / kPlaneCols),
                  static_cast<unsigned>(batch_heads));
  const bool vec = W % kPlaneCols == 0 && Aligned16(in) && Aligned16(out);
  kernel<<<grid, kPlaneThreads, smem, stream>>>(W, q, vec, flat_to_type, inverses, in, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchSmatTabulate(int64_t batch_heads, int64_t W, int64_t g_in, int64_t g_out,
                               const int32_t* offsets, const int32_t* items, int64_t entries,
                               const float* in, float* out, cudaStream_t stream) {
  if (batch_heads == 0 || g_out == 0 || W == 0) return cudaSuccess;
  // The column-tile kernel when a tile of `in` fits one block's shared memory
  // (d = 3 at T = 524288: g_in = 4489 profiles, 144 KB).
  int device = 0, smem_limit = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  const int64_t smem = static_cast<int64_t>(sizeof(float)) * kTabCols * g_in;
  if (g_in > 0 && smem <= smem_limit) {
    // Four columns per thread for long lists: H200, T = 524288, 8 heads, r = dv
    // = 64: d = 3 (67 entries per list) Tabulate 6.42 -> 4.91 ms, but d = 2 (one
    // entry) 0.07 -> 0.12 ms.
    auto kernel = entries >= 4 * g_out ? TabulateColumnsKernel<4> : TabulateColumnsKernel<1>;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    const dim3 tiles(static_cast<unsigned>((W + kTabCols - 1) / kTabCols),
                     static_cast<unsigned>(batch_heads));
    kernel<<<tiles, kTabThreads, static_cast<size_t>(smem), stream>>>(W, g_in, g_out, offsets,
                                                                      items, in, out);
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>((W + kThreads - 1) / kThreads),
                  static_cast<unsigned>(g_out), static_cast<unsigned>(batch_heads));
  TabulateKernel<<<grid, kThreads, 0, stream>>>(W, g_in, g_out, offsets, items, in, out);
  return cudaGetLastError();
}

bool SmatTabulatePlaneFits(int64_t q) {
  // SMAT_CUDA_GROUPED=general keeps the list kernels, which serve any d.
  const char* grouped = std::getenv("SMAT_CUDA_GROUPED");
  if (grouped != nullptr && std::strcmp(grouped, "general") == 0) return false;
  if (q < 2) return false;
  int device = 0, smem_limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
      cudaSuccess) {
    return false;
  }
  return static_cast<int64_t>(sizeof(float4)) * q * (q + 1) <= smem_limit;  // B >= P rows
}

cudaError_t LaunchSmatTabulatePlane(int64_t batch_heads, int64_t W, int64_t q,
                                    const int32_t* flat_to_type, const int32_t* inverses,
                                    bool adjoint, const float* in, float* out,
                                    cudaStream_t stream) {
  if (batch_heads == 0 || W == 0) return cudaSuccess;
  // The forward and the adjoint by slopes (smat_tabulate_slopes.cu) where
  // they serve; SMAT_CUDA_TABULATE=lines keeps a line (point) per thread.
  const char* form = std::getenv("SMAT_CUDA_TABULATE");
  if (SmatTabulateSlopesServes(q, adjoint) && W % kPlaneCols == 0 && Aligned16(in) &&
      Aligned16(out) && (form == nullptr || std::strcmp(form, "lines") != 0)) {
    return LaunchSmatTabulateSlopes(batch_heads, W, q, flat_to_type, inverses, adjoint, in, out,
                                    stream);
  }
  const int qi = static_cast<int>(q);
  return adjoint ? LaunchPlane<true>(batch_heads, W, qi, flat_to_type, inverses, in, out, stream)
                 : LaunchPlane<false>(batch_heads, W, qi, flat_to_type, inverses, in, out, stream);
}

}  // namespace smat
