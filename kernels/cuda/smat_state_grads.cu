// B1 + B5 in one pass over the tokens (SmatKernels::NormalizeBackwardStates)
// for bf16 phi: per chunk k and (b, h), with t the chunk's tokens,
//   gbar_t[0:dv] = do_t / den_t,  gbar_t[dv] = -(do_t . o_t) / den_t,
//   dlam_row_t = eps (do_t . o_t) / den_t                    (where asked for)
//   S_in_bar[k] = sum_t exp(lam_t) phi_t gbar_t^T            (ungated: weight 1)
// gbar is formed once, in registers: it is written out (B7 and the per-type
// reads' adjoint read it later) and, times the token's weight, split into the
// bf16 planes of the product at the same time, so the state gradients do not
// read it back.
//
// Exactness. gbar and dlam_row have the bits NormalizeBackwardTileKernel
// (smat_scan.cu) gives them: one warp per row, lane j holding the pair
// (2 j, 2 j + 1), the row's dot product as the pair products summed by xor
// steps. S_in_bar is summed as the bf16 outer sums of smat_outer_bf16.cu sum
// it (one 128-token segment per chunk, 16 tokens per MMA step): phi one exact
// bf16 part, w_t gbar_t (rounded to fp32) three, lo += a b3, lo += a b2,
// hi += a b1; ungated (w = 1) that is the ChunkStateGradients kernel, so the
// bits are the two phases'. Gated, ChunkStateGradients weights phi instead
// (exp(lam_t) phi_t in three parts, 6 MMAs: smat_grouped_mma.cu), so the two
// differ by fp32 roundings, each within 1e-5 of the CPU; weighting gbar keeps
// phi one part (3 MMAs) and the block at 74 KB (three per SM): 1.7 ms against
// 3.4 ms for the phi-weighted product here. Either way every S_in_bar element
// is summed in one fixed order, no atomics: the same inputs give the same
// bits.
//
// Shared memory: phi and the three parts of the weighted gbar as token rows
// [128][72] bf16 (ldmatrix.trans gives the k = token fragments); the r x p
// result leaves through the phi plane as whole 16-byte pieces. 74 KB: three
// blocks per SM.
//
// Speed (H200, bf16, batch 1, 8 heads, r = dv = 64, c = 128, T = 524288,
// fp32 d_o, bf16 o, 2026-12-01): 1.37 ms ungated, 1.47 ms gated, against
// 2.31 and 3.01 ms for NormalizeBackward and ChunkStateGradients in turn. Its
// traffic (3.8 GB) would take 0.8 ms; the block works through gbar's rows,
// the product and the store one after the other, and three blocks per SM
// (24 warps) hide only part of that. A warp forms eight rows at a time: their
// eight dot products as independent shuffle chains, then the pairs, then
// column dv of row u by lane u (one division per lane for the eight rows).
// Row by row (a dependent shuffle chain each, and every lane dividing for
// column dv) it took 1.66 and 1.71 ms.
//
// The same pass as runs of chunks (SmatKernels::ChunkBackward,
// LaunchSmatChunkBackward): B6's suffix scan of S_in_bar and B7 need
// D_bar[k] = Sigma[k + 1], Sigma[k] = S_in_bar[k] + e_k Sigma[k + 1]
// (e_k = exp(chunk_decay[k]); ungated 1). A block of
// NormalizeBackwardRunsKernel walks a run of consecutive chunks from its last
// down and keeps summing into the same tensor-core accumulators, scaled by
// e_k (gated) before chunk k's products, so that what they hold when chunk k
// is reached is the run's own part of D_bar[k]: written then, in place of
// S_in_bar[k]. RunCarriesKernel scans the runs' totals (about 100 per head at
// the benchmark's shape) into what each run gets from the runs after it, and
// B7 adds that, times the decays between, as it stages D_bar (SmatDBarCarry).
// Neither S_in_bar nor the whole D_bar is written or read back, and
// ChunkScanBackward does not run. The accumulators fold their correction
// terms in after each chunk (outer_tile::Warp::Fold), the rows are formed
// four at a time (registers: the accumulators stay live across the staging),
// and the sums differ from the phases' by fp32 roundings. Speed: see
// LaunchSmatChunkBackward's note in docs/PERFORMANCE.md (thirteenth pass):
// ChunkBackward 6.44 ms against 6.55 ms for the four phases at d = 2. With
// bf16 d_o and o (the trainer's and the benchmark's) the rows are staged by
// StageChunkWide, eight lanes and 16-byte loads to a row: ChunkBackward
// 4.45-4.52 -> 4.19-4.21 ms at d = 2 (H200, T = 524288, 8 heads, 2026-12-02;
// 4.24 with a division per column).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_fast_tiles.cuh"
#include "kernels/cuda/smat_grouped_mma.h"
#include "kernels/cuda/smat_mma.cuh"
#include "kernels/cuda/smat_outer_tile.cuh"

