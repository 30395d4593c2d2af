// F6 (eq. 10, gated by Lemma 4) for bf16 inputs in one tensor-core kernel in
// the style of the fused B7 (smat_chunk_bwd_mma.cu): per chunk k and (b, h),
// for the chunk's tokens t,
//   ybar_t = exp(lam_t) phi_t^T S_in[k] + sum_{s <= t} W[t, s] (phi_t . psi_s) vbar_s,
// W[t, s] = exp(lam_t - lam_s) (ungated: 1), vbar_s = [v_s, 1], written (not
// added) to ybar [batch, L, H, p]. c <= 128 tokens, r, dv <= 64.
// LaunchSmatChunkOutputsMma runs it for bf16 inputs; fp32 inputs keep the
// tile of smat_chunk_mma.cu, and SMAT_CUDA_CHUNK_TILES=ffma the FFMA tile.
//
// Staging, once per block: phi, psi and vbar as bf16 token rows ([128][72],
// cp.async where rows allow it; vbar's ones in column dv), and S_in[k] as three
// bf16 planes ([64][72] each, S = S1 + S2 + S3), all zero beyond the chunk's
// tokens and the matrices' sizes. 82 KB of shared memory: two blocks per SM.
//
// Products (mma.sync m16n8k16, bf16, fp32 accumulation): warp w takes the
// output rows of query block w, columns 0-31, and of query block 7 - w,
// columns 32-71 (w + 1 and 8 - w live key blocks: the same work per warp on a
// full chunk). For each key block s-block j <= i it computes the 16 x 16 score
// tile A = phi psi^T (exact products: both operands bf16), applies W and the
// causal mask in registers, splits it into three bf16 A fragments and
// multiplies by the staged vbar rows (3 MMAs per n-tile); the state term is
// phi (exact) times the three planes of S_in (3 MMAs per n-tile), scaled by
// exp(lam_t) first. The den column (dv) is the ones column of vbar and column
// dv of S_in, like any other.
//
// Finishing the outputs (kNorm, SmatKernels::NormalizedOutputs): instead of
// ybar, the kernel adds the per-type reads of recent rows (written before by
// TypeReads with SmatWrite::kAssign) and writes den and bf16 o, so that
// neither ybar nor its second and third passes (TypeReads +=, Normalize) go
// through memory. The left halves of the rows (columns 0-31) wait in shared
// memory until the warp holding column dv has stored 1 / den; o = y * (1 /
// den), as LaunchSmatNormalize computes it.
//
// Shapes: r = dv = 64 with aligned rows (kFull) runs a copy of the kernel in
// which the widths are constants; Nsight Compute had shown integer and
// branch instructions (loop bounds, width tests) at about 40% of the
// general kernel's, tensor-core MMAs at 9%.
//
// Speed (H200, bf16, batch 1, 8 heads, r = dv = 64, c = 128, T = 524288,
// 2026-12-01): 1.41 ms (74 TFLOP/s of exact-product FLOPs, 2.3 TB/s; 1.61
// with the widths as launch values), against 4.95 ms for the tile of
// smat_chunk_mma.cu and 6.04 ms with FFMA; gated 1.69. With kNorm 1.50 ms
// (gated 1.70; 1.54 and 1.77 with S_in split element by element, 1.90 and
// 2.10 before kFull): TypeReads (=) + this = 2.25 ms, against 2.78 ms for
// ChunkOutputs + TypeReads (+=) + Normalize.
//
// Exactness: as smat_chunk_mma.cu (every fp32 operand in three parts, the
// correction terms in an accumulator of their own): within 1e-5 of the CPU
// phase; a fixed summation order and no atomics, so the same inputs give the
// same bits (tests/gpu/smat_gpu_test.cc). SMAT_CUDA_BF16_PARTS=2 runs two
// parts (kP; 2 MMAs per n-tile and term): NormalizedOutputs 1.50 -> 1.35 ms
// at the shape above.
//
// The block shape, Outputs, Block and StageState: smat_chunk_fwd_mma.cuh
// (shared with the walk of smat_chunk_walk.cu, which computes the same
// outputs with the chunks' states carried from chunk to chunk in shared
// memory and one warp per query block).
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_chunk_fwd_mma.cuh"
#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_fast_tiles.cuh"
#include "kernels/cuda/smat_mma.cuh"

