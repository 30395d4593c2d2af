// The grouped phases of CUDA SMat-Attention: reductions of w_i a_i b_i^T over
// groups of tokens (chunk summaries, Algorithm 1 step 5; profile pooling, step
// 2; the chunk state gradients and the type-table gradient of eq. 18-19), the
// per-token reads against a group's r x p matrix (per-type reads, step 4, and
// their adjoints), and the stable counting sort that groups tokens under
// content maps. The incidence tabulation of Algorithm 2: smat_tabulate.cu.
//
// Work is spread over (segment, group, b * H) blocks rather than one block per
// head: a group's token list is cut into equal segments whose partial sums are
// then added in segment order (LaunchSmatReduceSegments), so even d = 1 (one
// profile holding every distant token) fills the GPU and the sum order is fixed.
// Positional groups are arithmetic progressions (no sort); content groups come
// from LaunchSmatGroupByContent. No floating-point atomics.
//
// For r, dv <= 64 (and c <= 128) the outer sums and the per-token reads run as
// 128-token tile products in smat_chunk_fast.cu instead (see
// SmatUseFastChunkTiles); the kernels here serve the other sizes.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/smat_device.cuh"

namespace smat {
namespace {

using cuda_detail::GroupCursor;
using cuda_detail::kRegM;
using cuda_detail::kRegN;
using cuda_detail::kThreads;
using cuda_detail::kTileM;
using cuda_detail::kTileN;
using cuda_detail::LoadIn;
using cuda_detail::PadOdd;
using cuda_detail::SegmentRange;
using cuda_detail::TileAccumulate;
using cuda_detail::TileStore;
using cuda_detail::TokenRow;
using cuda_detail::TokenWeight;
using cuda_detail::ZeroAcc;

constexpr int kTokenTile = 32;  // tokens staged in shared memory per step

// GroupGrid (batch * H, segments, G). Shared: a tile [kTokenTile][r], b tile
// [kTokenTile][p], weights [kTokenTile].
__global__ void GroupedOuterSumKernel(SmatCudaDims d, SmatTokenGroups groups, int segments,
                                      const void* __restrict__ a, const void* __restrict__ bsrc,
                                      bool b_is_v, SmatTokenWeights tw, SmatMatrixLayout lay,
                                      float* __restrict__ out) {
  extern __shared__ float smem[];
  float* a_s = smem;                          // [kTokenTile][r]
  float* b_s = a_s + kTokenTile * d.r;        // [kTokenTile][p]
  float* w_s = b_s + kTokenTile * d.p;        // [kTokenTile]
  __shared__ int64_t rows[kTokenTile];
  const cuda_detail::GroupBlock blk(groups, d, segments);
  const int r = d.r, p = d.p;
  float* dst = blk.Matrix(out, lay, r, p, segments, blk.seg);

  for (int m0 = 0; m0 < r; m0 += kTileM) {
    for (int n0 = 0; n0 < p; n0 += kTileN) {
      float acc[kRegM][kRegN];
      ZeroAcc(acc);
      for (int64_t j0 = blk.lo; j0 < blk.hi; j0 += kTokenTile) {
        const int nt = static_cast<int>(cuda_detail::Min64(kTokenTile, blk.hi - j0));
        __syncthreads();  // the previous step's reads are done
        if (threadIdx.x < nt) {
          const int64_t i = blk.cur.Token(j0 + threadIdx.x);
          rows[threadIdx.x] = TokenRow(d, blk.b, i, blk.h);
          w_s[threadIdx.x] = TokenWeight(d, tw, blk.b, blk.h, i);
        }
        __syncthreads();
        for (int e = threadIdx.x; e < nt * r; e += blockDim.x) {
          const int t = e / r, i = e % r;
          a_s[t * r + i] = w_s[t] * LoadIn(a, rows[t] * r + i, d.bf16);
        }
        for (int e = threadIdx.x; e < nt * p; e += blockDim.x) {
          const int t = e / p, j = e % p;
          float val;
          if (b_is_v) {
            val = j < d.dv ? LoadIn(bsrc, rows[t] * d.dv + j, d.bf16) : 1.f;
          } else {
            val = static_cast<const float*>(bsrc)[rows[t] * p + j];
          }
          b_s[t * p + j] = val;
        }
        __syncthreads();
        TileAccumulate(
            acc, m0, n0, r, p, nt, [&](int m, int k) { return a_s[k * r + m]; },
            [&](int n, int k) { return b_s[k * p + n]; });
      }
      TileStore(acc, m0, n0, r, p, [&](int m, int n, float v) { dst[m * p + n] = v; });
    }
  }
}

// grid (ceil(W / 256), G, batch * H): out = sum of the segments in order.
__global__ void ReduceSegmentsKernel(SmatCudaDims d, int num_groups, int segments,
                                     const float* __restrict__ partial, SmatMatrixLayout lay,
                                     float* __restrict__ out) {
  const int64_t W = static_cast<int64_t>(d.r) * d.p;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (w >= W) return;
  const int g = blockIdx.y, bh = blockIdx.z, b = bh / d.H, h = bh % d.H;
  const float* src = partial + (static_cast<int64_t>(bh) * num_groups + g) * segments * W + w;
  float acc = 0.f;
  for (int s = 0; s < segments; ++s) acc += src[s * W];
  out[cuda_detail::MatrixIndex(lay, b, g, h) * W + w] = acc;
}

// GroupGrid (batch * H, segments, G), 8 warps; a warp handles one token at a time.
// Shared: M [r][PadOdd(p)], per-warp vectors a [8][r] and b [8][p].
__global__ void GroupedReadsKernel(SmatCudaDims d, SmatTokenGroups groups, int segments,
                                   SmatReadKind kind, const float* __restrict__ M,
                                   SmatMatrixLayout lay, const void* __restrict__ a,
                                   const void* __restrict__ v, const float* __restrict__ gsrc,
                                   SmatTokenWeights tw, float* __restrict__ out_p,
                                   float* __restrict__ out_r, float* __restrict__ out_v,
                                   bool assign) {
  extern __shared__ float smem[];
  const int r = d.r, p = d.p, ldp = PadOdd(p);
  constexpr int kWarps = kThreads / 32;
  float* m_s = smem;                    // [r][ldp]
  float* va = m_s + r * ldp;            // [kWarps][r]
  float* vb = va + kWarps * r;          // [kWarps][p]
  const cuda_detail::GroupBlock blk(groups, d, segments);
  if (blk.lo >= blk.hi) return;  // uniform over the block
  const float* src = blk.Matrix(M, lay, r, p);
  for (int e = threadIdx.x; e < r * p; e += blockDim.x) m_s[(e / p) * ldp + e % p] = src[e];
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* my_a = va + warp * r;
  float* my_b = vb + warp * p;
  for (int64_t j = blk.lo + warp; j < blk.hi; j += kWarps) {
    const int64_t i = blk.cur.Token(j);
    const int64_t row = TokenRow(d, blk.b, i, blk.h);
    const float w = TokenWeight(d, tw, blk.b, blk.h, i);
    if (kind != SmatReadKind::kMatVec)
      for (int k = lane; k < r; k += 32) my_a[k] = LoadIn(a, row * r + k, d.bf16);
    if (kind == SmatReadKind::kMatVec)
      for (int k = lane; k < p; k += 32) my_b[k] = gsrc[row * p + k];
    if (kind == SmatReadKind::kBoth)
      for (int k = lane; k < p; k += 32) my_b[k] = k < d.dv ? LoadIn(v, row * d.dv + k, d.bf16) : 1.f;
    __syncwarp();
    if (kind == SmatReadKind::kVecMat) {
      for (int n = lane; n < p; n += 32) {
        float s = 0.f;
        for (int k = 0; k < r; ++k) s = fmaf(my_a[k], m_s[k * ldp + n], s);
        // The weight's product rounded on its own (no fused multiply-add), so
        // that = and += give the same sum downstream.
        const float x = __fmul_rn(w, s);
        out_p[row * p + n] = assign ? x : out_p[row * p + n] + x;
      }
    } else {
      for (int m = lane; m < r; m += 32) {
        float s = 0.f;
        for (int k = 0; k < p; ++k) s = fmaf(m_s[m * ldp + k], my_b[k], s);
        const float x = __fmul_rn(w, s);
        out_r[row * r + m] = assign ? x : out_r[row * r + m] + x;
      }
      if (kind == SmatReadKind::kBoth) {
        for (int n = lane; n < d.dv; n += 32) {
          float s = 0.f;
          for (int k = 0; k < r; ++k) s = fmaf(my_a[k], m_s[k * ldp + n], s);
          const float x = __fmul_rn(w, s);
          out_v[row * d.dv + n] = assign ? x : out_v[row * d.dv + n] + x;
        }
      }
    }
    __syncwarp();
  }
}

// One warp per (b, h): count, exclusive offsets, then a stable placement in
// token order (ranks inside a 32-token step from __match_any_sync).
__global__ void GroupByContentKernel(SmatCudaDims d, const int32_t* __restrict__ map,
                                     int64_t begin, int64_t end, int G,
                                     int32_t* __restrict__ counts, int32_t* __restrict__ offsets,
                                     int32_t* __restrict__ perm) {
  const int bh = blockIdx.x, b = bh / d.H, h = bh % d.H, lane = threadIdx.x;
  int32_t* cnt = counts + static_cast<int64_t>(bh) * G;
  int32_t* off = offsets + static_cast<int64_t>(bh) * (G + 1);
  int32_t* out = perm + static_cast<int64_t>(bh) * (end - begin);
  for (int g = lane; g < G; g += 32) cnt[g] = 0;
  __syncwarp();
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t base = begin; base < end; base += 32) {
      const int64_t i = base + lane;
      int g = i < end ? map[TokenRow(d, b, i, h)] : -1;
      if (g < 0 || g >= G) g = -1;
      const unsigned peers = __match_any_sync(0xffffffffu, g);
      const int leader = __ffs(peers) - 1;
      if (pass == 1 && g >= 0) {
        out[cnt[g] + __popc(peers & ((1u << lane) - 1u))] = static_cast<int32_t>(i);
      }
      __syncwarp();
      if (g >= 0 && lane == leader) cnt[g] += __popc(peers);
      __syncwarp();
    }
    if (pass == 0) {
      if (lane == 0) {
        int32_t acc = 0;
        for (int g = 0; g < G; ++g) {
          off[g] = acc;
          acc += cnt[g];
          cnt[g] = off[g];  // becomes the placement cursor
        }
        off[G] = acc;
      }
      __syncwarp();
    }
  }
}

}  // namespace

