// TypeReadsBackward in one pass on tensor cores, from the pieces of
// smat_reads_bf16.cuh. Over the recent tokens t of a type's segment, with wg_t = w_t gbar_t (fp32
// products, split into three bf16 planes once):
//   U_bar[type, segment] = sum_t phi_t wg_t^T      (the tile of smat_outer_tile.cuh)
//   phi_bar_t += U[type] wg_t                       (as kMatVec, smat_reads_bf16.cu)
// Both read the same staged rows, so gbar is loaded and split once, not twice.
// U's planes keep its columns < dv only: wg's column dv (in the planes, for
// U_bar) meets zeros there and enters phi_bar as wg_t[dv] U[:, dv] in fp32.
// Shared memory: U's planes, U[:, dv], phi and the three planes of wg, the
// rows, weights, wg[:, dv] and (kRaw, below) the rows' scales: 107 KB, two
// blocks per SM. Ungated (w = 1) the
// U_bar tile sums the bf16 outer sums' planes in their order: the same bits
// as LaunchSmatOuterSumBf16. Gated, the weight goes to gbar, so U_bar's
// product stays 3 MMAs (the general kernel weights phi: 6). H200, bf16,
// T = 524288, d = 2, 8 heads: TypeReadsBackward 1.41 ms ungated, 1.45 ms
// gated with the widths as constants (kFull; 1.61 and 1.68 ms without; 1.60
// and 2.03 ms in two passes).
// kP = 1 (SMAT_CUDA_BF16_PARTS=1): U and wg in one bf16 plane each (each
// product one MMA: flash-linear-attention's numerics, as the fused chunk
// tiles take them), 48 KB, three blocks per SM.
// kDo (SmatKernels::TypeReadsBackwardFromFactors): wg from gbar's factors,
// (w_t / den_t) d_o_t and w_t gden_t (StageFactorRows), with d_o's bf16 rows
// read 16 bytes at a time where gbar's fp32 rows took 4: half the bytes, and
// the backward no longer writes gbar's first dv columns at all (ChunkBackward
// writes its column dv alone). With three parts (kRaw) d_o's rows are staged
// as they are (StageFactorRows, kRaw), so phi_bar's products take them as one
// exact part against U's three planes (3 MMAs a step where wg's three parts
// took 6) and scale by s_t = w_t / den_t after (Den::kGScaled); then the rows
// are split in place into wg's planes (SplitRawRows: the values and parts
// StageFactorRows gives them, so U_bar keeps its bits). H200, bf16,
// T = 524288, d = 2, 8 heads (2026-12-02): TypeReadsBackward 0.949-0.960 ->
// 0.884-0.890 ms; phi_bar within 1.2e-7 of the CPU, as before. kRaw's phi_bar
// adds then leave through shared memory by whole rows (StageScaledRows,
// AddStagedRows; Nsight Compute had the kernel at 74% of L1 throughput, with
// 0.55 eligible warps per scheduler): 0.891-0.892 -> 0.856-0.857 ms (2026-12-03,
// one binary on one host), the same bits. Copying the tile's old phi_bar
// rows into shared memory by cp.async with its staging instead, so that the
// adds wait on no load, was 5% slower (H100, 2026-12-07: 0.901 -> 0.947-0.950
// ms): the block then waits for 32 KB more before its first product. The
// same four columns a lane for ProfilePoolingBackward's adds by lane pairs
// swapping halves (no shared memory to spare at three blocks per SM) took it
// from 0.92 to 3.5 ms: not kept.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/smat_grouped_mma.h"
#include "kernels/cuda/smat_reads_bf16.cuh"

