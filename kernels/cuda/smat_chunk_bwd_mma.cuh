// The shared pieces of B7's fused tensor-core kernel (smat_chunk_bwd_mma.cu):
// its block shape and shared-memory layout, the per-block state every warp
// reads (Block), the stores of a warp's output rows (StoreRows) and the side
// terms S_in and D_bar by columns (SideTerms). The causal sums, the kernel and
// its launchers stay in the .cu.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_mma.cuh"

namespace smat {
namespace chunk_bwd_mma {

using cuda_detail::TokenRow;
using namespace mma_tiles;  // NOLINT: the tensor-core pieces are this file's vocabulary

constexpr int kThreads = 256;
constexpr int kC = 128;          // chunk tokens held
constexpr int kW = 64;           // widest r or dv
static_assert(kW == mma_tiles::kTileWidth, "kFull means the widest tile");
constexpr int kLd = 72;          // bf16 row pitch of every staged tile
constexpr int kTile = kC * kLd;  // bf16 elements of one staged tile
// Shared memory: phi, psi, v, gbar's kP parts (bf16 [kC][kLd] each), then
// fp32 [kC] arrays gcol = gbar[:, dv], lam, wq = exp(lam), wk = w_s, [kW]
// arrays S_in[:, dv], D_bar[:, dv], and the gates' factors rf, cf [kC] and
// bb [8][8] (mma_tiles::GateFactors).
// kDo: gbar's columns < dv come as their factors (SmatGbarFactors), the bf16
// rows of d_o in one plane (exact) and gs = 1 / den [kC] after bb.
constexpr int kPhi = 0, kPsi = 1, kV = 2, kG = 3;  // tile indices
constexpr int kBlocks = kC / 16;  // 16-token blocks of a chunk
// kP: the bf16 parts of every fp32 operand (1, 2 or 3, SmatBf16SplitParts).
// kGParts: gbar's planes.
template <int kP, bool kDo>
constexpr int kGParts = kDo ? 1 : kP;
template <int kP, bool kDo = false>
constexpr int kTiles = 3 + kGParts<kP, kDo>;
template <bool kDo = false>
constexpr int kTokenFloats = 6 * kC + 2 * kW + kBlocks* kBlocks + (kDo ? kC : 0);
// With one part (kP = 1) S_in and D_bar also wait as bf16 planes [kW][kLd]
// (columns < dv, rows < r; zero elsewhere) after the per-token arrays, for the
// side terms of the rows' owners (OwnerSide); with more parts and kDo, one
// matrix in its kP planes: D_bar for the key rows' owners, then S_in over it
// for the query rows' (the kernel restages them between; both would take the
// block to 133 KB, one per SM).
constexpr int kSidePlane = kW * kLd;  // bf16 elements of one side plane
template <int kP, bool kDo>
constexpr int kSidePlanes = kP == 1 ? 2
                            : kDo   ? kP
                                    : 0;
template <int kP, bool kDo = false>
constexpr int kSideOffsetBytes = kTiles<kP, kDo>* kTile * 2 + kTokenFloats<kDo> * 4;
template <int kP, bool kDo = false>
constexpr int kSmemBytes = kSideOffsetBytes<kP, kDo> + kSidePlanes<kP, kDo>* kSidePlane * 2;
static_assert(kSideOffsetBytes<1> % 16 == 0 && kSideOffsetBytes<1, true> % 16 == 0 &&
                  kSideOffsetBytes<3, true> % 16 == 0,
              "the side planes are 16-byte aligned");

// The block's shared memory: bf16 tiles, then the fp32 per-token arrays.
__device__ __forceinline__ __nv_bfloat16* SmemTiles() {
  extern __shared__ float4 smem4[];
  return reinterpret_cast<__nv_bfloat16*>(smem4);
}
template <int kP, bool kDo = false>
__device__ __forceinline__ float* SmemTokens() {
  return reinterpret_cast<float*>(SmemTiles() + kTiles<kP, kDo> * kTile);
}

// What every warp of a block shares. The per-token arrays are at fixed
// shared-memory offsets (no registers): gcol = gbar[:, dv], lam, wq = exp(lam),
// wk = w_s, [kC] each; then scol = S_in[:, dv] and dcol = D_bar[:, dv] ([kW],
// 0 for rows >= r). kFull: r = dv = kW (mma_tiles::TileWidths), the staged
// rows 16-byte aligned and the outputs 8-byte aligned, so that the pair
// stores are constant too. kP: the parts of gbar's planes and of every split
// operand; kDo: gbar's columns < dv as d_o's plane and gs (see kTiles).
template <bool kFull, int kP, bool kDo = false>
struct Block : mma_tiles::TileWidths<kFull> {
  static constexpr int kGP = kGParts<kP, kDo>;
  __device__ const float* gcol() const { return SmemTokens<kP, kDo>(); }
  __device__ const float* lam() const { return SmemTokens<kP, kDo>() + kC; }
  __device__ const float* wq() const { return SmemTokens<kP, kDo>() + 2 * kC; }
  __device__ const float* wk() const { return SmemTokens<kP, kDo>() + 3 * kC; }
  __device__ const float* scol() const { return SmemTokens<kP, kDo>() + 4 * kC; }
  __device__ const float* dcol() const { return SmemTokens<kP, kDo>() + 4 * kC + kW; }
  __device__ const float* rf() const { return SmemTokens<kP, kDo>() + 4 * kC + 2 * kW; }
  __device__ const float* cf() const { return SmemTokens<kP, kDo>() + 5 * kC + 2 * kW; }
  __device__ const float* bb() const { return SmemTokens<kP, kDo>() + 6 * kC + 2 * kW; }
  __device__ const float* gs() const {  // kDo only
    return SmemTokens<kP, kDo>() + 6 * kC + 2 * kW + kBlocks * kBlocks;
  }
  int ce, nb;
  bool pairs_r_, pairs_v_;  // phi_bar and psi_bar, v_bar rows move as float2 (see StoreRows)
  __device__ bool pairs_r() const { return kFull || pairs_r_; }
  __device__ bool pairs_v() const { return kFull || pairs_v_; }
  int lane, g, tq;
  // Per-lane element offsets of the ldmatrix row addresses: A (rows m, k
  // contiguous), B from rows n with k contiguous, B from rows k (.trans).
  int off_a, off_bn, off_bt;
  uint32_t base;  // shared-memory address of the tiles
  __device__ uint32_t Addr(int tile, int row, int col, int off) const {
    return base + 2u * static_cast<uint32_t>(tile * kTile + row * kLd + col + off);
  }
  // The same in side plane q (kP = 1: 0 S_in, 1 D_bar; kDo with kP parts:
  // part q of the matrix staged, D_bar or S_in).
  __device__ uint32_t SideAddr(int q, int row, int col, int off) const {
    return base + static_cast<uint32_t>(kSideOffsetBytes<kP, kDo>) +
           2u * static_cast<uint32_t>(q * kSidePlane + row * kLd + col + off);
  }
  // The ldmatrix fragments of gbar's kGP planes at (row, col) (kTrans:
  // .trans); with kDo those of d_o.
  template <bool kTrans = false>
  __device__ void LoadG(uint32_t (&x)[kGP][4], int row, int col, int off) const {
#pragma unroll
    for (int q = 0; q < kGP; ++q) {
      if constexpr (kTrans) {
        Ldsm4T(x[q], Addr(kG + q, row, col, off));
      } else {
        Ldsm4(x[q], Addr(kG + q, row, col, off));
      }
    }
  }
};

// out rows m0 + (16 rows), columns n0 + (8 kNt) += hi + lo (kAssign: =), for
// rows < ce and columns < width. Every old value the thread adds to is loaded
// before the first store of its row (two memory latencies per job, not one per
// element); pairs: width is even and out 8-byte aligned, so each (n, n + 1)
// moves as one float2.
template <int kNt, bool kAssign, bool kFull, int kP, bool kDo>
__device__ __forceinline__ void StoreRows(const Block<kFull, kP, kDo>& bk, const SmatCudaDims& d,
                                          int b, int h, int64_t c0, int m0, int n0, int width,
                                          bool pairs, float (&hi)[kNt][4],
                                          const float (&lo)[kNt][4], float* __restrict__ out) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) hi[nt][e] += lo[nt][e];
  float* o[2];
  bool row_ok[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int m = m0 + bk.g + 8 * hr;
    row_ok[hr] = m < bk.ce;
    o[hr] = out + TokenRow(d, b, c0 + (row_ok[hr] ? m : 0), h) * width;
  }
  // One row at a time: kNt x 2 old values live, not all four per n-tile.
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float old[kNt][2];
    if (pairs) {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        const int n = n0 + 8 * nt + 2 * bk.tq;
        float2 x = make_float2(0.f, 0.f);
        if (!kAssign && row_ok[hr] && n < width) x = *reinterpret_cast<const float2*>(o[hr] + n);
        old[nt][0] = x.x;
        old[nt][1] = x.y;
      }
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        const int n = n0 + 8 * nt + 2 * bk.tq;
        if (row_ok[hr] && n < width) {
          *reinterpret_cast<float2*>(o[hr] + n) =
              make_float2(old[nt][0] + hi[nt][2 * hr], old[nt][1] + hi[nt][2 * hr + 1]);
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int n = n0 + 8 * nt + 2 * bk.tq + e1;
          old[nt][e1] = !kAssign && row_ok[hr] && n < width ? o[hr][n] : 0.f;
        }
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int n = n0 + 8 * nt + 2 * bk.tq + e1;
          if (row_ok[hr] && n < width) o[hr][n] = old[nt][e1] + hi[nt][2 * hr + e1];
        }
    }
  }
}