namespace smat {
namespace {

using cuda_detail::ChunkRow;
using cuda_detail::TokenRow;
using namespace mma_tiles;  // NOLINT: the tensor-core pieces are this file's vocabulary

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
using outer_tile::kC;             // chunk tokens held
constexpr int kW = 64;            // widest r
constexpr int kMaxDv = 64;        // widest dv: one pair per lane
using outer_tile::kLd;            // bf16 row pitch of the staged planes
using outer_tile::kPlane;         // bf16 elements of one staged plane
constexpr int kRowBatchOne = 8;   // rows whose loads a lane issues together (one chunk a block)
constexpr int kRowBatchRuns = 4;  // the same beside a run's accumulators (registers)

constexpr int kSmemBytes = 4 * kPlane * 2;  // phi, then the parts of w gbar

__device__ __forceinline__ float2 LoadPair(const void* ptr, int64_t pair, bool bf16) {
  if (bf16) return __bfloat1622float2(static_cast<const __nv_bfloat162*>(ptr)[pair]);
  return static_cast<const float2*>(ptr)[pair];
}

// Chunk k of (b, h) into shared memory: phi's rows into As (cp.async where
// vec_in: the caller waits), w gbar (w = exp(lam), ungated 1) split into the
// three planes at Bs; gbar and dlam_row (where not null) written out (with
// column_only, gbar is [batch, L, H]: its column dv alone). Returns
// the chunk's tokens. Columns dv + 2 .. kLd - 1 of the planes must be zero
// already (PadPlanes); every row's columns 0 .. dv + 1 are written here.
template <bool kGated, int kRowBatch = kRowBatchOne>
__device__ __forceinline__ int StageChunk(
    const SmatCudaDims& d, bool vec_in, int64_t k, int b, int h, const void* __restrict__ d_o,
    bool do_bf16, const void* __restrict__ o, bool o_bf16, const float* __restrict__ den, float eps,
    const __nv_bfloat16* __restrict__ phi, const float* __restrict__ lam, float* __restrict__ gbar,
    float* __restrict__ dlam_row, __nv_bfloat16* As, __nv_bfloat16* Bs, bool column_only = false) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c0 = k * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));  // tokens held
  const int r = d.r, dv = d.dv, p = d.p, half = dv / 2;
  const int64_t tok = TokenRow(d, b, c0, h);  // the chunk's token m is row tok + m H

  // ---- A: phi, on its way while gbar is formed ----
  StageBf16Rows<kC, kW, kLd, kThreads>(phi + tok * r, static_cast<int64_t>(d.H) * r, r, ce, vec_in,
                                       As);
  // ---- B: gbar, written out, and w gbar split ----
  // Warp w forms rows w, w + 8, ...; lane j the pair (2 j, 2 j + 1).
  const bool pair_lane = lane < half;
  for (int m0 = warp; m0 < kC; m0 += kWarps * kRowBatch) {
    float2 g[kRowBatch], y[kRowBatch];
    float dn[kRowBatch], lt[kRowBatch], dot[kRowBatch];
#pragma unroll
    for (int u = 0; u < kRowBatch; ++u) {
      const int m = m0 + u * kWarps;
      const int64_t row = tok + static_cast<int64_t>(m < ce ? m : 0) * d.H;
      const int64_t pair = row * half + (pair_lane ? lane : 0);
      g[u] = LoadPair(d_o, pair, do_bf16);
      y[u] = LoadPair(o, pair, o_bf16);
      dn[u] = den[row];
      lt[u] = kGated ? lam[row] : 0.f;
    }
    // The batch's dot products side by side: eight independent xor chains.
#pragma unroll
    for (int u = 0; u < kRowBatch; ++u)
      dot[u] = pair_lane ? fmaf(g[u].y, y[u].y, g[u].x * y[u].x) : 0.f;
#pragma unroll
    for (int sh = 16; sh > 0; sh >>= 1) {
#pragma unroll
      for (int u = 0; u < kRowBatch; ++u) dot[u] += __shfl_xor_sync(0xffffffffu, dot[u], sh);
    }
    // Columns 0 .. dv - 1: lane j the pair (2 j, 2 j + 1) of every row.
#pragma unroll
    for (int u = 0; u < kRowBatch; ++u) {
      const int m = m0 + u * kWarps;
      const bool here = m < ce;
      const int64_t row = tok + static_cast<int64_t>(here ? m : 0) * d.H;
      float x0 = 0.f, x1 = 0.f;
      if (here) {
        x0 = g[u].x / dn[u];
        x1 = g[u].y / dn[u];
      }
      const float w = kGated ? expf(lt[u]) : 1.f;
      if (pair_lane) {
        float* grow = gbar + row * p;
        if (here && !column_only) {
          grow[2 * lane] = x0;
          grow[2 * lane + 1] = x1;
        }
        uint32_t part[3];
        Split3(w * x0, w * x1, part[0], part[1], part[2]);
#pragma unroll
        for (int q = 0; q < 3; ++q)
          *reinterpret_cast<uint32_t*>(&Bs[q * kPlane + m * kLd + 2 * lane]) = part[q];
      }
    }
    // Column dv (and the 0 beside it) of row u by lane u: one division for
    // the batch where every lane dividing for every row took eight.
    if (lane < kRowBatch) {
      float dt = dot[0], dd = dn[0], ll = lt[0];
#pragma unroll
      for (int u = 1; u < kRowBatch; ++u) {
        if (lane == u) {
          dt = dot[u];
          dd = dn[u];
          ll = lt[u];
        }
      }
      const int m = m0 + lane * kWarps;
      const bool here = m < ce;
      const int64_t row = tok + static_cast<int64_t>(here ? m : 0) * d.H;
      const float xdv = here ? -dt / dd : 0.f;
      if (here) {
        gbar[column_only ? row : row * p + dv] = xdv;
        if (dlam_row != nullptr) dlam_row[row] = eps * dt / dd;
      }
      const float w = kGated ? expf(ll) : 1.f;
      uint32_t part[3];
      Split3(w * xdv, 0.f, part[0], part[1], part[2]);
#pragma unroll
      for (int q = 0; q < 3; ++q)
        *reinterpret_cast<uint32_t*>(&Bs[q * kPlane + m * kLd + dv]) = part[q];
    }
  }
  return ce;
}

