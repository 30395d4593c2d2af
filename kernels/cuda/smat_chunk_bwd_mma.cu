// B7 (eq. 19 of Appendix E, gated by Lemma 4) for bf16 inputs in one kernel
// on tensor cores: phi_bar, psi_bar and v_bar of a chunk from one staging of
// phi, psi, v and gbar, for c <= 128 tokens and r, dv <= 64. Per chunk k and
// (b, h), with t, s tokens of the chunk, W[t, s] = exp(lam[t] - lam[s]) for
// s <= t (else 0; ungated: 1), G[t, s] = gbar_t . vbar_s, A[t, s] = phi_t . psi_s:
//   phi_bar_t += exp(lam_t) S_in gbar_t   + sum_{s <= t} W G[t, s] psi_s     (query rows)
//   psi_bar_s += w_s D_bar vbar_s         + sum_{t >= s} W G[t, s] phi_t     (key rows)
//   v_bar_s   += w_s (D_bar^T psi_s)[:dv] + sum_{t >= s} W A[t, s] gbar_t[:dv]
// (w_s = exp(chunk_decay[k] - lam_s); kAssign: = in place of +=, the
// SmatWrite::kAssign of SmatBackward). LaunchSmatChunkOutputsBackwardMma runs it
// for bf16 inputs (the default where SmatUseMmaChunkTiles says so, and with
// SMAT_CUDA_CHUNK_TILES=mma); fp32 inputs keep the three tiles of
// smat_chunk_mma.cu, and SMAT_CUDA_CHUNK_TILES=ffma the FFMA tiles of
// smat_chunk_fast.cu. On devices of compute capability 9.0, ChunkBackward's
// case (ungated, r = dv = 64, gbar's factors, outputs written) runs on
// warpgroup MMAs instead (smat_chunk_bwd_wgmma.sm90a.cu) unless
// SMAT_CUDA_CHUNK_TILES=mma.
//
// Staging, once per block: phi, psi, v as bf16 token rows (cp.async, 16 bytes
// at a time where rows allow it), and gbar[:, 0:dv] split into three bf16
// parts (x = x1 + x2 + x3, as in smat_chunk_mma.cu), each [128][72] bf16 (the
// 144-byte pitch puts the 8 rows of an ldmatrix in distinct bank groups), all
// zero beyond the chunk's tokens and widths. The ones column of vbar never
// enters a product: its terms are fp32 additions (gbar[t][dv] in every score
// G[t, s], D_bar[:, dv] in the key side, gbar[t][dv] S_in[:, dv] in the query
// side). 112 KB of shared memory and <= 128 registers: two blocks per SM, so
// one block's staging overlaps the other's products.
//
// Products: mma.sync m16n8k16 bf16 with fp32 accumulation. Each warp owns
// 16-row output blocks; for each live 16-token block of the other side it
// computes the 16 x 16 score tile in the orientation its rows need (G for
// query rows, G^T and A^T for key rows: recomputing is cheaper than a
// transpose through memory), applies the mask and W in registers, splits the
// fp32 tile into three bf16 A fragments (the accumulator layout of m16n8 is
// the A layout of m16k16) and multiplies by the staged rows of that block
// (ldmatrix, .trans where the k index is the token). Dead causal blocks are
// skipped. Each warp takes one row block of each output, all its columns
// (see the kernel for which), so that each score tile is computed once per
// orientation it is needed in: A^T once for all of v_bar's columns, where two
// 32-column halves on two warps computed it twice (B7 5.63-5.68 ->
// 5.43-5.46 ms at the shape below, 2026-12-01).
//
// With one part (kP = 1) the side terms are the row owners' (OwnerSide): S_in
// and D_bar wait in shared memory as one bf16 plane each (18 KB, 95.5 KB per
// block, still two per SM), and each warp adds them to its rows' accumulators
// before its one store, so no pass reads the outputs back (B7 4.10 -> 2.48 ms
// with one part at the shape below, 2026-12-01). With three parts they
// follow, after a block barrier, by column blocks instead (SideTerms): warp w
// adds 16 columns of all three outputs for 64 tokens, so each warp loads and
// splits a quarter of S_in and D_bar.
// With three parts and the rows' owners computing them, every warp loaded and split all of both:
// half the kernel's instructions, 7.27 ms against 6.24 ms then. S_in and D_bar reach the warps
// through phi's tile (StageSide), one coalesced pass each, instead of every warp's scattered
// fragment loads from global memory: 5.66 -> 5.59 ms, the kernel being bound by L1 throughput
// (Nsight Compute: 85% of its peak).
//
// Exactness (the scheme of smat_chunk_mma.cu): bf16 inputs enter as one part;
// every fp32 operand (gbar, S_in, D_bar, the score tiles) as three, a product
// with one fp32 operand takes 3 MMAs and with two 6 (the terms down to 2^-16
// relative), the correction terms summed small ones first in an accumulator of
// their own, added to the leading one at the end. Each output element is summed
// in a fixed order, read, added to and written by one thread, no atomics: the
// same inputs give the same bits, within 1e-5 of the CPU phases
// (tests/gpu/smat_gpu_test.cc). The parts are a template argument (kP):
// SMAT_CUDA_BF16_PARTS=1 rounds each fp32 operand to bf16 once (kP = 1, up
// to 2^-8 relative per product): 4.81 -> 4.13 ms at the shape below
// (2026-12-01; the kernel stays bound by its memory traffic and the side
// terms' read-back). SMAT_CUDA_BF16_PARTS=2 (SmatBf16SplitParts) runs two,
// 16 significant bits, a product with two split operands 3 MMAs (5536 per chunk and head instead
// of 8832): 5.63 -> 5.18 ms at the shape below, up to 5.8e-6 of the CPU
// phases against 4e-7 with three.
//
// gbar by its factors (kDo; SmatGbarFactors, which ChunkBackward passes for a
// bf16 d_o, as the trainer's and the op's o are bf16). B1 makes gbar_t[0:dv] =
// d_o_t / den_t, so B7 stages d_o's bf16 rows as one exact plane and 1 / den_t
// (fp32) instead of gbar split into kP planes, and applies 1 / den_t in fp32
// where each product is done: G[t, s] = (d_o_t . v_s) / den_t + gbar_t[dv]
// (one MMA per n8 tile and k step where three parts took three), v_bar's
// X^T d_o with X^T's column t scaled first (kP MMAs where both split took
// six), the query side S_in d_o_t / den_t (three where it took six). Three
// parts: 8544 -> 5760 MMAs per chunk and head, a third of the gbar staging's
// bytes per chunk in shared memory (one plane, not three), and ChunkBackward
// 6.47 -> 5.76-5.78 ms at the shape below (2026-12-02), its errors against the
// CPU phases lower (v_bar 1.2e-6 -> 7.2e-7 of the largest reference). One
// part: the same MMAs (4.13 against 4.18 ms, within the spread between runs),
// its errors lower (psi_bar 4.6e-3 -> 3.1e-3). With gbar's planes gone, two
// or three parts have room for S_in's own planes (kSidePlanes: 105.7 KB per
// block with three, still two blocks per SM), so the query rows' owners add
// the S_in side term before their one store (OwnerSide), and SideTerms keeps
// the two key sides: ChunkBackward 5.76-5.78 -> 5.53-5.54 ms (three parts).
// Then the key sides too, with D_bar's kP planes in the same region: the
// block stages D_bar's planes, every warp runs its psi_bar and v_bar rows
// (adding the D_bar side before each store) and then its query rows' causal
// sum, a block barrier, S_in's planes over D_bar's, a barrier, and the query
// rows' side and store. No pass reads an output back: ChunkBackward 5.53 ->
// 4.93-4.96 ms (three parts), 5.38 -> 4.54 ms (two), at the shape below
// (2026-12-02). Both matrices' planes at once would take 133 KB, one block
// per SM.
//
// Speed (H200, r = dv = 64, c = 128, T = 524288, 8 heads, 2026-12-01): 5.64 ms
// ungated and 5.94 ms gated with the widths as constants (Block<kFull>, 72 KB
// of code against 105 KB; 5.70 and 6.01 ms with the launch's widths); the
// off-diagonal gates from their factors (mma_tiles::GateFactors; 6.11 ms
// with an exp per element), writing its
// outputs (kAssign; ungated 7.27 ms with the side terms by rows, 8.51 ms
// adding to outputs read back), against 21.7 ms for the three FFMA tiles;
// 5.43-5.46 ms with v_bar's rows on one warp each, 4.93-4.97 ms with the
// side terms by 16 columns of half the rows (8 columns of every row before:
// each warp loaded the A fragments of the whole chunk), 4.70-4.74 ms with
// their old values loaded a row block ahead. Per (chunk, b * H) the kernel
// issues 8544 MMAs (the splits make that about five times the FLOPs of an
// exact product): about 240 TFLOP/s of mma.sync at 4.7 ms. The
// kernel is instruction-fetch sensitive: at 174 KB of code (every loop
// unrolled) it took 13.9 ms, hence the loops kept rolled below. 128 registers,
// 114,432 bytes of shared memory.
//
// Where it waits (Nsight Compute, 2026-12-02, the ungated kernel of three
// parts and gbar by its factors at the shape above): 8.1 cycles between a
// warp's instructions, of which 1.9 on fixed-latency results (its MMA and
// split chains), 1.05 on shared-memory results, 0.84 on global loads, 0.72
// on a busy tensor pipe, 0.57 at barriers; 0.94 eligible warps per
// scheduler, DRAM 48%, L1 75%. Latency, not one pipe, bounds it. Not kept:
// each block prefetching into L2 the inputs of the block a wave (two per SM)
// after it: ChunkBackward 4.14-4.18 -> 4.23-4.25 ms.
//
// The block shape, Block, StoreRows and SideTerms: smat_chunk_bwd_mma.cuh.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "kernels/cuda/smat_chunk_bwd_mma.cuh"
#include "kernels/cuda/smat_chunk_bwd_wgmma.h"
#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_fast_tiles.cuh"
#include "kernels/cuda/smat_mma.cuh"

