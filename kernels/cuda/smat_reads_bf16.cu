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
// Shape: one block of 8 warps per (segment, group, b * H) (GroupGrid), the
// segment's tokens 128 at a time; warp w owns tokens 16 w .. 16 w + 15 of a
// tile and all their output columns, so a warp's results need no exchange.
// Shared memory: the M planes (3 x [64][88] bf16, 33 KB), M[:, dv] (fp32),
// the token planes ([128][72] bf16: one for phi, two for psi and v, three for
// gbar), the token rows, weights and gbar[:, dv]: 54 / 73 / 92 KB for kVecMat /
// kBoth / kMatVec, four / three / two blocks per SM; kVecMat with its rows
// staged (kStaged, see Launch) 74 KB, three blocks per SM.
//
// Speed (H200, bf16, batch 1, 8 heads, r = dv = 64, c = 128, T = 524288,
// d = 2, 2026-12-01), against the FFMA kernel: ProfilePoolingBackward (kBoth)
// 1.52 -> 0.95 ms, TypeReads (=) (kVecMat) 0.75 -> 0.71 ms. kMatVec is slower
// than FFMA (TypeReadsBackward 1.68 against 1.60 ms, gated 2.18 against 2.03:
// 6 MMAs per tile at two blocks per SM; 1.78 ms with 8 of gbar's loads in
// flight per thread instead of all), so SmatUseReadsBf16 leaves it to
// SMAT_CUDA_GROUPED=mma. kVecMat was bound by neither pipe (Nsight Compute:
// 46% of the SM, 29% of DRAM) while its p-wide output rows (65 floats) left
// as single floats, 8 rows per store; where the blocks hold a whole tile of
// tokens they now leave through shared memory, a row's columns per store
// (StoreRowsStaged): 0.76 -> 0.64 ms at d = 2. With r = dv = 64 the kernels
// run with the widths as constants (kFull; Nsight Compute had counted
// integer instructions and branches at about 40% of these kernels'):
// TypeReads (=) 0.78 -> 0.73 ms (the same run; 0.71 in an earlier one),
// ProfilePoolingBackward unchanged.
//
// TypeReadsBackwardKernel (further down) fuses kMatVec with the outer sums
// of U_bar over the same tokens, gbar staged once for both.
//
// SMAT_CUDA_BF16_PARTS=1 (SmatBf16SplitParts, the option the fused chunk
// tiles take too): M in one bf16 plane (kMP = 1) for kVecMat and kBoth, and
// in TypeReadsBackwardKernel M and w gbar in one plane each, so that every
// product is one MMA with fp32 accumulation; kMatVec keeps three.
//
// Exactness: the scheme of smat_chunk_mma.cu (the correction terms in an
// accumulator of their own, smallest first, added to the leading one at the
// end); w_i times the sum is rounded on its own, as in the other read kernels.
// Each output is summed in a fixed order by one thread, no atomics: the same
// inputs give the same bits. Tests: tests/gpu/smat_gpu_test.cc (every read
// phase against the CPU within 1e-5).
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_fast_tiles.cuh"
#include "kernels/cuda/smat_grouped_mma.h"
#include "kernels/cuda/smat_mma.cuh"
#include "kernels/cuda/smat_outer_tile.cuh"

