// The grouped outer sums of smat_grouped_mma.cu for bf16 token rows, which is
// what the op's bf16 forward and backward run at scale:
//   out[(b, g, h), segment] = sum over the segment's tokens i of (w_i a_i) b_i^T
// with a = psi or phi (bf16) and b = vbar = [v, 1] (v bf16: exact in one bf16
// part) or gbar (fp32: three bf16 parts b = b1 + b2 + b3, 24 significant bits,
// unit weights only). With weights (gated, or a span offset) w_i a_i is
// rounded to fp32 and split into three parts as well, and b = vbar stays one:
// the products and their order are those of smat_grouped_mma.cu's kernel
// (lo += a3 b, lo += a2 b, hi += a1 b), only the staging differs.
//
// The general kernel stages both operands as fp32 and splits them at every
// fragment load; here the rows stay bf16 from global to shared memory
// (cp.async, 16 bytes at a time: no registers, no conversion) and the
// fragments come from ldmatrix.trans, so a 16-token step is one ldmatrix per
// operand and one MMA per n8 tile (vbar) or three (gbar, or weighted a). The
// output tile goes through shared memory and leaves as whole 16-byte rows.
//
// Shape: as the general kernel. One block of 8 warps per (segment, group,
// b * H), 128 tokens at a time; warp w owns output rows 16 (w % 4) .. +15 and
// n8 tiles 0-4 (w < 4) or 5-8. Shared memory: a in one or three [128][72]
// bf16 planes (144-byte rows: conflict-free ldmatrix), b in one or three, the
// token rows and (weighted) their weights.
// Sums per output run over the tokens in list order, 16 at a time, the
// correction terms of gbar smallest first in their own accumulator, exactly
// as the general kernel orders them; no atomics.
#include <cuda_bf16.h>

#include <cstdint>

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
using mma_tiles::SmemAddr;
using outer_tile::kC;      // tokens staged at a time
using outer_tile::kLd;     // bf16 per staged row: r <= 64, p <= 72
using outer_tile::kPlane;  // bf16 elements of one staged operand

constexpr int kThreads = 256;
constexpr int kMaxOut = kPlane / 2;  // fp32 output elements the a plane can hold

// The a and b planes, the token rows (int64) and, with a weighted (three a
// parts), the token weights.
constexpr int SmemBytes(int a_parts, int b_parts) {
  return (a_parts + b_parts) * kPlane * 2 + kC * 8 + (a_parts == 3 ? kC * 4 : 0);
}

// A thread's share of a tile's bf16 rows (width % 8 == 0, 16-byte aligned),
// 16-byte piece e = threadIdx.x + u kThreads (row e / (width / 8)): loaded
// into registers (zeros past the tile's tokens) before the weights they are
// scaled by are known, so the two memory latencies overlap (H200, bf16,
// T = 524288, d = 2, gated: ChunkSummaries 0.92 -> 0.86 ms).
constexpr int kPiecesPerThread = kC * 8 / kThreads;  // r <= 64: 8 pieces per row
__device__ __forceinline__ void LoadRowPieces(const __nv_bfloat16* __restrict__ src,
                                              const int64_t* rows, int width, int nt,
                                              uint4 (&x)[kPiecesPerThread]) {
  const int pieces = width >> 3, total = kC * pieces;
#pragma unroll
  for (int u = 0; u < kPiecesPerThread; ++u) {
    const int e = threadIdx.x + u * kThreads, t = e / pieces, q = e - t * pieces;
    x[u] = e < total && t < nt
               ? __ldg(reinterpret_cast<const uint4*>(src + rows[t] * width + 8 * q))
               : make_uint4(0u, 0u, 0u, 0u);
  }
}