// The side terms, by column blocks: warp w owns the 16 columns
// [16 (w % 4), + 16) of each output for the 64 tokens of row blocks
// [4 (w / 4), + 4), so it loads and splits a quarter of S_in and D_bar (a
// warp that owned rows, as the causal sums do, would need all of both: four
// times the loads and splits, which were half the kernel's instructions when
// each warp loaded all of both). Added to out after the causal sums:
//   phi_bar_t += wq_t (sum_{k < dv} gbar_t[k] S[n][k] + gbar_t[dv] S[n][dv])
//   psi_bar_s += w_s (sum_{k < dv} D[n][k] v_s[k] + D[n][dv])
//   v_bar_s   += w_s sum_{k < r} psi_s[k] D[k][n]
// kSide: which of the three (the query side not with kDo: its rows' owners
// add it, OwnerSide). The B fragments of the warp's two n8 tiles stay
// in registers (kP parts x 4 k-steps); one 16-row block at a time, the next
// block's old values loading while its products run (B7 4.91-4.94 -> 4.70-4.74
// ms; they waited before the products). Against 8 columns of all 128 tokens per
// warp, each warp loads the A fragments (gbar's planes, v or psi) of half the
// chunk's rows instead of all of them: B7 5.43 -> 4.93-5.00 ms (H200, bf16,
// T = 524288, d = 2, 8 heads, r = dv = 64, 2026-12-01); two row blocks at a
// time, with the B fragments split again per k-step to stay within 128
// registers, took 5.10 ms.
enum class Side { kQuery, kKeyPsi, kKeyV };

