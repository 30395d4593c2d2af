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
#include <cuda_bf16.h>

#include <cstdint>

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
constexpr int kRowBatch = 8;      // rows whose loads a lane issues together

constexpr int kSmemBytes = 4 * kPlane * 2;  // phi, then the parts of w gbar

__device__ __forceinline__ float2 LoadPair(const void* ptr, int64_t pair, bool bf16) {
  if (bf16) return __bfloat1622float2(static_cast<const __nv_bfloat162*>(ptr)[pair]);
  return static_cast<const float2*>(ptr)[pair];
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
  const int64_t c0 = k * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));  // tokens held
  const int r = d.r, dv = d.dv, p = d.p, half = dv / 2;
  const int64_t tok = TokenRow(d, b, c0, h);  // the chunk's token m is row tok + m H

  // ---- A: phi, on its way while gbar is formed ----
  StageBf16Rows<kC, kW, kLd, kThreads>(phi + tok * r, static_cast<int64_t>(d.H) * r, r, ce, vec_in,
                                       As);
  // ---- B: gbar, written out, and w gbar split (w = exp(lam), ungated 1) ----
  // Columns dv + 2 .. kLd - 1 of the planes are 0; every row's columns
  // 0 .. dv + 1 are written below (dv + 1 = p is 0 too).
  {
    const int pad = kLd - (dv + 2);
    const __nv_bfloat16 zero = __float2bfloat16_rn(0.f);
    for (int e = tid; e < kC * pad; e += kThreads) {
      const int t = e / pad, c = dv + 2 + (e - t * pad);
#pragma unroll
      for (int q = 0; q < 3; ++q) Bs[q * kPlane + t * kLd + c] = zero;
    }
  }
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
        if (here) {
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
        gbar[row * p + dv] = xdv;
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

}  // namespace smat
