// TypeReads, ProfilePoolingBackward and the kMatVec reads on tensor cores:
// the products of smat_reads_bf16.cuh, one block per group segment.
//
// Shape: one block of 8 warps per (segment, group, b * H) (GroupGrid), the
// segment's tokens 128 at a time; warp w owns tokens 16 w .. 16 w + 15 of a
// tile and all their output columns, so a warp's results need no exchange.
// Shared memory: the M planes (3 x [64][88] bf16, 33 KB), M[:, dv] (fp32),
// the token planes ([128][72] bf16: one for phi, two for psi and v, three for
// gbar), the token rows, weights and gbar[:, dv]: 54 / 73 / 92 KB for kVecMat /
// kBoth / kMatVec, four / three / two blocks per SM; kVecMat with its rows
// staged (kStaged, see Launch) 74 KB, three blocks per SM.
//
// Speed (H200, bf16, batch 1, 8 heads, r = dv = 64, c = 128, T = 524288,
// d = 2, 2026-12-01), against the FFMA kernel: ProfilePoolingBackward (kBoth)
// 1.52 -> 0.95 ms, TypeReads (=) (kVecMat) 0.75 -> 0.71 ms. kMatVec is slower
// than FFMA (TypeReadsBackward 1.68 against 1.60 ms, gated 2.18 against 2.03:
// 6 MMAs per tile at two blocks per SM; 1.78 ms with 8 of gbar's loads in
// flight per thread instead of all), so SmatUseReadsBf16 leaves it to
// SMAT_CUDA_GROUPED=mma. kVecMat was bound by neither pipe (Nsight Compute:
// 46% of the SM, 29% of DRAM) while its p-wide output rows (65 floats) left
// as single floats, 8 rows per store; where the blocks hold a whole tile of
// tokens they now leave through shared memory, a row's columns per store
// (StoreRowsStaged): 0.76 -> 0.64 ms at d = 2. With r = dv = 64 the kernels
// run with the widths as constants (kFull; Nsight Compute had counted
// integer instructions and branches at about 40% of these kernels'):
// TypeReads (=) 0.78 -> 0.73 ms (the same run; 0.71 in an earlier one),
// ProfilePoolingBackward unchanged.
//
// SMAT_CUDA_BF16_PARTS=1 (SmatBf16SplitParts, the option the fused chunk
// tiles take too): M in one bf16 plane (kMP = 1) for kVecMat and kBoth, so that
// every product is one MMA with fp32 accumulation; kMatVec keeps three.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/smat_grouped_mma.h"
#include "kernels/cuda/smat_reads_bf16.cuh"

namespace smat {
namespace {

using namespace reads_bf16;  // NOLINT: the read kernels' shared pieces

// Token planes per kind: phi; v then psi; gbar in three parts.
constexpr int TokenPlanes(SmatReadKind kind) {
  return kind == SmatReadKind::kVecMat ? 1 : kind == SmatReadKind::kBoth ? 2 : 3;
}

// kVecMat's outputs of a pass (kVecMatTiles n8 tiles of a warp's 16 tokens)
// wait in shared memory, [16][kLdY] fp32 per warp, so that they leave as runs
// of consecutive floats (see StoreRowsStaged). kLdY = 8 (mod 32): the float2
// stores of a half-warp's fragments hit distinct banks.
constexpr int kVecMatTiles = 3;
constexpr int kLdY = 40;
static_assert(kLdY >= 8 * kVecMatTiles && kLdY % 32 == 8, "a pass's columns, conflict-free");

// Byte offsets after the token planes: rows (int64 [kC]), weights and
// gbar[:, dv] (fp32 [kC] each), then kVecMat's outputs.
constexpr int OffRows(SmatReadKind kind) { return kOffTok + TokenPlanes(kind) * kTokPlane * 2; }
constexpr int OffOutputs(SmatReadKind kind) { return OffRows(kind) + kC * 8 + 2 * kC * 4; }
constexpr int SmemBytes(SmatReadKind kind, bool staged = false) {
  return OffOutputs(kind) + (staged ? kC * kLdY * 4 : 0);
}
static_assert(OffRows(SmatReadKind::kBoth) % 16 == 0, "the rows must be 16-byte aligned");

// Asks L2 for the rows out[rows[t]] (t < nt, `width` floats each) that a
// tile adds to once its products are done, so that reading them back waits
// on L2 rather than on memory. A thread per row, a prefetch per 128 bytes.
// kVecMat's += (the TypeReads of the sequence-parallel forward) uses it:
// H200, bf16, T = 524288, 8 heads, 2026-12-01, TypeReads (+=) 0.735 ->
// 0.682 ms at d = 2, 0.80 -> 0.72 gated, 1.01 -> 0.93 at d = 3. Before the
// adds of TypeReadsBackward (phi_bar) and ProfilePoolingBackward (psi_bar,
// v_bar) it cost time at d <= 2 (1.26 -> 1.36 ms, 0.94 -> 0.97 ms).
__device__ __forceinline__ void PrefetchRows(const float* out, const int64_t* rows, int width,
                                             int nt) {
  static_assert(kThreads >= kC, "a thread per row");
  if (threadIdx.x >= nt) return;
  const float* row = out + rows[threadIdx.x] * width;
  for (int n = 0; n < width; n += 32) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + n));
}

