// F2 + F3 + NormalizedOutputs in one walk over the chunks for ungated bf16
// inputs (LaunchSmatChunkWalk, SmatKernels::ChunkStatesAndOutputs).
//
// The chunks' entering states S_in never go through memory to be read: one
// block walks a run of consecutive chunks of one (b, h) and carries the state
// in shared memory from chunk to chunk. Three launches:
//   1. ChunkTotalsKernel: per sub-segment (kSub per walked segment) the sum
//      of psi_s vbar_s^T over its tokens (the summaries of several chunks at
//      once; only their totals are written);
//   2. WalkStartsKernel: the exclusive sums of those totals in chunk order,
//      separately in the distant and the recent part, from `incoming` (or
//      zero): the state entering each walked segment;
//   3. ChunkWalkKernel: from its segment's state, per chunk, S_in[k] out (if
//      wanted), the chunk's outputs (one warp per query block, every column:
//      the state terms of all eight, a barrier, then the causal sums), and
//      S += psi^T vbar over the chunk on warps 0-3 beside the causal sums.
// Where the reads are written on another stream (SmatKernels::ForkSide), the
// stream waits for them between launches 2 and 3.
// The state waits between chunks as three bf16 planes, which hold an fp32
// value exactly (x = x1 + x2 + x3, 8 significant bits each, x1 + x2 and then
// + x3 exact in fp32): the planes the products read are the state itself.
// The update's products are exact (bf16 operands) and accumulate in fp32 onto
// the state. Ungated only: gated inputs keep the three phases.
//
// Speed (H200, bf16, batch 1, 8 heads, r = dv = 64, c = 128, T = 524288,
// 2026-12-01): 1.50-1.52 ms at d = 1 (the totals 0.29-0.30 ms, the walk
// 1.19 ms)
// against 2.04 ms for ChunkSummaries, ChunkScan and NormalizedOutputs. With
// the forward tile's old split of each query block into two column halves
// (both halves computing the same score tiles, phi's fragments loaded again
// per key block) the walk took 1.63 ms; 1.45 ms with one warp per query
// block, 1.37 ms with S_in and the previous chunk's o rows written while a
// chunk's rows load; 1.31 ms with a whole chunk's copies from addresses
// computed once (StageWholeRows) and vbar's ones column written only when a
// chunk's length changes, 1.28 ms with the o rows stored the same way (the
// general loops had been a fifth of the walk's instructions); 1.21 ms with
// the barrier after the state terms instead of after the causal sums, so the
// update (72 MMA steps per warp on warps 0-3) runs beside the longer causal
// sums of warps 4-7 rather than after the longest of them; 1.19 ms with 33
// segments of 125 chunks per head instead of 32 of 128 (the lengths had been
// rounded up to a multiple of kSub). Not kept: the
// update's products on the warps with the fewer key blocks before the
// barrier, and the next chunk's copies issued right after it (1.38 ms); the
// next key block's scores computed before a block's products (1.39 ms); S_in
// written by the update from its accumulators (1.47 ms: 4-byte stores, eight
// rows apart), or staged by it in phi's tile and copied out while the next
// chunk loads (1.41 ms: phi's copies then wait for that copy), or read back
// as column pairs (1.37 ms: two 4-byte stores 8 bytes apart per step); the
// next chunk's phi issued before the update (1.30 ms). Against the 1.21 ms
// walk: warps 0-2 also summing the first 3, 2, 1 key blocks of query blocks
// 7, 6, 5 and handing the partial sums over in shared memory (1.26 ms: the
// longest warp's path shrinks, the work per scheduler does not); the next
// chunk's phi issued after the state terms (1.21 ms); that and the next
// chunk's state terms computed while its psi and vbar load (1.33 ms). The
// totals with two buffers per block, three blocks per SM, took 305 us as
// before (72% of the DRAM peak): more bytes in flight did not move them.
// At d = 2 (walk with the reads 1.71 ms), not kept either: the reads loaded
// into the accumulators before the state term (1.90 ms) or added after it,
// before the barrier (1.79 ms); the starts and the walk as programmatic
// dependent launches (1.72 ms, and no change at d = 1); the distant
// segments, which read no reads, launched on their own before the wait for
// them, beside the per-type reads on the side stream (the forward 2.23 ->
// 2.56 ms; 2.37 with the recent part cut to fill a wave alone; 2.52 with
// the side stream at the walk's priority: half a wave of walks at one block
// per SM gains less than the reads lose to it, 2026-12-02).
// Nsight Compute (at 1.37 ms): issue slots 47%, L1 62%, tensor pipe 35%, 0.9
// eligible warps per scheduler of 3.7; warps stalled on fixed-latency
// dependences 24% of the samples, at the barrier after the query blocks 15%.
//
// Where it writes no S_in (the forward for inference) the walk at r = dv =
// 64 runs on warpgroup MMAs on an H200 (smat_chunk_walk_wgmma.sm90a.cu,
// SmatWalkChoice): faster there, slower than ChunkWalkKernel where S_in is
// written.
//
// With reads, ChunkWalkKernel walks the distant and the recent part as two
// launches, each a wave of segments of its own (WalkSplits): in one launch
// the distant segments, which add no reads, finish first and leave their
// slots idle. H200, bf16, T = 524288, d = 2, 2026-12-02: ChunkStatesAndOutputs
// 1.694 -> 1.644-1.647 ms, SmatForward keeping the states 2.258-2.272 ->
// 2.213-2.223 ms (d = 3: 5.003 -> 4.939). The walks on warpgroup MMAs stay in
// one launch: the forward for inference took 2.020-2.054 ms so and
// 2.046-2.077 split; with the recent segments weighed (PlanWalk), on an H100
// (2026-12-07), 2.257-2.261 ms in one launch and 2.311-2.318 split (d = 3
// 4.12-4.14 and 4.21-4.23). Where it keeps the states, ChunkWalkKernel in one
// weighed launch was within 1% of the two, the spread of the runs, so it
// stays split. (The nineteenth pass had split only the distant part
// off, half a wave at one block per SM beside the side stream's reads: 2.23
// -> 2.37-2.56 ms, see above.)
//
// Not kept either (H100, 2026-12-05): at d >= 3, the walk before the side
// stream's reads, beside its tabulation, writing the recent rows' ybar for a
// pass after the join to add the reads to and divide (the same bits): the
// d = 3 forward for inference 5.15 -> 5.66-5.72 ms, d = 2 2.35 -> 2.89. The
// tabulation and the walk each fill their SMs' shared memory, and the walk's
// segments, planned for one wave, then run in more than one.
//
// The block shape and the shared pieces: smat_chunk_fwd_mma.cuh.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