// StageChunk's contract where d_o and o are bf16 rows of dv % 8 == 0
// columns, 16-byte aligned (LaunchSmatChunkBackward checks): eight lanes to a
// row, a 16-byte load of each and eight columns a lane, so a warp takes four
// rows per load where StageChunk takes one, and a chunk's sixteen rows per
// warp arrive in two batches of loads instead of four. The dot products keep StageChunk's
// order (its xor steps over the pairs 16, 8, 4 apart become xor steps over
// the lanes 4, 2, 1 apart, then the lane's own pairs 2 and 1 apart), so
// column dv and dlam_row have its bits. Columns < dv are d_o times the row's
// 1 / den (one division a row, as B7 and the per-type reads form gbar from
// its factors), where StageChunk divides each: within an ulp of its values.
// All four passes' loads at once spill beside the run's accumulators.
template <bool kGated>
__device__ __forceinline__ int StageChunkWide(
    const SmatCudaDims& d, bool vec_in, int64_t k, int b, int h,
    const __nv_bfloat16* __restrict__ d_o, const __nv_bfloat16* __restrict__ o,
    const float* __restrict__ den, float eps, const __nv_bfloat16* __restrict__ phi,
    const float* __restrict__ lam, float* __restrict__ gbar, float* __restrict__ dlam_row,
    __nv_bfloat16* As, __nv_bfloat16* Bs, bool column_only) {
  constexpr int kLanes = 8, kRowsPerLoad = 32 / kLanes, kPasses = kC / (kWarps * kRowsPerLoad);
  constexpr int kBatch = 2;  // passes whose loads a lane issues together
  static_assert(kPasses % kBatch == 0 && kBatch <= kLanes, "whole batches");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane & (kLanes - 1), rq = lane / kLanes;
  const int64_t c0 = k * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));
  const int r = d.r, dv = d.dv, p = d.p;
  const int64_t tok = TokenRow(d, b, c0, h);
  StageBf16Rows<kC, kW, kLd, kThreads>(phi + tok * r, static_cast<int64_t>(d.H) * r, r, ce, vec_in,
                                       As);
  const bool cols = kLanes * sub < dv;