// kVecMat's rows (p = dv + 1 floats: odd for the usual even dv, so the pairs
// of StoreRows do not apply and its single floats, 8 rows x 4 columns two
// apart per store, reached L2 as partial sectors, 63% of them excess by
// Nsight Compute): out[rows[t]][8 j0 + n] (=|+=) w[t] (hi + lo) for the
// warp's tokens t < nt and n < min(8 kN, width - 8 j0), through this warp's
// [16][kLdY] of shared memory (ys): the fragments go in as float2, then each
// row's columns leave as one store of consecutive floats (and the old values
// come in as one load, all a lane's before the first add).
template <int kN>
__device__ __forceinline__ void StoreRowsStaged(const float (&hi)[kN][4], const float (&lo)[kN][4],
                                                int t0, int j0, int nt, const int64_t* rows,
                                                const float* w, int width, bool assign, float* ys,
                                                float* __restrict__ out) {
  static_assert(8 * kN <= kLdY, "a pass fits its rows");
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int m = g + 8 * hr;
    const float wt = t0 + m < nt ? w[t0 + m] : 0.f;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      *reinterpret_cast<float2*>(&ys[m * kLdY + 8 * j + 2 * tq]) =
          make_float2(__fmul_rn(wt, hi[j][2 * hr] + lo[j][2 * hr]),
                      __fmul_rn(wt, hi[j][2 * hr + 1] + lo[j][2 * hr + 1]));
    }
  }
  __syncwarp();
  const int n = 8 * j0 + lane;
  const bool mine = lane < 8 * kN && n < width;
  const int rows_here = min(16, nt - t0);
  if (assign) {
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      // 0 + y: the bits of old + y with old = 0 (a -0 leaves as +0).
      if (mine && m < rows_here) out[rows[t0 + m] * width + n] = 0.f + ys[m * kLdY + lane];
    }
  } else {
    float old[16];
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      old[m] = mine && m < rows_here ? out[rows[t0 + m] * width + n] : 0.f;
    }
#pragma unroll
    for (int m = 0; m < 16; ++m) {
      if (mine && m < rows_here) out[rows[t0 + m] * width + n] = old[m] + ys[m * kLdY + lane];
    }
  }
  __syncwarp();  // the next pass writes ys again
}

