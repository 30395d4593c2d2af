// Pieces shared by the per-token read kernels on tensor cores
// (smat_reads_bf16.cu: TypeReads, ProfilePoolingBackward and the kMatVec
// reads; smat_reads_bwd_bf16.cu: TypeReadsBackward in one pass).
//
// The per-token reads of a group's r x p matrix M (F7, B2, B4;
// LaunchSmatGroupedReads's contract, smat_cuda_kernels.h) on tensor cores,
// with the tokens as the rows of the product:
//   kVecMat: out_p[i] (=|+=) w_i (a_i^T M)               a = phi (bf16)
//   kMatVec: out_r[i] += w_i (M g_i)                      g = gbar (fp32)
//   kBoth:   out_r[i] += w_i (M vbar_i), out_v[i] += w_i (M^T a_i)[0:dv]
//                                                          a = psi, v (bf16)
// M (fp32) is split once per block into three bf16 planes M = M1 + M2 + M3
// (24 significant bits), staged [r][p] with a 176-byte row pitch, and serves
// both orientations: ldmatrix.trans gives the B fragments of a_i^T M (k = the
// row), plain ldmatrix those of M g_i (k = the column). bf16 token rows stay
// bf16 from global to shared memory (cp.async, 16 bytes at a time) and enter
// as one exact part: 3 MMAs per n8 tile and 16-token k step; gbar is split
// into three parts as it is staged: the 6 products of mma_tiles::Mma3x3.
// Column dv of g and of vbar (gbar's den column; vbar's ones) never enters a
// product: its term g_i[dv] M[:, dv] is one fp32 multiply-add per output.
//
// The general kernel of smat_grouped_mma.cu stages tokens and M as fp32 and
// splits them at every fragment load (two 4-byte shared loads per MMA); the
// FFMA kernel of smat_grouped_fast.cu does 4 x 8 outputs per thread. Here a
// 16-token step of a warp is one ldmatrix per token part and one per plane
// and n8 pair.
//
// Exactness: the scheme of smat_chunk_mma.cu (the correction terms in an
// accumulator of their own, smallest first, added to the leading one at the
// end); w_i times the sum is rounded on its own, as in the other read kernels.
// Each output is summed in a fixed order by one thread, no atomics: the same
// inputs give the same bits. Tests: tests/gpu/smat_gpu_test.cc (every read
// phase against the CPU within 1e-5).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_fast_tiles.cuh"
#include "kernels/cuda/smat_mma.cuh"
#include "kernels/cuda/smat_outer_tile.cuh"

