// TypeReads (kVecMat) at r = dv = 64 for types of few tokens: out_p[i]
// (=|+=) w_i (a_i^T M), a = phi (bf16 rows), M the r x p fp32 type table
// (p = 65), LaunchSmatGroupedReads's contract, where a (group, head) holds
// fewer tokens than one tile of the other read kernels on average (d = 3:
// about 58 recent tokens per type and head at T = 524288, 75 at 1M).
//
// The other kernels take one (group, segment, head) per block and stage its
// matrix before any product: every block waits for its 16.6 KB of M from
// memory, then multiplies a half-empty tile (d = 3: 36448 such blocks at T =
// 524288), and TypeReads ran at half of its floor. Here blocks stay resident
// and walk the (group, segment, head) items (the heads of a group side by
// side, as GroupGrid orders them, so that the rows of a token's heads fill
// their shared sectors together), a tile of 64 tokens at a time (four warps,
// four blocks per SM), with the next tile's token rows and, at an
// item's last tile, the next item's matrix on their way (cp.async) while
// this tile is multiplied and stored.
//
// The products and column 64 are those of smat_reads_held_bf16.cu
// (smat_reads_held.cuh): warp w holds the A fragments of M's columns
// 16 w .. + 15 over all 64 rows (kMP bf16 planes), here built from the fp32
// matrix in shared memory once per item; per tile it loads the B fragments
// of its 64 tokens. The outputs wait in shared memory and leave a row at a
// time, as the held kernel's do (StoreStagedRows of smat_reads_held.cuh).
//
// Exactness: as smat_reads_held_bf16.cu (the same splits of M, the same
// MMAs in the same order, the same column-64 chains: the same bits). Each
// output is summed in a fixed order by one thread, no atomics: the same
// inputs give the same bits, whichever block takes an item. Tests:
// tests/gpu/smat_reads_gpu_test.cc (TypeReads against the CPU within 1e-5 at
// 34 to 98 tokens per type, both writes, gated, content types, spans inside
// the sequence; SMAT_CUDA_READS=tiles runs the kernel of
// smat_reads_bf16.cu instead, for comparison).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/smat_grouped_mma.h"
#include "kernels/cuda/smat_reads_bf16.cuh"
#include "kernels/cuda/smat_reads_held.cuh"

namespace smat {
namespace {

using namespace reads_bf16;  // NOLINT: the read kernels' shared pieces
using namespace reads_held;  // NOLINT: the held kernels' shared pieces
using mma_tiles::CpAsync16;
using mma_tiles::CpAsyncCommit;

constexpr int kMFloats = kW * kP;
static_assert(kMFloats % 4 == 0, "M is copied as 16-byte pieces");

// A tile of kTile = 64 tokens: four warps, warp w holding M's columns
// 16 w .. + 15 for all of the tile's tokens. Shared memory: M (fp32, as in
// memory), M[:, 64], the staged outputs, then two buffers of token rows (bf16
// planes), row indices and weights: 54 KB, four blocks per SM. (Tiles of 128
// tokens, eight warps and two blocks per SM, were slower at every T measured,
// likely because half as many items are then in flight per SM to hide the
// arrival of their matrices; docs/PERFORMANCE.md, thirty-second pass.)
struct Few {
  static constexpr int kTile = 64;
  static constexpr int kThreads = 2 * kTile;  // two threads a token for column 64
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kOffMc = kMFloats * 4;
  static constexpr int kOffY = kOffMc + kW * 4;
  static constexpr int kOffT = kOffY + kTile * kLdY * 4;
  static constexpr int kOffRows = kOffT + 2 * kTile * kLdT * 2;
  static constexpr int kOffW = kOffRows + 2 * kTile * 8;
  static constexpr int kSmemBytes = kOffW + 2 * kTile * 4;
  static constexpr int kBlocksPerSm = 4;
  static_assert(kOffMc % 16 == 0 && kOffT % 16 == 0 && kOffRows % 16 == 0,
                "16-byte aligned M, planes and rows");
  static_assert(kBlocksPerSm * (kSmemBytes + 1024) <= 227 * 1024, "the blocks fit an SM");
  static_assert(kWarps == 4, "one warp per 16 of M's columns");
};
static_assert(Few::kTile % (8 * kNGroup) == 0, "whole groups of n8 tiles");

// An item: the tokens [lo, hi) of group grp's list for (b, h), segment seg
// of `segments` (item i = (grp * segments + seg) * batch * H + b * H + h).
struct Item {
  int64_t index;
  int bh, b, h, grp;
  cuda_detail::GroupCursor cur;
  int64_t lo = 0, hi = 0;