// The three bf16 parts of w[t] a_t from the pieces LoadRowPieces loaded into
// planes dst, dst + kPlane, dst + 2 kPlane; zeros for nt <= t < kC. Columns
// width.. are left alone.
__device__ __forceinline__ void StoreWeightedPieces(const uint4 (&x)[kPiecesPerThread],
                                                    const float* w, int width, int nt,
                                                    __nv_bfloat16* dst) {
  const int pieces = width >> 3, total = kC * pieces;
#pragma unroll
  for (int u = 0; u < kPiecesPerThread; ++u) {
    const int e = threadIdx.x + u * kThreads, t = e / pieces, q = e - t * pieces;
    if (e >= total) continue;
    const float wt = t < nt ? w[t] : 0.f;
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x[u]);
    uint32_t part[3][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      mma_tiles::Split3(wt * f.x, wt * f.y, part[0][i], part[1][i], part[2][i]);
    }
#pragma unroll
    for (int pl = 0; pl < 3; ++pl) {
      *reinterpret_cast<uint4*>(dst + pl * kPlane + t * kLd + 8 * q) =
          make_uint4(part[pl][0], part[pl][1], part[pl][2], part[pl][3]);
    }
  }
}

// Rows staged as in smat_outer_tile.cuh; fp32 rows (gbar) with their den
// column in the planes, 8 loads in flight per thread (5 rounds for 128 x 65).
__device__ __forceinline__ void StageRowsAsync(const __nv_bfloat16* __restrict__ src,
                                               const int64_t* rows, int width, int nt,
                                               __nv_bfloat16* dst) {
  outer_tile::StageRowsAsync<kThreads>(src, rows, width, nt, dst);
}
__device__ __forceinline__ void StageSplitRows(const float* __restrict__ src, const int64_t* rows,
                                               int p, int nt, __nv_bfloat16* dst) {
  outer_tile::StageSplitRows<false, true, false, 8, kThreads>(src, rows, nullptr, p - 1, nt, dst,
                                                              nullptr);
}

// GroupGrid (batch * H, segments, G), kThreads threads, SmemBytes(kAParts,
// kBParts). kAParts 1: a as it is; 3: w a (weighted). kBParts 1: b = vbar
// from bf16 v; 3: b = gbar (fp32, width p). With three parts of either, three
// blocks per SM (74 KB each; 80 registers, so the staging keeps 8 loads in
// flight, not 12): ChunkStateGradients 1.59 -> 1.44 ms against two blocks per
// SM (H200, bf16, r = dv = 64, T = 524288, 8 heads). kFull: r = dv = 64 as
// constants (mma_tiles::TileWidths):
// ChunkSummaries 0.53 -> 0.49 ms, ProfilePooling 0.33 -> 0.31 ms,
// ChunkStateGradients 1.39 -> 1.23 ms.
template <int kAParts, int kBParts, bool kFull>
__global__ void __launch_bounds__(kThreads, kAParts == 1 && kBParts == 1 ? 4 : 3)
    OuterSumBf16Kernel(SmatCudaDims d, SmatTokenGroups groups, int segments,
                       const __nv_bfloat16* __restrict__ a, const void* __restrict__ bsrc,
                       SmatTokenWeights tw, SmatMatrixLayout lay, float* __restrict__ out) {
  extern __shared__ uint4 smem_u4[];
  __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem_u4);
  __nv_bfloat16* Bs = As + kAParts * kPlane;
  int64_t* rows = reinterpret_cast<int64_t*>(Bs + kBParts * kPlane);
  float* wts = reinterpret_cast<float*>(rows + kC);  // token weights (kAParts 3)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const cuda_detail::GroupBlock blk(groups, d, segments);
  const mma_tiles::TileWidths<kFull> wd{d.r, d.dv};
  const int r = wd.r(), dv = wd.dv(), p = wd.p();
  const int bw = kBParts == 1 ? dv : p;  // b columns staged per token

  // Columns no staging writes: a's r.., b's bw.. are zero, except vbar's ones
  // in column dv (a's rows past the tile's tokens are zero, so they add 0).
  const __nv_bfloat16 zero = __float2bfloat16_rn(0.f), one = __float2bfloat16_rn(1.f);
  mma_tiles::FillPadColumns<kC, kLd, kThreads>(As, kAParts, r, zero);
  mma_tiles::FillPadColumns<kC, kLd, kThreads>(Bs, kBParts, bw, kBParts == 1 ? one : zero);

  outer_tile::Warp<kAParts, kBParts> tile(lane, warp, As, Bs);

  for (int64_t j0 = blk.lo; j0 < blk.hi; j0 += kC) {
    const int nt = static_cast<int>(cuda_detail::Min64(kC, blk.hi - j0));
    __syncthreads();  // the previous tile is consumed, the padding is written
    if (tid < nt) rows[tid] = TokenRow(d, blk.b, blk.cur.Token(j0 + tid), blk.h);
    __syncthreads();
    if constexpr (kAParts == 3) {
      // vbar and a on their way first; then the weights (their loads overlap
      // both), then w a split.
      StageRowsAsync(static_cast<const __nv_bfloat16*>(bsrc), rows, dv, nt, Bs);
      uint4 x[kPiecesPerThread];
      LoadRowPieces(a, rows, r, nt, x);
      if (tid < nt)
        wts[tid] = cuda_detail::TokenWeight(d, tw, blk.b, blk.h, blk.cur.Token(j0 + tid));
      __syncthreads();
      StoreWeightedPieces(x, wts, r, nt, As);
    } else if constexpr (kBParts == 1) {
      StageRowsAsync(a, rows, r, nt, As);
      StageRowsAsync(static_cast<const __nv_bfloat16*>(bsrc), rows, dv, nt, Bs);
    } else {
      StageRowsAsync(a, rows, r, nt, As);
      StageSplitRows(static_cast<const float*>(bsrc), rows, p, nt, Bs);
    }
    CpAsyncWaitAll();
    __syncthreads();
    const int ksteps = (nt + 15) >> 4;
    for (int ks = 0; ks < ksteps; ++ks) tile.Step(ks);
  }

  // The r x p result through shared memory (in a's plane), out as whole rows.
  tile.Store(r, p, reinterpret_cast<float*>(As), blk.Matrix(out, lay, r, p, segments, blk.seg), tid,
             kThreads);
}

