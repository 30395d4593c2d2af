// The shared pieces of the fused forward tile of bf16 inputs
// (smat_chunk_fwd_mma.cu) and of the walk that carries the chunks' states in
// shared memory (smat_chunk_walk.cu): the block shape and shared-memory
// layout, where the rows go (Outputs), the per-block state every warp reads
// (Block), a state's staging into bf16 planes (StageState), a warp's output
// rows of one query block (QueryBlock) and the chunk's o rows from shared
// memory (StoreRows). The kernels and their launchers stay in the .cu files.
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
// Finishing the outputs (kNorm) stages the chunk's bf16 o rows ([kC][kLd])
// for StoreRows: 100 KB, still two blocks per SM.
constexpr int kSmemNormBytes = kSmemBytes + kC * kLd * 2;

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
  // kNorm: the chunk's o rows on their way out.
  __device__ __nv_bfloat16* ostage() const { return base + kSmemBytes / 2; }
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

constexpr int kNt = kLd / 8;  // a query block's n-tiles: columns 0-71 hold p <= 65
static_assert(kNt == 9 && kW == 64, "four n-tile pairs and one more");

// phi_i's A fragments, one per k-step (kr of them), for the state term and
// every key block of query block i.
template <bool kFull>
__device__ __forceinline__ void QueryFragments(const Block<kFull>& bk, int i, uint32_t (&a)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    if (ks < bk.kr()) Ldsm4(a[ks], bk.Addr(kPhi * kTile, 16 * i, 16 * ks, bk.off_a));
  }
}

// acc += phi_i S_in from the planes, per k-step the planes smallest first.
// Lanes 0-15 address n-tile 8's rows for the x2 loads.
template <int kP, bool kFull>
__device__ __forceinline__ void StateTerm(const Block<kFull>& bk, const uint32_t (&a)[4][4],
                                          float (&acc)[kNt][4]) {
  const int p = bk.p(), kr = bk.kr();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    if (ks >= kr) break;
#pragma unroll
    for (int q = kP - 1; q >= 0; --q) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (!kFull && 16 * np >= p) break;
        uint32_t bs[4];
        Ldsm4T(bs, bk.Addr(kOffS + q * kPlane, 16 * ks, 16 * np, bk.off_bt));
        Mma(acc[2 * np], a[ks], bs[0], bs[1]);
        if (kFull || 16 * np + 8 < p) Mma(acc[2 * np + 1], a[ks], bs[2], bs[3]);
      }
      if (p > 64) {
        uint32_t bs[2];
        Ldsm2T(bs, bk.Addr(kOffS + q * kPlane, 16 * ks, 64, bk.off_bt));
        Mma(acc[8], a[ks], bs[0], bs[1]);
      }
    }
  }
}

// acc += the causal sum of query block i over key blocks j <= i: per key block the masked scores
// (gated, times W[t, s]; lt the rows' lam; kP parts, smallest first: MmaPx1 with one accumulator as
// hi and lo) times vbar_j; with the widths as constants vbar's ones column (dv = 64) as the scores'
// row sums in fp32, reduced over the quad in a fixed order and added to column dv at the end.
template <bool kGated, int kP, bool kFull>
__device__ __forceinline__ void CausalTerms(const Block<kFull>& bk, int i,
                                            const uint32_t (&a)[4][4], const float (&lt)[2],
                                            float (&acc)[kNt][4]) {
  const int g = bk.g, tq = bk.tq, p = bk.p(), kr = bk.kr();
  float ones[2] = {0.f, 0.f};  // kFull: this lane's part of rows g, g + 8
  for (int j = 0; j <= i; ++j) {
    float sc[2][4];
    cuda_detail::ZeroAcc(sc);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (ks >= kr) break;
      uint32_t bp[4];
      Ldsm4(bp, bk.Addr(kPsi * kTile, 16 * j, 16 * ks, bk.off_bn));
      Mma(sc[0], a[ks], bp[0], bp[1]);
      Mma(sc[1], a[ks], bp[2], bp[3]);
    }
    if (kGated) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sc[nt][e] *= expf(lt[e >> 1] - bk.lam()[16 * j + 8 * nt + 2 * tq + (e & 1)]);
    }
    MaskQueryTile(bk, i, j, g, tq, sc);
    if (kFull) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ones[e >> 1] += sc[nt][e];
    }
    uint32_t xa[kP][4];
    SplitTileParts<kP>(sc, xa);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (!kFull && 16 * np >= p) break;
      uint32_t bv[4];
      Ldsm4T(bv, bk.Addr(kV * kTile, 16 * j, 16 * np, bk.off_bt));
      MmaPx1<kP>(acc[2 * np], acc[2 * np], xa, bv[0], bv[1]);
      if (kFull || 16 * np + 8 < p) {
        MmaPx1<kP>(acc[2 * np + 1], acc[2 * np + 1], xa, bv[2], bv[3]);
      }
    }
    if (!kFull && p > 64) {
      uint32_t bv[2];
      Ldsm2T(bv, bk.Addr(kV * kTile, 16 * j, 64, bk.off_bt));
      MmaPx1<kP>(acc[8], acc[8], xa, bv[0], bv[1]);
    }
  }
  if (kFull) {
    // Column dv = 64 (lanes tq = 0, first of their pair): the row sums of the
    // quad's parts, in a fixed order.
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float x = ones[hr];
      x += __shfl_xor_sync(0xffffffffu, x, 1);
      x += __shfl_xor_sync(0xffffffffu, x, 2);
      if (tq == 0) acc[8][2 * hr] += x;
    }
  }
}