// The chunk's n = r p floats of S_in or D_bar (global, row-major) into `to`
// in shared memory, consecutive threads on consecutive 16-byte pieces where
// both are 16-byte aligned: one coalesced pass per block, where every warp
// loading its columns' B fragments from global memory touched 4-8 cache lines
// per load.
// With `carry` (not null): from + scale carry, element by element (D_bar
// from its two pieces, SmatDBarCarry).
__device__ __forceinline__ void StageSide(const float* __restrict__ from, int n, float* to,
                                          const float* __restrict__ carry = nullptr,
                                          float scale = 1.f) {
  const bool vec = n % 4 == 0 && (reinterpret_cast<uintptr_t>(from) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(carry) & 15) == 0;
  if (vec) {
    const float4* f4 = reinterpret_cast<const float4*>(from);
    const float4* c4 = reinterpret_cast<const float4*>(carry);
    float4* t4 = reinterpret_cast<float4*>(to);
    for (int e = threadIdx.x; e < n / 4; e += kThreads) {
      float4 x = __ldg(&f4[e]);
      if (carry != nullptr) {
        const float4 y = __ldg(&c4[e]);
        x = make_float4(fmaf(scale, y.x, x.x), fmaf(scale, y.y, x.y), fmaf(scale, y.z, x.z),
                        fmaf(scale, y.w, x.w));
      }
      t4[e] = x;
    }
  } else {
    for (int e = threadIdx.x; e < n; e += kThreads) {
      const float x = __ldg(&from[e]);
      to[e] = carry != nullptr ? fmaf(scale, __ldg(&carry[e]), x) : x;
    }
  }
}