namespace smat {
namespace {

using cuda_detail::ChunkRow;
using cuda_detail::TokenRow;
using namespace mma_tiles;      // NOLINT: the tensor-core pieces are this file's vocabulary
using namespace chunk_bwd_mma;  // NOLINT: the kernel's shared pieces

// The causal sum of phi_bar's rows t of block i into hi + lo (the kernel
// adds the side term and stores them).
template <bool kGated, bool kFull, int kP, bool kDo>
__device__ __forceinline__ void QuerySums(const Block<kFull, kP, kDo>& bk, int i, float (&hi)[8][4],
                                          float (&lo)[8][4]) {
  const int g = bk.g, tq = bk.tq, r = bk.r();
  constexpr int kGP = Block<kFull, kP, kDo>::kGP;
  float gc[2], gm[2], lt[2], rt[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    gc[hr] = bk.gcol()[16 * i + g + 8 * hr];
    gm[hr] = kDo ? bk.gs()[16 * i + g + 8 * hr] : 1.f;
    lt[hr] = bk.lam()[16 * i + g + 8 * hr];
    rt[hr] = kGated ? bk.rf()[16 * i + g + 8 * hr] : 1.f;
  }
  cuda_detail::ZeroAcc(hi);
  cuda_detail::ZeroAcc(lo);
  // Causal sum over key blocks j <= i.
  for (int j = 0; j <= i; ++j) {
    float sc[2][4], scl[2][4];
    cuda_detail::ZeroAcc(sc);
    cuda_detail::ZeroAcc(scl);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (ks >= bk.kd()) continue;
      uint32_t a[kGP][4], bv[4];
      bk.LoadG(a, 16 * i, 16 * ks, bk.off_a);
      Ldsm4(bv, bk.Addr(kV, 16 * j, 16 * ks, bk.off_bn));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) MmaPx1<kGP>(sc[nt], scl[nt], a, bv[2 * nt], bv[2 * nt + 1]);
    }
    // X[t, s] = W[t, s] (G[t, s] + gbar[t][dv]) for s <= t < ce; the mask
    // only where the tile holds pairs outside (diagonal or last block). W
    // off the diagonal from its factors (GateFactors). kDo: G[t, s] =
    // (d_o_t . v_s) / den_t.
    float rq[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      rq[hr] = kGated && j < i ? rt[hr] * bk.bb()[i * kBlocks + j] : 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float gv = sc[nt][e] + scl[nt][e];
        sc[nt][e] = kDo ? fmaf(gm[e >> 1], gv, gc[e >> 1]) : gv + gc[e >> 1];
      }
    if (kGated && j == i) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sc[nt][e] *= expf(lt[e >> 1] - bk.lam()[16 * j + 8 * nt + 2 * tq + (e & 1)]);
    } else if (kGated) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          sc[nt][e] *= rq[e >> 1] * bk.cf()[16 * j + 8 * nt + 2 * tq + (e & 1)];
    }
    MaskQueryTile(bk, i, j, g, tq, sc);
    uint32_t xa[kP][4];
    SplitTileParts<kP>(sc, xa);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (16 * np >= r) continue;
      uint32_t bp[4];
      Ldsm4T(bp, bk.Addr(kPsi, 16 * j, 16 * np, bk.off_bt));
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2)
        MmaPx1<kP>(hi[2 * np + h2], lo[2 * np + h2], xa, bp[2 * h2], bp[2 * h2 + 1]);
    }
  }
}

