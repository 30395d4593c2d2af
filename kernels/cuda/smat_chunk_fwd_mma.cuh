// The shared pieces of the fused forward tile of bf16 inputs
// (smat_chunk_fwd_mma.cu) and of the walk that carries the chunks' states in
// shared memory (smat_chunk_walk.cu): the block shape and shared-memory
// layout, where the rows go (Outputs), the per-block state every warp reads
// (Block), a state's staging into bf16 planes (StageState), a warp's output
// rows (QueryRows) and the left halves' finish (FinishLeftHalves). The
// kernels and their launchers stay in the .cu files.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_mma.cuh"

namespace smat {
namespace chunk_fwd_mma {

using cuda_detail::ChunkRow;
using cuda_detail::TokenRow;
using namespace mma_tiles;  // NOLINT: the tensor-core pieces are this file's vocabulary

constexpr int kThreads = 256;
constexpr int kC = 128;  // chunk tokens held
constexpr int kW = 64;   // widest r or dv
static_assert(kW == kTileWidth, "kFull means the widest tile");
constexpr int kLd = 72;           // bf16 row pitch of every staged tile
constexpr int kTile = kC * kLd;   // a token tile
constexpr int kPlane = kW * kLd;  // a plane of S_in
constexpr int kPhi = 0, kPsi = 1, kV = 2;
constexpr int kOffS = 3 * kTile;                // the three planes of S_in
constexpr int kOffTokens = kOffS + 3 * kPlane;  // fp32 lam, wq [kC] (bf16 units)
constexpr int kSmemBytes = kOffTokens * 2 + 2 * kC * 4;
static_assert(kOffTokens % 8 == 0, "the fp32 arrays must be 16-byte aligned");
// Finishing the outputs (kNorm) adds the left halves of the rows (columns
// 0-31, fp32, [kC][kLdY]) and each row's normaliser: 101 KB, still two
// blocks per SM.
constexpr int kLdY = 36;
constexpr int kSmemNormBytes = kSmemBytes + (kC * kLdY + kC) * 4;

// Where the rows go: ybar (written), or with kNorm o and den after the reads
// of recent rows are added (see LaunchSmatNormalizedOutputsFused).
struct Outputs {
  float* ybar;
  const float* reads;  // [batch, L, H, p], rows of local tokens >= recent_begin
  int64_t recent_begin;
  float eps;
  __nv_bfloat16* o;  // [batch, L, H, dv]
  float* den;        // [batch, L, H]
};

// kFull: r = dv = kW and 16-byte aligned rows (mma_tiles::TileWidths).
template <bool kFull>
struct Block : TileWidths<kFull> {
  __nv_bfloat16* base;
  int ce, nb;
  int g, tq;
  int off_a, off_bn, off_bt;  // ldmatrix lane offsets (see smat_chunk_bwd_mma.cu)
  __device__ const float* lam() const { return reinterpret_cast<const float*>(base + kOffTokens); }
  __device__ const float* wq() const { return lam() + kC; }
  // kNorm: the left halves of the rows and the normalisers' reciprocals.
  __device__ float* yleft() const { return reinterpret_cast<float*>(base) + kSmemBytes / 4; }
  __device__ float* inv_den() const { return yleft() + kC * kLdY; }
  __device__ uint32_t Addr(int elem, int row, int col, int off) const {
    return SmemAddr(base) + 2u * static_cast<uint32_t>(elem + row * kLd + col + off);
  }
};

// A state S (r x p fp32, rows p apart) into kP bf16 planes [kW][kLd] at
// `planes`, zero outside r x p. Thread t splits the column pairs (t % 4) + 4 j
// of row t / 4 (StoreSplitPair, one 4-byte store per plane); all loads of a
// thread issue before the first use (clamped indices, no branches).
template <int kP>
__device__ __forceinline__ void StageState(const float* __restrict__ S, int r, int p,
                                           __nv_bfloat16* planes) {
  static_assert(kThreads == 4 * kW && kLd % 8 == 0, "four threads per row of S_in");
  constexpr int kPairs = kLd / 8;  // column pairs per thread
  const int row = threadIdx.x >> 2, pair0 = threadIdx.x & 3;
  const float* Srow = S + min(row, r - 1) * p;
  float x[kPairs][2];
#pragma unroll
  for (int j = 0; j < kPairs; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int n = 2 * (pair0 + 4 * j) + c;
      const float y = __ldg(&Srow[min(n, p - 1)]);
      x[j][c] = row < r && n < p ? y : 0.f;
    }
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    StoreSplitPair<kP>(&planes[row * kLd + 2 * (pair0 + 4 * j)], kPlane, x[j][0], x[j][1]);
  }
}

// Output rows of query block i, n-tiles kN0 .. kN0 + kNt - 1 (8 columns each).
template <bool kGated, bool kNorm, int kN0, int kNt, int kP, bool kFull>
__device__ __forceinline__ void QueryRows(const Block<kFull>& bk, const SmatCudaDims& d, int b,
                                          int h, int64_t c0, int i, const Outputs& out) {
  constexpr int kPairs = (kNt + 1) / 2;  // ldmatrix x4 .trans loads two n-tiles
  const int g = bk.g, tq = bk.tq;
  float hi[kNt][4], lo[kNt][4];
  cuda_detail::ZeroAcc(hi);
  cuda_detail::ZeroAcc(lo);
  // State term: phi_t (exact) times the planes of S_in.
  for (int ks = 0; ks < bk.kr(); ++ks) {
    uint32_t a[4];
    Ldsm4(a, bk.Addr(kPhi * kTile, 16 * i, 16 * ks, bk.off_a));
    // Per accumulator the order of Mma1xP: lo += a S3, lo += a S2, hi += a S1.
#pragma unroll
    for (int q = kP - 1; q >= 0; --q) {
#pragma unroll
      for (int np = 0; np < kPairs; ++np) {
        uint32_t bs[4];
        Ldsm4T(bs, bk.Addr(kOffS + q * kPlane, 16 * ks, 8 * kN0 + 16 * np, bk.off_bt));
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          if (2 * np + h2 >= kNt) continue;
          Mma(q == 0 ? hi[2 * np + h2] : lo[2 * np + h2], a, bs[2 * h2], bs[2 * h2 + 1]);
        }
      }
    }
  }
  float lt[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = 16 * i + g + 8 * hr;
    lt[hr] = bk.lam()[row];
    if (kGated) {
      const float wt = bk.wq()[row];
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          hi[nt][2 * hr + e1] = wt * (hi[nt][2 * hr + e1] + lo[nt][2 * hr + e1]);
          lo[nt][2 * hr + e1] = 0.f;
        }
    }
  }
  // With the widths as constants the last n-tile of the right halves
  // (columns 64-71) holds only vbar's ones column (dv = 64): its causal part
  // is the row sum of the score tiles X, added in fp32 instead of kP MMAs
  // and a load of vbar per tile (and the warps' work evens out: the right
  // halves had 5 n-tiles against the left halves' 4).
  constexpr bool kOnesBySums = kFull && kN0 + kNt == 9;
  float ones[2] = {0.f, 0.f};  // this lane's part of rows g, g + 8
  // Causal sum over key blocks j <= i.
  for (int j = 0; j <= i; ++j) {
    float sc[2][4];
    cuda_detail::ZeroAcc(sc);
    for (int ks = 0; ks < bk.kr(); ++ks) {
      uint32_t a[4], bp[4];
      Ldsm4(a, bk.Addr(kPhi * kTile, 16 * i, 16 * ks, bk.off_a));
      Ldsm4(bp, bk.Addr(kPsi * kTile, 16 * j, 16 * ks, bk.off_bn));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) Mma(sc[nt], a, bp[2 * nt], bp[2 * nt + 1]);
    }
    // X[t, s] = W[t, s] A[t, s] for s <= t < ce; the mask only where the tile
    // holds pairs outside (the diagonal block or the chunk's last block).
    if (kGated) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int s = 16 * j + 8 * nt + 2 * tq + (e & 1);
          sc[nt][e] *= expf(lt[e >> 1] - bk.lam()[s]);
        }
    }
    MaskQueryTile(bk, i, j, g, tq, sc);
    if (kOnesBySums) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ones[e >> 1] += sc[nt][e];
    }
    uint32_t xa[kP][4];
    SplitTileParts<kP>(sc, xa);