// GroupGrid (batch * H, segments, G), kThreads threads, SmemBytes(kRead,
// kStaged). kFull: r = dv = kW as constants (mma_tiles::TileWidths).
// kStaged (kVecMat): the rows leave through shared memory (StoreRowsStaged),
// three blocks per SM instead of four (see Launch for when).
template <SmatReadKind kRead, bool kFull, bool kStaged, int kMP>
__global__ void __launch_bounds__(kThreads, kRead == SmatReadKind::kVecMat ? (kStaged ? 3 : 4)
                                            : kRead == SmatReadKind::kBoth ? 3
                                                                           : 2)
    ReadsBf16Kernel(SmatCudaDims d, SmatTokenGroups groups, int segments,
                    const float* __restrict__ M, SmatMatrixLayout lay,
                    const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ v,
                    const float* __restrict__ gsrc, SmatTokenWeights tw, float* __restrict__ out_p,
                    float* __restrict__ out_r, float* __restrict__ out_v, bool assign) {
  extern __shared__ uint4 smem_u4[];
  char* smem = reinterpret_cast<char*>(smem_u4);
  __nv_bfloat16* Ms = reinterpret_cast<__nv_bfloat16*>(smem);
  float* mcol = reinterpret_cast<float*>(smem + kOffMcol);
  __nv_bfloat16* Ts = reinterpret_cast<__nv_bfloat16*>(smem + kOffTok);
  int64_t* rows = reinterpret_cast<int64_t*>(smem + OffRows(kRead));
  float* w = reinterpret_cast<float*>(rows + kC);
  float* gcol = w + kC;
  const cuda_detail::GroupBlock blk(groups, d, segments);
  if (blk.lo >= blk.hi) return;  // uniform over the block
  const mma_tiles::TileWidths<kFull> wd{d.r, d.dv};
  const int r = wd.r(), dv = wd.dv(), p = wd.p();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kPlanes = TokenPlanes(kRead);

  // Token columns no staging writes are zero: kVecMat's and psi's r.., v's and
  // gbar's dv.. (M's column dv must meet zeros there).
  const __nv_bfloat16 zero = __float2bfloat16_rn(0.f);
#pragma unroll
  for (int q = 0; q < kPlanes; ++q) {
    const int width =
        kRead == SmatReadKind::kVecMat || (kRead == SmatReadKind::kBoth && q == 1) ? r : dv;
    mma_tiles::FillPadColumns<kC, kLdT, kThreads>(Ts + q * kTokPlane, 1, width, zero);
  }

  // This lane's ldmatrix addresses: the token planes as A (rows = tokens), M
  // as B by rows n (plain) or rows k (.trans).
  const uint32_t a_addr = SmemAddr(Ts) + 2u * ((16 * warp + (lane & 15)) * kLdT + (lane >> 4) * 8);
  const uint32_t b_plain =
      SmemAddr(Ms) + 2u * (((lane & 7) + (lane >> 4) * 8) * kLdM + ((lane >> 3) & 1) * 8);
  const uint32_t b_trans =
      SmemAddr(Ms) + 2u * (((lane & 7) + ((lane >> 3) & 1) * 8) * kLdM + (lane >> 4) * 8);
  const int kr = (r + 15) >> 4, kv = (dv + 15) >> 4;  // k steps over r and over dv

  for (int64_t j0 = blk.lo; j0 < blk.hi; j0 += kC) {
    const int nt = static_cast<int>(cuda_detail::Min64(kC, blk.hi - j0));
    StageTokens(blk, d, tw, j0, nt, rows, w);
    if constexpr (kRead == SmatReadKind::kVecMat) {
      if (!assign) PrefetchRows(out_p, rows, p, nt);
      StageRowsAsync(a, rows, r, nt, Ts);
    } else if constexpr (kRead == SmatReadKind::kBoth) {
      StageRowsAsync(v, rows, dv, nt, Ts);
      StageRowsAsync(a, rows, r, nt, Ts + kTokPlane);
    } else {
      // Every load of a thread in flight at once (one memory latency per
      // tile, not five): the product's accumulators are not live here.
      StageSplitRows<false, kSplitLoads>(gsrc, rows, w, dv, nt, Ts, gcol);
    }
    // M once per block, while the first tile's rows are on their way.
    if (j0 == blk.lo) StageMatrix<kMP>(blk.Matrix(M, lay, r, p), r, p, dv, p, Ms, mcol);
    CpAsyncWaitAll();
    __syncthreads();
    if (16 * warp >= nt) continue;

    if constexpr (kRead == SmatReadKind::kVecMat) {
      const int n_tiles = (p + 7) >> 3;
      for (int j0n = 0; j0n < n_tiles; j0n += kVecMatTiles) {  // 64 registers unstaged
        float hi[kVecMatTiles][4], lo[kVecMatTiles][4];
        Product<1, kVecMatTiles, true, kMP>(a_addr, b_trans, kr, j0n, n_tiles, hi, lo);
        if constexpr (kStaged) {
          float* ys = reinterpret_cast<float*>(smem + OffOutputs(kRead)) + 16 * warp * kLdY;
          StoreRowsStaged(hi, lo, 16 * warp, j0n, nt, rows, w, p, assign, ys, out_p);
        } else {
          StoreRows<kVecMatTiles, Den::kNone>(hi, lo, 16 * warp, j0n, nt, rows, w, gcol, mcol, p,
                                              assign, out_p);
        }
      }
    } else if constexpr (kRead == SmatReadKind::kMatVec) {
      static_assert(kMP == 3, "gbar's three parts go with M's three planes");
      float hi[8][4], lo[8][4];
      Product<3, 8, false>(a_addr, b_plain, kv, 0, (r + 7) >> 3, hi, lo);
      StoreRows<8, Den::kG>(hi, lo, 16 * warp, 0, nt, rows, w, gcol, mcol, r, assign, out_r);
    } else {
      // Passes of 4 n8 tiles (80 registers at three blocks per SM).
      for (int j0n = 0; 8 * j0n < r; j0n += 4) {
        float hi[4][4], lo[4][4];
        Product<1, 4, false, kMP>(a_addr, b_plain, kv, j0n, (r + 7) >> 3, hi, lo);
        StoreRows<4, Den::kOnes>(hi, lo, 16 * warp, j0n, nt, rows, w, gcol, mcol, r, assign, out_r);
      }
      for (int j0n = 0; 8 * j0n < dv; j0n += 4) {
        float hi[4][4], lo[4][4];
        Product<1, 4, true, kMP>(a_addr + 2u * kTokPlane, b_trans, kr, j0n, (dv + 7) >> 3, hi, lo);
        StoreRows<4, Den::kNone>(hi, lo, 16 * warp, j0n, nt, rows, w, gcol, mcol, dv, assign,
                                 out_v);
      }
    }
  }
}