namespace smat {
namespace {

using namespace reads_bf16;  // NOLINT: the read kernels' shared pieces

// gbar's loads in flight per thread as it is split beside U_bar's
// accumulators: a third of a tile's.
constexpr int kFusedSplitLoads = (kSplitLoads + 2) / 3;

template <int kP>
constexpr int kFusedOffMcol = kP* kMPlane * 2;
template <int kP>
constexpr int kFusedOffTok = kFusedOffMcol<kP> + kW * 4;
template <int kP>
constexpr int kFusedOffRows = kFusedOffTok<kP> + (1 + kP) * kTokPlane * 2;
template <int kP>
constexpr int kFusedSmemBytes = kFusedOffRows<kP> + kC * 8 + 3 * kC * 4;  // rows, w, gcol, s
static_assert(kFusedOffMcol<3> == kOffMcol && kFusedOffTok<3> == kOffTok,
              "three parts: the layout of the read kernels");
static_assert(kFusedOffTok<1> % 16 == 0 && kFusedOffRows<1> % 16 == 0, "16-byte aligned");

// The rows of wg = w gbar from gbar's factors (SmatGbarFactors: gbar_t[0:dv]
// = d_o_t / den_t, gbar_t[dv] = gden_t): columns < dv as (w_t / den_t) d_o_t,
// column dv as w_t gden_t (also to gcol), split into kP bf16 planes at dst;
// zeros for nt <= t < kC. d_o's rows are bf16 and 16-byte aligned with dv a
// multiple of 8 (SmatTypeReadsBackwardFactorsFit): eight threads to a row, a
// 16-byte load each, kRowBatch rows' loads issued before their first use.
// Half the bytes of gbar's fp32 rows, and gbar need not be written at all.
// kRaw (below): d_o's rows as they are into the first plane at dst instead
// (zeros in column dv), scale[t] = w_t / den_t and gcol[t] = w_t gden_t.
template <int kP, int kRowBatch, bool kRaw = false>
__device__ __forceinline__ void StageFactorRows(const SmatGbarFactors& gf, const int64_t* rows,
                                                const float* w, int dv, int nt, __nv_bfloat16* dst,
                                                float* gcol, float* scale = nullptr) {
  constexpr int kLanes = 8, kRowsPerPass = kThreads / kLanes, kPasses = kC / kRowsPerPass;
  static_assert(kC % kRowsPerPass == 0 && kPasses % kRowBatch == 0, "whole batches of rows");
  const int sub = threadIdx.x % kLanes, t0 = threadIdx.x / kLanes;
  const bool cols = 8 * sub < dv;
  const __nv_bfloat16* d_o = static_cast<const __nv_bfloat16*>(gf.d_o);
#pragma unroll
  for (int p0 = 0; p0 < kPasses; p0 += kRowBatch) {
    uint4 x[kRowBatch];
    float dn[kRowBatch], gd[kRowBatch];
#pragma unroll
    for (int u = 0; u < kRowBatch; ++u) {
      const int t = t0 + (p0 + u) * kRowsPerPass;
      const bool live = t < nt;
      const int64_t row = live ? rows[t] : rows[0];
      x[u] = make_uint4(0u, 0u, 0u, 0u);
      if (live && cols) x[u] = __ldg(reinterpret_cast<const uint4*>(d_o + row * dv + 8 * sub));
      dn[u] = !kRaw || sub == 0 ? __ldg(&gf.den[row]) : 1.f;
      gd[u] = sub == 0 ? __ldg(&gf.gden[row]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kRowBatch; ++u) {
      const int t = t0 + (p0 + u) * kRowsPerPass;
      const bool live = t < nt;
      if constexpr (kRaw) {
        if (cols) *reinterpret_cast<uint4*>(dst + t * kLdT + 8 * sub) = x[u];
        if (sub == 0) {
          const float wt = live ? w[t] : 0.f;
          scale[t] = live ? wt / dn[u] : 0.f;
          gcol[t] = wt * gd[u];
          *reinterpret_cast<uint32_t*>(dst + t * kLdT + dv) = 0u;  // columns dv, dv + 1
        }
      } else {
        const float wt = live ? w[t] : 0.f;
        const float s = live ? wt / dn[u] : 0.f;
        if (cols) {
          const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&x[u]);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float2 f = __bfloat1622float2(h2[j]);
            mma_tiles::StoreSplitPair<kP>(dst + t * kLdT + 8 * sub + 2 * j, kTokPlane, s * f.x,
                                          s * f.y);
          }
        }
        if (sub == 0) {
          const float gc = wt * gd[u];
          gcol[t] = gc;
          mma_tiles::StoreSplitPair<kP>(dst + t * kLdT + dv, kTokPlane, gc, 0.f);
        }
      }
    }
  }
}

// kRaw, once phi_bar's products have read the first plane: its d_o rows times
// s[t], split in place into the three planes of wg (the values and parts
// StageFactorRows gives them), and column dv (and the 0 beside it) from gcol.
__device__ __forceinline__ void SplitRawRows(const float* s, const float* gcol, int dv,
                                             __nv_bfloat16* dst) {
  const int per_row = dv >> 3;
  for (int e = threadIdx.x; e < kC * per_row; e += kThreads) {
    const int t = e / per_row, c = 8 * (e - t * per_row);
    __nv_bfloat16* at = dst + t * kLdT + c;
    const uint4 x = *reinterpret_cast<const uint4*>(at);
    const float st = s[t];
    const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&x);
    uint32_t part[3][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(h2[j]);
      mma_tiles::Split3(st * f.x, st * f.y, part[0][j], part[1][j], part[2][j]);
    }
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      *reinterpret_cast<uint4*>(at + q * kTokPlane) =
          make_uint4(part[q][0], part[q][1], part[q][2], part[q][3]);
    }
  }
  if (threadIdx.x < kC) {
    mma_tiles::StoreSplitPair<3>(dst + threadIdx.x * kLdT + dv, kTokPlane, gcol[threadIdx.x], 0.f);
  }
}