namespace smat {
namespace {

using cuda_detail::TokenRow;
using fast_tiles::Aligned16;
using mma_tiles::CpAsync16;
using mma_tiles::CpAsyncWaitAll;
using mma_tiles::Ldsm4;
using mma_tiles::Ldsm4T;
using mma_tiles::SmemAddr;

constexpr int kThreads = 256;
constexpr int kC = 128;                        // tokens staged at a time
constexpr int kW = 64;                         // widest r or dv
static_assert(kW == mma_tiles::kTileWidth, "kFull means the widest tile");
constexpr int kLdT = outer_tile::kLd;          // bf16 pitch of a token plane (144 bytes)
constexpr int kTokPlane = outer_tile::kPlane;  // bf16 elements of a token plane
static_assert(kC == outer_tile::kC, "token planes are staged as the outer sums stage them");
constexpr int kLdM = 88;            // bf16 pitch of an M plane (176 bytes; p <= 80)
constexpr int kMPlane = kW * kLdM;  // bf16 elements of an M plane

// gbar's loads in flight per thread as it is split: all of a tile's (kMatVec)
// or, beside U_bar's accumulators, a third (TypeReadsBackwardKernel).
constexpr int kSplitLoads = (kC * (kW + 1) + kThreads - 1) / kThreads;
constexpr int kFusedSplitLoads = (kSplitLoads + 2) / 3;

// Token planes per kind: phi; v then psi; gbar in three parts.
constexpr int TokenPlanes(SmatReadKind kind) {
  return kind == SmatReadKind::kVecMat ? 1 : kind == SmatReadKind::kBoth ? 2 : 3;
}

// kVecMat's outputs of a pass (kVecMatTiles n8 tiles of a warp's 16 tokens)
// wait in shared memory, [16][kLdY] fp32 per warp, so that they leave as runs
// of consecutive floats (see StoreRowsStaged). kLdY = 8 (mod 32): the float2
// stores of a half-warp's fragments hit distinct banks.
constexpr int kVecMatTiles = 3;
constexpr int kLdY = 40;
static_assert(kLdY >= 8 * kVecMatTiles && kLdY % 32 == 8, "a pass's columns, conflict-free");

// Byte offsets: M planes, M[:, dv] (fp32 [kW]), token planes, rows (int64
// [kC]), weights and gbar[:, dv] (fp32 [kC] each), then kVecMat's outputs.
constexpr int kOffMcol = 3 * kMPlane * 2;
constexpr int kOffTok = kOffMcol + kW * 4;
constexpr int OffRows(SmatReadKind kind) { return kOffTok + TokenPlanes(kind) * kTokPlane * 2; }
constexpr int OffOutputs(SmatReadKind kind) { return OffRows(kind) + kC * 8 + 2 * kC * 4; }
constexpr int SmemBytes(SmatReadKind kind, bool staged = false) {
  return OffOutputs(kind) + (staged ? kC * kLdY * 4 : 0);
}
static_assert(kOffTok % 16 == 0 && OffRows(SmatReadKind::kBoth) % 16 == 0,
              "planes and rows must be 16-byte aligned");

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

// Asks L2 for the rows out[rows[t]] (t < nt, `width` floats each) that a
// tile adds to once its products are done, so that reading them back waits
// on L2 rather than on memory. A thread per row, a prefetch per 128 bytes.
// kVecMat's += (the TypeReads of the sequence-parallel forward) uses it:
// H200, bf16, T = 524288, 8 heads, 2026-12-01, TypeReads (+=) 0.735 ->
// 0.682 ms at d = 2, 0.80 -> 0.72 gated, 1.01 -> 0.93 at d = 3. Before the
// adds of TypeReadsBackward (phi_bar) and ProfilePoolingBackward (psi_bar,
// v_bar) it cost time at d <= 2 (1.26 -> 1.36 ms, 0.94 -> 0.97 ms).
__device__ __forceinline__ void PrefetchRows(const float* out, const int64_t* rows, int width,
                                             int nt) {
  static_assert(kThreads >= kC, "a thread per row");
  if (threadIdx.x >= nt) return;
  const float* row = out + rows[threadIdx.x] * width;
  for (int n = 0; n < width; n += 32) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + n));
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
// (M vbar) or as gbar[:, dv] (M g).
enum class Den { kNone, kOnes, kG };

// out[rows[t]][n] (=|+=) w[t] ((hi + lo) + den_t M[n][dv]) (w null: 1) for the warp's
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
    const float den = kDen == Den::kG ? gcol[t] : 1.f;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      float y[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = 8 * (j0 + j) + 2 * tq + e;
        float sum = hi[j][2 * hr + e] + lo[j][2 * hr + e];
        if (kDen != Den::kNone) sum = fmaf(den, mcol[n < kW ? n : 0], sum);
        y[e] = old[hr][j][e] + __fmul_rn(wt, sum);
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

// kVecMat's rows (p = dv + 1 floats: odd for the usual even dv, so the pairs
// of StoreRows do not apply and its single floats, 8 rows x 4 columns two
// apart per store, reached L2 as partial sectors, 63% of them excess by
// Nsight Compute): out[rows[t]][8 j0 + n] (=|+=) w[t] (hi + lo) for the
// warp's tokens t < nt and n < min(8 kN, width - 8 j0), through this warp's
// [16][kLdY] of shared memory (ys): the fragments go in as float2, then each
// row's columns leave as one store of consecutive floats (and the old values
// come in as one load, all a lane's before the first add).
template <int kN>
__device__ __forceinline__ void StoreRowsStaged(const float (&hi)[kN][4], const float (&lo)[kN][4],
                                                int t0, int j0, int nt, const int64_t* rows,
                                                const float* w, int width, bool assign, float* ys,
                                                float* __restrict__ out) {
  static_assert(8 * kN <= kLdY, "a pass fits its rows");
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int m = g + 8 * hr;
    const float wt = t0 + m < nt ? w[t0 + m] : 0.f;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      *reinterpret_cast<float2*>(&ys[m * kLdY + 8 * j + 2 * tq]) =
          make_float2(__fmul_rn(wt, hi[j][2 * hr] + lo[j][2 * hr]),
                      __fmul_rn(wt, hi[j][2 * hr + 1] + lo[j][2 * hr + 1]));
    }
  }
  __syncwarp();
  const int n = 8 * j0 + lane;
  const bool mine = lane < 8 * kN && n < width;
  const int rows_here = min(16, nt - t0);
  if (assign) {
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      // 0 + y: the bits of old + y with old = 0 (a -0 leaves as +0).
      if (mine && m < rows_here) out[rows[t0 + m] * width + n] = 0.f + ys[m * kLdY + lane];
    }
  } else {
    float old[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      old[m] = mine && m < rows_here ? out[rows[t0 + m] * width + n] : 0.f;
    }
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      if (mine && m < rows_here) out[rows[t0 + m] * width + n] = old[m] + ys[m * kLdY + lane];
    }
  }
  __syncwarp();  // the next pass writes ys again
}