#pragma unroll
  for (int p0 = 0; p0 < kPasses; p0 += kBatch) {
    uint4 gx[kBatch], yx[kBatch];
    float dn[kBatch], lt[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int m = ((p0 + u) * kWarps + warp) * kRowsPerLoad + rq;
      const bool here = m < ce;
      const int64_t row = tok + static_cast<int64_t>(here ? m : 0) * d.H;
      gx[u] = yx[u] = make_uint4(0u, 0u, 0u, 0u);
      if (here && cols) {
        gx[u] = __ldg(reinterpret_cast<const uint4*>(d_o + row * dv + kLanes * sub));
        yx[u] = __ldg(reinterpret_cast<const uint4*>(o + row * dv + kLanes * sub));
      }
      dn[u] = __ldg(&den[row]);
      lt[u] = kGated ? __ldg(&lam[row]) : 0.f;
    }
    float dot[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gx[u]);
      const __nv_bfloat162* y2 = reinterpret_cast<const __nv_bfloat162*>(&yx[u]);
      float q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 g = __bfloat1622float2(g2[i]), y = __bfloat1622float2(y2[i]);
        q[i] = fmaf(g.y, y.y, g.x * y.x);
      }
#pragma unroll
      for (int sh = kLanes / 2; sh > 0; sh >>= 1) {
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] += __shfl_xor_sync(0xffffffffu, q[i], sh);
      }
      dot[u] = (q[0] + q[2]) + (q[1] + q[3]);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int m = ((p0 + u) * kWarps + warp) * kRowsPerLoad + rq;
      const bool here = m < ce;
      const int64_t row = tok + static_cast<int64_t>(here ? m : 0) * d.H;
      const float w = kGated ? expf(lt[u]) : 1.f;
      if (cols) {
        const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&gx[u]);
        const float inv = here ? 1.f / dn[u] : 0.f;
        float x[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 g = __bfloat1622float2(g2[i]);
          x[2 * i] = g.x * inv;
          x[2 * i + 1] = g.y * inv;
        }
        if (here && !column_only) {
          float* grow = gbar + row * p + kLanes * sub;
#pragma unroll
          for (int c = 0; c < 8; ++c) grow[c] = x[c];
        }
        uint32_t part[3][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          Split3(w * x[2 * i], w * x[2 * i + 1], part[0][i], part[1][i], part[2][i]);
        }
#pragma unroll
        for (int q = 0; q < 3; ++q) {
          *reinterpret_cast<uint4*>(&Bs[q * kPlane + m * kLd + kLanes * sub]) =
              make_uint4(part[q][0], part[q][1], part[q][2], part[q][3]);
        }
      }
      // Column dv (and the 0 beside it) of pass u's rows by lane u of each row.
      if (sub == u) {
        const float xdv = here ? -dot[u] / dn[u] : 0.f;
        if (here) {
          gbar[column_only ? row : row * p + dv] = xdv;
          if (dlam_row != nullptr) dlam_row[row] = eps * dot[u] / dn[u];
        }
        uint32_t part[3];
        Split3(w * xdv, 0.f, part[0], part[1], part[2]);
#pragma unroll
        for (int q = 0; q < 3; ++q)
          *reinterpret_cast<uint32_t*>(&Bs[q * kPlane + m * kLd + dv]) = part[q];
      }
    }
  }
  return ce;
}

// Chunk k's rows that StageChunk reads (d_o, o, den, lam where not null,
// phi) asked of L2, a thread per row and tensor pair, so that staging chunk k
// later waits on L2 rather than on memory.
__device__ __forceinline__ void PrefetchChunk(const SmatCudaDims& d, int64_t k, int b, int h,
                                              const void* d_o, bool do_bf16, const void* o,
                                              bool o_bf16, const float* den,
                                              const __nv_bfloat16* phi, const float* lam) {
  static_assert(kThreads == 2 * kC, "two threads to a row");
  const int64_t c0 = k * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));
  const int m = threadIdx.x % kC;
  if (m >= ce) return;
  const int64_t row = TokenRow(d, b, c0, h) + static_cast<int64_t>(m) * d.H;
  auto fetch = [](const void* at, int bytes) {
    for (int off = 0; off < bytes; off += 128) {
      asm volatile(
          "prefetch.global.L2::evict_last [%0];" ::"l"(static_cast<const char*>(at) + off));
    }
  };
  if (threadIdx.x < kC) {
    const int es = do_bf16 ? 2 : 4;
    fetch(static_cast<const char*>(d_o) + row * d.dv * es, d.dv * es);
    fetch(den + row, 4);
    if (lam != nullptr) fetch(lam + row, 4);
  } else {
    const int es = o_bf16 ? 2 : 4;
    fetch(static_cast<const char*>(o) + row * d.dv * es, d.dv * es);
    fetch(phi + row * d.r, d.r * 2);
  }
}