#include "kernels/cuda/smat_chunk_fwd_mma.cuh"
#if defined(SMAT_HAVE_SM90A)
#include "kernels/cuda/smat_chunk_walk_wgmma.h"
#endif
#include "kernels/cuda/smat_cuda_kernels.h"
#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_fast_tiles.cuh"
#include "kernels/cuda/smat_mma.cuh"

namespace smat {
namespace {

using namespace chunk_fwd_mma;  // NOLINT: the tile's shared pieces

// A span's chunks split into the segments walked by one block each
// (SmatChunkRuns: the distant chunks [0, N) in seg_d segments, the recent
// [N, Lc) in seg_r, each of len chunks). Each segment's totals come in kSub
// sub-segments of near-equal length.
using WalkSegments = SmatChunkRuns;
using cuda_detail::DeviceSms;
constexpr int kSub = 4;
constexpr int kMinWalk = 8;  // chunks: shorter walks leave too little to carry

// The chunk's products psi^T vbar (16 tokens per MMA step) added to the
// state's m16n8 tiles that a warp holds: rows 16 mb .. + 15, n-tiles kN0 ..
// kN0 + kNt - 1 (columns 0-71 cover p <= 65; the totals split them 0-4 and
// 5-8 between warps w and w + 4, the walk's warps 0-3 take all nine). A =
// psi^T from the token-major psi tile (ldmatrix .trans), B = vbar (.trans).
template <int kN0, int kNt, bool kFull>
__device__ __forceinline__ void StateProducts(const Block<kFull>& bk, int mb,
                                              float (&acc)[kNt][4]) {
  constexpr int kPairs = (kNt + 1) / 2;
  for (int ks = 0; ks < bk.nb; ++ks) {
    uint32_t a[4];
    Ldsm4T(a, bk.Addr(kPsi * kTile, 16 * ks, 16 * mb, bk.off_bn));
#pragma unroll
    for (int np = 0; np < kPairs; ++np) {
      uint32_t bv[4];
      Ldsm4T(bv, bk.Addr(kV * kTile, 16 * ks, 8 * kN0 + 16 * np, bk.off_bt));
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        if (2 * np + h2 >= kNt) continue;
        Mma(acc[2 * np + h2], a, bv[2 * h2], bv[2 * h2 + 1]);
      }
    }
  }
}

// S += psi^T vbar for the warp's tiles of the state held in the three planes:
// read exactly, the products added, split back.
template <int kN0, int kNt, bool kFull>
__device__ __forceinline__ void UpdateState(const Block<kFull>& bk, int mb) {
  if (16 * mb >= bk.r()) return;
  __nv_bfloat16* const planes = bk.base + kOffS;
  float acc[kNt][4];
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const __nv_bfloat16* at =
          planes + (16 * mb + bk.g + 8 * hr) * kLd + 8 * (kN0 + nt) + 2 * bk.tq;
      float x0 = 0.f, x1 = 0.f;
#pragma unroll
      for (int q = 0; q < 3; ++q) {
        const __nv_bfloat162 y = *reinterpret_cast<const __nv_bfloat162*>(at + q * kPlane);
        x0 += __low2float(y);
        x1 += __high2float(y);
      }
      acc[nt][2 * hr] = x0;
      acc[nt][2 * hr + 1] = x1;
    }
  StateProducts<kN0, kNt>(bk, mb, acc);
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      __nv_bfloat16* at = planes + (16 * mb + bk.g + 8 * hr) * kLd + 8 * (kN0 + nt) + 2 * bk.tq;
      StoreSplitPair<3>(at, kPlane, acc[nt][2 * hr], acc[nt][2 * hr + 1]);
    }
}