// A key-row tile X^T[s, t] (rows s of block j: ls = lam_s; columns t of
// block i >= j) times W[t, s]: the diagonal tile by an exp per element, the
// others from mma_tiles::GateFactors' factors (rk = cf[s] bb[i][j]).
template <bool kFull, int kP, bool kDo>
__device__ __forceinline__ void GateKeyTile(const Block<kFull, kP, kDo>& bk, int i, int j, int tq,
                                            const float (&ls)[2], const float (&rk)[2],
                                            float (&sc)[2][4]) {
  if (j == i) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sc[nt][e] *= expf(bk.lam()[16 * i + 8 * nt + 2 * tq + (e & 1)] - ls[e >> 1]);
  } else {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sc[nt][e] *= rk[e >> 1] * bk.rf()[16 * i + 8 * nt + 2 * tq + (e & 1)];
  }
}

// psi_bar rows s of block j += the causal sum (kAssign: =).
template <bool kGated, bool kAssign, bool kFull, int kP, bool kDo>
__device__ __forceinline__ void KeyRowsPsi(const Block<kFull, kP, kDo>& bk, const SmatCudaDims& d,
                                           int b, int h, int64_t c0, int j,
                                           float* __restrict__ psi_bar) {
  const int g = bk.g, tq = bk.tq, r = bk.r();
  float hi[8][4], lo[8][4];
  float ls[2], cs[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    ls[hr] = bk.lam()[16 * j + g + 8 * hr];
    cs[hr] = kGated ? bk.cf()[16 * j + g + 8 * hr] : 1.f;
  }
  cuda_detail::ZeroAcc(hi);
  cuda_detail::ZeroAcc(lo);
  // Causal sum over query blocks i >= j.
  for (int i = j; i < bk.nb; ++i) {
    float sc[2][4], scl[2][4];
    cuda_detail::ZeroAcc(sc);
    cuda_detail::ZeroAcc(scl);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (ks >= bk.kd()) continue;
      constexpr int kGP = Block<kFull, kP, kDo>::kGP;
      uint32_t a[4], bg[kGP][4];
      Ldsm4(a, bk.Addr(kV, 16 * j, 16 * ks, bk.off_a));
      bk.LoadG(bg, 16 * i, 16 * ks, bk.off_bn);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t bb[kGP][2];
#pragma unroll
        for (int q = 0; q < kGP; ++q) {
          bb[q][0] = bg[q][2 * nt];
          bb[q][1] = bg[q][2 * nt + 1];
        }
        Mma1xP<kGP>(sc[nt], scl[nt], a, bb);
      }
    }
    // X^T[s, t] = W[t, s] (G[t, s] + gbar[t][dv]) for s <= t < ce (masked as
    // in QueryRows; kDo: G[t, s] = (v_s . d_o_t) / den_t).
    float rk[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      rk[hr] = kGated && j < i ? cs[hr] * bk.bb()[i * kBlocks + j] : 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 16 * i + 8 * nt + 2 * tq + (e & 1);
        const float gv = sc[nt][e] + scl[nt][e];
        sc[nt][e] = kDo ? fmaf(bk.gs()[t], gv, bk.gcol()[t]) : gv + bk.gcol()[t];
      }
    if (kGated) GateKeyTile(bk, i, j, tq, ls, rk, sc);
    MaskTile</*kKeyRows=*/true>(bk, i, j, g, tq, sc);
    uint32_t xa[kP][4];
    SplitTileParts<kP>(sc, xa);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (16 * np >= r) continue;
      uint32_t bp[4];
      Ldsm4T(bp, bk.Addr(kPhi, 16 * i, 16 * np, bk.off_bt));
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2)
        MmaPx1<kP>(hi[2 * np + h2], lo[2 * np + h2], xa, bp[2 * h2], bp[2 * h2 + 1]);
    }
  }
  if constexpr (kSidePlanes<kP, kDo> != 0) OwnerSide<Side::kKeyPsi>(bk, j, hi, lo);
  StoreRows<8, kAssign>(bk, d, b, h, c0, 16 * j, 0, r, bk.pairs_r(), hi, lo, psi_bar);
}