// Columns dv + 2 .. kLd - 1 of the three planes at Bs: zero.
__device__ __forceinline__ void PadPlanes(int dv, __nv_bfloat16* Bs) {
  const int pad = kLd - (dv + 2);
  const __nv_bfloat16 zero = __float2bfloat16_rn(0.f);
  for (int e = threadIdx.x; e < kC * pad; e += kThreads) {
    const int t = e / pad, c = dv + 2 + (e - t * pad);
#pragma unroll
    for (int q = 0; q < 3; ++q) Bs[q * kPlane + t * kLd + c] = zero;
  }
}

// grid ChunkGrid(d), kThreads threads, kSmemBytes of shared memory.
template <bool kGated>
__global__ void __launch_bounds__(kThreads, 3)
    NormalizeBackwardStatesKernel(SmatCudaDims d, bool vec_in, const void* __restrict__ d_o,
                                  bool do_bf16, const void* __restrict__ o, bool o_bf16,
                                  const float* __restrict__ den, float eps,
                                  const __nv_bfloat16* __restrict__ phi,
                                  const float* __restrict__ lam, float* __restrict__ gbar,
                                  float* __restrict__ dlam_row, float* __restrict__ S_in_bar) {
  extern __shared__ uint4 smem_u4[];
  __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem_u4);
  __nv_bfloat16* Bs = As + kPlane;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const cuda_detail::ChunkBlock blk(d);
  const int64_t k = blk.k;
  const int b = blk.b, h = blk.h;
  const int r = d.r, p = d.p;
  PadPlanes(d.dv, Bs);
  const int ce = StageChunk<kGated>(d, vec_in, k, b, h, d_o, do_bf16, o, o_bf16, den, eps, phi, lam,
                                    gbar, dlam_row, As, Bs);
  if (vec_in) CpAsyncWaitAll();
  __syncthreads();

  // ---- S_in_bar[k] = A^T B, the tile of smat_outer_bf16.cu ----
  outer_tile::Warp<1, 3> tile(lane, warp, As, Bs);
  const int ksteps = (ce + 15) >> 4;
  for (int ks = 0; ks < ksteps; ++ks) tile.Step(ks);
  // Out through the phi plane, as whole 16-byte pieces where the matrix allows.
  tile.Store(r, p, reinterpret_cast<float*>(As),
             S_in_bar + ChunkRow(d, b, k, h) * static_cast<int64_t>(r) * p, tid, kThreads);
}

// grid (batch * H, runs), kThreads threads, kSmemBytes of shared memory
// (SmatKernels::ChunkBackward): block (bh, s) walks run s's chunks from the
// last down. With Sigma[k] = S_in_bar[k] + e_k Sigma[k + 1] (e_k =
// exp(chunk_decay[k]), ungated 1) summed within the run only (Sigma = 0 past
// its last chunk), local[k] = Sigma[k + 1] is the state gradient the tiles
// hold when chunk k is reached: written before chunk k's products add to
// them (scaled by e_k first, gated). scale[k] = the product of e over
// chunks k + 1 .. of the run (gated only), total[bh, s] = Sigma[first],
// decay[bh, s] = the product of e over the run (gated only).
template <bool kGated, bool kWide>
__global__ void __launch_bounds__(kThreads, 3) NormalizeBackwardRunsKernel(
    SmatCudaDims d, bool vec_in, SmatChunkRuns rs, const void* __restrict__ d_o, bool do_bf16,
    const void* __restrict__ o, bool o_bf16, const float* __restrict__ den, float eps,
    const __nv_bfloat16* __restrict__ phi, const float* __restrict__ lam,
    const float* __restrict__ cd, float* __restrict__ gbar, bool gbar_column_only,
    float* __restrict__ dlam_row, float* __restrict__ local, float* __restrict__ scale,
    float* __restrict__ total, float* __restrict__ decay) {
  extern __shared__ uint4 smem_u4[];
  __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem_u4);
  __nv_bfloat16* Bs = As + kPlane;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int bh = blockIdx.x, s = blockIdx.y, b = bh / d.H, h = bh - b * d.H;
  const int r = d.r, p = d.p;
  const int64_t W = static_cast<int64_t>(r) * p;
  int k0, k1;
  cuda_detail::RunChunks(rs, d.Lc, s, &k0, &k1);
  PadPlanes(d.dv, Bs);
  outer_tile::Warp<1, 3> tile(lane, warp, As, Bs);
  float run = 1.f;  // the product of e over the chunks after k
  for (int k = k1 - 1; k >= k0; --k) {
    const int64_t crow = ChunkRow(d, b, k, h);
    // local[k] from the tiles, through the phi plane (the previous chunk's
    // products are done with it: Store begins with a barrier).
    tile.Store(r, p, reinterpret_cast<float*>(As), local + crow * W, tid, kThreads);
    if (kGated && tid == 0) scale[crow] = run;
    __syncthreads();  // the phi plane is free again
    int ce;
    if constexpr (kWide) {
      ce = StageChunkWide<kGated>(d, vec_in, k, b, h, static_cast<const __nv_bfloat16*>(d_o),
                                  static_cast<const __nv_bfloat16*>(o), den, eps, phi, lam, gbar,
                                  dlam_row, As, Bs, gbar_column_only);
    } else {
      ce = StageChunk<kGated, kRowBatchRuns>(d, vec_in, k, b, h, d_o, do_bf16, o, o_bf16, den, eps,
                                             phi, lam, gbar, dlam_row, As, Bs, gbar_column_only);
    }
    if (vec_in) CpAsyncWaitAll();
    __syncthreads();
    // The next chunk down, on its way to L2 while this one's products run.
    if (k > k0) PrefetchChunk(d, k - 1, b, h, d_o, do_bf16, o, o_bf16, den, phi, lam);
    if (kGated) {
      const float e = expf(__ldg(&cd[crow]));
      tile.Scale(e);
      run *= e;
    }
    const int ksteps = (ce + 15) >> 4;
    for (int ks = 0; ks < ksteps; ++ks) tile.Step(ks);
    tile.Fold();  // one accumulator across the staging (registers)
  }
  const int64_t row = static_cast<int64_t>(bh) * gridDim.y + s;
  tile.Store(r, p, reinterpret_cast<float*>(As), total + row * W, tid, kThreads);
  if (kGated && tid == 0) decay[row] = run;
}