cudaError_t LaunchSmatGroupedOuterSum(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                      int segments, const void* a, const void* b, bool b_is_v,
                                      const SmatTokenWeights& w, const SmatMatrixLayout& lay,
                                      float* out, cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatUseFastChunkTiles(d)) {
    return LaunchSmatGroupedOuterSumFast(d, groups, segments, a, b, b_is_v, w, lay, out, stream);
  }
  const size_t smem = sizeof(float) * (kTokenTile * (d.r + d.p) + kTokenTile);
  const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
  GroupedOuterSumKernel<<<grid, kThreads, smem, stream>>>(d, groups, segments, a, b, b_is_v, w,
                                                          lay, out);
  return cudaGetLastError();
}

cudaError_t LaunchSmatReduceSegments(const SmatCudaDims& d, int num_groups, int segments,
                                     const float* partial, const SmatMatrixLayout& lay,
                                     float* out, cudaStream_t stream) {
  if (num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  const int64_t W = static_cast<int64_t>(d.r) * d.p;
  const dim3 grid(static_cast<unsigned>((W + kThreads - 1) / kThreads), num_groups, d.batch * d.H);
  ReduceSegmentsKernel<<<grid, kThreads, 0, stream>>>(d, num_groups, segments, partial, lay, out);
  return cudaGetLastError();
}

cudaError_t LaunchSmatGroupedReads(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                   int segments, SmatReadKind kind, const float* M,
                                   const SmatMatrixLayout& lay, const void* a, const void* v,
                                   const float* g, const SmatTokenWeights& w, float* out_p,
                                   float* out_r, float* out_v, bool assign, cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatUseFastChunkTiles(d)) {
    return LaunchSmatGroupedReadsFast(d, groups, segments, kind, M, lay, a, v, g, w, out_p, out_r,
                                      out_v, assign, stream);
  }
  const size_t smem = sizeof(float) * (static_cast<size_t>(d.r) * PadOdd(d.p) +
                                       (kThreads / 32) * (d.r + d.p));
  if (smem > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(
        GroupedReadsKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
  GroupedReadsKernel<<<grid, kThreads, smem, stream>>>(d, groups, segments, kind, M, lay, a, v, g,
                                                       w, out_p, out_r, out_v, assign);
  return cudaGetLastError();
}

cudaError_t LaunchSmatGroupByContent(const SmatCudaDims& d, const int32_t* map, int64_t begin,
                                     int64_t end, int num_groups, int32_t* counts,
                                     int32_t* offsets, int32_t* perm, cudaStream_t stream) {
  if (d.batch * d.H == 0) return cudaSuccess;
  GroupByContentKernel<<<d.batch * d.H, 32, 0, stream>>>(d, map, begin, end, num_groups, counts,
                                                         offsets, perm);
  return cudaGetLastError();
}

}  // namespace smat
