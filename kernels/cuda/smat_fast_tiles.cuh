// Shared pieces of the fast SMat tiles (c <= 128 tokens, r and dv <= 64):
// the block shape, 16-byte row loads widened exactly to fp32, the staging of
// token tiles and chunk matrices into shared memory (batches of independent
// global loads, no division per element) and the register-blocked fp32 FFMA
// product. smat_chunk_fast.cu (the chunk tiles F6 / B7) and
// smat_grouped_fast.cu (the grouped outer sums and per-token reads) are built
// from them; smat_chunk_mma.cu uses the row loads.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/smat_device.cuh"

namespace smat {
namespace fast_tiles {

using cuda_detail::ChunkRow;
using cuda_detail::TokenRow;

constexpr int kThreads = 256;
constexpr int kC = 128;      // chunk tokens held (rows of every token tile)
constexpr int kW = 64;       // widest r or dv
constexpr int kK1 = kW + 1;  // widest inner size of a score tile: p = dv + 1
constexpr int kLdF = 68;     // F rows: 16-byte aligned, 4-way conflicts when staged transposed

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }

// 16 bytes of a row: 4 floats or 8 bf16, widened exactly to fp32.
__device__ __forceinline__ void LoadVec(const float* src, float (&o)[4]) {
  const float4 x = __ldg(reinterpret_cast<const float4*>(src));
  o[0] = x.x;
  o[1] = x.y;
  o[2] = x.z;
  o[3] = x.w;
}
__device__ __forceinline__ void LoadVec(const __nv_bfloat16* src, float (&o)[8]) {
  const uint4 x = __ldg(reinterpret_cast<const uint4*>(src));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    o[2 * i] = f.x;
    o[2 * i + 1] = f.y;
  }
}

// Token rows of one (chunk, b, h): element (t, j) at base[t * stride + j].
template <typename T>
struct TokenTile {
  using Elem = T;
  const T* base;
  int64_t stride;
  int width;
  __device__ const T* Row(int t) const { return base + t * stride; }
  __device__ const T* At(int t, int j) const { return &base[t * stride + j]; }
};

// Rows of a token list: element (t, j) at src[rows[t] * width + j].
template <typename T>
struct ListedRows {
  using Elem = T;
  const T* src;
  const int64_t* rows;  // shared memory
  int width;
  __device__ const T* Row(int t) const { return src + rows[t] * width; }
  __device__ const T* At(int t, int j) const { return &src[rows[t] * width + j]; }
};

template <typename T>
__device__ __forceinline__ TokenTile<T> Tile(const SmatCudaDims& d, const T* src, int width, int b,
                                             int h, int64_t c0) {
  return {src + TokenRow(d, b, c0, h) * width, static_cast<int64_t>(d.H) * width, width};
}

// Staging loops issue a batch of kBatch independent global loads per thread
// before the first shared-memory store, so the tile arrives in a few memory
// latencies rather than one per element.
constexpr int kBatch = 8;

// dst[i][t] (ld kLd) = src[t][i] for i < width, 0 for t >= ce; src a
// TokenTile (chunk tiles) or ListedRows (grouped products, ce = the tokens
// listed). Threads walk t fastest, so the shared-memory stores of a warp hit
// 32 different banks. The rows from width on are the caller's.
template <int kLd, class Src>
__device__ void StageTransposedRows(const Src& src, int ce, bool vec, float* dst) {
  constexpr int V = 16 / sizeof(typename Src::Elem);
  if (vec) {
    const int total = kC * (src.width / V);
    for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * 4) {
      float x[4][V];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = e0 + u * kThreads, t = e & (kC - 1), q = e >> 7;
        if (e < total && t < ce) {
          LoadVec(src.At(t, q * V), x[u]);
        } else {
#pragma unroll
          for (int z = 0; z < V; ++z) x[u][z] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = e0 + u * kThreads, t = e & (kC - 1), q = e >> 7;
        if (e < total) {
#pragma unroll
          for (int z = 0; z < V; ++z) dst[(q * V + z) * kLd + t] = x[u][z];
        }
      }
    }
  } else {
    const int total = kC * src.width;
    for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * kBatch) {
      float x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e & (kC - 1), i = e >> 7;
        x[u] = e < total && t < ce ? ToF(__ldg(src.At(t, i))) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads;
        if constexpr (kLd == kC) {
          if (e < total) dst[e] = x[u];  // e = i * kC + t
        } else {
          const int t = e & (kC - 1), i = e >> 7;
          if (e < total) dst[i * kLd + t] = x[u];
        }
      }
    }
  }
}