// S_in[k] (r x p fp32, row-major) from the planes, consecutive threads on
// consecutive floats. Storing S_in[k + 1] from UpdateState's registers
// instead (no reads of the planes; stores in the fragments' order) made
// ChunkStatesAndOutputs 5% slower at d = 2 (H100, 2026-12-07, 1.833 ->
// 1.921-1.924 ms); the streaming cache hint on these stores (__stcs) gained
// nothing (1.824-1.825 -> 1.838-1.843 ms).
template <bool kFull>
__device__ __forceinline__ void WriteState(const Block<kFull>& bk, float* __restrict__ out) {
  const int p = bk.p(), n = bk.r() * p;
  const __nv_bfloat16* planes = bk.base + kOffS;
  for (int e = threadIdx.x; e < n; e += kThreads) {
    const int row = e / p;
    const __nv_bfloat16* at = planes + row * kLd + (e - row * p);
    out[e] =
        (__bfloat162float(at[0]) + __bfloat162float(at[kPlane])) + __bfloat162float(at[2 * kPlane]);
  }
}

// Chunk k's rows of one (b, h) feature (width wide, rows stride apart) into
// the token tile `dst`: whole chunks from addresses computed once, others by
// the general loop (which zeroes the rows past ce). Returns the chunk's
// tokens.
template <bool kFull>
__device__ __forceinline__ int StageTile(const SmatCudaDims& d, bool vec_in, int b, int h, int k,
                                         const __nv_bfloat16* __restrict__ x, int width,
                                         __nv_bfloat16* dst) {
  const int64_t c0 = static_cast<int64_t>(k) * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));
  const int64_t stride = static_cast<int64_t>(d.H) * width;
  const __nv_bfloat16* src = x + TokenRow(d, b, c0, h) * width;
  if (kFull && ce == kC) {
    StageWholeRows<kC, kW, kLd, kThreads>(src, stride, dst);
  } else {
    StageBf16Rows<kC, kW, kLd, kThreads>(src, stride, width, ce, vec_in, dst);
  }
  return ce;
}

// vbar's ones column (dv) and the zero columns past it, up to kLd, of the v
// tile `vt` for a chunk of ce tokens.
__device__ __forceinline__ void OnesColumn(__nv_bfloat16* vt, int ce, int dv) {
  for (int e = threadIdx.x; e < kC * (kLd - dv); e += kThreads) {
    const int t = e / (kLd - dv), n = dv + (e - t * (kLd - dv));
    vt[t * kLd + n] = __float2bfloat16_rn(t < ce && n == dv ? 1.f : 0.f);
  }
}