// grid (ceil(r p / 256), batch * H), 256 threads: carry[bh, s] = Sigma past
// run s within its part (zero past the part's last run), from the runs'
// totals and decays (NormalizeBackwardRunsKernel), walked from the part's
// last run down; the loads of kGroup runs issue before their updates.
__global__ void RunCarriesKernel(SmatCudaDims d, SmatChunkRuns rs, const float* __restrict__ total,
                                 const float* __restrict__ decay, float* __restrict__ carry) {
  constexpr int kGroup = 8;
  const int64_t W = static_cast<int64_t>(d.r) * d.p;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= W) return;
  const int bh = blockIdx.y, runs = rs.seg_d + rs.seg_r;
  const int64_t row0 = static_cast<int64_t>(bh) * runs;
  for (int part = 0; part < 2; ++part) {
    const int s0 = part == 0 ? 0 : rs.seg_d, s1 = part == 0 ? rs.seg_d : runs;
    float Y = 0.f;
    for (int s = s1 - 1; s >= s0; s -= kGroup) {
      float t[kGroup], e[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const bool ok = s - g >= s0;
        t[g] = ok ? total[(row0 + s - g) * W + w] : 0.f;
        e[g] = ok && decay != nullptr ? decay[row0 + s - g] : 1.f;
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (s - g < s0) break;
        carry[(row0 + s - g) * W + w] = Y;
        Y = fmaf(e[g], Y, t[g]);
      }
    }
  }
}

template <bool kGated>
cudaError_t Launch(const SmatCudaDims& d, const void* d_o, bool do_bf16, const void* o, bool o_bf16,
                   const float* den, float eps, const void* phi, const float* lam, float* gbar,
                   float* dlam_row, float* S_in_bar, cudaStream_t stream) {
  auto kernel = NormalizeBackwardStatesKernel<kGated>;
  constexpr int kBytes = kSmemBytes;
  const cudaError_t err = AllowSharedMemory(kernel, kBytes);
  if (err != cudaSuccess) return err;
  const bool vec = d.r % 8 == 0 && fast_tiles::Aligned16(phi);
  kernel<<<cuda_detail::ChunkGrid(d), kThreads, kBytes, stream>>>(
      d, vec, d_o, do_bf16, o, o_bf16, den, eps, static_cast<const __nv_bfloat16*>(phi), lam, gbar,
      dlam_row, S_in_bar);
  return cudaGetLastError();
}

