// TypeReads (kVecMat) at r = dv = 64 with the group's matrix held in
// registers: out_p[i] (=|+=) w_i (a_i^T M), a = phi (bf16 rows), M the r x p
// fp32 type table (p = 65), LaunchSmatGroupedReads's contract.
//
// The kernel of smat_reads_bf16.cu puts the tokens in the rows of the
// products, so every warp loads all of M's B fragments (three planes, nine
// n8 tiles) again for each 16 of its tokens: 84 ldmatrix per warp and tile
// of 128 tokens, the larger part of its shared-memory traffic. Here the
// product is transposed, out^T = M^T a^T: M's columns are the rows (m) and
// the tokens the columns (n). Warp w holds the A fragments of M's columns
// 16 (w % 4) .. + 15 over all 64 rows, three planes (48 registers; one
// part: 16), loaded once per block; per tile it loads only the B fragments
// of its 64 tokens (half w / 4), 16 ldmatrix. Column 64 (the denominator
// column, one of 65) is no fifth m16 tile: each token's a_i . M[:, 64] is
// two 32-term fp32 FMA chains (two threads a token) added in a fixed order.
//
// The outputs of a tile wait in shared memory ([128][68] fp32, over M's
// planes once they are in registers) and leave a row at a time, its 65
// floats in three stores. The tokens' rows are staged one tile ahead
// (cp.async into two buffers): the next tile's rows are on their way while
// this one is multiplied and stored.
//
// Speed (H200, bf16, batch 1, 8 heads, T = 524288, d = 2, 2026-12-02),
// TypeReads (=) against the kernel of smat_reads_bf16.cu in the same binary:
// 0.620 -> 0.351 ms (0.414 with the other kernel's 256-token blocks; with
// SMAT_CUDA_BF16_PARTS=1 0.537 -> 0.378, gated 0.617 -> 0.487, both with
// 256-token blocks); the forward 2.498 -> 2.246 ms, since the walk waits for
// these reads. The += of the sequence-parallel forward, which loads each old
// row before its add: 0.692 -> 0.627 ms.
//
// Exactness: bf16 a enters the MMAs exactly; M is split into kMP bf16
// planes (three: exact), its correction terms summed smallest first in an
// accumulator of their own (mma_tiles::Mma3x1), as in the other read
// kernels; w_i times the sum is rounded on its own. Each output is summed in
// a fixed order by one thread, no atomics: the same inputs give the same
// bits. Tests: tests/gpu/smat_gpu_test.cc (TypeReads against the CPU within
// 1e-5; the bf16 cases at r = dv = 64 whose types hold a tile of tokens
// on average run this kernel: d = 2 at T = 36001, d = 1 at T = 2000).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/smat_grouped_mma.h"
#include "kernels/cuda/smat_reads_bf16.cuh"
#include "kernels/cuda/smat_reads_held.cuh"

namespace smat {
namespace {

using namespace reads_bf16;  // NOLINT: the read kernels' shared pieces
using namespace reads_held;  // NOLINT: the products and column 64, shared
using mma_tiles::CpAsyncCommit;
using mma_tiles::CpAsyncWaitOlder;

constexpr int kNPerWarp = kC / 2;  // tokens of a tile per warp
// Tokens of a group per block: each block stages its matrix once and loads
// its A fragments once, so fewer, longer blocks pay that less often. H200,
// bf16, T = 524288, d = 2 (503 tokens per type and head), 8 heads: TypeReads
// (=) 0.554 / 0.414 / 0.351 ms with blocks of 128 / 256 / 512 tokens.
constexpr int64_t kTokensPerBlock = 512;

// Shared memory: M's planes, then (once the A fragments are loaded) the
// staged outputs in the same bytes; M[:, 64]; two buffers of token planes,
// rows and weights.
constexpr int kOutBytes = kC * kLdY * 4;
constexpr int kRegion = kOutBytes > 3 * kMPlane * 2 ? kOutBytes : 3 * kMPlane * 2;
constexpr int kOffMc = kRegion;
constexpr int kOffT = kOffMc + kW * 4;
constexpr int kOffRows = kOffT + 2 * kTokPlane * 2;
constexpr int kOffW = kOffRows + 2 * kC * 8;
constexpr int kSmemBytes = kOffW + 2 * kC * 4;
static_assert(kOffMc % 16 == 0 && kOffT % 16 == 0 && kOffRows % 16 == 0,
              "16-byte aligned M[:, 64] (read as float4), planes and rows");

// The rows and weights of the tile at list position j0 (nt tokens) into one
// buffer; the caller puts a barrier before they are read.
__device__ __forceinline__ void TileRows(const cuda_detail::GroupBlock& blk, const SmatCudaDims& d,
                                         const SmatTokenWeights& tw, int64_t j0, int nt,
                                         int64_t* rows, float* w) {
  const int tid = threadIdx.x;
  if (tid < nt) {
    const int64_t i = blk.cur.Token(j0 + tid);
    rows[tid] = TokenRow(d, blk.b, i, blk.h);
    w[tid] = cuda_detail::TokenWeight(d, tw, blk.b, blk.h, i);
  }
}

// GroupGrid (batch * H, segments, G), kThreads threads, kSmemBytes.
template <int kMP>
__global__ void __launch_bounds__(kThreads, 2)
    HeldReadsKernel(SmatCudaDims d, SmatTokenGroups groups, int segments,
                    const float* __restrict__ M, SmatMatrixLayout lay,
                    const __nv_bfloat16* __restrict__ a, SmatTokenWeights tw,
                    float* __restrict__ out, bool assign) {
  extern __shared__ uint4 smem_u4[];
  char* smem = reinterpret_cast<char*>(smem_u4);
  __nv_bfloat16* Ms = reinterpret_cast<__nv_bfloat16*>(smem);
  float* ys = reinterpret_cast<float*>(smem);
  float* mcol = reinterpret_cast<float*>(smem + kOffMc);
  __nv_bfloat16* Ts = reinterpret_cast<__nv_bfloat16*>(smem + kOffT);
  int64_t* rows = reinterpret_cast<int64_t*>(smem + kOffRows);
  float* wts = reinterpret_cast<float*>(smem + kOffW);
  const cuda_detail::GroupBlock blk(groups, d, segments);
  if (blk.lo >= blk.hi) return;  // uniform over the block
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3, mt = warp & 3, half = warp >> 2;
  auto tokens = [&](int64_t j0) { return static_cast<int>(cuda_detail::Min64(kC, blk.hi - j0)); };
  auto stage = [&](int64_t j0, int buf) {  // rows and weights written, barrier, copies issued
    const int nt = tokens(j0);
    TileRows(blk, d, tw, j0, nt, rows + buf * kC, wts + buf * kC);
    __syncthreads();
    if (!assign && tid < nt) {
      const float* row = out + rows[buf * kC + tid] * kP;
      for (int n = 0; n < kP; n += 32) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + n));
    }
    StageRowsAsync(a, rows + buf * kC, kW, nt, Ts + buf * kTokPlane);
    CpAsyncCommit();
  };