// GroupGrid (batch * H, segments, G), kThreads threads, SmemBytes(kRead,
// kStaged). kFull: r = dv = kW as constants (mma_tiles::TileWidths).
// kStaged (kVecMat): the rows leave through shared memory (StoreRowsStaged),
// three blocks per SM instead of four (see Launch for when).
template <SmatReadKind kRead, bool kFull, bool kStaged, int kMP>
__global__ void __launch_bounds__(kThreads, kRead == SmatReadKind::kVecMat ? (kStaged ? 3 : 4)
                                            : kRead == SmatReadKind::kBoth ? 3
                                                                           : 2)
    ReadsBf16Kernel(SmatCudaDims d, SmatTokenGroups groups, int segments,
                    const float* __restrict__ M, SmatMatrixLayout lay,
                    const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ v,
                    const float* __restrict__ gsrc, SmatTokenWeights tw, float* __restrict__ out_p,
                    float* __restrict__ out_r, float* __restrict__ out_v, bool assign_p) {
  extern __shared__ uint4 smem_u4[];
  char* smem = reinterpret_cast<char*>(smem_u4);
  __nv_bfloat16* Ms = reinterpret_cast<__nv_bfloat16*>(smem);
  float* mcol = reinterpret_cast<float*>(smem + kOffMcol);
  __nv_bfloat16* Ts = reinterpret_cast<__nv_bfloat16*>(smem + kOffTok);
  int64_t* rows = reinterpret_cast<int64_t*>(smem + OffRows(kRead));
  float* w = reinterpret_cast<float*>(rows + kC);
  float* gcol = w + kC;
  const cuda_detail::GroupBlock blk(groups, d, segments);
  if (blk.lo >= blk.hi) return;  // uniform over the block
  const mma_tiles::TileWidths<kFull> wd{d.r, d.dv};
  const int r = wd.r(), dv = wd.dv(), p = wd.p();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kPlanes = TokenPlanes(kRead);

  // Token columns no staging writes are zero: kVecMat's and psi's r.., v's and
  // gbar's dv.. (M's column dv must meet zeros there).
  const __nv_bfloat16 zero = __float2bfloat16_rn(0.f);
#pragma unroll
  for (int q = 0; q < kPlanes; ++q) {
    const int width =
        kRead == SmatReadKind::kVecMat || (kRead == SmatReadKind::kBoth && q == 1) ? r : dv;
    mma_tiles::FillPadColumns<kC, kLdT, kThreads>(Ts + q * kTokPlane, 1, width, zero);
  }

  // This lane's ldmatrix addresses: the token planes as A (rows = tokens), M
  // as B by rows n (plain) or rows k (.trans).
  const uint32_t a_addr = SmemAddr(Ts) + 2u * ((16 * warp + (lane & 15)) * kLdT + (lane >> 4) * 8);
  const uint32_t b_plain =
      SmemAddr(Ms) + 2u * (((lane & 7) + (lane >> 4) * 8) * kLdM + ((lane >> 3) & 1) * 8);
  const uint32_t b_trans =
      SmemAddr(Ms) + 2u * (((lane & 7) + ((lane >> 3) & 1) * 8) * kLdM + (lane >> 4) * 8);
  const int kr = (r + 15) >> 4, kv = (dv + 15) >> 4;  // k steps over r and over dv

  for (int64_t j0 = blk.lo; j0 < blk.hi; j0 += kC) {
    const int nt = static_cast<int>(cuda_detail::Min64(kC, blk.hi - j0));
    StageTokens(blk, d, tw, j0, nt, rows, w);
    if constexpr (kRead == SmatReadKind::kVecMat) {
      if (!assign_p) PrefetchRows(out_p, rows, p, nt);
      StageRowsAsync(a, rows, r, nt, Ts);
    } else if constexpr (kRead == SmatReadKind::kBoth) {
      StageRowsAsync(v, rows, dv, nt, Ts);
      StageRowsAsync(a, rows, r, nt, Ts + kTokPlane);
    } else {
      // Every load of a thread in flight at once (one memory latency per
      // tile, not five): the product's accumulators are not live here.
      StageSplitRows<false, kSplitLoads>(gsrc, rows, w, dv, nt, Ts, gcol);
    }
    // M once per block, while the first tile's rows are on their way.
    if (j0 == blk.lo) StageMatrix<kMP>(blk.Matrix(M, lay, r, p), r, p, dv, p, Ms, mcol);
    CpAsyncWaitAll();
    __syncthreads();
    if (16 * warp >= nt) continue;

    if constexpr (kRead == SmatReadKind::kVecMat) {
      const int n_tiles = (p + 7) >> 3;
      for (int j0n = 0; j0n < n_tiles; j0n += kVecMatTiles) {  // 64 registers unstaged
        float hi[kVecMatTiles][4], lo[kVecMatTiles][4];
        Product<1, kVecMatTiles, true, kMP>(a_addr, b_trans, kr, j0n, n_tiles, hi, lo);
        if constexpr (kStaged) {
          float* ys = reinterpret_cast<float*>(smem + OffOutputs(kRead)) + 16 * warp * kLdY;
          StoreRowsStaged(hi, lo, 16 * warp, j0n, nt, rows, w, p, assign_p, ys, out_p);
        } else {
          StoreRows<kVecMatTiles, Den::kNone>(hi, lo, 16 * warp, j0n, nt, rows, w, gcol, mcol, p,
                                              assign_p, out_p);
        }
      }
    } else if constexpr (kRead == SmatReadKind::kMatVec) {
      static_assert(kMP == 3, "gbar's three parts go with M's three planes");
      float hi[8][4], lo[8][4];
      Product<3, 8, false>(a_addr, b_plain, kv, 0, (r + 7) >> 3, hi, lo);
      StoreRows<8, Den::kG>(hi, lo, 16 * warp, 0, nt, rows, w, gcol, mcol, r, false, out_r);
    } else {
      // Passes of 4 n8 tiles (80 registers at three blocks per SM).
      for (int j0n = 0; 8 * j0n < r; j0n += 4) {
        float hi[4][4], lo[4][4];
        Product<1, 4, false, kMP>(a_addr, b_plain, kv, j0n, (r + 7) >> 3, hi, lo);
        StoreRows<4, Den::kOnes>(hi, lo, 16 * warp, j0n, nt, rows, w, gcol, mcol, r, false, out_r);
      }
      for (int j0n = 0; 8 * j0n < dv; j0n += 4) {
        float hi[4][4], lo[4][4];
        Product<1, 4, true, kMP>(a_addr + 2u * kTokPlane, b_trans, kr, j0n, (dv + 7) >> 3, hi, lo);
        StoreRows<4, Den::kNone>(hi, lo, 16 * warp, j0n, nt, rows, w, gcol, mcol, dv, false, out_v);
      }
    }
  }
}