// v_bar rows s of block j, every column, += the causal sum (kAssign: =):
// each score tile once for all dv columns.
template <bool kGated, bool kAssign, bool kFull, int kP, bool kDo>
__device__ __forceinline__ void KeyRowsV(const Block<kFull, kP, kDo>& bk, const SmatCudaDims& d,
                                         int b, int h, int64_t c0, int j,
                                         float* __restrict__ v_bar) {
  const int g = bk.g, tq = bk.tq, dv = bk.dv();
  float hi[8][4], lo[8][4];
  float ls[2], cs[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    ls[hr] = bk.lam()[16 * j + g + 8 * hr];
    cs[hr] = kGated ? bk.cf()[16 * j + g + 8 * hr] : 1.f;
  }
  cuda_detail::ZeroAcc(hi);
  cuda_detail::ZeroAcc(lo);
  // psi_j's A fragments, the same for every query block, loaded once (B7
  // 4.93-4.97 -> 4.90-4.94 ms). KeyRowsPsi keeps loading vbar_j's per block:
  // holding them too spills the gated kernels. Held in the ungated kernels
  // only, with QuerySums holding d_o_i's as well (a quarter of the causal
  // sums' ldmatrix, 127 registers, no spills), they changed nothing:
  // ChunkBackward 4.058-4.064 against 4.063 ms (H200, bf16, T = 524288,
  // d = 2, 8 heads, 2026-12-02; 3.50 against 3.45 ms with one part), so the
  // fragments' loads are not what bounds the kernel.
  uint32_t ap[4][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    if (ks < bk.kr()) Ldsm4(ap[ks], bk.Addr(kPsi, 16 * j, 16 * ks, bk.off_a));
  }
  for (int i = j; i < bk.nb; ++i) {
    float sc[2][4];
    cuda_detail::ZeroAcc(sc);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (ks >= bk.kr()) continue;
      uint32_t bp[4];
      Ldsm4(bp, bk.Addr(kPhi, 16 * i, 16 * ks, bk.off_bn));
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) Mma(sc[nt], ap[ks], bp[2 * nt], bp[2 * nt + 1]);
    }
    // X^T[s, t] = W[t, s] A[t, s] for s <= t < ce (masked as in QueryRows).
    if (kGated) {
      float rk[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) rk[hr] = j < i ? cs[hr] * bk.bb()[i * kBlocks + j] : 0.f;
      GateKeyTile(bk, i, j, tq, ls, rk, sc);
    }
    MaskTile</*kKeyRows=*/true>(bk, i, j, g, tq, sc);
    if constexpr (kDo) {
      // gbar_t[:dv] = d_o_t / den_t: X^T's column t takes the 1 / den_t, so
      // that d_o enters the product as one exact part.
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[nt][e] *= bk.gs()[16 * i + 8 * nt + 2 * tq + (e & 1)];
    }
    uint32_t xa[kP][4];
    SplitTileParts<kP>(sc, xa);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (16 * np >= dv) continue;
      constexpr int kGP = Block<kFull, kP, kDo>::kGP;
      uint32_t bg[kGP][4];
      bk.template LoadG</*kTrans=*/true>(bg, 16 * i, 16 * np, bk.off_bt);
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        if constexpr (kDo) {
          MmaPx1<kP>(hi[2 * np + h2], lo[2 * np + h2], xa, bg[0][2 * h2], bg[0][2 * h2 + 1]);
        } else {
          uint32_t bb[kP][2];
#pragma unroll
          for (int q = 0; q < kP; ++q) {
            bb[q][0] = bg[q][2 * h2];
            bb[q][1] = bg[q][2 * h2 + 1];
          }
          MmaPxP<kP>(hi[2 * np + h2], lo[2 * np + h2], xa, bb);
        }
      }
    }
  }
  if constexpr (kSidePlanes<kP, kDo> != 0) OwnerSide<Side::kKeyV>(bk, j, hi, lo);
  StoreRows<8, kAssign>(bk, d, b, h, c0, 16 * j, 0, dv, bk.pairs_v(), hi, lo, v_bar);
}

