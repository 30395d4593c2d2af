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
// Products (mma.sync m16n8k16, bf16, fp32 accumulation; QueryBlock of
// smat_chunk_fwd_mma.cuh): warp w takes every column of the output rows of
// query block i (i = w for w < 4, 11 - w otherwise, so that the two warps of
// a scheduler cover nine key blocks between them), with phi_i's fragments
// held in registers. For each key block j <= i it computes the 16 x 16 score
// tile A = phi psi^T (exact products: both operands bf16), applies W and the
// causal mask in registers, splits it into three bf16 A fragments and
// multiplies by the staged vbar rows (3 MMAs per n-tile); the state term is
// phi (exact) times the three planes of S_in (3 MMAs per n-tile), scaled by
// exp(lam_t) first. The den column (dv) is column dv of S_in and, with the
// widths as constants, the scores' row sums (else the ones column of vbar).
// Before, each query block was split into two column halves on two warps,
// both computing the same score tiles.
//
// Finishing the outputs (kNorm, SmatKernels::NormalizedOutputs): instead of
// ybar, the kernel adds the per-type reads of recent rows (written before by
// TypeReads with SmatWrite::kAssign) and writes den and bf16 o, so that
// neither ybar nor its second and third passes (TypeReads +=, Normalize) go
// through memory. o = y * (1 / den), as LaunchSmatNormalize computes it,
// waits in shared memory and leaves in 16-byte pieces (StoreRows).
//
// Shapes: r = dv = 64 with aligned rows (kFull) runs a copy of the kernel in
// which the widths are constants; Nsight Compute had shown integer and
// branch instructions (loop bounds, width tests) at about 40% of the
// general kernel's, tensor-core MMAs at 9%.
//
// Speed (H200, bf16, batch 1, 8 heads, r = dv = 64, c = 128, T = 524288,
// 2026-12-01): 1.16 ms (89 TFLOP/s of exact-product FLOPs, 2.8 TB/s), gated
// 1.33; with kNorm 1.13 ms at d = 1 and 1.31 ms with the reads of d = 2
// (gated 1.44). With the column halves: 1.39 ms (1.56 gated), kNorm 1.50 ms
// (gated 1.74); before that 4.95 ms for the tile of smat_chunk_mma.cu and
// 6.04 ms with FFMA.
//
// Exactness: as smat_chunk_mma.cu, every fp32 operand in three parts, summed
// smallest first into one accumulator per output element (the accumulator
// of their own that the correction terms had took registers the full rows
// need): within 1e-5 of the CPU phase (den within 4.6e-7 on the GPU tests'
// cases); a fixed summation order and no atomics, so the same inputs give the
// same bits (tests/gpu/smat_gpu_test.cc). SMAT_CUDA_BF16_PARTS=2 runs two
// parts (kP; 2 MMAs per n-tile and term): NormalizedOutputs 1.50 -> 1.35 ms
// at the shape above with the column halves; SMAT_CUDA_BF16_PARTS=1 one
// (bf16 products): 1.33 -> 0.97 ms at d = 2 (2026-12-01).
//
// The block shape, Outputs, Block, StageState, QueryBlock and StoreRows:
// smat_chunk_fwd_mma.cuh (shared with the walk of smat_chunk_walk.cu, which
// computes the same outputs with the chunks' states carried from chunk to
// chunk in shared memory).
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_chunk_fwd_mma.cuh"
#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_fast_tiles.cuh"
#include "kernels/cuda/smat_mma.cuh"

namespace smat {
namespace {

using namespace chunk_fwd_mma;  // NOLINT: the tile's shared pieces

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
  // Query block of warp w: warps w and w + 4 share a scheduler and take
  // blocks i and 7 - i, whose causal sums together cover nine key blocks.
  const int w = tid >> 5, qi = w < 4 ? w : 11 - w;
  __nv_bfloat16* const ostage = bk.ostage();
  if (qi < bk.nb) QueryBlock<kGated, kNorm, kP>(bk, d, b, h, c0, qi, out, ostage);
  if (kNorm) {
    __syncthreads();  // the o rows are staged
    const bool vec_out = dv % 8 == 0 && (reinterpret_cast<uintptr_t>(out.o) & 15) == 0;
    StoreRows(bk, d, b, h, c0, ce, ostage, out.o, vec_out);
  }
}

template <bool kGated, bool kNorm, bool kFull>
cudaError_t LaunchShaped(const SmatCudaDims& d, bool vec, const void* phi, const void* psi,
                         const void* v, const float* lam, const float* S_in, const Outputs& out,
                         cudaStream_t stream) {
  auto kernel = mma_tiles::WithSplitParts(SmatBf16SplitParts(), [](auto parts) {
    return ChunkForwardFusedKernel<kGated, kNorm, kFull, decltype(parts)::value>;
  });
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
