// The pieces that the TypeReads kernels with M held in registers share
// (smat_reads_held_bf16.cu: a block per (group, segment, head);
// smat_reads_few_bf16.cu: resident blocks for groups of few tokens). Both
// multiply out^T = M^T a^T: M's columns are the rows (m) of the products,
// the tokens their columns (n); warp w holds the A fragments of M's columns
// 16 mt .. 16 mt + 15 over all 64 rows (kMP bf16 planes) and, per tile,
// loads the B fragments of its tokens from a bf16 plane [tokens][kLdT].
// Column 64 (the denominator column, one of 65) is two 32-term fp32 FMA
// chains per token, added in a fixed order. The outputs wait in shared
// memory ([tokens][kLdY] fp32) and leave a row at a time (StoreStagedRows).
//
// Exactness: bf16 a enters the MMAs exactly; M's correction terms are summed
// smallest first in an accumulator of their own (mma_tiles::Mma3x1); w_i
// times the sum is rounded on its own. Each output is summed in a fixed order
// by one thread: the same inputs give the same bits.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_reads_bf16.cuh"

namespace smat {
namespace reads_held {

using reads_bf16::kLdT;
using reads_bf16::kW;

constexpr int kP = kW + 1;  // M's columns: dv = 64 and the denominator's
constexpr int kLdY = 68;    // fp32 pitch of a staged output row: the fragments' stores
                            // (tokens 2 tq, 2 tq + 1 of 8 columns) hit distinct banks
static_assert(kLdY % 32 == 4 && kLdY >= kP, "conflict-free, a whole row");
constexpr int kKSteps = kW / 16;  // k steps over r
constexpr int kNGroup = 4;        // n8 tiles multiplied between two stores

// This warp's 16 columns (16 mt ..) for the kNGroup n8 tiles of tokens n0 ..
// n0 + 31 of its plane (b_addr: this lane's B address there), staged as
// ys[t][m] = w[t] (hi + lo) with t = t0 + n0 + .. (t0: the plane's first
// token in ys and w); g = lane / 4 and tq = lane % 4 as the MMAs lay out
// their fragments.
template <int kMP>
__device__ __forceinline__ void StageProducts(const uint32_t (&af)[kKSteps][kMP][4],
                                              uint32_t b_addr, int n0, int t0, int mt, int g,
                                              int tq, const float* w, float* ys) {
  float hi[kNGroup][4], lo[kNGroup][4];
  cuda_detail::ZeroAcc(hi);
  cuda_detail::ZeroAcc(lo);
#pragma unroll
  for (int j = 0; j < kNGroup; ++j) {
    uint32_t b[2][4];
    mma_tiles::Ldsm4(b[0], b_addr + 2u * ((n0 + 8 * j) * kLdT));
    mma_tiles::Ldsm4(b[1], b_addr + 2u * ((n0 + 8 * j) * kLdT + 32));
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      const uint32_t b0 = b[ks >> 1][2 * (ks & 1)], b1 = b[ks >> 1][2 * (ks & 1) + 1];
      if constexpr (kMP == 3) {
        mma_tiles::Mma3x1(hi[j], lo[j], af[ks], b0, b1);
      } else {
        mma_tiles::Mma(hi[j], af[ks][0], b0, b1);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kNGroup; ++j) {
    const int t = t0 + n0 + 8 * j + 2 * tq;
    const float w0 = w[t], w1 = w[t + 1];
    const int m = 16 * mt + g;
    ys[t * kLdY + m] = __fmul_rn(w0, hi[j][0] + lo[j][0]);
    ys[(t + 1) * kLdY + m] = __fmul_rn(w1, hi[j][1] + lo[j][1]);
    ys[t * kLdY + m + 8] = __fmul_rn(w0, hi[j][2] + lo[j][2]);
    ys[(t + 1) * kLdY + m + 8] = __fmul_rn(w1, hi[j][3] + lo[j][3]);
  }
}

// Column 64 of token t < nt (its bf16 row in T): this thread (dh = its lane's
// parity; the pair are adjacent lanes) sums half dh of the 64 terms
// a_t[k] mcol[k]; the first half's sum plus the second's, times w[t], goes to
// ys[t][64].
__device__ __forceinline__ void StageDenColumn(const __nv_bfloat16* T, const float* mcol,
                                               const float* w, int t, int nt, float* ys) {
  const int dh = threadIdx.x & 1;
  float s = 0.f;
  if (t < nt) {
    const uint4* x = reinterpret_cast<const uint4*>(T + t * kLdT + 32 * dh);
    const float4* mc = reinterpret_cast<const float4*>(mcol + 32 * dh);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint4 y = x[u];
      const uint32_t wds[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const float4 c = mc[2 * u + e / 2];
        const float2 f0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wds[e]));
        const float2 f1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wds[e + 1]));
        s = fmaf(f0.x, c.x, s);
        s = fmaf(f0.y, c.y, s);
        s = fmaf(f1.x, c.z, s);
        s = fmaf(f1.y, c.w, s);
      }
    }
  }
  const float other = __shfl_xor_sync(0xffffffffu, s, 1);
  if (dh == 0 && t < nt) ys[t * kLdY + kW] = __fmul_rn(w[t], s + other);
}

// The staged rows t < nt out: out[rows[t]] (=|+=) ys[t], a row at a time,
// warp w of kWarps rows w, w + kWarps, ..: columns lane, 32 + lane and
// (lane 0) 64; the old values (+=) of four rows loaded before their adds.
template <int kWarps>
__device__ __forceinline__ void StoreStagedRows(const int64_t* rows, const float* ys, int nt,
                                                bool assign, float* __restrict__ out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (assign) {
#pragma unroll 4
    for (int m = warp; m < nt; m += kWarps) {
      float* o = out + rows[m] * kP;
      const float* y = ys + m * kLdY;
      // 0 + y: the bits of old + y with old = 0 (a -0 leaves as +0).
      o[lane] = 0.f + y[lane];
      o[32 + lane] = 0.f + y[32 + lane];
      if (lane == 0) o[kW] = 0.f + y[kW];
    }
    return;
  }
  for (int m0 = warp; m0 < nt; m0 += 4 * kWarps) {
    float old[4][3];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int m = m0 + kWarps * u;
      if (m < nt) {
        const float* o = out + rows[m] * kP;
        old[u][0] = o[lane];
        old[u][1] = o[32 + lane];
        old[u][2] = lane == 0 ? o[kW] : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int m = m0 + kWarps * u;
      if (m < nt) {
        float* o = out + rows[m] * kP;
        const float* y = ys + m * kLdY;
        o[lane] = old[u][0] + y[lane];
        o[32 + lane] = old[u][1] + y[32 + lane];
        if (lane == 0) o[kW] = old[u][2] + y[kW];
      }
    }
  }
}

}  // namespace reads_held
}  // namespace smat