// Stages chunk k's psi and vbar (and with kPhi phi) of (b, h); returns the
// chunk's tokens. The ones column of vbar: with kFull in columns the staging
// never writes (64-71), so before the wait and only when the chunk's length
// differs from *ones_ce's (the chunk it was last written for); otherwise
// after the wait, between two barriers. `work()` runs while the copies are in
// flight (it must not touch the tiles). Ends with the block's barrier.
template <bool kWithPhi, bool kFull, class Work>
__device__ __forceinline__ int StageChunk(const SmatCudaDims& d, bool vec_in, int b, int h, int k,
                                          const __nv_bfloat16* __restrict__ phi,
                                          const __nv_bfloat16* __restrict__ psi,
                                          const __nv_bfloat16* __restrict__ v, int r, int dv,
                                          __nv_bfloat16* base, int* ones_ce, Work&& work) {
  if (kWithPhi) StageTile<kFull>(d, vec_in, b, h, k, phi, r, base + kPhi * kTile);
  const int ce = StageTile<kFull>(d, vec_in, b, h, k, psi, r, base + kPsi * kTile);
  StageTile<kFull>(d, vec_in, b, h, k, v, dv, base + kV * kTile);
  if (kFull && *ones_ce != ce) {
    OnesColumn(base + kV * kTile, ce, dv);
    *ones_ce = ce;
  }
  work();
  if (vec_in) CpAsyncWaitAll();
  __syncthreads();
  if (!kFull) {
    OnesColumn(base + kV * kTile, ce, dv);
    __syncthreads();
  }
  return ce;
}

// grid (batch * H, segments * kSub), kThreads threads, kOffS * 2 bytes of
// shared memory: totals[(bh, segment, sub)] (r x p) = sum over the
// sub-segment's tokens of psi vbar^T (0 for an empty one).
template <bool kFull>
__global__ void __launch_bounds__(kThreads, 4)
    ChunkTotalsKernel(SmatCudaDims d, bool vec_in, WalkSegments ws,
                      const __nv_bfloat16* __restrict__ psi, const __nv_bfloat16* __restrict__ v,
                      float* __restrict__ totals) {
  extern __shared__ float4 smem4[];
  __nv_bfloat16* base = reinterpret_cast<__nv_bfloat16*>(smem4);
  const TileWidths<kFull> wd{d.r, d.dv};
  const int r = wd.r(), dv = wd.dv(), p = wd.p();
  if (kFull) vec_in = true;
  const int bh = blockIdx.x, u = blockIdx.y, s = u / kSub, j = u - s * kSub;
  // No segment follows the last of a part: its totals are never read.
  if (s == ws.seg_d - 1 || s == ws.seg_d + ws.seg_r - 1) return;
  const int b = bh / d.H, h = bh - b * d.H;
  int K0, K1;
  cuda_detail::RunChunks(ws, d.Lc, s, &K0, &K1);
  const int n = K1 - K0, k0 = K0 + j * n / kSub, k1 = K0 + (j + 1) * n / kSub;
  Block<kFull> bk = MakeBlock<kFull>(base, r, dv);
  const int w = threadIdx.x >> 5, mb = w & 3;
  float acc0[5][4], acc1[4][4];
  cuda_detail::ZeroAcc(acc0);
  cuda_detail::ZeroAcc(acc1);
  int ones_ce = -1;
  for (int k = k0; k < k1; ++k) {
    const int ce =
        StageChunk<false, kFull>(d, vec_in, b, h, k, nullptr, psi, v, r, dv, base, &ones_ce, [] {});
    bk.ce = ce;
    bk.nb = (ce + 15) >> 4;
    if (16 * mb < r) {
      if (w < 4) {
        StateProducts<0, 5>(bk, mb, acc0);
      } else {
        StateProducts<5, 4>(bk, mb, acc1);
      }
    }
    __syncthreads();  // the tiles are staged again
  }
  float* out = totals + (static_cast<int64_t>(bh) * gridDim.y + u) * r * p;
  auto store = [&](auto& acc, int n0) {
#pragma unroll
    for (int nt = 0; nt < static_cast<int>(sizeof(acc) / sizeof(acc[0])); ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * mb + bk.g + 8 * (e >> 1), col = 8 * (n0 + nt) + 2 * bk.tq + (e & 1);
        if (row < r && col < p) out[row * p + col] = acc[nt][e];
      }
  };
  if (w < 4) {
    store(acc0, 0);
  } else {
    store(acc1, 5);
  }
}