// grid ChunkGrid(d), kThreads threads, kSmemBytes<kP, kDo> of shared memory.
// kAssign: the outputs are written, not added to (SmatWrite::kAssign).
// kFull: r = dv = kW, vec_in, pairs_r and pairs_v (see Block). kP: the bf16
// parts of every fp32 operand (SmatBf16SplitParts). kDo: gbar's columns < dv
// from their factors gf (SmatGbarFactors; vec_in then covers d_o's rows), only
// column dv from gbar.
template <bool kGated, bool kAssign, bool kFull, int kP, bool kDo>
__global__ void __launch_bounds__(kThreads, 2)
    ChunkBackwardFusedKernel(SmatCudaDims d, bool vec_in, bool pairs_r, bool pairs_v,
                             const __nv_bfloat16* __restrict__ phi,
                             const __nv_bfloat16* __restrict__ psi,
                             const __nv_bfloat16* __restrict__ v, const float* __restrict__ lam,
                             const float* __restrict__ cd, const float* __restrict__ S_in,
                             const float* __restrict__ gbar, const float* __restrict__ D_bar,
                             float* __restrict__ phi_bar, float* __restrict__ psi_bar,
                             float* __restrict__ v_bar, SmatDBarCarry dc, SmatGbarFactors gf) {
  __nv_bfloat16* tiles = SmemTiles();
  float* gcol = SmemTokens<kP, kDo>();
  float* lam_s = gcol + kC;
  float* wq = lam_s + kC;
  float* wk = wq + kC;

  const int tid = threadIdx.x;
  const cuda_detail::ChunkBlock blk(d);
  const int64_t k = blk.k;
  const int b = blk.b, h = blk.h;
  const int64_t c0 = k * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));  // tokens held
  const TileWidths<kFull> wd{d.r, d.dv};
  const int r = wd.r(), dv = wd.dv(), p = wd.p();
  if (kFull) vec_in = true;
  const int64_t crow = ChunkRow(d, b, k, h);
  // D_bar = Dk + dscale Dc where it comes in two pieces (SmatDBarCarry);
  // found where it is read, not held across the causal sums (registers).
  auto carried = [&](const float** Dc, float* dscale) {
    *Dc = nullptr;
    *dscale = 1.f;
    if (dc.carry == nullptr) return;
    const int runs = dc.runs.seg_d + dc.runs.seg_r;
    *Dc = dc.carry + (static_cast<int64_t>(b * d.H + h) * runs + cuda_detail::RunOf(dc.runs, k)) *
                         static_cast<int64_t>(r) * p;
    if (dc.scale != nullptr) *dscale = __ldg(&dc.scale[crow]);
  };

  // ---- staging ----
  const int64_t tok = TokenRow(d, b, c0, h);
  StageBf16Rows<kC, kW, kLd, kThreads>(phi + tok * r, static_cast<int64_t>(d.H) * r, r, ce, vec_in,
                                       tiles + kPhi * kTile);
  StageBf16Rows<kC, kW, kLd, kThreads>(psi + tok * r, static_cast<int64_t>(d.H) * r, r, ce, vec_in,
                                       tiles + kPsi * kTile);
  StageBf16Rows<kC, kW, kLd, kThreads>(v + tok * dv, static_cast<int64_t>(d.H) * dv, dv, ce, vec_in,
                                       tiles + kV * kTile);
  {
    // gbar[:, 0:dv] in kP parts, a column pair (n, n + 1) per thread and
    // step (StoreSplitPair: a 4-byte store per part); gcol = gbar[:, dv]. All 32
    // loads of a thread issue before the first use (clamped indices, no
    // branches). kDo: d_o's rows instead, as they are, and gs = 1 / den.
    const float* tg = gbar + tok * p;
    const int64_t sg = static_cast<int64_t>(d.H) * p;
    constexpr int kBatch = 8;  // pairs
    if constexpr (kDo) {
      StageBf16Rows<kC, kW, kLd, kThreads>(static_cast<const __nv_bfloat16*>(gf.d_o) + tok * dv,
                                           static_cast<int64_t>(d.H) * dv, dv, ce, vec_in,
                                           tiles + kG * kTile);
      if (tid < kC) {
        float* gs = gcol + 6 * kC + 2 * kW + kBlocks * kBlocks;  // Block::gs()
        gs[tid] = tid < ce ? 1.f / __ldg(&gf.den[tok + static_cast<int64_t>(tid) * d.H]) : 0.f;
      }
    }
    for (int e0 = tid; !kDo && e0 < kC * kW / 2; e0 += kThreads * kBatch) {
      float x[kBatch][2];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e >> 5, n = 2 * (e & 31);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float y = __ldg(&tg[min(t, ce - 1) * sg + min(n + c, dv - 1)]);
          x[u][c] = t < ce && n + c < dv ? y : 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e >> 5, n = 2 * (e & 31);
        StoreSplitPair<kP>(&tiles[kG * kTile + t * kLd + n], kTile, x[u][0], x[u][1]);
      }
    }
    if (tid < kC) {
      // gbar's column dv, from gden where it is a tensor of its own.
      const bool own = kDo && gf.gden != nullptr;
      const float* gc = own ? gf.gden + tok : tg + dv;
      gcol[tid] = tid < ce ? __ldg(&gc[tid * (own ? static_cast<int64_t>(d.H) : sg)]) : 0.f;
      // Ungated (kGated false: no lam) the weights below are exp(0) = 1
      // exactly; the side terms apply them, the causal sums skip W.
      const float l = kGated && tid < ce ? __ldg(&lam[tok + static_cast<int64_t>(tid) * d.H]) : 0.f;
      lam_s[tid] = l;
      wq[tid] = expf(l);
      wk[tid] = expf((kGated ? __ldg(&cd[crow]) : 0.f) - l);
    }
    if (tid < 2 * kW) {
      const float* M = (tid < kW ? S_in : D_bar) + crow * static_cast<int64_t>(r) * p;
      const int n = tid & (kW - 1);
      float x = n < r ? __ldg(&M[n * p + dv]) : 0.f;
      const float* Dc;
      float dscale;
      carried(&Dc, &dscale);
      if (tid >= kW && Dc != nullptr && n < r) x = fmaf(dscale, __ldg(&Dc[n * p + dv]), x);
      wk[kC + tid] = x;
    }
  }
  const float* Sk = S_in + crow * static_cast<int64_t>(r) * p;
  const float* Dk = D_bar + crow * static_cast<int64_t>(r) * p;
  __nv_bfloat16* const planes =
      reinterpret_cast<__nv_bfloat16*>(reinterpret_cast<char*>(tiles) + kSideOffsetBytes<kP, kDo>);
  if constexpr (kSidePlanes<kP, kDo> != 0) {
    // The side planes for OwnerSide: one part, S_in and D_bar (with its
    // carry) as one bf16 plane each; kDo with kP parts, D_bar in its kP for
    // the key rows' owners (S_in follows, over them, for the query rows').
    const float* Dc;
    float dscale;
    carried(&Dc, &dscale);
    if constexpr (kP == 1) {
      StageSidePlanes<kP, 2, 6>(Sk, Dk, Dc, dscale, r, dv, p, planes);
    } else {
      StageSidePlanes<kP, 1, kSideItems<1>>(nullptr, Dk, Dc, dscale, r, dv, p, planes);
    }
  }
  if (vec_in) CpAsyncWaitAll();
  __syncthreads();
  if (kGated) {
    GateFactors<kC, kThreads>(ce, lam_s, wk + kC + 2 * kW);
    __syncthreads();
  }

  Block<kFull, kP, kDo> bk;
  bk.ce = ce;
  bk.nb = (ce + 15) >> 4;
  bk.r_ = r;
  bk.dv_ = dv;
  bk.pairs_r_ = pairs_r;
  bk.pairs_v_ = pairs_v;
  bk.base = SmemAddr(tiles);
  bk.lane = tid & 31;
  bk.g = bk.lane >> 2;
  bk.tq = bk.lane & 3;
  bk.off_a = (bk.lane & 15) * kLd + (bk.lane >> 4) * 8;
  bk.off_bn = ((bk.lane & 7) + ((bk.lane >> 4) << 3)) * kLd + ((bk.lane >> 3) & 1) * 8;
  bk.off_bt = ((bk.lane & 7) + ((bk.lane >> 3) & 1) * 8) * kLd + (bk.lane >> 4) * 8;

  const int w = tid >> 5;
  // The row blocks of warp w: psi_bar rows 2 (w % 4) + w / 4, v_bar rows
  // 7 - w (8 - j query blocks for key rows j) and query rows (w + 4) % 8 (a
  // causal sum over (w + 4) % 8 + 1 key blocks): 13 or 14 score tiles and
  // their products per warp of a full chunk. The query rows come last: with
  // kP > 1 parts and kDo their side plane (S_in) replaces D_bar's once every
  // warp has added the key sides.
  const int qi = (w + 4) & 7, pj = 2 * (w & 3) + (w >> 2), vj = 7 - w;
  if (pj < bk.nb) KeyRowsPsi<kGated, kAssign>(bk, d, b, h, c0, pj, psi_bar);
  if (vj < bk.nb) KeyRowsV<kGated, kAssign>(bk, d, b, h, c0, vj, v_bar);
  if constexpr (kP > 1 && kDo) {
    // S_in's rows on their way to L2 while the query sums run (a warp per
    // eighth of the 128-byte lines): its staging below then waits on L2, not
    // on memory.
    const int n = r * p, lines = (n + 31) / 32, line = w + (kThreads / 32) * bk.lane;
    if (line < lines) asm volatile("prefetch.global.L2 [%0];" ::"l"(Sk + 32 * line));
  }
  float hi[8][4], lo[8][4];
  if (qi < bk.nb) QuerySums<kGated>(bk, qi, hi, lo);
  if constexpr (kP > 1 && kDo) {
    // The sum's correction terms folded in now, as OwnerSide would first:
    // half the registers held across the restaging (holding S_in's loads
    // across the barrier as well spills).
    FoldCorrections(hi, lo);
    __syncthreads();
    StageSidePlanes<kP, 1, 3>(nullptr, Sk, nullptr, 1.f, r, dv, p, planes);
    __syncthreads();
  }
  if (qi < bk.nb) {
    if constexpr (kSidePlanes<kP, kDo> != 0) OwnerSide<Side::kQuery>(bk, qi, hi, lo);
    StoreRows<8, kAssign>(bk, d, b, h, c0, 16 * qi, 0, r, bk.pairs_r(), hi, lo, phi_bar);
  }
  if constexpr (kSidePlanes<kP, kDo> == 0) {
    // No side planes (gbar in kP parts): the side terms add to rows that
    // other warps' causal sums wrote. Their matrices come through shared
    // memory, into phi's tile, which they do not read: D_bar for the two key
    // sides, then S_in for the query side.
    float* const side = reinterpret_cast<float*>(tiles + kPhi * kTile);
    static_assert(kW * (kW + 1) * 4 <= kTile * 2, "S_in or D_bar fits phi's tile");
    __syncthreads();
    {
      const float* Dc;
      float dscale;
      carried(&Dc, &dscale);
      StageSide(Dk, r * p, side, Dc, dscale);
    }
    __syncthreads();
    SideTerms<Side::kKeyPsi>(bk, d, b, h, c0, w, side, psi_bar);
    SideTerms<Side::kKeyV>(bk, d, b, h, c0, w, side, v_bar);
    __syncthreads();
    StageSide(Sk, r * p, side);
    __syncthreads();
    SideTerms<Side::kQuery>(bk, d, b, h, c0, w, side, phi_bar);
  }
}

