// The grouped outer sums of smat_grouped_mma.cu for bf16 token rows with unit
// weights (ungated, no span offset), which is what the op's bf16 forward and
// backward run at scale:
//   out[(b, g, h), segment] = sum over the segment's tokens i of a_i b_i^T
// with a = psi or phi (bf16) and b = vbar = [v, 1] (v bf16: exact in one bf16
// part) or gbar (fp32: three bf16 parts b = b1 + b2 + b3, 24 significant bits).
//
// The general kernel stages both operands as fp32 and splits them at every
// fragment load; here the rows stay bf16 from global to shared memory
// (cp.async, 16 bytes at a time: no registers, no conversion) and the
// fragments come from ldmatrix.trans, so a 16-token step is one ldmatrix per
// operand and one MMA per n8 tile (vbar) or three (gbar, Mma1x3). The output
// tile goes through shared memory and leaves as whole 16-byte rows.
//
// Shape: as the general kernel. One block of 8 warps per (segment, group,
// b * H), 128 tokens at a time; warp w owns output rows 16 (w % 4) .. +15 and
// n8 tiles 0-4 (w < 4) or 5-8. Shared memory: a [128][72] bf16 (144-byte rows:
// conflict-free ldmatrix), b in one or three such planes, the token rows.
// Sums per output run over the tokens in list order, 16 at a time, the
// correction terms of gbar smallest first in their own accumulator, exactly
// as the general kernel orders them; no atomics.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_fast_tiles.cuh"
#include "kernels/cuda/smat_grouped_mma.h"
#include "kernels/cuda/smat_mma.cuh"