// grid (ceil(r p / 256), batch * H), 256 threads: starts[(bh, segment)] = the
// state entering the segment, per part incoming[b, part, h] (or 0) plus the
// totals of the part's earlier sub-segments, added in chunk order (the part's
// last segment has none: ChunkTotalsKernel skips it). The loads of kGroup
// segments issue before their adds: 8.3-8.8 us at the benchmark's shape,
// against 17.8 us for one segment's loads at a time with a break before the
// part's last.
__global__ void WalkStartsKernel(SmatCudaDims d, WalkSegments ws,
                                 const float* __restrict__ incoming,
                                 const float* __restrict__ totals, float* __restrict__ starts) {
  constexpr int kGroup = 8;
  const int64_t W = static_cast<int64_t>(d.r) * d.p;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= W) return;
  const int bh = blockIdx.y, b = bh / d.H, h = bh - b * d.H;
  const int segs = ws.seg_d + ws.seg_r;
  const int64_t row0 = static_cast<int64_t>(bh) * segs;
  for (int part = 0; part < 2; ++part) {
    const int s0 = part == 0 ? 0 : ws.seg_d, s1 = part == 0 ? ws.seg_d : segs;
    float Y = incoming != nullptr
                  ? incoming[((static_cast<int64_t>(b) * 2 + part) * d.H + h) * W + w]
                  : 0.f;
    for (int s = s0; s < s1; s += kGroup) {
      const int n = min(kGroup, s1 - 1 - s);  // segments whose totals are read
      float t[kGroup][kSub];
#pragma unroll
      for (int g = 0; g < kGroup; ++g)
#pragma unroll
        for (int j = 0; j < kSub; ++j)
          t[g][j] = g < n ? totals[((row0 + s + g) * kSub + j) * W + w] : 0.f;
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (s + g >= s1) break;
        starts[(row0 + s + g) * W + w] = Y;
        if (g < n) {
#pragma unroll
          for (int j = 0; j < kSub; ++j) Y += t[g][j];
        }
      }
    }
  }
}

// grid (batch * H, segments), kThreads threads, kSmemNormBytes of shared
// memory: the walk (see above). kP: the parts of the state and of the score
// tiles in the products (the planes always hold three, so the state carried
// and S_in stay exact whatever kP; kP = 1, bf16 products:
// ChunkStatesAndOutputs 1.52 -> 1.20-1.23 ms at d = 1, 2026-12-01).
template <bool kFull, int kP>
__global__ void __launch_bounds__(kThreads, 2)
    ChunkWalkKernel(SmatCudaDims d, bool vec_in, WalkSegments ws,
                    const __nv_bfloat16* __restrict__ phi, const __nv_bfloat16* __restrict__ psi,
                    const __nv_bfloat16* __restrict__ v, const float* __restrict__ starts,
                    float* __restrict__ S_in, Outputs out, int seg0) {
  extern __shared__ float4 smem4[];
  __nv_bfloat16* base = reinterpret_cast<__nv_bfloat16*>(smem4);
  const int tid = threadIdx.x;
  const TileWidths<kFull> wd{d.r, d.dv};
  const int r = wd.r(), dv = wd.dv(), p = wd.p();
  if (kFull) vec_in = true;
  const int bh = blockIdx.x, s = seg0 + static_cast<int>(blockIdx.y);
  const int b = bh / d.H, h = bh - b * d.H;
  int k0, k1;
  cuda_detail::RunChunks(ws, d.Lc, s, &k0, &k1);
  const int64_t W = static_cast<int64_t>(r) * p;
  StageState<3>(starts + (static_cast<int64_t>(bh) * (ws.seg_d + ws.seg_r) + s) * W, r, p,
                base + kOffS);
  // The planes staged: the first chunk's S_in (WriteState, inside StageChunk
  // before its barrier) reads them in another thread order than StageState
  // writes them.
  __syncthreads();
  Block<kFull> bk = MakeBlock<kFull>(base, r, dv);
  const int w = tid >> 5;
  // Query block of warp w: warps w and w + 4 share a scheduler and take
  // blocks i and 7 - i, whose causal sums together cover nine key blocks.
  const int qi = w < 4 ? w : 11 - w;
  __nv_bfloat16* const ostage = bk.ostage();
  const bool vec_out = dv % 8 == 0 && (reinterpret_cast<uintptr_t>(out.o) & 15) == 0;
  int ones_ce = -1;
  for (int k = k0; k < k1; ++k) {
    const int64_t c0 = static_cast<int64_t>(k) * d.chunk;
    if (out.reads != nullptr && c0 >= out.recent_begin) {
      // As ChunkForwardFusedKernel: the reads rows in L2 before the epilogue.
      const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));
      const int64_t tok = TokenRow(d, b, c0, h);
      for (int e = tid; e < 3 * ce; e += kThreads) {
        const int m = e / 3, piece = e - 3 * m;
        const char* row = reinterpret_cast<const char*>(out.reads + (tok + int64_t{m} * d.H) * p);
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(row + 128 * piece));
      }
    }
    // While chunk k's rows come in: S_in[k] out from the planes, and the
    // previous chunk's o rows (a whole chunk) from the staging tile.
    bk.ce = StageChunk<true, kFull>(d, vec_in, b, h, k, phi, psi, v, r, dv, base, &ones_ce, [&] {
      if (S_in != nullptr) WriteState(bk, S_in + ChunkRow(d, b, k, h) * W);
      if (k > k0) StoreRows(bk, d, b, h, c0 - d.chunk, d.chunk, ostage, out.o, vec_out);
    });
    bk.nb = (bk.ce + 15) >> 4;
    // Every warp's state term first (the same work for each), then the
    // causal sums (qi + 1 key blocks) and, on warps 0-3, the update of the
    // state's rows 16 w .. 16 w + 15: per scheduler the same work again.
    const bool mine = qi < bk.nb;
    float acc[kNt][4];
    uint32_t a[4][4];
    if (mine) {
      cuda_detail::ZeroAcc(acc);
      QueryFragments(bk, qi, a);
      StateTerm<kP>(bk, a, acc);
    }
    __syncthreads();  // the planes are read
    if (mine) {
      const float lt[2] = {0.f, 0.f};  // ungated
      CausalTerms</*kGated=*/false, kP>(bk, qi, a, lt, acc);
      FinishQueryRows</*kNorm=*/true>(bk, d, b, h, c0, qi, out, ostage, acc);
    }
    if (w < 4) UpdateState<0, kNt>(bk, w);
    __syncthreads();  // the tiles and the planes are free again, the o rows staged
  }
  if (k1 > k0) StoreRows(bk, d, b, h, int64_t{k1 - 1} * d.chunk, bk.ce, ostage, out.o, vec_out);
}