// The runs of a span's chunks: at most kWaves waves of
// NormalizeBackwardRunsKernel (three blocks per SM), runs of one length (the
// shortest whose runs of both parts fit in those waves), at least kMinRun
// chunks. H200, T = 524288, 8 heads (4096 chunks a head), d = 2: runs of 21
// chunks in four waves, 42 in two (ChunkBackward 4.19-4.21 -> 4.14 ms, one
// run), 86 in one (4.19), 11 in eight (4.22).
constexpr int kWaves = 2, kMinRun = 4;
SmatChunkRuns PlanRuns(const SmatCudaDims& d) {
  const int64_t bh = std::max<int64_t>(1, static_cast<int64_t>(d.batch) * d.H);
  const int64_t blocks = int64_t{kWaves} * 3 * cuda_detail::DeviceSms();
  int64_t len = std::max<int64_t>(kMinRun, (int64_t{d.Lc} * bh + blocks - 1) / blocks);
  const int Nd = cuda_detail::DistantChunks(d), Nr = d.Lc - Nd;
  auto count = [](int chunks, int64_t l) { return (chunks + l - 1) / l; };
  while (len < d.Lc && bh * (count(Nd, len) + count(Nr, len)) > blocks) ++len;
  return cuda_detail::ChunkRunsOfLength(
      cuda_detail::DistantChunks(d), d.Lc,
      static_cast<int>(std::min<int64_t>(len, std::max(1, d.Lc))));
}

}  // namespace

bool SmatNormalizeBackwardStatesFusedFits(const SmatCudaDims& d, const void* d_o, bool do_bf16,
                                          const void* o, bool o_bf16, const void* phi,
                                          const float* lam, const float* gbar) {
  if (!d.bf16 || d.chunk > kC || d.r <= 0 || d.r > kW || d.p > kLd) return false;
  if (d.dv <= 0 || d.dv % 2 != 0 || d.dv > kMaxDv) return false;
  // Where the two phases it stands in for run their fast kernels: the row tile
  // of NormalizeBackward (pairs of d_o and o aligned) and the tensor-core
  // outer sums of ChunkStateGradients (ungated: the bf16-staged kernel, whose
  // bits it reproduces; its conditions on r and phi's rows hold gated too).
  auto aligned = [](const void* ptr, bool bf16) {
    return (reinterpret_cast<uintptr_t>(ptr) & (bf16 ? 3 : 7)) == 0;
  };
  if (!aligned(d_o, do_bf16) || !aligned(o, o_bf16)) return false;
  if (!SmatUseFastChunkTiles(d) || !SmatUseMmaGrouped(d, /*reads=*/false)) return false;
  const SmatTokenWeights w{nullptr, nullptr, nullptr, nullptr, /*key_side=*/false};
  if (!SmatOuterSumBf16Fits(d, phi, gbar, /*b_is_v=*/false, w)) return false;
  return SmatDeviceRunsMma(kSmemBytes);
}

cudaError_t LaunchSmatNormalizeBackwardStatesFused(const SmatCudaDims& d, const void* d_o,
                                                   bool do_bf16, const void* o, bool o_bf16,
                                                   const float* den, float eps, const void* phi,
                                                   const float* lam, float* gbar, float* dlam_row,
                                                   float* S_in_bar, cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  return lam != nullptr ? Launch<true>(d, d_o, do_bf16, o, o_bf16, den, eps, phi, lam, gbar,
                                       dlam_row, S_in_bar, stream)
                        : Launch<false>(d, d_o, do_bf16, o, o_bf16, den, eps, phi, lam, gbar,
                                        dlam_row, S_in_bar, stream);
}

bool SmatChunkBackwardFits(const SmatCudaDims& d, const void* d_o, bool do_bf16, const void* o,
                           bool o_bf16, const void* phi, const float* lam, const float* gbar) {
  return SmatNormalizeBackwardStatesFusedFits(d, d_o, do_bf16, o, o_bf16, phi, lam, gbar) &&
         SmatChunkBackwardRunsFused(d);
}

int64_t SmatChunkBackwardScratchFloats(const SmatCudaDims& d) {
  const SmatChunkRuns rs = PlanRuns(d);
  const int64_t bh = static_cast<int64_t>(d.batch) * d.H, W = static_cast<int64_t>(d.r) * d.p;
  const int64_t runs = rs.seg_d + rs.seg_r;
  // local, scale; total, carry, decay.
  return bh * d.Lc * (W + 1) + bh * runs * (2 * W + 1);
}