// ---- TypeReadsBackward in one pass ----------------------------------------------
// Over the recent tokens t of a type's segment, with wg_t = w_t gbar_t (fp32
// products, split into three bf16 planes once):
//   U_bar[type, segment] = sum_t phi_t wg_t^T      (the tile of smat_outer_tile.cuh)
//   phi_bar_t += U[type] wg_t                       (as kMatVec above)
// Both read the same staged rows, so gbar is loaded and split once, not twice.
// U's planes keep its columns < dv only: wg's column dv (in the planes, for
// U_bar) meets zeros there and enters phi_bar as wg_t[dv] U[:, dv] in fp32.
// Shared memory: U's planes, U[:, dv], phi and the three planes of wg, the
// rows, weights and wg[:, dv]: 107 KB, two blocks per SM. Ungated (w = 1) the
// U_bar tile sums the bf16 outer sums' planes in their order: the same bits
// as LaunchSmatOuterSumBf16. Gated, the weight goes to gbar, so U_bar's
// product stays 3 MMAs (the general kernel weights phi: 6). H200, bf16,
// T = 524288, d = 2, 8 heads: TypeReadsBackward 1.41 ms ungated, 1.45 ms
// gated with the widths as constants (kFull; 1.61 and 1.68 ms without; 1.60
// and 2.03 ms in two passes).
// kP = 1 (SMAT_CUDA_BF16_PARTS=1): U and wg in one bf16 plane each (each
// product one MMA: flash-linear-attention's numerics, as the fused chunk
// tiles take them), 48 KB, three blocks per SM.
template <int kP>
constexpr int kFusedOffMcol = kP* kMPlane * 2;
template <int kP>
constexpr int kFusedOffTok = kFusedOffMcol<kP> + kW * 4;
template <int kP>
constexpr int kFusedOffRows = kFusedOffTok<kP> + (1 + kP) * kTokPlane * 2;
template <int kP>
constexpr int kFusedSmemBytes = kFusedOffRows<kP> + kC * 8 + 2 * kC * 4;
static_assert(kFusedOffMcol<3> == kOffMcol && kFusedOffTok<3> == kOffTok,
              "three parts: the layout of the read kernels");