template <int kAParts, int kBParts>
cudaError_t Launch(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                   const void* a, const void* b, const SmatTokenWeights& w,
                   const SmatMatrixLayout& lay, float* out, cudaStream_t stream) {
  // The weighted kernel (kAParts 3) keeps the launch's widths: with them as
  // constants it spills more (32 bytes against 16).
  const bool full = kAParts == 1 && d.r == mma_tiles::kTileWidth && d.dv == mma_tiles::kTileWidth;
  auto kernel = full ? OuterSumBf16Kernel<kAParts, kBParts, kAParts == 1>
                     : OuterSumBf16Kernel<kAParts, kBParts, false>;
  constexpr int kSmem = SmemBytes(kAParts, kBParts);
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
  kernel<<<grid, kThreads, kSmem, stream>>>(d, groups, segments,
                                            static_cast<const __nv_bfloat16*>(a), b, w, lay, out);
  return cudaGetLastError();
}

}  // namespace

bool SmatOuterSumBf16Fits(const SmatCudaDims& d, const void* a, const void* b, bool b_is_v,
                          const SmatTokenWeights& w) {
  // Weights go to a (three parts), which takes b = vbar (one part) only.
  const bool weighted = w.lam != nullptr || w.extra != nullptr;
  if (!d.bf16 || (weighted && !b_is_v)) return false;
  if (d.r <= 0 || d.r > 64 || d.r % 8 != 0 || d.p > kLd || d.r * d.p > kMaxOut) return false;
  if (!Aligned16(a)) return false;
  if (b_is_v && (d.dv % 8 != 0 || !Aligned16(b))) return false;
  return SmatDeviceRunsMma(SmemBytes(weighted ? 3 : 1, b_is_v ? 1 : 3));
}

cudaError_t LaunchSmatOuterSumBf16(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                   int segments, const void* a, const void* b, bool b_is_v,
                                   const SmatTokenWeights& w, const SmatMatrixLayout& lay,
                                   float* out, cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (!b_is_v) return Launch<1, 3>(d, groups, segments, a, b, w, lay, out, stream);
  return w.lam != nullptr || w.extra != nullptr
             ? Launch<3, 1>(d, groups, segments, a, b, w, lay, out, stream)
             : Launch<1, 1>(d, groups, segments, a, b, w, lay, out, stream);
}

}  // namespace smat