namespace {

// The scratch of ChunkBackward (SmatChunkBackwardScratchFloats), in order.
struct BackwardScratch {
  float *local, *scale, *total, *carry, *decay;
};

BackwardScratch SplitScratch(const SmatCudaDims& d, const SmatChunkRuns& rs, float* scratch) {
  const int64_t bh = static_cast<int64_t>(d.batch) * d.H, W = static_cast<int64_t>(d.r) * d.p;
  const int runs = rs.seg_d + rs.seg_r;
  BackwardScratch b;
  b.local = scratch;
  b.scale = b.local + bh * d.Lc * W;
  b.total = b.scale + bh * d.Lc;
  b.carry = b.total + bh * runs * W;
  b.decay = b.carry + bh * runs * W;
  return b;
}

}  // namespace

cudaError_t LaunchSmatChunkBackwardStates(const SmatCudaDims& d, const void* d_o, bool do_bf16,
                                          const void* o, bool o_bf16, const float* den, float eps,
                                          const void* phi, const float* lam,
                                          const float* chunk_decay, float* gbar, float* dlam_row,
                                          float* scratch, cudaStream_t stream,
                                          bool gbar_column_only) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (gbar_column_only && !do_bf16) return cudaErrorInvalidValue;  // B7 needs gbar's factors
  const SmatChunkRuns rs = PlanRuns(d);
  const int64_t bh = static_cast<int64_t>(d.batch) * d.H, W = static_cast<int64_t>(d.r) * d.p;
  const int runs = rs.seg_d + rs.seg_r;
  const BackwardScratch sc = SplitScratch(d, rs, scratch);
  const bool gated = lam != nullptr;
  const bool vec = d.r % 8 == 0 && fast_tiles::Aligned16(phi);
  {
    // StageChunkWide where d_o and o are bf16 rows it can load 16 bytes at a time.
    const bool wide = do_bf16 && o_bf16 && d.dv % 8 == 0 && fast_tiles::Aligned16(d_o) &&
                      fast_tiles::Aligned16(o);
    auto pick = [&](auto g) {
      constexpr bool kG = decltype(g)::value;
      return wide ? NormalizeBackwardRunsKernel<kG, true> : NormalizeBackwardRunsKernel<kG, false>;
    };
    auto kernel = gated ? pick(std::true_type()) : pick(std::false_type());
    const cudaError_t err = AllowSharedMemory(kernel, kSmemBytes);
    if (err != cudaSuccess) return err;
    kernel<<<dim3(static_cast<unsigned>(bh), static_cast<unsigned>(runs)), kThreads, kSmemBytes,
             stream>>>(d, vec, rs, d_o, do_bf16, o, o_bf16, den, eps,
                       static_cast<const __nv_bfloat16*>(phi), lam, chunk_decay, gbar,
                       gbar_column_only, dlam_row, sc.local, sc.scale, sc.total, sc.decay);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  RunCarriesKernel<<<dim3(static_cast<unsigned>((W + 255) / 256), static_cast<unsigned>(bh)), 256,
                     0, stream>>>(d, rs, sc.total, gated ? sc.decay : nullptr, sc.carry);
  return cudaGetLastError();
}

cudaError_t LaunchSmatChunkBackwardTiles(const SmatCudaDims& d, const void* d_o, bool do_bf16,
                                         const float* den, const void* phi, const void* psi,
                                         const void* v, const float* lam, const float* chunk_decay,
                                         const float* S_in, const float* gbar, float* phi_bar,
                                         float* psi_bar, float* v_bar, const float* scratch,
                                         cudaStream_t stream, bool gbar_column_only,
                                         const SmatChunkBackwardAdds* adds) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (gbar_column_only && !do_bf16) return cudaErrorInvalidValue;  // B7 needs gbar's factors
  const SmatChunkRuns rs = PlanRuns(d);
  const BackwardScratch sc = SplitScratch(d, rs, const_cast<float*>(scratch));
  SmatDBarCarry dc;
  dc.carry = sc.carry;
  dc.scale = lam != nullptr ? sc.scale : nullptr;
  dc.runs = rs;
  // With bf16 d_o, B7 takes gbar's columns < dv as d_o and 1 / den
  // (SmatGbarFactors): one exact part in its products instead of three.
  SmatGbarFactors gf;
  if (do_bf16) {
    gf.d_o = d_o;
    gf.den = den;
    if (gbar_column_only) gf.gden = gbar;
  }
  return LaunchSmatChunkOutputsBackwardFused(d, phi, psi, v, lam, chunk_decay, S_in, gbar, sc.local,
                                             phi_bar, psi_bar, v_bar, /*assign=*/true, stream, &dc,
                                             &gf, adds);
}

}  // namespace smat