namespace smat {
namespace {

using namespace chunk_fwd_mma;  // NOLINT: the tile's shared pieces

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

// grid ChunkGrid(d), kThreads threads, kSmemBytes (kNorm: kSmemNormBytes)
// of shared memory. kFull: r = dv = kW and vec_in (see Block). kP: the bf16
// parts of S_in and of the score tiles (SmatBf16SplitParts; the layout keeps
// room for three planes either way).
template <bool kGated, bool kNorm, bool kFull, int kP>
__global__ void __launch_bounds__(kThreads, 2)
    ChunkForwardFusedKernel(SmatCudaDims d, bool vec_in, const __nv_bfloat16* __restrict__ phi,
                            const __nv_bfloat16* __restrict__ psi,
                            const __nv_bfloat16* __restrict__ v, const float* __restrict__ lam,
                            const float* __restrict__ S_in, Outputs out) {
  extern __shared__ float4 smem4[];
  __nv_bfloat16* base = reinterpret_cast<__nv_bfloat16*>(smem4);
  float* lam_s = reinterpret_cast<float*>(base + kOffTokens);
  float* wq = lam_s + kC;
  const int tid = threadIdx.x;
  const cuda_detail::ChunkBlock blk(d);
  const int64_t k = blk.k;
  const int b = blk.b, h = blk.h;
  const int64_t c0 = k * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));
  const TileWidths<kFull> wd{d.r, d.dv};
  const int r = wd.r(), dv = wd.dv(), p = wd.p();
  if (kFull) vec_in = true;
  const int64_t tok = TokenRow(d, b, c0, h);
  const int64_t stride_r = static_cast<int64_t>(d.H) * r, stride_v = static_cast<int64_t>(d.H) * dv;

  // The reads rows of a recent chunk are wanted only at the end: ask L2 for
  // them now, so that the epilogue does not wait on memory.
  if (kNorm && out.reads != nullptr && c0 >= out.recent_begin) {
    for (int e = tid; e < 3 * ce; e += kThreads) {  // 3 lines of 128 bytes hold a row
      const int m = e / 3, piece = e - 3 * m;
      const char* row = reinterpret_cast<const char*>(out.reads + (tok + int64_t{m} * d.H) * p);
      asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(row + 128 * piece));
    }
  }
  // ---- staging ----
  StageBf16Rows<kC, kW, kLd, kThreads>(phi + tok * r, stride_r, r, ce, vec_in, base + kPhi * kTile);
  StageBf16Rows<kC, kW, kLd, kThreads>(psi + tok * r, stride_r, r, ce, vec_in, base + kPsi * kTile);
  StageBf16Rows<kC, kW, kLd, kThreads>(v + tok * dv, stride_v, dv, ce, vec_in, base + kV * kTile);
  StageState<kP>(S_in + ChunkRow(d, b, k, h) * static_cast<int64_t>(r) * p, r, p, base + kOffS);
  if (tid < kC) {
    const float l = kGated && tid < ce ? __ldg(&lam[tok + static_cast<int64_t>(tid) * d.H]) : 0.f;
    lam_s[tid] = l;
    wq[tid] = kGated ? expf(l) : 1.f;
  }
  if (vec_in) CpAsyncWaitAll();
  __syncthreads();
  // vbar columns dv .. kLd - 1 (after the staging, which zeroes up to kW):
  // the ones in column dv for tokens < ce, else 0.
  for (int e = tid; e < kC * (kLd - dv); e += kThreads) {
    const int t = e / (kLd - dv), n = dv + (e - t * (kLd - dv));
    base[kV * kTile + t * kLd + n] = __float2bfloat16_rn(t < ce && n == dv ? 1.f : 0.f);
  }
  __syncthreads();

  Block<kFull> bk;
  bk.base = base;
  bk.ce = ce;
  bk.nb = (ce + 15) >> 4;
  bk.r_ = r;
  bk.dv_ = dv;
  const int lane = tid & 31;
  bk.g = lane >> 2;
  bk.tq = lane & 3;
  bk.off_a = (lane & 15) * kLd + (lane >> 4) * 8;
  bk.off_bn = ((lane & 7) + ((lane >> 4) << 3)) * kLd + ((lane >> 3) & 1) * 8;
  bk.off_bt = ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8;
  const int w = tid >> 5;
  if (w < bk.nb) QueryRows<kGated, kNorm, 0, 4, kP>(bk, d, b, h, c0, w, out);
  if (7 - w < bk.nb && p > 32) QueryRows<kGated, kNorm, 4, 5, kP>(bk, d, b, h, c0, 7 - w, out);
  if (kNorm) {
    __syncthreads();  // every left half and normaliser is in shared memory
    FinishLeftHalves(bk, d, b, h, c0, out);
  }
}