namespace smat {
namespace {

using cuda_detail::TokenRow;
using fast_tiles::Aligned16;
using mma_tiles::CpAsync16;
using mma_tiles::CpAsyncWaitAll;
using mma_tiles::Ldsm4T;
using mma_tiles::Mma;
using mma_tiles::SmemAddr;

constexpr int kThreads = 256;
constexpr int kC = 128;               // tokens staged at a time
constexpr int kLd = 72;               // bf16 per staged row: r <= 64, p <= 72
constexpr int kPlane = kC * kLd;      // bf16 elements of one staged operand
constexpr int kMaxOut = kPlane / 2;   // fp32 output elements the a plane can hold

constexpr int SmemBytes(int b_parts) { return (1 + b_parts) * kPlane * 2 + kC * 8; }

// dst[t][0 .. width) = src row rows[t] for t < nt, zeros for nt <= t < kC;
// width % 8 == 0, rows 16-byte aligned.
__device__ __forceinline__ void StageRowsAsync(const __nv_bfloat16* __restrict__ src,
                                               const int64_t* rows, int width, int nt,
                                               __nv_bfloat16* dst) {
  const int pieces = width >> 3;
  for (int e = threadIdx.x; e < kC * pieces; e += kThreads) {
    const int t = e / pieces, q = e - t * pieces;
    __nv_bfloat16* to = dst + t * kLd + 8 * q;
    if (t < nt) {
      CpAsync16(SmemAddr(to), src + rows[t] * width + 8 * q);
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// The three bf16 parts of fp32 rows (width p) into planes dst, dst + kPlane,
// dst + 2 kPlane; zeros for nt <= t < kC.
__device__ __forceinline__ void StageSplitRows(const float* __restrict__ src, const int64_t* rows,
                                               int p, int nt, __nv_bfloat16* dst) {
  constexpr int kBatch = 8;  // loads in flight per thread: 5 rounds for 128 x 65
  const int total = kC * p;
  for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * kBatch) {
    float x[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads, t = e / p, c = e - t * p;
      x[u] = e < total && t < nt ? __ldg(&src[rows[t] * p + c]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads, t = e / p, c = e - t * p;
      if (e < total) {
        const __nv_bfloat16 x1 = __float2bfloat16_rn(x[u]);
        const float r1 = x[u] - __bfloat162float(x1);  // exact
        const __nv_bfloat16 x2 = __float2bfloat16_rn(r1);
        const __nv_bfloat16 x3 = __float2bfloat16_rn(r1 - __bfloat162float(x2));
        __nv_bfloat16* to = dst + t * kLd + c;
        to[0] = x1;
        to[kPlane] = x2;
        to[2 * kPlane] = x3;
      }
    }
  }
}

// GroupGrid (batch * H, segments, G), kThreads threads, SmemBytes(kBParts).
// kBParts 1: b = vbar from bf16 v; 3: b = gbar (fp32, width p), three blocks
// per SM (74 KB each; 80 registers, so the staging keeps 8 loads in flight,
// not 12): ChunkStateGradients 1.59 -> 1.44 ms against two blocks per SM
// (H200, bf16, r = dv = 64, T = 524288, 8 heads).
template <int kBParts>
__global__ void __launch_bounds__(kThreads, kBParts == 1 ? 4 : 3)
    OuterSumBf16Kernel(SmatCudaDims d, SmatTokenGroups groups, int segments,
                       const __nv_bfloat16* __restrict__ a, const void* __restrict__ bsrc,
                       SmatMatrixLayout lay, float* __restrict__ out) {
  extern __shared__ uint4 smem_u4[];
  __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem_u4);
  __nv_bfloat16* Bs = As + kPlane;
  int64_t* rows = reinterpret_cast<int64_t*>(Bs + kBParts * kPlane);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const cuda_detail::GroupBlock blk(groups, d, segments);
  const int r = d.r, p = d.p, dv = d.dv;
  const int bw = kBParts == 1 ? dv : p;  // b columns staged per token

  // Columns no staging writes: a's r.., b's bw.. are zero, except vbar's ones
  // in column dv (a's rows past the tile's tokens are zero, so they add 0).
  const __nv_bfloat16 zero = __float2bfloat16_rn(0.f), one = __float2bfloat16_rn(1.f);
  for (int e = tid; e < kPlane; e += kThreads) {
    const int c = e % kLd;
    if (c >= r) As[e] = zero;
    if (c >= bw) {
#pragma unroll
      for (int q = 0; q < kBParts; ++q) Bs[q * kPlane + e] = kBParts == 1 && c == dv ? one : zero;
    }
  }

  const int m0 = (warp & 3) * 16;
  const int n_first = warp < 4 ? 0 : 5, n_count = warp < 4 ? 5 : 4;
  // ldmatrix.trans lane offsets: a is stored k-major (As[token][m]), b as
  // Bs[token][n]; see smat_chunk_bwd_mma.cu for the fragment layouts.
  const int off_a = ((lane & 7) + (lane >> 4) * 8) * kLd + ((lane >> 3) & 1) * 8 + m0;
  const int off_b = ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8 + 8 * n_first;
  const uint32_t a_base = SmemAddr(As) + 2u * off_a;
  const uint32_t b_base = SmemAddr(Bs) + 2u * off_b;
  float acc[5][4], cor[5][4];
#pragma unroll
  for (int j = 0; j < 5; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = cor[j][e] = 0.f;

  for (int64_t j0 = blk.lo; j0 < blk.hi; j0 += kC) {
    const int nt = static_cast<int>(cuda_detail::Min64(kC, blk.hi - j0));
    __syncthreads();  // the previous tile is consumed, the padding is written
    if (tid < nt) rows[tid] = TokenRow(d, blk.b, blk.cur.Token(j0 + tid), blk.h);
    __syncthreads();
    StageRowsAsync(a, rows, r, nt, As);
    if constexpr (kBParts == 1) {
      StageRowsAsync(static_cast<const __nv_bfloat16*>(bsrc), rows, dv, nt, Bs);
    } else {
      StageSplitRows(static_cast<const float*>(bsrc), rows, p, nt, Bs);
    }
    CpAsyncWaitAll();
    __syncthreads();
    const int ksteps = (nt + 15) >> 4;
    for (int ks = 0; ks < ksteps; ++ks) {
      const uint32_t row_bytes = 2u * 16u * kLd * ks;
      uint32_t af[4];
      Ldsm4T(af, a_base + row_bytes);
#pragma unroll
      for (int pp = 0; pp < 3; ++pp) {
        if (2 * pp >= n_count) break;
        uint32_t bf[kBParts][4];
#pragma unroll
        for (int q = 0; q < kBParts; ++q) {
          Ldsm4T(bf[q], b_base + 2u * (q * kPlane + 16 * pp) + row_bytes);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * pp + half;
          if (j >= n_count) break;
          if constexpr (kBParts == 1) {
            Mma(acc[j], af, bf[0][2 * half], bf[0][2 * half + 1]);
          } else {
            Mma(cor[j], af, bf[2][2 * half], bf[2][2 * half + 1]);
            Mma(cor[j], af, bf[1][2 * half], bf[1][2 * half + 1]);
            Mma(acc[j], af, bf[0][2 * half], bf[0][2 * half + 1]);
          }
        }
      }
    }
  }

  // The r x p result through shared memory (in a's plane), out as whole rows.
  __syncthreads();
  float* os = reinterpret_cast<float*>(As);
#pragma unroll
  for (int j = 0; j < 5; ++j) {
    if (j >= n_count) break;
    const int col = (n_first + j) * 8 + 2 * tig;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = m0 + gid + (e >= 2 ? 8 : 0), c = col + (e & 1);
      if (row < r && c < p) os[row * p + c] = kBParts == 1 ? acc[j][e] : acc[j][e] + cor[j][e];
    }
  }
  __syncthreads();
  float* dst = blk.Matrix(out, lay, r, p, segments, blk.seg);
  const int n = r * p;
  if (n % 4 == 0 && Aligned16(dst)) {
    for (int i = tid; i < n / 4; i += kThreads) {
      reinterpret_cast<float4*>(dst)[i] = reinterpret_cast<const float4*>(os)[i];
    }
  } else {
    for (int i = tid; i < n; i += kThreads) dst[i] = os[i];
  }
}

template <int kBParts>
cudaError_t Launch(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                   const void* a, const void* b, const SmatMatrixLayout& lay, float* out,
                   cudaStream_t stream) {
  auto kernel = OuterSumBf16Kernel<kBParts>;
  constexpr int kSmem = SmemBytes(kBParts);
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
  kernel<<<grid, kThreads, kSmem, stream>>>(d, groups, segments,
                                            static_cast<const __nv_bfloat16*>(a), b, lay, out);
  return cudaGetLastError();
}

}  // namespace

bool SmatOuterSumBf16Fits(const SmatCudaDims& d, const void* a, const void* b, bool b_is_v,
                          const SmatTokenWeights& w) {
  if (!d.bf16 || w.lam != nullptr || w.extra != nullptr) return false;
  if (d.r <= 0 || d.r > 64 || d.r % 8 != 0 || d.p > kLd || d.r * d.p > kMaxOut) return false;
  if (!Aligned16(a)) return false;
  if (b_is_v && (d.dv % 8 != 0 || !Aligned16(b))) return false;
  return SmatDeviceRunsMma(SmemBytes(b_is_v ? 1 : 3));
}

cudaError_t LaunchSmatOuterSumBf16(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                   int segments, const void* a, const void* b, bool b_is_v,
                                   const SmatMatrixLayout& lay, float* out, cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  return b_is_v ? Launch<1>(d, groups, segments, a, b, lay, out, stream)
                : Launch<3>(d, groups, segments, a, b, lay, out, stream);
}

}  // namespace smat