// Query block i's rows from its sums: ybar (written), or with kNorm the reads
// of recent rows added, den = y[dv] + eps and o = y * (1 / den) as
// LaunchSmatNormalize computes them, o rounded to bf16 into `ostage`
// ([kC][kLd], written out by StoreRows).
template <bool kNorm, bool kFull>
__device__ __forceinline__ void FinishQueryRows(const Block<kFull>& bk, const SmatCudaDims& d,
                                                int b, int h, int64_t c0, int i, const Outputs& out,
                                                __nv_bfloat16* ostage, float (&acc)[kNt][4]) {
  const int g = bk.g, tq = bk.tq, p = bk.p(), dv = bk.dv();
  if (!kNorm) {
    // ybar[t][n] for t < ce, n < p (rows of p = dv + 1 floats).
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int m = 16 * i + g + 8 * hr;
      if (m >= bk.ce) continue;
      float* y = out.ybar + TokenRow(d, b, c0 + m, h) * p;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int n = 8 * nt + 2 * tq + e1;
          if (n < p) y[n] = acc[nt][2 * hr + e1];
        }
    }
    return;
  }
  const bool read = out.reads != nullptr && c0 >= out.recent_begin;  // chunks never cross n
  const int tdv = (dv & 7) >> 1;  // the lane of the quad holding column dv
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int m = 16 * i + g + 8 * hr;
    const bool here = m < bk.ce;
    const int64_t row = TokenRow(d, b, c0 + min(m, bk.ce - 1), h);
    if (read && here) {
      const float* src = out.reads + row * p;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int n = 8 * nt + 2 * tq + e1;
          if (n < p) acc[nt][2 * hr + e1] += src[n];
        }
    }
    float ydv = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        if (8 * nt + 2 * tq + e1 == dv) ydv = acc[nt][2 * hr + e1];
      }
    ydv = __shfl_sync(0xffffffffu, ydv, (g << 2) | tdv);
    const float dn = ydv + out.eps, inv = 1.f / dn;
    if (here && tq == tdv) out.den[row] = dn;
    __nv_bfloat16* srow = ostage + m * kLd;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      const int n = 8 * nt + 2 * tq;
      if (n >= dv) continue;
      *reinterpret_cast<__nv_bfloat162*>(srow + n) = __floats2bfloat162_rn(
          __fmul_rn(acc[nt][2 * hr], inv), __fmul_rn(acc[nt][2 * hr + 1], inv));
    }
  }
}

// The output rows of query block i, every column, in one warp. phi_i's A
// fragments stay in registers for the state term and every key block; each
// score tile is computed once. In this order per element of the accumulator:
// phi_i S_in (gated, times exp(lam_t)), then the causal sum over key blocks j
// <= i (CausalTerms), then the rows out (FinishQueryRows).
template <bool kGated, bool kNorm, int kP, bool kFull>
__device__ __forceinline__ void QueryBlock(const Block<kFull>& bk, const SmatCudaDims& d, int b,
                                           int h, int64_t c0, int i, const Outputs& out,
                                           __nv_bfloat16* ostage) {
  float acc[kNt][4];
  cuda_detail::ZeroAcc(acc);
  uint32_t a[4][4];
  QueryFragments(bk, i, a);
  StateTerm<kP>(bk, a, acc);
  float lt[2];  // gated: the rows' lam
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int row = 16 * i + bk.g + 8 * hr;
    lt[hr] = kGated ? bk.lam()[row] : 0.f;
    if (kGated) {
      const float wt = bk.wq()[row];
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) acc[nt][2 * hr + e1] *= wt;
    }
  }
  CausalTerms<kGated, kP>(bk, i, a, lt, acc);
  FinishQueryRows<kNorm>(bk, d, b, h, c0, i, out, ostage, acc);
}

// The o rows of the chunk at c0 (ce tokens) from `ostage` to memory: whole
// 16-byte pieces where dv % 8 == 0 and o is 16-byte aligned (vec), else one
// element at a time.
template <bool kFull>
__device__ __forceinline__ void StoreRows(const Block<kFull>& bk, const SmatCudaDims& d, int b,
                                          int h, int64_t c0, int ce, const __nv_bfloat16* ostage,
                                          __nv_bfloat16* __restrict__ o, bool vec) {
  const int dv = bk.dv();
  const int64_t row0 = TokenRow(d, b, c0, h), step = d.H;
  if (kFull && vec && ce == kC) {
    // A whole chunk of kW-wide rows: thread t moves piece t % 8 of rows
    // t / 8 + 32 u, its addresses computed once.
    constexpr int kPieces = kW / 8, kRowsPerPass = kThreads / kPieces;
    const int m = threadIdx.x / kPieces, q = threadIdx.x % kPieces;
    uint4* to = reinterpret_cast<uint4*>(o + (row0 + m * step) * kW + 8 * q);
    const uint4* from = reinterpret_cast<const uint4*>(ostage + m * kLd + 8 * q);
    const int64_t jump = kRowsPerPass * step * (kW / 8);
#pragma unroll
    for (int u = 0; u < kC / kRowsPerPass; ++u) to[u * jump] = from[u * kRowsPerPass * (kLd / 8)];
    return;
  }
  if (vec) {
    const int pieces = dv >> 3;
    for (int e = threadIdx.x; e < ce * pieces; e += kThreads) {
      const int m = e / pieces, q = e - m * pieces;
      *reinterpret_cast<uint4*>(o + (row0 + m * step) * dv + 8 * q) =
          *reinterpret_cast<const uint4*>(ostage + m * kLd + 8 * q);
    }
  } else {
    for (int e = threadIdx.x; e < ce * dv; e += kThreads) {
      const int m = e / dv, n = e - m * dv;
      o[(row0 + m * step) * dv + n] = ostage[m * kLd + n];
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