// The segments of a walk over `d`'s span: at most one per block slot of a
// single wave (per_sm resident per SM), at least kMinWalk chunks each (the
// walk takes as long as its longest segment: 4096 chunks in 33 slots per
// head walk 125 each, not 128). In one launch, a recent chunk that adds the
// reads costs `weight` distant ones, so the recent segments are cut shorter
// by that ratio, the two lengths the shortest that fit the slots.
WalkSegments PlanWalk(const SmatCudaDims& d, int sms, bool split, int per_sm, double weight) {
  const int Nd = cuda_detail::DistantChunks(d), Nr = d.Lc - Nd;
  const int64_t bh = static_cast<int64_t>(d.batch) * d.H;
  const int parts = (Nd > 0) + (Nr > 0);
  const int slots =
      static_cast<int>(std::max<int64_t>(parts, int64_t{per_sm} * sms / std::max<int64_t>(1, bh)));
  auto count = [](int chunks, int len) { return (chunks + len - 1) / len; };
  if (split && parts == 2) {  // a wave for each part
    const int len = std::max(kMinWalk, count(std::max(Nd, Nr), slots));
    return cuda_detail::ChunkRunsOfLength(Nd, d.Lc, len);
  }
  if (parts < 2 || !(weight > 1.0)) weight = 1.0;
  auto recent_len = [&](int len) {
    return std::max(kMinWalk, static_cast<int>(static_cast<double>(len) / weight));
  };
  int len = std::max(kMinWalk, count(d.Lc, slots));
  while (count(Nd, len) + count(Nr, recent_len(len)) > slots) ++len;
  return cuda_detail::ChunkRunsOfLengths(Nd, d.Lc, len, recent_len(len));
}