static_assert(kFusedOffTok<1> % 16 == 0 && kFusedOffRows<1> % 16 == 0, "16-byte aligned");

template <bool kFull, int kP>
__global__ void __launch_bounds__(kThreads, kP == 1 ? 3 : 2)
    TypeReadsBackwardKernel(SmatCudaDims d, SmatTokenGroups groups, int segments,
                            const float* __restrict__ U, SmatMatrixLayout lay,
                            const __nv_bfloat16* __restrict__ phi, const float* __restrict__ gbar,
                            SmatTokenWeights tw, SmatMatrixLayout out_lay,
                            float* __restrict__ U_bar, float* __restrict__ phi_bar) {
  extern __shared__ uint4 smem_u4[];
  char* smem = reinterpret_cast<char*>(smem_u4);
  __nv_bfloat16* Ms = reinterpret_cast<__nv_bfloat16*>(smem);
  float* mcol = reinterpret_cast<float*>(smem + kFusedOffMcol<kP>);
  __nv_bfloat16* Ph = reinterpret_cast<__nv_bfloat16*>(smem + kFusedOffTok<kP>);
  __nv_bfloat16* Gs = Ph + kTokPlane;  // the kP planes of wg
  int64_t* rows = reinterpret_cast<int64_t*>(smem + kFusedOffRows<kP>);
  float* w = reinterpret_cast<float*>(rows + kC);
  float* gcol = w + kC;
  const cuda_detail::GroupBlock blk(groups, d, segments);
  const mma_tiles::TileWidths<kFull> wd{d.r, d.dv};
  const int r = wd.r(), dv = wd.dv(), p = wd.p();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // Columns no staging writes: phi's r.., wg's p.. .
  const __nv_bfloat16 zero = __float2bfloat16_rn(0.f);
  mma_tiles::FillPadColumns<kC, kLdT, kThreads>(Ph, 1, r, zero);
  mma_tiles::FillPadColumns<kC, kLdT, kThreads>(Gs, kP, p, zero);
  outer_tile::Warp<1, kP> tile(lane, warp, Ph, Gs);
  const uint32_t a_addr = SmemAddr(Gs) + 2u * ((16 * warp + (lane & 15)) * kLdT + (lane >> 4) * 8);
  const uint32_t b_plain =
      SmemAddr(Ms) + 2u * (((lane & 7) + (lane >> 4) * 8) * kLdM + ((lane >> 3) & 1) * 8);
  const int kv = (dv + 15) >> 4, n_tiles = (r + 7) >> 3;

  for (int64_t j0 = blk.lo; j0 < blk.hi; j0 += kC) {
    const int nt = static_cast<int>(cuda_detail::Min64(kC, blk.hi - j0));
    StageTokens(blk, d, tw, j0, nt, rows, w);
    StageRowsAsync(phi, rows, r, nt, Ph);
    // U_bar's accumulators stay live: fewer loads in flight.
    StageSplitRows<true, kFusedSplitLoads, kP>(gbar, rows, w, dv, nt, Gs, gcol);
    if (j0 == blk.lo) StageMatrix<kP>(blk.Matrix(U, lay, r, p), r, p, dv, dv, Ms, mcol);
    CpAsyncWaitAll();
    __syncthreads();
    const int ksteps = (nt + 15) >> 4;
    for (int ks = 0; ks < ksteps; ++ks) tile.Step(ks);
    if (16 * warp < nt) {
      for (int j0n = 0; j0n < n_tiles; j0n += 4) {
        float hi[4][4], lo[4][4];
        Product<kP, 4, false, kP>(a_addr, b_plain, kv, j0n, n_tiles, hi, lo);
        StoreRows<4, Den::kG>(hi, lo, 16 * warp, j0n, nt, rows, nullptr, gcol, mcol, r, false,
                              phi_bar);
      }
    }
  }
  // U_bar's tile through U's planes (no warp reads them any more), written
  // in full: zeros for a segment without tokens.
  tile.Store(r, p, reinterpret_cast<float*>(Ms),
             blk.Matrix(U_bar, out_lay, r, p, segments, blk.seg), tid, kThreads);
}