// M: the chunk's S_in or D_bar (r x p fp32, row-major) in shared memory
// (StageSide).
template <Side kSide, bool kFull, int kP, bool kDo>
__device__ __forceinline__ void SideTerms(const Block<kFull, kP, kDo>& bk, const SmatCudaDims& d,
                                          int b, int h, int64_t c0, int w, const float* M,
                                          float* __restrict__ out) {
  const int g = bk.g, tq = bk.tq;
  constexpr bool kQuery = kSide == Side::kQuery, kKeyV = kSide == Side::kKeyV;
  static_assert(kSidePlanes<kP, kDo> == 0, "with side planes the rows' owners add the sides");
  const int width = kKeyV ? bk.dv() : bk.r();
  const int n0 = 16 * (w & 3), i_first = 4 * (w >> 2);
  if (n0 >= width || i_first >= bk.nb) return;
  // B(k, n) = M[n][k] (query, key psi: k < dv) or M[k][n] (key v: k < r),
  // for the warp's two n8 tiles.
  const int ksteps = kKeyV ? bk.kr() : bk.kd();
  uint32_t bs[4][2][kP][2];
  {
    float x[4][2][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int n = n0 + 8 * nt + g;
        if (kKeyV) {
          LoadB(M, bk.p(), 1, 16 * ks, n, bk.r(), bk.dv(), tq, x[ks][nt]);
        } else {
          LoadB(M, 1, bk.p(), 16 * ks, n, bk.dv(), bk.r(), tq, x[ks][nt]);
        }
      }
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) SplitBParts<kP>(x[ks][nt], bs[ks][nt]);
  }
  const bool pairs = kKeyV ? bk.pairs_v() : bk.pairs_r();
  const int a_tile = kQuery ? kG : kKeyV ? kPsi : kV;
  const float* wrow = kQuery ? bk.wq() : bk.wk();
  // The ones column: gbar[t][dv] S[n][dv] (query), D[n][dv] (key psi).
  float extra[2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e1 = 0; e1 < 2; ++e1) {
      const int n = n0 + 8 * nt + 2 * tq + e1;
      extra[nt][e1] = kQuery ? bk.scol()[n] : kKeyV ? 0.f : bk.dcol()[n];
    }
  // Token m's row: o0 + m * stride (the rows of one (b, h) are H rows apart),
  // this thread's columns n0 + 8 nt + 2 tq (+ 1) at o0 + 8 nt.
  float* const o0 = out + TokenRow(d, b, c0, h) * width + n0 + 2 * tq;
  const int64_t stride = static_cast<int64_t>(d.H) * width;
  const int i_end = min(bk.nb, i_first + 4);
  // Row block i's old values ([half][n-tile][column]).
  auto load_old = [&](int i, float(&old)[2][2][2]) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int m = 16 * i + g + 8 * hr;
      const bool ok = m < bk.ce;
      const float* o = o0 + (ok ? m : 0) * stride;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int n = n0 + 8 * nt + 2 * tq;
        if (pairs) {
          float2 x = make_float2(0.f, 0.f);
          if (ok && n < width) x = *reinterpret_cast<const float2*>(o + 8 * nt);
          old[hr][nt][0] = x.x;
          old[hr][nt][1] = x.y;
        } else {
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1)
            old[hr][nt][e1] = ok && n + e1 < width ? o[8 * nt + e1] : 0.f;
        }
      }
    }
  };
  // A block's old values load while the block before it runs its products.
  float next[2][2][2];
  load_old(i_first, next);
