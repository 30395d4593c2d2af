// The r x p outer-sum tile of 8 warps on tensor cores, over token rows staged
// as bf16 planes [128][72] in shared memory (and the staging of such planes:
// StageRowsAsync, StageSplitRows, shared with the per-token reads of
// smat_reads_bf16.cu): out = sum_t a_t b_t^T with a
// (r <= 64 wide) in kAParts planes and b (p <= 72 wide) in kBParts, each
// operand's planes summing to its value (one part: exact bf16; three: an fp32
// value split by mma_tiles::Split3). The bf16 outer sums (smat_outer_bf16.cu)
// and the state gradients fused with the division's Jacobian
// (smat_state_grads.cu) share it, so both sum in one order.
//
// Warp w owns output rows 16 (w % 4) .. + 15 and n8 tiles 0-4 (w < 4) or 5-8;
// a 16-token step is one ldmatrix.trans per plane (the k index is the token)
// and, per n8 tile, the products of smat_grouped_mma.cu in its order: one
// (1 x 1 parts), lo += a b3, lo += a b2, hi += a b1 (1 x 3), or lo += a3 b,
// lo += a2 b, hi += a1 b (3 x 1); the correction terms in an accumulator of
// their own, added to the leading one at the end.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_fast_tiles.cuh"
#include "kernels/cuda/smat_mma.cuh"

namespace smat {
namespace outer_tile {

constexpr int kC = 128;           // tokens a plane holds
constexpr int kLd = 72;           // bf16 row pitch (144 bytes: conflict-free ldmatrix)
constexpr int kPlane = kC * kLd;  // bf16 elements of one plane

// A warp's part of the tile and its accumulators.
template <int kAParts, int kBParts>
struct Warp {
  static_assert((kAParts == 1 || kAParts == 3) && (kBParts == 1 || kBParts == 3) &&
                    kAParts * kBParts <= 3,
                "one exact operand and at most one split one");
  int gid, tig, m0, n_first, n_count;
  uint32_t a_base, b_base;  // this lane's ldmatrix addresses in the first planes
  float acc[5][4], cor[5][4];