// kMP: M's planes, 1 where SMAT_CUDA_BF16_PARTS=1 and the tokens are bf16
// rows (kVecMat, kBoth: one MMA per product), else 3.
template <SmatReadKind kRead, bool kStaged, int kMP>
cudaError_t LaunchKernel(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                         const float* M, const SmatMatrixLayout& lay, const void* a, const void* v,
                         const float* g, const SmatTokenWeights& w, float* out_p, float* out_r,
                         float* out_v, bool assign_p, cudaStream_t stream) {
  auto kernel = d.r == kW && d.dv == kW ? ReadsBf16Kernel<kRead, true, kStaged, kMP>
                                        : ReadsBf16Kernel<kRead, false, kStaged, kMP>;
  constexpr int kSmem = SmemBytes(kRead, kStaged);
  const cudaError_t err = mma_tiles::AllowSharedMemory(kernel, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
  kernel<<<grid, kThreads, kSmem, stream>>>(
      d, groups, segments, M, lay, static_cast<const __nv_bfloat16*>(a),
      static_cast<const __nv_bfloat16*>(v), g, w, out_p, out_r, out_v, assign_p);
  return cudaGetLastError();
}

template <SmatReadKind kRead, int kMP>
cudaError_t LaunchWith(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                       const float* M, const SmatMatrixLayout& lay, const void* a, const void* v,
                       const float* g, const SmatTokenWeights& w, float* out_p, float* out_r,
                       float* out_v, bool assign_p, cudaStream_t stream) {
  if constexpr (kRead == SmatReadKind::kVecMat) {
    // The rows go through shared memory (kStaged) where they are odd-sized
    // and the blocks hold a whole tile of tokens on average: H200, bf16,
    // T = 524288, 8 heads, 2026-12-01, TypeReads (=) at d = 2 (252 tokens per
    // block) 0.76 -> 0.64 ms; at d = 3, whose many small groups make each
    // block's staging of M the larger part, 0.76 -> 0.91 ms at three blocks
    // per SM, so it keeps four.
    const int64_t blocks = int64_t{groups.num_groups} * segments;
    if (d.p % 2 != 0 && groups.end - groups.begin >= kC * blocks) {
      return LaunchKernel<kRead, true, kMP>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r,
                                            out_v, assign_p, stream);
    }
  }
  return LaunchKernel<kRead, false, kMP>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r,
                                         out_v, assign_p, stream);
}

template <SmatReadKind kRead>
cudaError_t Launch(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                   const float* M, const SmatMatrixLayout& lay, const void* a, const void* v,
                   const float* g, const SmatTokenWeights& w, float* out_p, float* out_r,
                   float* out_v, bool assign_p, cudaStream_t stream) {
  if constexpr (kRead != SmatReadKind::kMatVec) {
    if (SmatBf16SplitParts() == 1) {
      return LaunchWith<kRead, 1>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r, out_v,
                                  assign_p, stream);
    }
  }
  return LaunchWith<kRead, 3>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r, out_v,
                              assign_p, stream);
}

}  // namespace