  __device__ Item(const SmatTokenGroups& groups, const SmatCudaDims& d, int segments, int64_t i)
      : index(i),
        bh(static_cast<int>(i % (int64_t{d.batch} * d.H))),
        b(bh / d.H),
        h(bh % d.H),
        grp(static_cast<int>(i / (int64_t{d.batch} * d.H * segments))),
        cur(groups, d, bh, grp) {
    const int seg = static_cast<int>((i / (int64_t{d.batch} * d.H)) % segments);
    cuda_detail::SegmentRange(cur.count, segments, seg, &lo, &hi);
  }
};

// The first item from i on (in steps of `stride`) with tokens; `items` if none.
__device__ __forceinline__ int64_t NextItem(const SmatTokenGroups& groups, const SmatCudaDims& d,
                                            int segments, int64_t items, int64_t i,
                                            int64_t stride) {
  for (; i < items; i += stride) {
    const Item it(groups, d, segments, i);
    if (it.lo < it.hi) return i;
  }
  return items;
}

// dst[t] = bf16 row rows[t] of a (64 wide) for t < nt, zeros for nt <= t <
// kTile (cp.async: the caller commits and waits).
__device__ __forceinline__ void StageTileRows(const __nv_bfloat16* __restrict__ a,
                                              const int64_t* rows, int nt, __nv_bfloat16* dst) {
  constexpr int kPieces = kW / 8;
  for (int e = threadIdx.x; e < Few::kTile * kPieces; e += Few::kThreads) {
    const int t = e / kPieces, q = e - t * kPieces;
    __nv_bfloat16* to = dst + t * kLdT + 8 * q;
    if (t < nt) {
      CpAsync16(mma_tiles::SmemAddr(to), a + rows[t] * kW + 8 * q);
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// The persistent grid (see LaunchSmatFewReadsBf16), Few::kThreads threads,
// Few::kSmemBytes; `items` = G * segments * batch * H.
template <int kMP>
__global__ void __launch_bounds__(Few::kThreads, Few::kBlocksPerSm)
    FewReadsKernel(SmatCudaDims d, SmatTokenGroups groups, int segments, int64_t items,
                   const float* __restrict__ M, SmatMatrixLayout lay,
                   const __nv_bfloat16* __restrict__ a, SmatTokenWeights tw,
                   float* __restrict__ out, bool assign) {
  using S = Few;
  constexpr int kTile = S::kTile;
  extern __shared__ uint4 smem_u4[];
  char* smem = reinterpret_cast<char*>(smem_u4);
  float* Mf = reinterpret_cast<float*>(smem);
  float* mcol = reinterpret_cast<float*>(smem + S::kOffMc);
  float* ys = reinterpret_cast<float*>(smem + S::kOffY);
  __nv_bfloat16* Ts = reinterpret_cast<__nv_bfloat16*>(smem + S::kOffT);
  int64_t* rows = reinterpret_cast<int64_t*>(smem + S::kOffRows);
  float* wts = reinterpret_cast<float*>(smem + S::kOffW);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int mt = warp;
  const int64_t stride = gridDim.x;

  int64_t first = NextItem(groups, d, segments, items, blockIdx.x, stride);
  if (first >= items) return;  // uniform over the block
  Item cur(groups, d, segments, first);

  // Row indices and weights of the tile at list position j0 of `it` into
  // buffer buf (the caller puts a barrier before they are read).
  auto tile_rows = [&](const Item& it, int64_t j0, int buf) {
    const int nt = static_cast<int>(cuda_detail::Min64(kTile, it.hi - j0));
    if (tid < nt) {
      const int64_t i = it.cur.Token(j0 + tid);
      rows[buf * kTile + tid] = cuda_detail::TokenRow(d, it.b, i, it.h);
      wts[buf * kTile + tid] = cuda_detail::TokenWeight(d, tw, it.b, it.h, i);
    }
  };
  // After that barrier: the copies of the tile's rows (and, for an item's
  // first tile, of its matrix), as one group.
  auto tile_copies = [&](const Item& it, int64_t j0, int buf, bool matrix) {
    const int nt = static_cast<int>(cuda_detail::Min64(kTile, it.hi - j0));
    if (matrix) {
      const float* src = M + cuda_detail::MatrixIndex(lay, it.b, it.grp, it.h) * kMFloats;
      for (int e = tid; e < kMFloats / 4; e += S::kThreads) {
        CpAsync16(mma_tiles::SmemAddr(Mf + 4 * e), src + 4 * e);
      }
    }
    if (!assign && tid < nt) {  // the rows the adds will read back, asked of L2
      const float* row = out + rows[buf * kTile + tid] * kP;
      for (int n = 0; n < kP; n += 32) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + n));
    }
    StageTileRows(a, rows + buf * kTile, nt, Ts + buf * kTile * kLdT);
    CpAsyncCommit();
  };

  int64_t j0 = cur.lo;
  int buf = 0;
  bool fresh = true;  // this tile is its item's first: its matrix is in Mf
  tile_rows(cur, j0, 0);
  __syncthreads();
  tile_copies(cur, j0, 0, true);

  uint32_t af[kKSteps][kMP][4];
  // This lane's B address (rows = tokens, k = 8 (lane / 8) ..): one x4 gives
  // an n8 tile's fragments for two k steps.
  const uint32_t b_lane = 2u * ((lane & 7) * kLdT + 8 * (lane >> 3));

  for (;;) {
    const int nt = static_cast<int>(cuda_detail::Min64(kTile, cur.hi - j0));
    mma_tiles::CpAsyncWaitAll();
    __syncthreads();  // this tile's rows (and at an item's first tile its matrix) are in
    if (fresh) {
      // A[m][k] = M[k][m] for this warp's m = 16 mt + .., as ldmatrix.trans
      // gives it from the planes of smat_reads_held_bf16.cu: register i holds
      // (m + 8 (i & 1), k + 8 (i >> 1)) and k + 1.
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = 16 * mt + g + 8 * (i & 1), k = 16 * ks + 2 * tq + 8 * (i >> 1);
          uint32_t parts[kMP];
          mma_tiles::SplitPair<kMP>(Mf[k * kP + m], Mf[(k + 1) * kP + m], parts);
#pragma unroll
          for (int q = 0; q < kMP; ++q) af[ks][q][i] = parts[q];
        }
      }
      if (tid < kW) mcol[tid] = Mf[tid * kP + kW];
    }

    // The next tile: this item's next, or the next item's first.
    Item next = cur;
    int64_t next_j0 = j0 + kTile;
    bool next_fresh = false, more = true;
    if (next_j0 >= cur.hi) {
      const int64_t i = NextItem(groups, d, segments, items, cur.index + stride, stride);
      more = i < items;
      if (more) {
        next = Item(groups, d, segments, i);
        next_j0 = next.lo;
        next_fresh = true;
      }
    }
    if (more) tile_rows(next, next_j0, buf ^ 1);
    __syncthreads();  // Mf read (a new matrix may come), mcol and the next rows written
    if (more) tile_copies(next, next_j0, buf ^ 1, next_fresh);

    const __nv_bfloat16* T = Ts + buf * kTile * kLdT;
    const float* w = wts + buf * kTile;
    const uint32_t b_addr = mma_tiles::SmemAddr(T) + b_lane;

    // The products: this warp's 16 columns for the tile's tokens, kNGroup
    // n8 tiles at a time, each stored to ys as w (hi + lo); column 64 by two
    // threads a token.
#pragma unroll 1
    for (int n0 = 0; n0 < kTile; n0 += 8 * kNGroup) {
      if (n0 >= nt) break;  // uniform over the warp
      StageProducts<kMP>(af, b_addr, n0, 0, mt, g, tq, w, ys);
    }
    StageDenColumn(T, mcol, w, tid >> 1, nt, ys);
    __syncthreads();  // the tile's outputs are staged
    StoreStagedRows<S::kWarps>(rows + buf * kTile, ys, nt, assign, out);
    if (!more) break;
    __syncthreads();  // ys, this buffer's rows and planes are free again
    cur = next;
    j0 = next_j0;
    fresh = next_fresh;
    buf ^= 1;
  }
}

template <int kMP>
cudaError_t LaunchFew(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                      const float* M, const SmatMatrixLayout& lay, const void* a,
                      const SmatTokenWeights& w, float* out, bool assign, cudaStream_t stream) {
  using S = Few;
  auto kernel = FewReadsKernel<kMP>;
  const cudaError_t err = mma_tiles::AllowSharedMemory(kernel, S::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int64_t items = int64_t{groups.num_groups} * segments * d.batch * d.H;
  int per_sm = 0;
  const cudaError_t occ =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, S::kThreads, S::kSmemBytes);
  if (occ != cudaSuccess) return occ;
  const int64_t resident = int64_t{std::max(per_sm, 1)} * cuda_detail::DeviceSms();
  const unsigned blocks = static_cast<unsigned>(std::min(items, resident));
  kernel<<<blocks, S::kThreads, S::kSmemBytes, stream>>>(
      d, groups, segments, items, M, lay, static_cast<const __nv_bfloat16*>(a), w, out, assign);
  return cudaGetLastError();
}

}  // namespace

bool SmatFewReadsFit(const SmatCudaDims& d, const float* M, const void* a) {
  const char* env = std::getenv("SMAT_CUDA_READS");
  if (env != nullptr && std::strcmp(env, "tiles") == 0) return false;
  return d.bf16 && d.r == kW && d.dv == kW && d.p == kP && d.chunk <= kC &&
         fast_tiles::Aligned16(a) && fast_tiles::Aligned16(M) && SmatDeviceRunsMma(Few::kSmemBytes);
}

cudaError_t LaunchSmatFewReadsBf16(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                   int segments, const float* M, const SmatMatrixLayout& lay,
                                   const void* a, const SmatTokenWeights& w, float* out,
                                   bool assign, cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  segments = std::max(segments, 1);
  return SmatBf16SplitParts() == 1
             ? LaunchFew<1>(d, groups, segments, M, lay, a, w, out, assign, stream)
             : LaunchFew<3>(d, groups, segments, M, lay, a, w, out, assign, stream);
}

}  // namespace smat