#pragma unroll
    for (int np = 0; np < kPairs; ++np) {
      if (kOnesBySums && np == kPairs - 1) continue;
      uint32_t bv[4];
      Ldsm4T(bv, bk.Addr(kV * kTile, 16 * j, 8 * kN0 + 16 * np, bk.off_bt));
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        if (2 * np + h2 >= kNt) continue;
        MmaPx1<kP>(hi[2 * np + h2], lo[2 * np + h2], xa, bv[2 * h2], bv[2 * h2 + 1]);
      }
    }
  }
  if (kOnesBySums) {
    // Column dv = 64 (lanes tq = 0, first of their pair) of the causal sum:
    // the row sums of the quad's parts, in a fixed order.
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float x = ones[hr];
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      x += __shfl_xor_sync(0xffffffffu, x, 2);
      if (tq == 0) hi[kNt - 1][2 * hr] += x;
    }
  }
  if (!kNorm) {
    // ybar[t][n] = hi + lo for t < ce, n < p (rows of p = dv + 1 floats).
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int m = 16 * i + g + 8 * hr;
      if (m >= bk.ce) continue;
      float* o = out.ybar + TokenRow(d, b, c0 + m, h) * bk.p();
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int n = 8 * (kN0 + nt) + 2 * tq + e1;
          if (n < bk.p()) o[n] = hi[nt][2 * hr + e1] + lo[nt][2 * hr + e1];
        }
    }
  } else if (kN0 == 0) {
    // The left halves wait in shared memory for the normalisers.
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float* y = bk.yleft() + (16 * i + g + 8 * hr) * kLdY;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          y[8 * nt + 2 * tq + e1] = hi[nt][2 * hr + e1] + lo[nt][2 * hr + e1];
        }
    }
  } else {
    // The right halves hold column dv (p > 32): add the reads, then den and
    // the columns 32 .. dv - 1 of o, as LaunchSmatNormalize computes them.
    const int dv = bk.dv();
    const bool pairs = dv % 2 == 0;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int m = 16 * i + g + 8 * hr;
      const int64_t row = TokenRow(d, b, c0 + m, h);
      const bool read = out.reads != nullptr && c0 + m >= out.recent_begin && m < bk.ce;
      float y[kNt][2];
      float ydv = 0.f;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int n = 8 * (kN0 + nt) + 2 * tq + e1;
          y[nt][e1] = hi[nt][2 * hr + e1] + lo[nt][2 * hr + e1];
          if (read && n < bk.p()) y[nt][e1] += out.reads[row * bk.p() + n];
          if (n == dv) ydv = y[nt][e1];
        }
      // Column dv lives in lane tq = (dv % 8) / 2 of the row's quad.
      ydv = __shfl_sync(0xffffffffu, ydv, (bk.g << 2) | ((dv & 7) >> 1));
      const float dn = ydv + out.eps, inv = 1.f / dn;
      if (m >= bk.ce) continue;
      if (tq == ((dv & 7) >> 1)) {
        bk.inv_den()[m] = inv;
        out.den[row] = dn;
      }
      __nv_bfloat16* o = out.o + row * dv;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        const int n = 8 * (kN0 + nt) + 2 * tq;
        const float o0 = __fmul_rn(y[nt][0], inv), o1 = __fmul_rn(y[nt][1], inv);
        if (pairs && n + 1 < dv) {
          *reinterpret_cast<__nv_bfloat162*>(o + n) = __floats2bfloat162_rn(o0, o1);
        } else {
          if (n < dv) o[n] = __float2bfloat16(o0);
          if (n + 1 < dv) o[n + 1] = __float2bfloat16(o1);
        }
      }
    }
  }
}

