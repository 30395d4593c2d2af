// Device helpers shared by the SMat phase kernels (smat_*.cu): input loads
// (fp32 or bf16 to fp32), the per-token decay weights of Lemma 4, the token
// groups of the grouped phases, and TileAccumulate, the register-tiled block
// product every chunk tile and grouped reduction is built from.
//
// TileAccumulate runs on 256 threads laid out 16 x 16; each thread holds a
// 4 x 5 block of a 64 x 80 output tile and walks k in increasing order, so the
// sum order of every output element is fixed (bitwise repeatable results).
// Operands come through accessor functors a(m, k), b(n, k) (shared memory or
// read-only global), so one routine serves A = tril(phi psi^T), Y = A vbar,
// D = psi^T vbar and the adjoint tiles of eq. 19. Plain FFMA on fp32 (no TF32)
// keeps fp32 inputs within 1e-5 of the CPU phases.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/smat_cuda_kernels.h"

namespace smat {
namespace cuda_detail {

constexpr int kThreads = 256;
constexpr int kTileM = 64;  // rows of one TileAccumulate pass (16 threads x 4)
constexpr int kTileN = 80;  // columns of one pass (16 threads x 5): p = 65 in one pass
constexpr int kRegM = 4;
constexpr int kRegN = 5;

__host__ __device__ __forceinline__ int64_t Min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t Max64(int64_t a, int64_t b) { return a > b ? a : b; }
// Whether p may be read and written as float4 / 16-byte vectors.
__host__ __device__ inline bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

__device__ __forceinline__ float LoadIn(const void* p, int64_t i, bool bf16) {
  return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i])
              : static_cast<const float*>(p)[i];
}

// Odd leading dimension for shared-memory rows read column-wise by 16 threads
// (rows of 64 floats would put all 16 in one bank).
__host__ __device__ __forceinline__ int PadOdd(int x) { return x | 1; }

// Row index of (b, local token i, h) in token tensors [batch, L, H, *].
__device__ __forceinline__ int64_t TokenRow(const SmatCudaDims& d, int b, int64_t i, int h) {
  return (static_cast<int64_t>(b) * d.L + i) * d.H + h;
}
// Row index of (b, local chunk k, h) in chunk tensors [batch, Lc, H, *].
__device__ __forceinline__ int64_t ChunkRow(const SmatCudaDims& d, int b, int64_t k, int h) {
  return (static_cast<int64_t>(b) * d.Lc + k) * d.H + h;
}

// Chunks [*k0, *k1) of run s (SmatChunkRuns; empty past the part's end).
__device__ __forceinline__ void RunChunks(const SmatChunkRuns& rs, int Lc, int s, int* k0,
                                          int* k1) {
  if (s < rs.seg_d) {
    *k0 = s * rs.len;
    *k1 = min(rs.N, *k0 + rs.len);
  } else {
    *k0 = rs.N + (s - rs.seg_d) * rs.len_r;
    *k1 = min(Lc, *k0 + rs.len_r);
  }
}
// The run that holds chunk k.
__device__ __forceinline__ int RunOf(const SmatChunkRuns& rs, int64_t k) {
  return k < rs.N ? static_cast<int>(k / rs.len)
                  : rs.seg_d + static_cast<int>((k - rs.N) / rs.len_r);
}
// Runs over a span's Lc chunks, of which the first N are distant, each part
// cut on its own (so no run crosses n): the distant one into runs of len
// chunks, the recent one of len_r.
inline SmatChunkRuns ChunkRunsOfLengths(int N, int Lc, int len, int len_r) {
  SmatChunkRuns rs;
  rs.N = N;
  rs.len = len;
  rs.len_r = len_r;
  rs.seg_d = (N + len - 1) / len;
  rs.seg_r = (Lc - N + len_r - 1) / len_r;
  return rs;
}
// Runs of len chunks in both parts.
inline SmatChunkRuns ChunkRunsOfLength(int N, int Lc, int len) {
  return ChunkRunsOfLengths(N, Lc, len, len);
}
// How many of the span's local chunks lie in the distant block [0, n).
inline int DistantChunks(const SmatCudaDims& d) {
  const int64_t first = d.t0 / d.chunk, n_chunks = d.n / d.chunk;
  return static_cast<int>(Min64(d.Lc, Max64(0, n_chunks - first)));
}
// Streaming multiprocessors of the current device (1 if it cannot be asked).
inline int DeviceSms() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    return 1;
  }
  return sms > 0 ? sms : 1;
}