bool Aligned8(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 7) == 0; }

template <bool kGated, bool kAssign, int kP, bool kDo>
cudaError_t LaunchGated(const SmatCudaDims& d, const void* phi, const void* psi, const void* v,
                        const float* lam, const float* chunk_decay, const float* S_in,
                        const float* gbar, const float* D_bar, float* phi_bar, float* psi_bar,
                        float* v_bar, const SmatDBarCarry& dc, const SmatGbarFactors& gf,
                        cudaStream_t stream) {
  // Rows by 16-byte pieces where every staged row allows it (d_o's too, kDo).
  const bool vec = d.r % 8 == 0 && d.dv % 8 == 0 && fast_tiles::Aligned16(phi) &&
                   fast_tiles::Aligned16(psi) && fast_tiles::Aligned16(v) &&
                   (!kDo || fast_tiles::Aligned16(gf.d_o));
  const bool pairs_r = d.r % 2 == 0 && Aligned8(phi_bar) && Aligned8(psi_bar);
  const bool pairs_v = d.dv % 2 == 0 && Aligned8(v_bar);
  const bool full = d.r == kW && d.dv == kW && vec && pairs_r && pairs_v;
  auto kernel = full ? ChunkBackwardFusedKernel<kGated, kAssign, true, kP, kDo>
                     : ChunkBackwardFusedKernel<kGated, kAssign, false, kP, kDo>;
  // Two blocks per SM need the largest shared-memory carveout.
  constexpr int kBytes = kSmemBytes<kP, kDo>;
  const cudaError_t err = AllowSharedMemory(kernel, kBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid = cuda_detail::ChunkGrid(d);
  kernel<<<grid, kThreads, kBytes, stream>>>(
      d, vec, pairs_r, pairs_v, static_cast<const __nv_bfloat16*>(phi),
      static_cast<const __nv_bfloat16*>(psi), static_cast<const __nv_bfloat16*>(v), lam,
      chunk_decay, S_in, gbar, D_bar, phi_bar, psi_bar, v_bar, dc, gf);
  return cudaGetLastError();
}

}  // namespace