// What a recent chunk that adds the reads costs the walk, in distant chunks
// (PlanWalk): SMAT_CUDA_WALK_RECENT_WEIGHT in [1, 4], else
// kWalkRecentWeightByDefault. Measured on an H100 (docs/PERFORMANCE.md,
// fortieth pass), the forward for inference at d = 2 took 2.32 ms at 1,
// 2.24-2.26 at 1.3 to 1.6 and 2.29 at 2.
constexpr double kWalkRecentWeightByDefault = 1.3;
double WalkRecentWeight(bool has_reads) {
  if (!has_reads) return 1.0;
  const char* env = std::getenv("SMAT_CUDA_WALK_RECENT_WEIGHT");
  if (env == nullptr || *env == '\0') return kWalkRecentWeightByDefault;
  char* end = nullptr;
  const double w = std::strtod(env, &end);
  if (*end == '\0' && w >= 1.0 && w <= 4.0) return w;
  static std::once_flag warned;
  std::call_once(warned, [env] {
    std::fprintf(stderr,
                 "smat: SMAT_CUDA_WALK_RECENT_WEIGHT=\"%s\" is not a number in [1, 4]; using %g\n",
                 env, kWalkRecentWeightByDefault);
  });
  return kWalkRecentWeightByDefault;
}

// Whether the walk of a span with reads runs its two parts as two launches,
// each cut into a wave of its own (SmatChunkWalkScratchFloats): by default
// for ChunkWalkKernel (kind 0), whose distant segments otherwise finish
// early and leave their slots idle while the recent ones, which also add the
// reads, walk on; SMAT_CUDA_WALK_SPLIT = "1" or "0" for every walk.
bool WalkSplits(bool has_reads, int kind) {
  if (!has_reads) return false;
  const char* env = std::getenv("SMAT_CUDA_WALK_SPLIT");
  const std::string split = env != nullptr ? env : "";
  if (split == "1" || split == "0") return split == "1";
  return kind == 0;
}

constexpr int kWalkRows64 = 2;     // SmatWalk::kWgmma64
constexpr int kWalkRows64Tma = 3;  // SmatWalk::kWgmma64 by the bulk copy engine
#if defined(SMAT_HAVE_SM90A)
static_assert(kWalkRows64 == static_cast<int>(SmatWalk::kWgmma64), "the kinds' numbers");
#endif

// The kernel that walks: 0 ChunkWalkKernel, else the SmatWalk of
// smat_chunk_walk_wgmma.h (where built), kWgmma64 as kWalkRows64Tma where
// SmatWalk64Tma(d); and its blocks per SM. By default the one-warpgroup walk
// where it keeps no states, and where it keeps them but adds no reads (d = 1)
// with the bulk copy engine; ChunkWalkKernel where it keeps the states and
// adds the reads, the faster measured (docs/PERFORMANCE.md).
int WalkKind(const SmatCudaDims& d, bool full, bool keeps_states, bool has_reads) {
#if defined(SMAT_HAVE_SM90A)
  if (full) {
    const bool tma = SmatWalk64Tma(d);
    const SmatWalk w = SmatWalkChoice(!keeps_states || (!has_reads && tma));
    if (w == SmatWalk::kWgmma64 && tma) return kWalkRows64Tma;
    return static_cast<int>(w);
  }
#endif
  return 0;
}
int WalkBlocksPerSm(int kind) {
#if defined(SMAT_HAVE_SM90A)
  if (kind == kWalkRows64Tma) return kWalk64TmaBlocksPerSm;
#endif
  return kind == kWalkRows64 ? 4 : 2;
}