// Decay weight of local token i of (b, h); see SmatTokenWeights.
__device__ __forceinline__ float TokenWeight(const SmatCudaDims& d, const SmatTokenWeights& w,
                                             int b, int h, int64_t i) {
  const float extra = w.extra != nullptr ? w.extra[static_cast<int64_t>(b) * d.H + h] : 0.f;
  if (w.lam == nullptr) return w.extra != nullptr ? expf(extra) : 1.f;  // span offset only
  const int64_t k = i / d.chunk;
  float x = w.key_side ? w.chunk_decay[ChunkRow(d, b, k, h)] - w.lam[TokenRow(d, b, i, h)]
                       : w.lam[TokenRow(d, b, i, h)];
  if (w.off != nullptr) x += w.off[ChunkRow(d, b, k, h)];
  return expf(x + extra);
}

// Token list of group g for (b, h): Count() tokens, Token(j) the j-th local
// index (increasing).
struct GroupCursor {
  const SmatTokenGroups* gr;
  int64_t first = 0, count = 0;
  const int32_t* list = nullptr;

  __device__ GroupCursor(const SmatTokenGroups& groups, const SmatCudaDims& d, int bh, int g)
      : gr(&groups) {
    switch (groups.mode) {
      case SmatGroupMode::kChunks: {
        first = static_cast<int64_t>(g) * d.chunk;
        const int64_t last = min(first + d.chunk, static_cast<int64_t>(d.L));
        count = Max64(0, last - first);
        break;
      }
      case SmatGroupMode::kProgression: {
        const int64_t P = groups.period;
        // Smallest i >= begin with (i + phase) mod P = g.
        int64_t delta = (g - (groups.begin + groups.phase)) % P;
        if (delta < 0) delta += P;
        first = groups.begin + delta;
        count = first < groups.end ? (groups.end - first + P - 1) / P : 0;
        break;
      }
      case SmatGroupMode::kLists: {
        const int32_t* off = groups.offsets + static_cast<int64_t>(bh) * (groups.num_groups + 1);
        list = groups.perm + static_cast<int64_t>(bh) * (groups.end - groups.begin) + off[g];
        count = off[g + 1] - off[g];
        break;
      }
    }
  }
  __device__ int64_t Token(int64_t j) const {
    switch (gr->mode) {
      case SmatGroupMode::kChunks: return first + j;
      case SmatGroupMode::kProgression: return first + j * gr->period;
      default: return list[j];
    }
  }
};

// Segment `seg` of `segments` equal parts of [0, count).
__device__ __forceinline__ void SegmentRange(int64_t count, int segments, int seg, int64_t* lo,
                                             int64_t* hi) {
  const int64_t len = (count + segments - 1) / segments;
  *lo = min(count, static_cast<int64_t>(seg) * len);
  *hi = min(count, *lo + len);
}

// Index of the matrix of (b, g, h) in a table of layout l (in matrices).
__device__ __forceinline__ int64_t MatrixIndex(const SmatMatrixLayout& l, int b, int g, int h) {
  return static_cast<int64_t>(b) * l.ob + static_cast<int64_t>(g) * l.og +
         static_cast<int64_t>(h) * l.oh;
}

// The grid of a per-chunk kernel: one block per (chunk, b, h), Lc * batch * H
// in one dimension with the heads fastest, so the blocks that share a chunk's
// token records ([b, t, H, ...]) run together (rows of p = dv + 1 floats, as
// ybar and gbar, share 32-byte sectors across heads; see GroupGrid).
inline dim3 ChunkGrid(const SmatCudaDims& d) {
  return dim3(static_cast<unsigned>(static_cast<int64_t>(d.Lc) * d.batch * d.H));
}
struct ChunkBlock {
  int64_t k;
  int b, h;
  __device__ explicit ChunkBlock(const SmatCudaDims& d) {
    const unsigned bh_count = static_cast<unsigned>(d.batch * d.H);
    const int bh = static_cast<int>(blockIdx.x % bh_count);
    k = blockIdx.x / bh_count;
    b = bh / d.H;
    h = bh % d.H;
  }
};