  // The first tile's rows on their way; M into planes meanwhile, then this
  // warp's A fragments: (m = column 16 mt + .., k = row) from M's [k][m]
  // planes by ldmatrix.trans.
  stage(blk.lo, 0);
  StageMatrix<kMP>(blk.Matrix(M, lay, kW, kP), kW, kP, kW, kP, Ms, mcol);
  __syncthreads();
  uint32_t af[kKSteps][kMP][4];
  {
    const uint32_t base = SmemAddr(Ms) + 2u * (((lane & 7) + (lane >> 4) * 8) * kLdM +
                                               ((lane >> 3) & 1) * 8 + 16 * mt);
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks)
#pragma unroll
      for (int q = 0; q < kMP; ++q) Ldsm4T(af[ks][q], base + 2u * (q * kMPlane + 16 * ks * kLdM));
  }
  // This lane's B address (rows = tokens, k = 8 (lane / 8) ..): one x4 gives
  // an n8 tile's fragments for two k steps.
  const uint32_t b_lane = 2u * ((half * kNPerWarp + (lane & 7)) * kLdT + 8 * (lane >> 3));

  int buf = 0;
  for (int64_t j0 = blk.lo; j0 < blk.hi; j0 += kC, buf ^= 1) {
    const int nt = tokens(j0);
    if (j0 + kC < blk.hi) {
      stage(j0 + kC, buf ^ 1);
      CpAsyncWaitOlder();
    } else {
      CpAsyncWaitAll();
    }
    __syncthreads();  // this tile's rows are in; at the first, M's planes are read
    const __nv_bfloat16* T = Ts + buf * kTokPlane;
    const float* w = wts + buf * kC;
    const uint32_t b_addr = SmemAddr(T) + b_lane;

    // The products: this warp's 16 columns for its 64 tokens, kNGroup n8
    // tiles at a time, each stored to ys as w (hi + lo).
#pragma unroll 1
    for (int n0 = 0; n0 < kNPerWarp; n0 += 8 * kNGroup) {
      if (half * kNPerWarp + n0 >= nt) break;  // uniform over the warp
      StageProducts<kMP>(af, b_addr, n0, half * kNPerWarp, mt, g, tq, w, ys);
    }
    StageDenColumn(T, mcol, w, tid >> 1, nt, ys);
    __syncthreads();  // the tile's outputs are staged

    // A row at a time, warp w rows w, w + 8, ..; the old values (+=) of four
    // rows loaded before their adds.
    StoreStagedRows<kThreads / 32>(rows + buf * kC, ys, nt, assign, out);
    __syncthreads();  // ys, this buffer's rows and planes are free again
  }
}

}  // namespace

bool SmatHeldReadsFit(const SmatCudaDims& d, const void* a) {
  return d.bf16 && d.r == kW && d.dv == kW && d.chunk <= kC && fast_tiles::Aligned16(a) &&
         SmatDeviceRunsMma(kSmemBytes);
}

cudaError_t LaunchSmatHeldReadsBf16(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                    int segments, const float* M, const SmatMatrixLayout& lay,
                                    const void* a, const SmatTokenWeights& w, float* out,
                                    bool assign, cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  auto kernel = SmatBf16SplitParts() == 1 ? HeldReadsKernel<1> : HeldReadsKernel<3>;
  const cudaError_t err = mma_tiles::AllowSharedMemory(kernel, kSmemBytes);
  if (err != cudaSuccess) return err;
  // Segments of up to kTokensPerBlock tokens, whatever the caller planned
  // for the other read kernels: see kTokensPerBlock.
  const int64_t per_group = (groups.end - groups.begin + groups.num_groups - 1) / groups.num_groups;
  segments = static_cast<int>(std::clamp<int64_t>(
      (per_group + kTokensPerBlock - 1) / kTokensPerBlock, 1, std::max(segments, 1)));
  const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(
      d, groups, segments, M, lay, static_cast<const __nv_bfloat16*>(a), w, out, assign);
  return cudaGetLastError();
}

}  // namespace smat