// kMP: M's planes, 1 where SMAT_CUDA_BF16_PARTS=1 and the tokens are bf16
// rows (kVecMat, kBoth: one MMA per product), else 3.
template <SmatReadKind kRead, bool kStaged, int kMP>
cudaError_t LaunchKernel(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                         const float* M, const SmatMatrixLayout& lay, const void* a, const void* v,
                         const float* g, const SmatTokenWeights& w, float* out_p, float* out_r,
                         float* out_v, bool assign, cudaStream_t stream) {
  auto kernel = d.r == kW && d.dv == kW ? ReadsBf16Kernel<kRead, true, kStaged, kMP>
                                        : ReadsBf16Kernel<kRead, false, kStaged, kMP>;
  constexpr int kSmem = SmemBytes(kRead, kStaged);
  const cudaError_t err = mma_tiles::AllowSharedMemory(kernel, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
  kernel<<<grid, kThreads, kSmem, stream>>>(
      d, groups, segments, M, lay, static_cast<const __nv_bfloat16*>(a),
      static_cast<const __nv_bfloat16*>(v), g, w, out_p, out_r, out_v, assign);
  return cudaGetLastError();
}

template <SmatReadKind kRead, int kMP>
cudaError_t LaunchWith(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                       const float* M, const SmatMatrixLayout& lay, const void* a, const void* v,
                       const float* g, const SmatTokenWeights& w, float* out_p, float* out_r,
                       float* out_v, bool assign, cudaStream_t stream) {
  if constexpr (kRead == SmatReadKind::kVecMat) {
    // The rows go through shared memory (kStaged) where they are odd-sized
    // and the blocks hold a whole tile of tokens on average: H200, bf16,
    // T = 524288, 8 heads, 2026-12-01, TypeReads (=) at d = 2 (252 tokens per
    // block) 0.76 -> 0.64 ms; at d = 3, whose many small groups make each
    // block's staging of M the larger part, 0.76 -> 0.91 ms at three blocks
    // per SM, so it keeps four. At r = dv = 64 the kernel that holds M in
    // registers (smat_reads_held_bf16.cu) takes the same cases: 0.62 -> 0.35
    // ms at d = 2 (2026-12-02).
    const int64_t blocks = int64_t{groups.num_groups} * segments;
    if (groups.end - groups.begin >= kC * blocks && SmatHeldReadsFit(d, a)) {
      return LaunchSmatHeldReadsBf16(d, groups, segments, M, lay, a, w, out_p, assign, stream);
    }
    // Fewer tokens per block: resident blocks that fetch the next group's
    // matrix while they multiply (smat_reads_few_bf16.cu). H200, d = 3,
    // 2026-12-06: TypeReads (=) 0.76 -> 0.54 ms at T = 524288 (58 tokens
    // per type and head), 1.42 -> 1.06 ms at T = 1048576.
    if (SmatFewReadsFit(d, M, a)) {
      return LaunchSmatFewReadsBf16(d, groups, segments, M, lay, a, w, out_p, assign, stream);
    }
    if (d.p % 2 != 0 && groups.end - groups.begin >= kC * blocks) {
      return LaunchKernel<kRead, true, kMP>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r,
                                            out_v, assign, stream);
    }
  }
  return LaunchKernel<kRead, false, kMP>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r,
                                         out_v, assign, stream);
}