// The grid of a grouped product: (batch * H, segments, G). The heads of a
// token run side by side (x varies fastest), so the blocks that touch one
// token's rows of all heads ([b, t, H, width], contiguous) run together:
// rows whose width is not a multiple of 8 floats (ybar's p = dv + 1) share
// 32-byte sectors with the next head's, and those sectors fill in L2 while
// they are resident instead of being read back from memory.
inline dim3 GroupGrid(int segments, int64_t groups, int64_t batch_heads) {
  return dim3(static_cast<unsigned>(batch_heads), static_cast<unsigned>(segments),
              static_cast<unsigned>(groups));
}

// The share of a grouped product that one block of GroupGrid works on: group
// grp of (b, h), the tokens [lo, hi) of its list (segment seg of `segments`
// equal parts).
struct GroupBlock {
  int seg, grp, b, h;
  GroupCursor cur;
  int64_t lo = 0, hi = 0;

  __device__ GroupBlock(const SmatTokenGroups& groups, const SmatCudaDims& d, int segments)
      : seg(blockIdx.y),
        grp(blockIdx.z),
        b(blockIdx.x / d.H),
        h(blockIdx.x % d.H),
        cur(groups, d, blockIdx.x, blockIdx.z) {
    SegmentRange(cur.count, segments, seg, &lo, &hi);
  }

  // The r x p matrix of this block's (b, group, h) in `base` (layout `lay`):
  // segment `segment` of `segments` per group (the outer sums' partials), or
  // the group's one matrix (the reads' M).
  template <typename T>
  __device__ T* Matrix(T* base, const SmatMatrixLayout& lay, int r, int p, int segments = 1,
                       int segment = 0) const {
    return base + (MatrixIndex(lay, b, grp, h) * segments + segment) * static_cast<int64_t>(r) * p;
  }
};

// acc[i][j] += sum_{k < K} a(m0 + ty + 16 i, k) * b(n0 + tx + 16 j, k) for the
// rows < M and columns < N (others contribute 0). 256 threads.
template <class FA, class FB>
__device__ __forceinline__ void TileAccumulate(float (&acc)[kRegM][kRegN], int m0, int n0, int M,
                                               int N, int K, FA a, FB b) {
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  bool mv[kRegM], nv[kRegN];
#pragma unroll
  for (int i = 0; i < kRegM; ++i) mv[i] = m0 + ty + 16 * i < M;
#pragma unroll
  for (int j = 0; j < kRegN; ++j) nv[j] = n0 + tx + 16 * j < N;
  for (int k = 0; k < K; ++k) {
    float av[kRegM], bv[kRegN];
#pragma unroll
    for (int i = 0; i < kRegM; ++i) av[i] = mv[i] ? a(m0 + ty + 16 * i, k) : 0.f;
#pragma unroll
    for (int j = 0; j < kRegN; ++j) bv[j] = nv[j] ? b(n0 + tx + 16 * j, k) : 0.f;
#pragma unroll
    for (int i = 0; i < kRegM; ++i)
#pragma unroll
      for (int j = 0; j < kRegN; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
  }
}

// Calls epi(m, n, acc) for the valid elements of the thread's block.
template <class Epi>
__device__ __forceinline__ void TileStore(const float (&acc)[kRegM][kRegN], int m0, int n0, int M,
                                          int N, Epi epi) {
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int i = 0; i < kRegM; ++i)
#pragma unroll
    for (int j = 0; j < kRegN; ++j) {
      const int m = m0 + ty + 16 * i, n = n0 + tx + 16 * j;
      if (m < M && n < N) epi(m, n, acc[i][j]);
    }
}

// Register accumulators (a thread's kRegM x kRegN outputs, or kM m16n8
// fragments of 4) set to zero.
template <int kM, int kN>
__device__ __forceinline__ void ZeroAcc(float (&acc)[kM][kN]) {
#pragma unroll
  for (int i = 0; i < kM; ++i)
#pragma unroll
    for (int j = 0; j < kN; ++j) acc[i][j] = 0.f;
}

// acc += x, element by element.
__device__ __forceinline__ void Add4(float4& acc, const float4& x) {
  acc.x += x.x;
  acc.y += x.y;
  acc.z += x.z;
  acc.w += x.w;
}

}  // namespace cuda_detail
}  // namespace smat