template <bool kFull, int kP>
cudaError_t LaunchWalk(const SmatCudaDims& d, bool vec, const WalkSegments& ws, int kind,
                       bool split, const void* phi, const void* psi, const void* v,
                       const float* incoming, float* totals, float* starts, float* S_in,
                       const Outputs& out, cudaEvent_t reads_ready, cudaStream_t stream) {
  const int segs = ws.seg_d + ws.seg_r;
  const unsigned bh = static_cast<unsigned>(d.batch * d.H);
  auto bf = [](const void* x) { return static_cast<const __nv_bfloat16*>(x); };
  {
    auto kernel = ChunkTotalsKernel<kFull>;
    constexpr int kBytes = kOffS * 2;
    cudaError_t err = AllowSharedMemory(kernel, kBytes);
    if (err != cudaSuccess) return err;
    kernel<<<dim3(bh, static_cast<unsigned>(segs * kSub)), kThreads, kBytes, stream>>>(
        d, vec, ws, bf(psi), bf(v), totals);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  {
    const int64_t W = static_cast<int64_t>(d.r) * d.p;
    WalkStartsKernel<<<dim3(static_cast<unsigned>((W + 255) / 256), bh), 256, 0, stream>>>(
        d, ws, incoming, totals, starts);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  // Segments [s0, s1) of the walk in one launch.
  auto walk = [&](int s0, int s1) -> cudaError_t {
#if defined(SMAT_HAVE_SM90A)
    if (kFull && kind == kWalkRows64Tma) {
      return LaunchChunkWalkWgmma64Tma(d, ws, s0, s1, phi, psi, v, starts, S_in, out, kP, stream);
    }
    if (kFull && kind == kWalkRows64) {
      return LaunchChunkWalkWgmma64(d, ws, s0, s1, phi, psi, v, starts, S_in, out, kP, stream);
    }
    if (kFull && kind != 0) {
      return LaunchChunkWalkWgmma(d, ws, s0, s1, phi, psi, v, starts, S_in, out, kP, stream);
    }
#endif
    auto kernel = ChunkWalkKernel<kFull, kP>;
    const cudaError_t err = AllowSharedMemory(kernel, kSmemNormBytes);
    if (err != cudaSuccess) return err;
    kernel<<<dim3(bh, static_cast<unsigned>(s1 - s0)), kThreads, kSmemNormBytes, stream>>>(
        d, vec, ws, bf(phi), bf(psi), bf(v), starts, S_in, out, s0);
    return cudaGetLastError();
  };
  // Split, the distant part (which reads no reads) runs beside the side
  // stream's reads; the recent part waits for them.
  const int s_wait = split ? ws.seg_d : 0;
  if (s_wait > 0) {
    const cudaError_t err = walk(0, s_wait);
    if (err != cudaSuccess) return err;
  }
  if (reads_ready != nullptr) {
    const cudaError_t err = cudaStreamWaitEvent(stream, reads_ready, 0);
    if (err != cudaSuccess) return err;
  }
  return walk(s_wait, segs);
}

}  // namespace

int64_t SmatChunkWalkScratchFloats(const SmatCudaDims& d, bool has_reads) {
  int segs = 0;  // the most any walk's plan takes
  const double weight = WalkRecentWeight(has_reads);
  for (int per_sm : {2, 3, 4}) {
    for (bool split : {false, has_reads}) {
      const WalkSegments ws = PlanWalk(d, DeviceSms(), split, per_sm, weight);
      segs = std::max(segs, ws.seg_d + ws.seg_r);
    }
  }
  return static_cast<int64_t>(d.batch) * d.H * segs * (kSub + 1) * d.r * d.p;
}

cudaError_t LaunchSmatChunkWalk(const SmatCudaDims& d, const void* phi, const void* psi,
                                const void* v, const float* incoming, const float* reads,
                                int64_t recent_begin, float eps, float* S_in, void* o, float* den,
                                float* scratch, cudaEvent_t reads_ready, cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) {
    return reads_ready != nullptr ? cudaStreamWaitEvent(stream, reads_ready, 0) : cudaSuccess;
  }
  const bool vec = d.r % 8 == 0 && d.dv % 8 == 0 && fast_tiles::Aligned16(phi) &&
                   fast_tiles::Aligned16(psi) && fast_tiles::Aligned16(v);
  const bool full = vec && d.r == kW && d.dv == kW;
  const int kind = WalkKind(d, full, /*keeps_states=*/S_in != nullptr, reads != nullptr);
  const bool split = WalkSplits(reads != nullptr, kind);
  const WalkSegments ws =
      PlanWalk(d, DeviceSms(), split, WalkBlocksPerSm(kind), WalkRecentWeight(reads != nullptr));
  const int64_t starts_floats =
      static_cast<int64_t>(d.batch) * d.H * (ws.seg_d + ws.seg_r) * d.r * d.p;
  float* starts = scratch;
  float* totals = scratch + starts_floats;
  const Outputs out{nullptr, reads, recent_begin, eps, static_cast<__nv_bfloat16*>(o), den};
  auto launch = [&](auto full_c) {
    return mma_tiles::WithSplitParts(SmatBf16SplitParts(), [&](auto parts) {
      return LaunchWalk<decltype(full_c)::value, decltype(parts)::value>(
          d, vec, ws, kind, split, phi, psi, v, incoming, totals, starts, S_in, out, reads_ready,
          stream);
    });
  };
  return full ? launch(std::true_type()) : launch(std::false_type());
}

}  // namespace smat