// kRaw's phi_bar adds through shared memory: a warp's 16 rows of
// s_t (hi + lo) + gcol_t M[:, dv] (Den::kGScaled's terms) wait in ys
// ([16][kLdRow] fp32; kLdRow = 8 (mod 32), so the fragments' float2 stores of
// a half-warp hit distinct banks), then leave a row's 16-byte pieces at a
// time: each warp access reads and writes two whole rows where the
// fragments' float2 reached eight rows with 32 bytes each, a quarter of the
// L1 wavefronts for the same bytes. old + y in that order: StoreRows' bits.
// vec: out 16-byte aligned (the width, r, is a multiple of 8; else StoreRows).
constexpr int kLdRow = 72;
static_assert(kLdRow >= kW && kLdRow % 32 == 8 && kLdRow % 4 == 0, "whole rows, conflict-free");
static_assert(kThreads / 32 * 16 * kLdRow * 4 <= 2 * kTokPlane * 2,
              "the warps' rows fit two planes");

template <int kN>
__device__ __forceinline__ void StageScaledRows(const float (&hi)[kN][4], const float (&lo)[kN][4],
                                                int t0, int j0, int nt, const float* s,
                                                const float* gcol, const float* mcol, float* ys) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int m = g + 8 * hr, t = t0 + m;
    const float wt = t < nt ? s[t] : 0.f, den = t < nt ? gcol[t] : 0.f;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      const int n = 8 * (j0 + j) + 2 * tq;
      float y[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float sum = hi[j][2 * hr + e] + lo[j][2 * hr + e];
        y[e] = fmaf(den, mcol[n + e < kW ? n + e : 0], __fmul_rn(wt, sum));
      }
      *reinterpret_cast<float2*>(&ys[m * kLdRow + n]) = make_float2(y[0], y[1]);
    }
  }
}