// kNorm, after both halves: columns 0-31 of o (all below dv >= 32) from the
// left halves, their reads and the normalisers. 16 threads per row, two
// columns each; a thread's reads are all loaded before the first is used.
template <bool kFull>
__device__ __forceinline__ void FinishLeftHalves(const Block<kFull>& bk, const SmatCudaDims& d,
                                                 int b, int h, int64_t c0, const Outputs& out) {
  constexpr int kRows = kC / (kThreads / 16);  // rows per thread
  const int dv = bk.dv(), tid = threadIdx.x;
  const int n = 2 * (tid & 15), m0 = tid >> 4;
  const bool read = out.reads != nullptr && c0 >= out.recent_begin;  // chunks never cross n
  // Rows m0 + 16 k of the chunk: token rows 16 k H apart.
  const int64_t row0 = TokenRow(d, b, c0 + m0, h), step = int64_t{kThreads / 16} * d.H;
  float x[kRows][2];
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const bool here = read && m0 + k * (kThreads / 16) < bk.ce;
    const float* src = out.reads + (row0 + k * step) * bk.p() + n;
    x[k][0] = here ? src[0] : 0.f;
    x[k][1] = here ? src[1] : 0.f;
  }
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int m = m0 + k * (kThreads / 16);
    if (m >= bk.ce) break;
    const float* yl = bk.yleft() + m * kLdY;
    const float y0 = read ? yl[n] + x[k][0] : yl[n];
    const float y1 = read ? yl[n + 1] + x[k][1] : yl[n + 1];
    const float inv = bk.inv_den()[m];
    const float o0 = __fmul_rn(y0, inv), o1 = __fmul_rn(y1, inv);
    __nv_bfloat16* o = out.o + (row0 + k * step) * dv;
    if (dv % 2 == 0) {
      *reinterpret_cast<__nv_bfloat162*>(o + n) = __floats2bfloat162_rn(o0, o1);
    } else {
      o[n] = __float2bfloat16(o0);
      o[n + 1] = __float2bfloat16(o1);
    }
  }
}

// The block's Block: widths, lane offsets (see ChunkForwardFusedKernel).
template <bool kFull>
__device__ __forceinline__ Block<kFull> MakeBlock(__nv_bfloat16* base, int r, int dv) {
  Block<kFull> bk;
  bk.base = base;
  bk.ce = 0;
  bk.nb = 0;
  bk.r_ = r;
  bk.dv_ = dv;
  const int lane = threadIdx.x & 31;
  bk.g = lane >> 2;
  bk.tq = lane & 3;
  bk.off_a = (lane & 15) * kLd + (lane >> 4) * 8;
  bk.off_bn = ((lane & 7) + ((lane >> 4) << 3)) * kLd + ((lane >> 3) & 1) * 8;
  bk.off_bt = ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8;
  return bk;
}

}  // namespace chunk_fwd_mma
}  // namespace smat