  // a and b: the first of their planes (the others follow kPlane apart).
  __device__ __forceinline__ Warp(int lane, int warp, const __nv_bfloat16* a,
                                  const __nv_bfloat16* b) {
    gid = lane >> 2;
    tig = lane & 3;
    m0 = (warp & 3) * 16;
    n_first = warp < 4 ? 0 : 5;
    n_count = warp < 4 ? 5 : 4;
    // ldmatrix.trans lane offsets: a as a[token][m], b as b[token][n]; see
    // smat_chunk_bwd_mma.cu for the fragment layouts.
    const int off_a = ((lane & 7) + (lane >> 4) * 8) * kLd + ((lane >> 3) & 1) * 8 + m0;
    const int off_b = ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8 + 8 * n_first;
    a_base = mma_tiles::SmemAddr(a) + 2u * off_a;
    b_base = mma_tiles::SmemAddr(b) + 2u * off_b;
#pragma unroll
    for (int j = 0; j < 5; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = cor[j][e] = 0.f;
  }

  // Tokens 16 ks .. 16 ks + 15 of the planes.
  __device__ __forceinline__ void Step(int ks) {
    using mma_tiles::Ldsm4T;
    using mma_tiles::Mma;
    const uint32_t row_bytes = 2u * 16u * kLd * ks;
    uint32_t af[kAParts][4];
#pragma unroll
    for (int q = 0; q < kAParts; ++q) Ldsm4T(af[q], a_base + 2u * q * kPlane + row_bytes);
#pragma unroll
    for (int pp = 0; pp < 3; ++pp) {
      if (2 * pp >= n_count) break;
      uint32_t bf[kBParts][4];
#pragma unroll
      for (int q = 0; q < kBParts; ++q) {
        Ldsm4T(bf[q], b_base + 2u * (q * kPlane + 16 * pp) + row_bytes);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * pp + half;
        if (j >= n_count) break;
        const uint32_t b0 = bf[0][2 * half], b1 = bf[0][2 * half + 1];
        if constexpr (kAParts == 3) {
          Mma(cor[j], af[2], b0, b1);
          Mma(cor[j], af[1], b0, b1);
          Mma(acc[j], af[0], b0, b1);
        } else if constexpr (kBParts == 1) {
          Mma(acc[j], af[0], b0, b1);
        } else {
          Mma(cor[j], af[0], bf[2][2 * half], bf[2][2 * half + 1]);
          Mma(cor[j], af[0], bf[1][2 * half], bf[1][2 * half + 1]);
          Mma(acc[j], af[0], b0, b1);
        }
      }
    }
  }

  // The correction terms added to the leading ones, and zeroed: a tile that
  // sums on over several token sets (the runs of smat_state_grads.cu) holds
  // one accumulator between them.
  __device__ __forceinline__ void Fold() {
#pragma unroll
    for (int j = 0; j < 5; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        acc[j][q] += cor[j][q];
        cor[j][q] = 0.f;
      }
  }

  // The sum so far times e (both accumulators).
  __device__ __forceinline__ void Scale(float e) {
#pragma unroll
    for (int j = 0; j < 5; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        acc[j][q] *= e;
        cor[j][q] *= e;
      }
  }

  // The r x p result to dst (row-major, ld p) through os (r p floats of
  // shared memory no warp reads any more), as whole 16-byte pieces where dst
  // allows; every thread of the block calls it.
  __device__ __forceinline__ void Store(int r, int p, float* os, float* __restrict__ dst, int tid,
                                        int threads) const {
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 5; ++j) {
      if (j >= n_count) break;
      const int col = (n_first + j) * 8 + 2 * tig;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = m0 + gid + (e >= 2 ? 8 : 0), c = col + (e & 1);
        if (row < r && c < p) {
          os[row * p + c] = kAParts * kBParts == 1 ? acc[j][e] : acc[j][e] + cor[j][e];
        }
      }
    }
    __syncthreads();
    const int n = r * p;
    if (n % 4 == 0 && fast_tiles::Aligned16(dst)) {
      for (int i = tid; i < n / 4; i += threads) {
        reinterpret_cast<float4*>(dst)[i] = reinterpret_cast<const float4*>(os)[i];
      }
    } else {
      for (int i = tid; i < n; i += threads) dst[i] = os[i];
    }
  }
};

// dst[t][0 .. width) = bf16 row rows[t] of src (width % 8 == 0, 16-byte
// aligned rows) for t < nt, zeros for nt <= t < kC, by kThreads threads
// (cp.async: the caller waits); columns width.. are left alone.
template <int kThreads>
__device__ __forceinline__ void StageRowsAsync(const __nv_bfloat16* __restrict__ src,
                                               const int64_t* rows, int width, int nt,
                                               __nv_bfloat16* dst) {
  const int pieces = width >> 3;
  for (int e = threadIdx.x; e < kC * pieces; e += kThreads) {
    const int t = e / pieces, q = e - t * pieces;
    __nv_bfloat16* to = dst + t * kLd + 8 * q;
    if (t < nt) {
      mma_tiles::CpAsync16(mma_tiles::SmemAddr(to), src + rows[t] * width + 8 * q);
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// fp32 rows (gbar: width p = dv + 1) in three bf16 planes dst, dst + kPlane,
// dst + 2 kPlane (x = x1 + x2 + x3; kParts = 1: one plane, x rounded to
// bf16); zeros for nt <= t < kC. kWeighted:
// w[t] x instead (each product rounded to fp32). Column dv goes to the planes
// (kDenInPlanes) and/or to gcol[t] (kGcol). kThreads threads, 8 to a row:
// thread i of a row takes the column pairs (2 j, 2 j + 1), j = i, i + 8, ...
// (StoreSplitPair: one 4-byte store per plane), its kBatch loads issued before their
// first use. A pair's element past the staged columns (p, or dv without
// kDenInPlanes) stores 0 there, as the padding is. Element by element, with a
// division by p and three 2-byte stores each, it took TypeReadsBackward
// about twice the instructions.
template <bool kWeighted, bool kDenInPlanes, bool kGcol, int kBatch, int kThreads, int kParts = 3>
__device__ __forceinline__ void StageSplitRows(const float* __restrict__ src, const int64_t* rows,
                                               const float* w, int dv, int nt, __nv_bfloat16* dst,
                                               float* gcol) {
  constexpr int kLanes = 8;  // threads to a row
  constexpr int kRowsPerPass = kThreads / kLanes;
  constexpr int kSlots = (kLd / 2 + kLanes - 1) / kLanes;  // pairs a thread may take in a row
  constexpr int kItems = (kC / kRowsPerPass) * kSlots;
  constexpr int kPairBatch = kBatch / 2 > 0 ? kBatch / 2 : 1;
  static_assert(kThreads % kLanes == 0 && kC % kRowsPerPass == 0, "whole rows per pass");
  const int p = dv + 1;
  const int cols = kDenInPlanes ? p : dv;  // columns the planes take
  const int pairs = (p + 1) / 2;           // pairs read (column dv for gcol too)
  const int sub = threadIdx.x % kLanes, t0 = threadIdx.x / kLanes;
#pragma unroll
  for (int i0 = 0; i0 < kItems; i0 += kPairBatch) {
    float x[kPairBatch][2];
#pragma unroll
    for (int u = 0; u < kPairBatch; ++u) {
      const int item = i0 + u;
      const int t = t0 + (item / kSlots) * kRowsPerPass, c = 2 * (sub + (item % kSlots) * kLanes);
      const bool live = item < kItems && t < nt && c < 2 * pairs;
      const float* row = src + (live ? rows[t] : 0) * p;
#pragma unroll
      for (int e = 0; e < 2; ++e) x[u][e] = live && c + e < p ? __ldg(&row[c + e]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kPairBatch; ++u) {
      const int item = i0 + u;
      const int t = t0 + (item / kSlots) * kRowsPerPass, c = 2 * (sub + (item % kSlots) * kLanes);
      if (item >= kItems || c >= 2 * pairs) continue;
      float y[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        y[e] = kWeighted && t < nt ? w[t] * x[u][e] : x[u][e];
        if (kGcol && c + e == dv) gcol[t] = y[e];
        if (c + e >= cols) y[e] = 0.f;
      }
      if (c >= cols) continue;
      mma_tiles::StoreSplitPair<kParts>(dst + t * kLd + c, kPlane, y[0], y[1]);
    }
  }
}

}  // namespace outer_tile
}  // namespace smat