template <bool kGated, bool kNorm, bool kFull>
cudaError_t LaunchShaped(const SmatCudaDims& d, bool vec, const void* phi, const void* psi,
                         const void* v, const float* lam, const float* S_in, const Outputs& out,
                         cudaStream_t stream) {
  auto kernel = SmatBf16SplitParts() == 3 ? ChunkForwardFusedKernel<kGated, kNorm, kFull, 3>
                                          : ChunkForwardFusedKernel<kGated, kNorm, kFull, 2>;
  constexpr int kBytes = kNorm ? kSmemNormBytes : kSmemBytes;
  const cudaError_t err = AllowSharedMemory(kernel, kBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid = cuda_detail::ChunkGrid(d);
  kernel<<<grid, kThreads, kBytes, stream>>>(d, vec, static_cast<const __nv_bfloat16*>(phi),
                                             static_cast<const __nv_bfloat16*>(psi),
                                             static_cast<const __nv_bfloat16*>(v), lam, S_in, out);
  return cudaGetLastError();
}

template <bool kGated, bool kNorm>
cudaError_t LaunchGated(const SmatCudaDims& d, const void* phi, const void* psi, const void* v,
                        const float* lam, const float* S_in, const Outputs& out,
                        cudaStream_t stream) {
  const bool vec = d.r % 8 == 0 && d.dv % 8 == 0 && fast_tiles::Aligned16(phi) &&
                   fast_tiles::Aligned16(psi) && fast_tiles::Aligned16(v);
  if (vec && d.r == kW && d.dv == kW) {
    return LaunchShaped<kGated, kNorm, true>(d, vec, phi, psi, v, lam, S_in, out, stream);
  }
  return LaunchShaped<kGated, kNorm, false>(d, vec, phi, psi, v, lam, S_in, out, stream);
}

}  // namespace

bool SmatChunkForwardFusedFits(const SmatCudaDims& d) {
  if (!d.bf16 || !SmatChunkFastTilesFit(d)) return false;
  return SmatDeviceRunsMma(kSmemBytes);
}

bool SmatNormalizedOutputsFusedFits(const SmatCudaDims& d) {
  // Column dv (the normaliser) must lie in the right halves: dv >= 32.
  return SmatChunkForwardFusedFits(d) && d.dv >= 32 && SmatDeviceRunsMma(kSmemNormBytes);
}

cudaError_t LaunchSmatNormalizedOutputsFused(const SmatCudaDims& d, const void* phi,
                                             const void* psi, const void* v, const float* lam,
                                             const float* S_in, const float* reads,
                                             int64_t recent_begin, float eps, void* o, float* den,
                                             cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  const Outputs out{nullptr, reads, recent_begin, eps, static_cast<__nv_bfloat16*>(o), den};
  return lam != nullptr ? LaunchGated<true, true>(d, phi, psi, v, lam, S_in, out, stream)
                        : LaunchGated<false, true>(d, phi, psi, v, lam, S_in, out, stream);
}

cudaError_t LaunchSmatChunkOutputsForwardFused(const SmatCudaDims& d, const void* phi,
                                               const void* psi, const void* v, const float* lam,
                                               const float* S_in, float* ybar,
                                               cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  const Outputs out{ybar, nullptr, 0, 0.f, nullptr, nullptr};
  return lam != nullptr ? LaunchGated<true, false>(d, phi, psi, v, lam, S_in, out, stream)
                        : LaunchGated<false, false>(d, phi, psi, v, lam, S_in, out, stream);
}

}  // namespace smat