// StageTransposedRows (ld kC), then rows width .. K1 - 1: 1 in row `width`
// for t < ce (the ones of vbar), else 0.
template <class Src>
__device__ void StageTransposed(const Src& src, int ce, int K1, bool vec, float* dst) {
  StageTransposedRows<kC>(src, ce, vec, dst);
  for (int e = threadIdx.x; e < kC * (K1 - src.width); e += kThreads) {
    const int t = e & (kC - 1), i = src.width + (e >> 7);
    dst[i * kC + t] = t < ce && i == src.width ? 1.f : 0.f;
  }
}

// dst[t][j] (leading dim ld, a multiple of 4) = scale[t] * src[t][j] for
// t < ce, j < ncols (scale null: 1); then 1 in column ones_col (>= 0) and 0 up
// to column `cols`. Rows >= ce are not written (never read). `vec` requires
// ncols == width.
template <class Src>
__device__ void StageRows(const Src& src, int ce, int ncols, bool vec, float* dst, int ld = kW,
                          int cols = kW, int ones_col = -1, const float* scale = nullptr) {
  constexpr int V = 16 / sizeof(typename Src::Elem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int done = ncols;  // columns written by the loads below
  if (vec) {
    const int nq = ncols / V, total = ce * nq;
    const bool pow2 = (nq & (nq - 1)) == 0;  // shift and mask, no division
    const int lq = __ffs(nq) - 1;
    for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * 4) {
      float x[4][V];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = e0 + u * kThreads;
        const int t = pow2 ? e >> lq : e / nq, q = pow2 ? e & (nq - 1) : e % nq;
        if (e < total) LoadVec(src.Row(t) + q * V, x[u]);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = e0 + u * kThreads;
        const int t = pow2 ? e >> lq : e / nq, q = pow2 ? e & (nq - 1) : e % nq;
        if (e < total) {
          const float sc = scale != nullptr ? scale[t] : 1.f;
#pragma unroll
          for (int z = 0; z < V; z += 4)
            *reinterpret_cast<float4*>(&dst[t * ld + q * V + z]) =
                make_float4(sc * x[u][z], sc * x[u][z + 1], sc * x[u][z + 2], sc * x[u][z + 3]);
        }
      }
    }
  } else {
    // A warp per row, lanes along the row: coalesced loads, conflict-free stores.
    for (int t0 = warp; t0 < ce; t0 += kThreads / 32 * 4) {
      float x[4][3];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int z = 0; z < 3; ++z) {
          const int t = t0 + u * (kThreads / 32), j = lane + 32 * z;
          x[u][z] = t < ce && j < ncols ? ToF(__ldg(src.Row(t) + j)) : 0.f;
        }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int z = 0; z < 3; ++z) {
          const int t = t0 + u * (kThreads / 32), j = lane + 32 * z;
          if (t < ce && j < cols) {
            const float sc = scale != nullptr ? scale[t] : 1.f;
            dst[t * ld + j] = j < ncols ? sc * x[u][z] : (j == ones_col ? 1.f : 0.f);
          }
        }
    }
    done = cols;
  }
  for (int t = warp; t < ce; t += kThreads / 32)
    for (int j = done + lane; j < cols; j += 32) dst[t * ld + j] = j == ones_col ? 1.f : 0.f;
}