// out[rows[t0 + m]][n] += ys[m][n] for the warp's rows t0 + m < nt and
// columns n < width, 16 bytes a lane: two rows a warp access, every lane's
// old values loaded before the first add (= with assign: 0 + y, the bits of
// old + y with old = 0).
__device__ __forceinline__ void AddStagedRows(const float* ys, int t0, int nt, const int64_t* rows,
                                              int width, bool assign, float* __restrict__ out) {
  const int lane = threadIdx.x & 31, c = 4 * (lane & 15);
  const int rows_here = min(16, nt - t0);
  const bool mine = c < width;
  __syncwarp();
  float4 old[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int m = 2 * i + (lane >> 4);
    old[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (!assign && mine && m < rows_here) {
      old[i] = *reinterpret_cast<const float4*>(out + rows[t0 + m] * width + c);
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int m = 2 * i + (lane >> 4);
    if (!mine || m >= rows_here) continue;
    const float4 y = *reinterpret_cast<const float4*>(&ys[m * kLdRow + c]);
    *reinterpret_cast<float4*>(out + rows[t0 + m] * width + c) =
        make_float4(old[i].x + y.x, old[i].y + y.y, old[i].z + y.z, old[i].w + y.w);
  }
}

template <bool kFull, int kP, bool kDo>
__global__ void __launch_bounds__(kThreads, kP == 1 ? 3 : 2)
    TypeReadsBackwardKernel(SmatCudaDims d, SmatTokenGroups groups, int segments,
                            const float* __restrict__ U, SmatMatrixLayout lay,
                            const __nv_bfloat16* __restrict__ phi, const float* __restrict__ gbar,
                            SmatTokenWeights tw, SmatMatrixLayout out_lay,
                            float* __restrict__ U_bar, float* __restrict__ phi_bar,
                            SmatGbarFactors gf, bool vec, bool assign) {
  extern __shared__ uint4 smem_u4[];
  char* smem = reinterpret_cast<char*>(smem_u4);
  __nv_bfloat16* Ms = reinterpret_cast<__nv_bfloat16*>(smem);
  float* mcol = reinterpret_cast<float*>(smem + kFusedOffMcol<kP>);
  __nv_bfloat16* Ph = reinterpret_cast<__nv_bfloat16*>(smem + kFusedOffTok<kP>);
  __nv_bfloat16* Gs = Ph + kTokPlane;  // the kP planes of wg
  int64_t* rows = reinterpret_cast<int64_t*>(smem + kFusedOffRows<kP>);
  float* w = reinterpret_cast<float*>(rows + kC);
  float* gcol = w + kC;
  float* s = gcol + kC;
  // From gbar's factors with three parts: phi_bar's products take d_o's rows
  // as one exact part (3 MMAs a step, not 6) and scale by s_t = w_t / den_t
  // after; then the rows are split into wg's planes in place for U_bar.
  constexpr bool kRaw = kDo && kP == 3;
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
    if constexpr (kRaw) {
      StageFactorRows<kP, 4, true>(gf, rows, w, dv, nt, Gs, gcol, s);
    } else if constexpr (kDo) {
      StageFactorRows<kP, 2>(gf, rows, w, dv, nt, Gs, gcol);
    } else {
      StageSplitRows<true, kFusedSplitLoads, kP>(gbar, rows, w, dv, nt, Gs, gcol);
    }
    if (j0 == blk.lo) StageMatrix<kP>(blk.Matrix(U, lay, r, p), r, p, dv, dv, Ms, mcol);
    CpAsyncWaitAll();
    __syncthreads();
    if constexpr (kRaw) {
      // phi_bar_t += s_t (U d_o_t) + gcol_t U[:, dv], then wg's planes.
      // With vec the rows wait in wg's second and third planes, free until
      // SplitRawRows (their pad columns are zeroed again before it).
      float* ys = reinterpret_cast<float*>(Gs + kTokPlane) + warp * 16 * kLdRow;
      if (16 * warp < nt) {
        for (int j0n = 0; j0n < n_tiles; j0n += 4) {
          float hi[4][4], lo[4][4];
          Product<1, 4, false, 3>(a_addr, b_plain, kv, j0n, n_tiles, hi, lo);
          if (vec) {
            StageScaledRows(hi, lo, 16 * warp, j0n, nt, s, gcol, mcol, ys);
          } else {
            StoreRows<4, Den::kGScaled>(hi, lo, 16 * warp, j0n, nt, rows, s, gcol, mcol, r, assign,
                                        phi_bar);
          }
        }
        if (vec) AddStagedRows(ys, 16 * warp, nt, rows, r, assign, phi_bar);
      }
      __syncthreads();  // the first plane's d_o rows are read; ys is done
      if (vec) mma_tiles::FillPadColumns<kC, kLdT, kThreads>(Gs + kTokPlane, 2, p, zero);
      SplitRawRows(s, gcol, dv, Gs);
      __syncthreads();
    }
    const int ksteps = (nt + 15) >> 4;
    for (int ks = 0; ks < ksteps; ++ks) tile.Step(ks);
    if (!kRaw && 16 * warp < nt) {
      for (int j0n = 0; j0n < n_tiles; j0n += 4) {
        float hi[4][4], lo[4][4];
        Product<kP, 4, false, kP>(a_addr, b_plain, kv, j0n, n_tiles, hi, lo);
        StoreRows<4, Den::kG>(hi, lo, 16 * warp, j0n, nt, rows, nullptr, gcol, mcol, r, assign,
                              phi_bar);
      }
    }
  }
  // U_bar's tile through U's planes (no warp reads them any more), written
  // in full: zeros for a segment without tokens.
  tile.Store(r, p, reinterpret_cast<float*>(Ms),
             blk.Matrix(U_bar, out_lay, r, p, segments, blk.seg), tid, kThreads);
}

}  // namespace