bool SmatChunkBackwardFusedFits(const SmatCudaDims& d) {
  if (!d.bf16 || !SmatChunkFastTilesFit(d)) return false;
  return SmatDeviceRunsMma(kSmemBytes<3>);  // the larger of the two
}

bool SmatLongRangeFirst(bool by_default) {
  const char* env = std::getenv("SMAT_CUDA_LONG_RANGE_FIRST");
  if (env == nullptr || *env == '\0') return by_default;
  if (std::strcmp(env, "1") == 0) return true;
  if (std::strcmp(env, "0") == 0) return false;
  static std::once_flag warned;
  std::call_once(warned, [env] {
    std::fprintf(stderr, "smat: SMAT_CUDA_LONG_RANGE_FIRST=\"%s\" is not 0 or 1; ignored\n", env);
  });
  return by_default;
}

bool SmatChunkBackwardTilesAdd(const SmatCudaDims& d, const void* phi, const void* psi,
                               const void* v, const float* lam, const void* d_o, const float* S_in,
                               const float* phi_bar, const float* psi_bar, const float* v_bar) {
#if defined(SMAT_HAVE_SM90A)
  return lam == nullptr && d.r == kW && d.dv == kW && d.chunk <= kC && fast_tiles::Aligned16(phi) &&
         fast_tiles::Aligned16(psi) && fast_tiles::Aligned16(v) && fast_tiles::Aligned16(d_o) &&
         fast_tiles::Aligned16(S_in) && Aligned8(phi_bar) && Aligned8(psi_bar) && Aligned8(v_bar) &&
         SmatChunkBackwardOnWgmma();
#else
  return false;
#endif
}