bool SmatReadsBf16Fits(const SmatCudaDims& d, SmatReadKind kind, const void* a, const void* v) {
  if (d.chunk > kC || d.r <= 0 || d.r > kW || d.dv <= 0 || d.dv > kW) return false;
  // kMatVec reads gbar (fp32) only; the others bf16 rows by 16-byte pieces.
  if (kind != SmatReadKind::kMatVec) {
    if (!d.bf16 || d.r % 8 != 0 || !Aligned16(a)) return false;
    if (kind == SmatReadKind::kBoth && (d.dv % 8 != 0 || !Aligned16(v))) return false;
  }
  return SmatDeviceRunsMma(SmemBytes(kind, kind == SmatReadKind::kVecMat));
}

bool SmatTypeReadsBackwardBf16Fits(const SmatCudaDims& d, const void* phi) {
  if (!d.bf16 || d.chunk > kC || d.r <= 0 || d.r > kW || d.r % 8 != 0) return false;
  if (d.dv <= 0 || d.dv > kW || !Aligned16(phi)) return false;
  const char* env = std::getenv("SMAT_CUDA_GROUPED");
  if (env != nullptr && std::strcmp(env, "ffma") == 0) return false;
  if (!SmatUseFastChunkTiles(d) || !SmatUseMmaGrouped(d, /*reads=*/false)) return false;
  return SmatDeviceRunsMma(kFusedSmemBytes<3>);
}

cudaError_t LaunchSmatTypeReadsBackwardBf16(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                            int segments, const float* U,
                                            const SmatMatrixLayout& lay, const void* phi,
                                            const float* gbar, const SmatTokenWeights& w,
                                            const SmatMatrixLayout& out_lay, float* U_bar,
                                            float* phi_bar, cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  auto launch = [&](auto parts) {
    constexpr int kP = decltype(parts)::value;
    auto kernel = d.r == kW && d.dv == kW ? TypeReadsBackwardKernel<true, kP>
                                          : TypeReadsBackwardKernel<false, kP>;
    const cudaError_t err = mma_tiles::AllowSharedMemory(kernel, kFusedSmemBytes<kP>);
    if (err != cudaSuccess) return err;
    const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
    kernel<<<grid, kThreads, kFusedSmemBytes<kP>, stream>>>(d, groups, segments, U, lay,
                                                            static_cast<const __nv_bfloat16*>(phi),
                                                            gbar, w, out_lay, U_bar, phi_bar);
    return cudaGetLastError();
  };
  // Two parts keep three here: the option splits the fused chunk tiles only.
  if (SmatBf16SplitParts() == 1) return launch(std::integral_constant<int, 1>());
  return launch(std::integral_constant<int, 3>());
}

bool SmatUseReadsBf16(const SmatCudaDims& d, SmatReadKind kind, const void* a, const void* v) {
  // kMatVec stays on FFMA unless SMAT_CUDA_GROUPED=mma: with gbar in three
  // parts (6 MMAs per tile, two blocks per SM) TypeReadsBackward takes 1.68 ms
  // here against 1.60 ms (H200, bf16, T = 524288, d = 2, 8 heads).
  const char* env = std::getenv("SMAT_CUDA_GROUPED");
  if (env != nullptr && std::strcmp(env, "ffma") == 0) return false;
  const bool forced = env != nullptr && std::strcmp(env, "mma") == 0;
  if (kind == SmatReadKind::kMatVec && !forced) return false;
  return SmatReadsBf16Fits(d, kind, a, v);
}

cudaError_t LaunchSmatReadsBf16(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                                SmatReadKind kind, const float* M, const SmatMatrixLayout& lay,
                                const void* a, const void* v, const float* g,
                                const SmatTokenWeights& w, float* out_p, float* out_r, float* out_v,
                                bool assign_p, cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  switch (kind) {
    case SmatReadKind::kVecMat:
      return Launch<SmatReadKind::kVecMat>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r,
                                           out_v, assign_p, stream);
    case SmatReadKind::kMatVec:
      return Launch<SmatReadKind::kMatVec>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r,
                                           out_v, assign_p, stream);
    case SmatReadKind::kBoth:
      return Launch<SmatReadKind::kBoth>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r,
                                         out_v, assign_p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace smat