template <SmatReadKind kRead>
cudaError_t Launch(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                   const float* M, const SmatMatrixLayout& lay, const void* a, const void* v,
                   const float* g, const SmatTokenWeights& w, float* out_p, float* out_r,
                   float* out_v, bool assign, cudaStream_t stream) {
  if constexpr (kRead != SmatReadKind::kMatVec) {
    if (SmatBf16SplitParts() == 1) {
      return LaunchWith<kRead, 1>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r, out_v,
                                  assign, stream);
    }
  }
  return LaunchWith<kRead, 3>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r, out_v, assign,
                              stream);
}

}  // namespace

bool SmatReadsBf16Fits(const SmatCudaDims& d, SmatReadKind kind, const void* a, const void* v) {
  if (d.chunk > kC || d.r <= 0 || d.r > kW || d.dv <= 0 || d.dv > kW) return false;
  // kMatVec reads gbar (fp32) only; the others bf16 rows by 16-byte pieces.
  if (kind != SmatReadKind::kMatVec) {
    if (!d.bf16 || d.r % 8 != 0 || !Aligned16(a)) return false;
    if (kind == SmatReadKind::kBoth && (d.dv % 8 != 0 || !Aligned16(v))) return false;
  }
  return SmatDeviceRunsMma(SmemBytes(kind, kind == SmatReadKind::kVecMat));
}

bool SmatUseReadsBf16(const SmatCudaDims& d, SmatReadKind kind, const void* a, const void* v) {
  // kMatVec stays on FFMA unless SMAT_CUDA_GROUPED=mma: with gbar in three
  // parts (6 MMAs per tile, two blocks per SM) TypeReadsBackward takes 1.68 ms
  // here against 1.60 ms (H200, bf16, T = 524288, d = 2, 8 heads).
  const char* env = std::getenv("SMAT_CUDA_GROUPED");
  if (env != nullptr && std::strcmp(env, "ffma") == 0) return false;
  const bool forced = env != nullptr && std::strcmp(env, "mma") == 0;
  if (kind == SmatReadKind::kMatVec && !forced) return false;
  return SmatReadsBf16Fits(d, kind, a, v);
}

cudaError_t LaunchSmatReadsBf16(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                                SmatReadKind kind, const float* M, const SmatMatrixLayout& lay,
                                const void* a, const void* v, const float* g,
                                const SmatTokenWeights& w, float* out_p, float* out_r, float* out_v,
                                bool assign, cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  switch (kind) {
    case SmatReadKind::kVecMat:
      return Launch<SmatReadKind::kVecMat>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r,
                                           out_v, assign, stream);
    case SmatReadKind::kMatVec:
      return Launch<SmatReadKind::kMatVec>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r,
                                           out_v, assign, stream);
    case SmatReadKind::kBoth:
      return Launch<SmatReadKind::kBoth>(d, groups, segments, M, lay, a, v, g, w, out_p, out_r,
                                         out_v, assign, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace smat