// F from the chunk's r x p fp32 matrix M: transposed, F[i][n] = M[n][i]
// (i < p, n < r); else F[i][n] = M[i][n] (i < r, n < ncols). Zero elsewhere.
__device__ inline void StageChunkMatrix(const float* M, int r, int p, int ncols, bool transposed,
                                 float* F) {
  if (transposed) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int n0 = warp; n0 < kW; n0 += kThreads / 32 * 4) {
      float x[4][3];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int z = 0; z < 3; ++z) {
          const int n = n0 + u * (kThreads / 32), i = lane + 32 * z;
          x[u][z] = n < r && i < p ? __ldg(&M[n * p + i]) : 0.f;
        }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int z = 0; z < 3; ++z) {
          const int n = n0 + u * (kThreads / 32), i = lane + 32 * z;
          if (i < kK1) F[i * kLdF + n] = x[u][z];
        }
    }
  } else {
    for (int e0 = threadIdx.x; e0 < kW * kW; e0 += kThreads * kBatch) {
      float x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, i = e >> 6, n = e & (kW - 1);
        x[u] = i < r && n < ncols ? __ldg(&M[i * p + n]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, i = e >> 6, n = e & (kW - 1);
        F[i * kLdF + n] = x[u];
      }
    }
  }
}

// acc[i][4 h + j] += sum_{k in [k0, k1)} A[k][m0 + i] B[k][n0 + 64 h + j] for the
// column halves h with (kLo, kHi) set; A, B k-major with leading dims lda, ldb.
template <bool kLo, bool kHi, int kN>
__device__ __forceinline__ void Gemm(float (&acc)[8][kN], const float* A, int lda, int m0,
                                     const float* B, int ldb, int n0, int k0, int k1) {
#pragma unroll 4
  for (int k = k0; k < k1; ++k) {
    const float4 a0 = *reinterpret_cast<const float4*>(&A[k * lda + m0]);
    const float4 a1 = *reinterpret_cast<const float4*>(&A[k * lda + m0 + 4]);
    const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
    for (int h = 0; h < kN / 4; ++h) {
      if ((h == 0 && !kLo) || (h == 1 && !kHi)) continue;
      const float4 b = *reinterpret_cast<const float4*>(&B[k * ldb + n0 + 64 * h]);
      const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][4 * h + j] = fmaf(av[i], bv[j], acc[i][4 * h + j]);
    }
  }
}

template <int kN>
__device__ __forceinline__ void Zero(float (&acc)[8][kN]) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < kN; ++j) acc[i][j] = 0.f;
}

// Runs Launch<kind, In>::Run(args...) for a read call's kind and input dtype
// (bf16: __nv_bfloat16, else float): the one switch over the read kernels'
// instantiations, for smat_grouped_fast.cu and smat_grouped_mma.cu.
template <template <SmatReadKind, typename> class Launch, typename In, typename... Args>
cudaError_t DispatchReadKind(SmatReadKind kind, const Args&... args) {
  switch (kind) {
    case SmatReadKind::kVecMat:
      return Launch<SmatReadKind::kVecMat, In>::Run(args...);
    case SmatReadKind::kMatVec:
      return Launch<SmatReadKind::kMatVec, In>::Run(args...);
    case SmatReadKind::kBoth:
      return Launch<SmatReadKind::kBoth, In>::Run(args...);
  }
  return cudaErrorInvalidValue;
}
template <template <SmatReadKind, typename> class Launch, typename... Args>
cudaError_t DispatchReads(bool bf16, SmatReadKind kind, const Args&... args) {
  return bf16 ? DispatchReadKind<Launch, __nv_bfloat16>(kind, args...)
              : DispatchReadKind<Launch, float>(kind, args...);
}

using cuda_detail::Aligned16;

}  // namespace fast_tiles
}  // namespace smat