bool SmatTypeReadsBackwardBf16Fits(const SmatCudaDims& d, const void* phi) {
  if (!d.bf16 || d.chunk > kC || d.r <= 0 || d.r > kW || d.r % 8 != 0) return false;
  if (d.dv <= 0 || d.dv > kW || !Aligned16(phi)) return false;
  const char* env = std::getenv("SMAT_CUDA_GROUPED");
  if (env != nullptr && std::strcmp(env, "ffma") == 0) return false;
  if (!SmatUseFastChunkTiles(d) || !SmatUseMmaGrouped(d, /*reads=*/false)) return false;
  return SmatDeviceRunsMma(kFusedSmemBytes<3>);
}

bool SmatTypeReadsBackwardFactorsFit(const SmatCudaDims& d, const void* phi, const void* d_o) {
  return SmatTypeReadsBackwardBf16Fits(d, phi) && d.dv % 8 == 0 && Aligned16(d_o);
}

cudaError_t LaunchSmatTypeReadsBackwardBf16(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                            int segments, const float* U,
                                            const SmatMatrixLayout& lay, const void* phi,
                                            const float* gbar, const SmatTokenWeights& w,
                                            const SmatMatrixLayout& out_lay, float* U_bar,
                                            float* phi_bar, bool assign, cudaStream_t stream,
                                            const SmatGbarFactors* factors) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  const bool by_factors = factors != nullptr;
  if (by_factors && !SmatTypeReadsBackwardFactorsFit(d, phi, factors->d_o)) {
    return cudaErrorInvalidValue;
  }
  const SmatGbarFactors gf = by_factors ? *factors : SmatGbarFactors();
  // phi_bar's adds by whole 16-byte pieces of its rows (kRaw: StageScaledRows);
  // r % 8 == 0 already (SmatTypeReadsBackwardBf16Fits), so alignment decides.
  const bool vec = Aligned16(phi_bar);
  auto launch = [&](auto parts, auto by_do) {
    constexpr int kP = decltype(parts)::value;
    constexpr bool kDo = decltype(by_do)::value;
    auto kernel = d.r == kW && d.dv == kW ? TypeReadsBackwardKernel<true, kP, kDo>
                                          : TypeReadsBackwardKernel<false, kP, kDo>;
    const cudaError_t err = mma_tiles::AllowSharedMemory(kernel, kFusedSmemBytes<kP>);
    if (err != cudaSuccess) return err;
    const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
    kernel<<<grid, kThreads, kFusedSmemBytes<kP>, stream>>>(
        d, groups, segments, U, lay, static_cast<const __nv_bfloat16*>(phi), gbar, w, out_lay,
        U_bar, phi_bar, gf, vec, assign);
    return cudaGetLastError();
  };
  auto with_parts = [&](auto by_do) {
    // Two parts keep three here: the option splits the fused chunk tiles only.
    if (SmatBf16SplitParts() == 1) return launch(std::integral_constant<int, 1>(), by_do);
    return launch(std::integral_constant<int, 3>(), by_do);
  };
  return by_factors ? with_parts(std::true_type()) : with_parts(std::false_type());
}

}  // namespace smat