#pragma unroll 1
  for (int i = i_first; i < i_end; ++i) {
    float old[2][2][2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) old[hr][nt][e1] = next[hr][nt][e1];
    if (i + 1 < i_end) load_old(i + 1, next);
    float hi[2][4], lo[2][4];
    cuda_detail::ZeroAcc(hi);
    cuda_detail::ZeroAcc(lo);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (ks >= ksteps) continue;
      if constexpr (kQuery) {
        uint32_t a[kP][4];
        bk.LoadG(a, 16 * i, 16 * ks, bk.off_a);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) MmaPxP<kP>(hi[nt], lo[nt], a, bs[ks][nt]);
      } else {
        uint32_t a[4];
        Ldsm4(a, bk.Addr(a_tile, 16 * i, 16 * ks, bk.off_a));
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) Mma1xP<kP>(hi[nt], lo[nt], a, bs[ks][nt]);
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int m = 16 * i + g + 8 * hr;
      if (m >= bk.ce) continue;
      float* o = o0 + m * stride;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int n = n0 + 8 * nt + 2 * tq;
        float y[2];
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const float sum = hi[nt][2 * hr + e1] + lo[nt][2 * hr + e1];
          const float side = kQuery ? fmaf(bk.gcol()[m], extra[nt][e1], sum) : sum + extra[nt][e1];
          y[e1] = old[hr][nt][e1] + wrow[m] * side;
        }
        if (pairs) {
          if (n < width) *reinterpret_cast<float2*>(o + 8 * nt) = make_float2(y[0], y[1]);
        } else {
#pragma unroll
          for (int e1 = 0; e1 < 2; ++e1)
            if (n + e1 < width) o[8 * nt + e1] = y[e1];
        }
      }
    }
  }
}

// The column pairs (n, n + 1) of the side planes per thread, for kMats
// matrices.
template <int kMats>
constexpr int kSideItems = kMats* kW*(kLd / 2) / kThreads;
static_assert(kW * (kLd / 2) % kThreads == 0, "whole items per thread");

// Side planes for OwnerSide: kMats r x p matrices (row-major, fp32; kMats = 2:
// S then D, 1: D) split into kP bf16 planes each (planes q kP .. q kP + kP - 1
// for matrix q), row n < r, columns k < dv, zero elsewhere. D comes with its
// carry where Dc is not null (D + dscale Dc, SmatDBarCarry). A column pair per
// thread and item; each batch of kBatch items issues all its loads first (one
// memory latency per batch, not per pair).
template <int kP, int kMats, int kBatch>
__device__ __forceinline__ void StageSidePlanes(const float* __restrict__ S,
                                                const float* __restrict__ D,
                                                const float* __restrict__ Dc, float dscale, int r,
                                                int dv, int p, __nv_bfloat16* planes) {
  constexpr int kPairs = kLd / 2, kItems = kSideItems<kMats>;
  static_assert(kItems % kBatch == 0, "whole batches");
  const int tid = threadIdx.x;
  for (int i0 = 0; i0 < kItems; i0 += kBatch) {
    float x[kBatch][2], y[kBatch][2];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = tid + (i0 + u) * kThreads, q = e / (kW * kPairs);
      const int rem = e - q * kW * kPairs, n = rem / kPairs, c = 2 * (rem - n * kPairs);
      const bool is_d = kMats == 1 || q == 1;
#pragma unroll
      for (int v2 = 0; v2 < 2; ++v2) {
        const bool in = n < r && c + v2 < dv;
        const int64_t at = in ? static_cast<int64_t>(n) * p + c + v2 : 0;
        x[u][v2] = in ? __ldg(&(is_d ? D : S)[at]) : 0.f;
        y[u][v2] = is_d && in && Dc != nullptr ? __ldg(&Dc[at]) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = tid + (i0 + u) * kThreads, q = e / (kW * kPairs);
      const int rem = e - q * kW * kPairs, n = rem / kPairs, c = 2 * (rem - n * kPairs);
      if ((kMats == 1 || q == 1) && Dc != nullptr) {
        x[u][0] = fmaf(dscale, y[u][0], x[u][0]);
        x[u][1] = fmaf(dscale, y[u][1], x[u][1]);
      }
      StoreSplitPair<kP>(&planes[q * kP * kSidePlane + n * kLd + c], kSidePlane, x[u][0], x[u][1]);
    }
  }
}