namespace smat {
namespace reads_bf16 {

using cuda_detail::TokenRow;
using fast_tiles::Aligned16;
using mma_tiles::CpAsyncWaitAll;
using mma_tiles::Ldsm4;
using mma_tiles::Ldsm4T;
using mma_tiles::SmemAddr;

constexpr int kThreads = 256;
constexpr int kC = 128;  // tokens staged at a time
constexpr int kW = 64;   // widest r or dv
static_assert(kW == mma_tiles::kTileWidth, "kFull means the widest tile");
constexpr int kLdT = outer_tile::kLd;          // bf16 pitch of a token plane (144 bytes)
constexpr int kTokPlane = outer_tile::kPlane;  // bf16 elements of a token plane
static_assert(kC == outer_tile::kC, "token planes are staged as the outer sums stage them");
constexpr int kLdM = 88;            // bf16 pitch of an M plane (176 bytes; p <= 80)
constexpr int kMPlane = kW * kLdM;  // bf16 elements of an M plane

// gbar's loads in flight per thread as it is split: all of a tile's (kMatVec;
// a third beside U_bar's accumulators in smat_reads_bwd_bf16.cu).
constexpr int kSplitLoads = (kC * (kW + 1) + kThreads - 1) / kThreads;

// Byte offsets shared by both layouts: M's planes, then M[:, dv] (fp32
// [kW]), then the token planes.
constexpr int kOffMcol = 3 * kMPlane * 2;
constexpr int kOffTok = kOffMcol + kW * 4;
static_assert(kOffTok % 16 == 0, "the token planes must be 16-byte aligned");

// The three bf16 planes of M's columns < cols (r x p, row-major) as
// [64][kLdM], zero elsewhere, and mcol = M[:, dv] (zero for rows >= r).
// Columns 80.. are never read.
// Loads go in two rounds of five pairs per thread, each round's loads issued
// before its first split.
template <int kMP = 3>
__device__ __forceinline__ void StageMatrix(const float* __restrict__ M, int r, int p, int dv,
                                            int cols, __nv_bfloat16* planes, float* mcol) {
  constexpr int kPairs = 40;  // column pairs staged per row
  constexpr int kPer = 5;
  static_assert(kW * kPairs == 2 * kPer * kThreads && 2 * kPairs <= kLdM, "two whole rounds");
  if (threadIdx.x < kW) mcol[threadIdx.x] = threadIdx.x < r ? __ldg(&M[threadIdx.x * p + dv]) : 0.f;
#pragma unroll 1
  for (int round = 0; round < 2; ++round) {
    float x[kPer][2];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int e = threadIdx.x + (round * kPer + u) * kThreads, row = e / kPairs;
      const int c = 2 * (e - row * kPairs), rc = min(row, r - 1);
      const float y0 = __ldg(&M[rc * p + min(c, p - 1)]);
      const float y1 = __ldg(&M[rc * p + min(c + 1, p - 1)]);
      x[u][0] = row < r && c < cols ? y0 : 0.f;
      x[u][1] = row < r && c + 1 < cols ? y1 : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int e = threadIdx.x + (round * kPer + u) * kThreads, row = e / kPairs;
      const int c = 2 * (e - row * kPairs);
      if constexpr (kMP == 3) {
        uint32_t p1, p2, p3;
        mma_tiles::Split3(x[u][0], x[u][1], p1, p2, p3);
        uint32_t* to = reinterpret_cast<uint32_t*>(planes + row * kLdM + c);
        to[0] = p1;
        to[kMPlane / 2] = p2;
        to[kMPlane] = p3;
      } else {
        mma_tiles::StoreSplitPair<kMP>(planes + row * kLdM + c, kMPlane, x[u][0], x[u][1]);
      }
    }
  }
}

// Token rows staged as in smat_outer_tile.cuh.
__device__ __forceinline__ void StageRowsAsync(const __nv_bfloat16* __restrict__ src,
                                               const int64_t* rows, int width, int nt,
                                               __nv_bfloat16* dst) {
  outer_tile::StageRowsAsync<kThreads>(src, rows, width, nt, dst);
}

// gbar rows (fp32, width p = dv + 1): columns < dv in three bf16 planes,
// column dv to gcol; zeros for nt <= t < kC. kWeighted: w[t] gbar_t (each
// product rounded to fp32) instead, column dv in the planes too. kBatch
// loads in flight per thread.
template <bool kWeighted, int kBatch, int kParts = 3>
__device__ __forceinline__ void StageSplitRows(const float* __restrict__ src, const int64_t* rows,
                                               const float* w, int dv, int nt, __nv_bfloat16* dst,
                                               float* gcol) {
  outer_tile::StageSplitRows<kWeighted, kWeighted, true, kBatch, kThreads, kParts>(src, rows, w, dv,
                                                                                   nt, dst, gcol);
}

// The token rows and weights of the tile at list position j0 (nt tokens),
// between the block barriers around them.
__device__ __forceinline__ void StageTokens(const cuda_detail::GroupBlock& blk,
                                            const SmatCudaDims& d, const SmatTokenWeights& tw,
                                            int64_t j0, int nt, int64_t* rows, float* w) {
  const int tid = threadIdx.x;
  __syncthreads();  // the previous tile is consumed; the padding is written
  if (tid < nt) {
    const int64_t i = blk.cur.Token(j0 + tid);
    rows[tid] = TokenRow(d, blk.b, i, blk.h);
    w[tid] = cuda_detail::TokenWeight(d, tw, blk.b, blk.h, i);
  }
  __syncthreads();
}

// hi/lo[j] (j < kN) = the warp's 16 tokens (kAParts planes from a_addr, this
// lane's ldmatrix address in the first) times M's n8 tiles j0 + j < n_tiles,
// over `ksteps` 16-wide k steps; kTrans: k is M's row (a^T M), else its
// column (M g).
template <int kAParts, int kN, bool kTrans, int kMP = 3>
__device__ __forceinline__ void Product(uint32_t a_addr, uint32_t b_addr, int ksteps, int j0,
                                        int n_tiles, float (&hi)[kN][4], float (&lo)[kN][4]) {
  cuda_detail::ZeroAcc(hi);
  cuda_detail::ZeroAcc(lo);
  for (int ks = 0; ks < ksteps; ++ks) {
    uint32_t a[kAParts][4];
#pragma unroll
    for (int q = 0; q < kAParts; ++q) Ldsm4(a[q], a_addr + 2u * (q * kTokPlane + 16 * ks));
#pragma unroll
    for (int pp = 0; pp < (kN + 1) / 2; ++pp) {
      const int j = j0 + 2 * pp;  // the pair's first n8 tile
      if (j >= n_tiles) break;
      uint32_t b[kMP][4];
      const int off = kTrans ? 16 * ks * kLdM + 8 * j : 8 * j * kLdM + 16 * ks;
#pragma unroll
      for (int q = 0; q < kMP; ++q) {
        if (kTrans) {
          Ldsm4T(b[q], b_addr + 2u * (q * kMPlane + off));
        } else {
          Ldsm4(b[q], b_addr + 2u * (q * kMPlane + off));
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int jj = 2 * pp + half;
        if (jj >= kN || j0 + jj >= n_tiles) break;
        if constexpr (kMP == 1) {
          static_assert(kAParts == 1, "one plane of M goes with one part of the tokens");
          mma_tiles::Mma(hi[jj], a[0], b[0][2 * half], b[0][2 * half + 1]);
          continue;
        } else {
          const uint32_t bb[3][2] = {{b[0][2 * half], b[0][2 * half + 1]},
                                     {b[1][2 * half], b[1][2 * half + 1]},
                                     {b[2][2 * half], b[2][2 * half + 1]}};
          if constexpr (kAParts == 1) {
            mma_tiles::Mma1x3(hi[jj], lo[jj], a[0], bb);
          } else {
            mma_tiles::Mma3x3(hi[jj], lo[jj], a, bb);
          }
        }
      }
    }
  }
}

// How column dv of the token side enters: not at all (a^T M), as vbar's ones
// (M vbar), as gbar[:, dv] (M g), or as gbar[:, dv] beside a product that w
// scales alone (M d_o_t for gbar's columns < dv as w[t] d_o_t:
// smat_reads_bwd_bf16.cu).
enum class Den { kNone, kOnes, kG, kGScaled };

// out[rows[t]][n] (=|+=) w[t] ((hi + lo) + den_t M[n][dv]) (w null: 1; kGScaled:
// w[t] (hi + lo) + den_t M[n][dv]) for the warp's
// tokens t < nt and the columns n < width of n8 tiles j0 + j; the old values
// of both of a lane's rows are loaded before any is stored (one memory
// latency per call, not one per row); (n, n + 1) as one float2 where width is
// even and out 8-byte aligned.
template <int kN, Den kDen>
__device__ __forceinline__ void StoreRows(const float (&hi)[kN][4], const float (&lo)[kN][4],
                                          int t0, int j0, int nt, const int64_t* rows,
                                          const float* w, const float* gcol, const float* mcol,
                                          int width, bool assign, float* __restrict__ out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const bool pairs = width % 2 == 0 && (reinterpret_cast<uintptr_t>(out) & 7) == 0;
  float* o[2];
  float old[2][kN][2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int t = t0 + g + 8 * hr;
    o[hr] = out + rows[t < nt ? t : t0] * width;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const int n = 8 * (j0 + j) + 2 * tq;
      old[hr][j][0] = old[hr][j][1] = 0.f;
      if (assign || t >= nt) continue;
      if (pairs && n < width) {
        const float2 x = *reinterpret_cast<const float2*>(o[hr] + n);
        old[hr][j][0] = x.x;
        old[hr][j][1] = x.y;
      } else if (!pairs) {
#pragma unroll
        for (int e = 0; e < 2; ++e) old[hr][j][e] = n + e < width ? o[hr][n + e] : 0.f;
      }
    }
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int t = t0 + g + 8 * hr;
    if (t >= nt) continue;
    const float wt = w != nullptr ? w[t] : 1.f;
    const float den = kDen == Den::kG || kDen == Den::kGScaled ? gcol[t] : 1.f;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      float y[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = 8 * (j0 + j) + 2 * tq + e;
        float sum = hi[j][2 * hr + e] + lo[j][2 * hr + e];
        if constexpr (kDen == Den::kGScaled) {
          y[e] = old[hr][j][e] + fmaf(den, mcol[n < kW ? n : 0], __fmul_rn(wt, sum));
        } else {
          if (kDen != Den::kNone) sum = fmaf(den, mcol[n < kW ? n : 0], sum);
          y[e] = old[hr][j][e] + __fmul_rn(wt, sum);
        }
      }
      const int n = 8 * (j0 + j) + 2 * tq;
      if (pairs) {
        if (n < width) *reinterpret_cast<float2*>(o[hr] + n) = make_float2(y[0], y[1]);
      } else {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (n + e < width) o[hr][n + e] = y[e];
        }
      }
    }
  }
}

}  // namespace reads_bf16
}  // namespace smat