cudaError_t LaunchSmatChunkOutputsBackwardFused(
    const SmatCudaDims& d, const void* phi, const void* psi, const void* v, const float* lam,
    const float* chunk_decay, const float* S_in, const float* gbar, const float* D_bar,
    float* phi_bar, float* psi_bar, float* v_bar, bool assign, cudaStream_t stream,
    const SmatDBarCarry* carry, const SmatGbarFactors* factors, const SmatChunkBackwardAdds* adds) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  const SmatDBarCarry dc = carry != nullptr ? *carry : SmatDBarCarry();
  const bool by_factors = factors != nullptr && factors->d_o != nullptr && factors->den != nullptr;
  const SmatGbarFactors gf = by_factors ? *factors : SmatGbarFactors();
  // B7 on warpgroup MMAs, the one that adds to some rows and writes others.
  const bool on_wgmma =
      by_factors && assign &&
      SmatChunkBackwardTilesAdd(d, phi, psi, v, lam, gf.d_o, S_in, phi_bar, psi_bar, v_bar);
  if (adds != nullptr && !on_wgmma) return cudaErrorInvalidValue;
  auto launch = [&](auto gated, auto write, auto by_do) {
    return mma_tiles::WithSplitParts(SmatBf16SplitParts(), [&](auto parts) {
      return LaunchGated<decltype(gated)::value, decltype(write)::value, decltype(parts)::value,
                         decltype(by_do)::value>(d, phi, psi, v, lam, chunk_decay, S_in, gbar,
                                                 D_bar, phi_bar, psi_bar, v_bar, dc, gf, stream);
    });
  };
  using Yes = std::true_type;
  using No = std::false_type;
  // The factors come with ChunkBackward, which writes its outputs.
#if defined(SMAT_HAVE_SM90A)
  if (on_wgmma) {
    return LaunchChunkBackwardWgmma(d, phi, psi, v, S_in, gbar, D_bar, phi_bar, psi_bar, v_bar, dc,
                                    gf, adds != nullptr ? *adds : SmatChunkBackwardAdds(),
                                    SmatBf16SplitParts(), stream);
  }
#endif
  if (by_factors && assign) {
    return lam != nullptr ? launch(Yes(), Yes(), Yes()) : launch(No(), Yes(), Yes());
  }
  if (lam != nullptr) return assign ? launch(Yes(), Yes(), No()) : launch(Yes(), No(), No());
  return assign ? launch(No(), Yes(), No()) : launch(No(), No(), No());
}

}  // namespace smat