// hi += lo, lo = 0: a causal sum's correction terms folded into its leading
// accumulator, before a side term's products go into lo.
__device__ __forceinline__ void FoldCorrections(float (&hi)[8][4], float (&lo)[8][4]) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      hi[nt][e] += lo[nt][e];
      lo[nt][e] = 0.f;
    }
}

// One part (kP = 1): the side term of a row owner's block, rows 16 i ..
// 16 i + 15 and every column, from the bf16 side planes, summed in lo (which
// the causal sums of one part leave at zero) and added to hi with the row
// weights as SideTerms adds it:
//   query (S_in):  hi += wq_t (sum_{k < dv} gbar_t[k] S[n][k] + gbar_t[dv] S[n][dv])
//   key psi (D):   hi += w_s (sum_{k < dv} D[n][k] v_s[k] + D[n][dv])
//   key v (D):     hi += w_s sum_{k < r} psi_s[k] D[k][n]
// so the outputs are written once, with no pass over them after the causal
// sums (the column blocks of SideTerms read back what the owners wrote).
// kDo with kP parts: each side the same way from the kP planes of its matrix
// (the query side with d_o: gbar_t[k] = d_o_t[k] / den_t), the causal sum's lo
// first added to hi, every term of the side's products into lo, the smallest
// first.
template <Side kSide, bool kFull, int kP, bool kDo>
__device__ __forceinline__ void OwnerSide(const Block<kFull, kP, kDo>& bk, int i, float (&hi)[8][4],
                                          float (&lo)[8][4]) {
  constexpr bool kQuery = kSide == Side::kQuery, kKeyV = kSide == Side::kKeyV;
  static_assert(kP == 1 || kDo, "more parts: with d_o only (kSidePlanes)");
  const int width = kKeyV ? bk.dv() : bk.r();
  const int ksteps = kKeyV ? bk.kr() : bk.kd();
  const int q = kQuery || kP > 1 ? 0 : 1;  // the side's first plane
  if constexpr (kP > 1) FoldCorrections(hi, lo);
    // kP > 1: a k-step at a time (the planes' fragments of every k-step in
    // flight at once spill the key rows' kernels).
#pragma unroll(kP > 1 ? 1 : 4)
  for (int ks = 0; ks < 4; ++ks) {
    if (ks >= ksteps) continue;
    uint32_t a[1][4];
    if (kQuery) {
      bk.LoadG(a, 16 * i, 16 * ks, bk.off_a);
    } else {
      Ldsm4(a[0], bk.Addr(kKeyV ? kPsi : kV, 16 * i, 16 * ks, bk.off_a));
    }
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (16 * np >= width) continue;
      uint32_t bp[kP][4];
#pragma unroll
      for (int u = 0; u < kP; ++u) {
        if (kKeyV) {
          Ldsm4T(bp[u], bk.SideAddr(q + u, 16 * ks, 16 * np, bk.off_bt));  // B(k, n) = D[k][n]
        } else {
          Ldsm4(bp[u], bk.SideAddr(q + u, 16 * np, 16 * ks, bk.off_bn));  // B(k, n) = M[n][k]
        }
      }
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        uint32_t bb[kP][2];
#pragma unroll
        for (int u = 0; u < kP; ++u) {
          bb[u][0] = bp[u][2 * h2];
          bb[u][1] = bp[u][2 * h2 + 1];
        }
        Mma1xP<kP>(lo[2 * np + h2], lo[2 * np + h2], a[0], bb);
      }
    }
  }
  const float* wrow = kQuery ? bk.wq() : bk.wk();
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int m = 16 * i + bk.g + 8 * hr;
    const float wt = wrow[m], gc = kQuery ? bk.gcol()[m] : 0.f;
    const float gm = kDo && kQuery ? bk.gs()[m] : 1.f;  // d_o_t's product, divided by den_t
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        const int n = 8 * nt + 2 * bk.tq + e1, e = 2 * hr + e1;
        const float extra = kQuery ? bk.scol()[n] : kKeyV ? 0.f : bk.dcol()[n];
        const float side =
            kQuery ? fmaf(gc, extra, kDo ? gm * lo[nt][e] : lo[nt][e]) : lo[nt][e] + extra;
        hi[nt][e] += wt * side;
        lo[nt][e] = 0.f;
      }
  }
}

}  // namespace chunk_bwd_mma
}  // namespace smat
