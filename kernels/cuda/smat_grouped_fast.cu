// The fast path of the grouped SMat phases (c <= 128 tokens, r and dv <= 64):
// the grouped outer sums (F2, profile pooling, B5, the type-table gradient)
// and the per-token reads (F7, B2, B4), 128 tokens of a group at a time, as
// tile products with the staging and FFMA blocking of smat_fast_tiles.cuh.
// smat_grouped.cu holds the general kernels and picks these when the sizes
// fit. fp32 FFMA throughout, each output summed in a fixed order, no atomics.
// Both run on tensor cores instead (smat_grouped_mma.cu) where
// SmatUseMmaGrouped says so (SMAT_CUDA_GROUPED=mma|ffma), and the reads of
// bf16 rows by default where SmatUseReadsBf16 says so (smat_reads_bf16.cu).
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_fast_tiles.cuh"
#include "kernels/cuda/smat_grouped_mma.h"

namespace smat {
namespace {

using namespace fast_tiles;  // NOLINT: the tile pieces are this file's vocabulary

// ---- grouped outer sums: chunk summaries (F2), pooling, state gradients ------
// out[(b, g, h), seg] = sum over the segment's tokens i of group g of
// (w_i a_i) b_i^T (r x p): a = psi or phi (input dtype), b = vbar = [v, 1] or
// gbar (fp32, width p); LaunchSmatGroupedOuterSum's contract. GroupGrid
// (batch * H, segments, G), 256 threads, 128 tokens staged at a time; a thread owns 4 x 4
// outputs (16-byte operand loads, tokens in list order), and 4 threads per row
// add column 64 (p = 65), each over every 4th token, combined in a fixed
// order. Shared: A [kC][kW], B [kC][kLdB], w [kC], rows [kC] (int64).
constexpr int kLdB = 68;
constexpr int kOuterSmemFloats = kC * kW + kC * kLdB + kC + 2 * kC;

template <typename In>
__global__ void __launch_bounds__(kThreads)
    GroupOuterSumKernel(SmatCudaDims d, SmatTokenGroups groups, int segments, bool vec_in,
                        const In* __restrict__ a, const void* __restrict__ bsrc, bool b_is_v,
                        SmatTokenWeights tw, SmatMatrixLayout lay, float* __restrict__ out) {
  extern __shared__ float4 smem4[];
  float* A = reinterpret_cast<float*>(smem4);
  float* B = A + kC * kW;
  float* w = B + kC * kLdB;
  int64_t* rows = reinterpret_cast<int64_t*>(w + kC);
  const int tid = threadIdx.x;
  const cuda_detail::GroupBlock blk(groups, d, segments);
  const int r = d.r, p = d.p, dv = d.dv;
  const int ty = tid >> 4, tx = tid & 15;
  const int crow = tid >> 2, part = tid & 3;  // column-64 role
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  float sum64 = 0.f;
  for (int64_t j0 = blk.lo; j0 < blk.hi; j0 += kC) {
    const int nt = static_cast<int>(cuda_detail::Min64(kC, blk.hi - j0));
    __syncthreads();  // the previous tile is consumed
    if (tid < nt) {
      const int64_t i = blk.cur.Token(j0 + tid);
      rows[tid] = TokenRow(d, blk.b, i, blk.h);
      w[tid] = cuda_detail::TokenWeight(d, tw, blk.b, blk.h, i);
    }
    __syncthreads();
    StageRows(ListedRows<In>{a, rows, r}, nt, r, vec_in, A, kW, kW, -1, w);
    if (b_is_v) {
      StageRows(ListedRows<In>{static_cast<const In*>(bsrc), rows, dv}, nt, dv, vec_in, B, kLdB,
                kLdB, dv);
    } else {
      StageRows(ListedRows<float>{static_cast<const float*>(bsrc), rows, p}, nt, p, false, B,
                kLdB, kLdB);
    }
    __syncthreads();
#pragma unroll 4
    for (int t = 0; t < nt; ++t) {
      const float4 av = *reinterpret_cast<const float4*>(&A[t * kW + ty * 4]);
      const float4 bv = *reinterpret_cast<const float4*>(&B[t * kLdB + tx * 4]);
      const float ar[4] = {av.x, av.y, av.z, av.w}, br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(ar[i], br[j], acc[i][j]);
    }
    if (p > kW) {
      for (int t = part; t < nt; t += 4) sum64 = fmaf(A[t * kW + crow], B[t * kLdB + kW], sum64);
    }
  }
  float* dst = blk.Matrix(out, lay, r, p, segments, blk.seg);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = ty * 4 + i, col = tx * 4 + j;
      if (row < r && col < p) dst[row * p + col] = acc[i][j];
    }
  if (p > kW) {
    // (s0 + s1) + (s2 + s3) by the butterfly: the same bits in all four lanes.
    sum64 += __shfl_xor_sync(0xffffffffu, sum64, 1);
    sum64 += __shfl_xor_sync(0xffffffffu, sum64, 2);
    if (part == 0 && crow < r) dst[crow * p + kW] = sum64;
  }
}

// ---- per-token reads of a group's r x p matrix (F7, B2, B4) -------------------
// The tokens of a segment of group g, 128 at a time, as a tile product with
// the group's matrix M (see SmatReadKind):
//   kVecMat: out_p[i] += w_i (a_i^T M)          A^T [r][128] x M [r][p]
//   kMatVec: out_r[i] += w_i (M g_i)            G^T [p][128] x M^T [p][r]
//   kBoth:   out_r[i] += w_i (M vbar_i),  out_v[i] += w_i (M^T a_i)[0:dv]
// GroupGrid (batch * H, segments, G), 256 threads; rows = tokens (8 per thread),
// 4 columns per thread, k in increasing order; column 64 of out_p (p = 65) by
// two half sums added in order. Shared: Ma [64][kLdF] = M and At [64][kC]
// (kinds with an a-side product), Mg [kK1][kLdF] = M^T and Bt [kK1][kC] (kinds
// with a b-side product), rows, w, partial sums. Each kind holds only its own
// buffers (52 KB for kVecMat and kMatVec), so their blocks fit three per SM
// at their register counts; kBoth needs all (104 KB, two per SM).
template <SmatReadKind kRead>
struct ReadsSmem {
  static constexpr bool kA = kRead != SmatReadKind::kMatVec;
  static constexpr bool kG = kRead != SmatReadKind::kVecMat;
  static constexpr int kMa = 0;
  static constexpr int kMg = kMa + (kA ? kW * kLdF : 0);
  static constexpr int kAt = kMg + (kG ? kK1 * kLdF : 0);
  static constexpr int kBt = kAt + (kA ? kW * kC : 0);
  static constexpr int kWOff = kBt + (kG ? kK1 * kC : 0);
  static constexpr int kPart = kWOff + 2 * kC;
  static constexpr int kRows = kPart + 2 * kC;     // kC int64 = 2 kC floats
  static constexpr int kFloats = kRows + 2 * kC;
  static_assert(kMg % 4 == 0 && kAt % 4 == 0 && kBt % 4 == 0 && kRows % 2 == 0,
                "16-byte aligned tiles, 8-byte aligned rows");
};

// out[rows[t]][n] += w[t] acc[i][jj] for this thread's tokens t = m0 + i < nt
// and columns n = n0 + jj < ncols (rows `width` wide); = with kAssign. The
// product w[t] acc is rounded on its own (no fused multiply-add), so that the
// two modes give the same sums downstream. The old values of kPass rows are
// loaded before any is stored, so their latencies overlap (the rows may alias
// as far as the compiler knows); whole 16-byte pieces where the rows allow.
template <bool kAssign>
__device__ __forceinline__ void AddToRows(float* __restrict__ out, int width, int ncols,
                                          const int64_t* rows, const float* w, int m0, int n0,
                                          int nt, const float (&acc)[8][4]) {
  constexpr int kPass = 4;
  const bool vec = width % 4 == 0 && Aligned16(out) && n0 + 4 <= ncols;
#pragma unroll
  for (int i0 = 0; i0 < 8; i0 += kPass) {
    float old[kPass][4];
#pragma unroll
    for (int i = 0; i < kPass; ++i) {
      const int t = m0 + i0 + i;
      const float* o = out + rows[t < nt ? t : 0] * width + n0;
      if (kAssign) {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) old[i][jj] = 0.f;
      } else if (t < nt && vec) {
        const float4 x = *reinterpret_cast<const float4*>(o);
        old[i][0] = x.x;
        old[i][1] = x.y;
        old[i][2] = x.z;
        old[i][3] = x.w;
      } else {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) old[i][jj] = t < nt && n0 + jj < ncols ? o[jj] : 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < kPass; ++i) {
      const int t = m0 + i0 + i;
      if (t >= nt) continue;
      float* o = out + rows[t] * width + n0;
      const float wt = w[t];
      float y[4];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const float x = __fmul_rn(wt, acc[i0 + i][jj]);
        y[jj] = kAssign ? x : old[i][jj] + x;
      }
      if (vec) {
        *reinterpret_cast<float4*>(o) = make_float4(y[0], y[1], y[2], y[3]);
      } else {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          if (n0 + jj < ncols) o[jj] = y[jj];
        }
      }
    }
  }
}

// kAssign: the kind's outputs are written, not added to.
template <SmatReadKind kRead, typename In, bool kAssign>
__global__ void __launch_bounds__(kThreads, kRead == SmatReadKind::kBoth ? 2 : 3)
    GroupReadsKernel(SmatCudaDims d, SmatTokenGroups groups, int segments, bool vec_in,
                     const float* __restrict__ M, SmatMatrixLayout lay, const In* __restrict__ a,
                     const In* __restrict__ v, const float* __restrict__ gsrc, SmatTokenWeights tw,
                     float* __restrict__ out_p, float* __restrict__ out_r,
                     float* __restrict__ out_v) {
  constexpr bool kA = kRead != SmatReadKind::kMatVec;  // a-side product (out_p or out_v)
  constexpr bool kG = kRead != SmatReadKind::kVecMat;  // b-side product (out_r)
  extern __shared__ float4 smem4[];
  using Smem = ReadsSmem<kRead>;
  float* sm = reinterpret_cast<float*>(smem4);
  float* Ma = sm + Smem::kMa;
  float* Mg = sm + Smem::kMg;
  float* At = sm + Smem::kAt;
  float* Bt = sm + Smem::kBt;
  float* w = sm + Smem::kWOff;
  float* part = sm + Smem::kPart;
  int64_t* rows = reinterpret_cast<int64_t*>(sm + Smem::kRows);
  const cuda_detail::GroupBlock blk(groups, d, segments);
  if (blk.lo >= blk.hi) return;  // uniform over the block
  const int r = d.r, p = d.p, dv = d.dv, tid = threadIdx.x;
  const float* Mk = blk.Matrix(M, lay, r, p);
  if (kA) StageChunkMatrix(Mk, r, p, p < kW ? p : kW, false, Ma);
  if (kG) StageChunkMatrix(Mk, r, p, r, true, Mg);
  const int ty = tid >> 4, tx = tid & 15, m0 = ty * 8, n0 = tx * 4;
  const int wa = kRead == SmatReadKind::kVecMat ? p : dv;  // a-side output width
  for (int64_t j0 = blk.lo; j0 < blk.hi; j0 += kC) {
    const int nt = static_cast<int>(cuda_detail::Min64(kC, blk.hi - j0));
    __syncthreads();  // the previous tile's reads of At, Bt, w, rows are done
    if (tid < nt) {
      const int64_t i = blk.cur.Token(j0 + tid);
      rows[tid] = TokenRow(d, blk.b, i, blk.h);
      w[tid] = cuda_detail::TokenWeight(d, tw, blk.b, blk.h, i);
    }
    __syncthreads();
    if (kA) StageTransposed(ListedRows<In>{a, rows, r}, nt, r, vec_in, At);
    if (kRead == SmatReadKind::kBoth) {
      StageTransposed(ListedRows<In>{v, rows, dv}, nt, p, vec_in, Bt);
    }
    if (kRead == SmatReadKind::kMatVec) {
      StageTransposed(ListedRows<float>{gsrc, rows, p}, nt, p, false, Bt);
    }
    __syncthreads();
    if (kA) {
      float acc[8][4];
      Zero(acc);
      Gemm<true, false>(acc, At, kC, m0, Ma, kLdF, n0, 0, r);
      AddToRows<kAssign>(kRead == SmatReadKind::kVecMat ? out_p : out_v, wa, wa < kW ? wa : kW,
                         rows, w, m0, n0, nt, acc);
      if (kRead == SmatReadKind::kVecMat && p > kW) {
        // Column 64: a_t . M[:, 64] in two halves of r, added in order.
        const int t = tid & (kC - 1), half = tid >> 7;
        const int kh = (r + 1) / 2, k0 = half * kh, k1 = min(r, k0 + kh);
        float sum = 0.f;
        for (int k = k0; k < k1; ++k) sum = fmaf(At[k * kC + t], __ldg(&Mk[k * p + kW]), sum);
        part[half * kC + t] = sum;
        __syncthreads();
        if (tid < nt) {
          float* o = out_p + rows[tid] * p + kW;
          const float x = __fmul_rn(w[tid], part[tid] + part[kC + tid]);
          *o = kAssign ? x : *o + x;
        }
      }
    }
    if (kG) {
      float acc[8][4];
      Zero(acc);
      Gemm<true, false>(acc, Bt, kC, m0, Mg, kLdF, n0, 0, p);
      AddToRows<kAssign>(out_r, r, r, rows, w, m0, n0, nt, acc);
    }
  }
}

template <SmatReadKind kRead, typename In>
struct LaunchReads {
  static cudaError_t Run(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                         const float* M, const SmatMatrixLayout& lay, const void* a, const void* v,
                         const float* g, const SmatTokenWeights& w, float* out_p, float* out_r,
                         float* out_v, bool assign, cudaStream_t stream) {
    constexpr size_t kSmem = sizeof(float) * ReadsSmem<kRead>::kFloats;
    auto kernel = assign ? GroupReadsKernel<kRead, In, true> : GroupReadsKernel<kRead, In, false>;
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
    constexpr int V = 16 / sizeof(In);
    const bool vec = d.r % V == 0 && d.dv % V == 0 && Aligned16(a) && Aligned16(v);
    const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
    kernel<<<grid, kThreads, kSmem, stream>>>(d, groups, segments, vec, M, lay,
                                              static_cast<const In*>(a), static_cast<const In*>(v),
                                              g, w, out_p, out_r, out_v);
    return cudaGetLastError();
  }
};

template <typename In>
cudaError_t LaunchOuter(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                        const void* a, const void* b, bool b_is_v, const SmatTokenWeights& w,
                        const SmatMatrixLayout& lay, float* out, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(float) * kOuterSmemFloats;
  auto kernel = GroupOuterSumKernel<In>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  constexpr int V = 16 / sizeof(In);
  const bool vec = d.r % V == 0 && d.dv % V == 0 && Aligned16(a) && (!b_is_v || Aligned16(b));
  const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
  kernel<<<grid, kThreads, kSmem, stream>>>(d, groups, segments, vec, static_cast<const In*>(a), b,
                                            b_is_v, w, lay, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchSmatGroupedOuterSumFast(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                          int segments, const void* a, const void* b,
                                          bool b_is_v, const SmatTokenWeights& w,
                                          const SmatMatrixLayout& lay, float* out,
                                          cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatUseMmaGrouped(d, /*reads=*/false)) {
    return LaunchSmatGroupedOuterSumMma(d, groups, segments, a, b, b_is_v, w, lay, out, stream);
  }
  return d.bf16 ? LaunchOuter<__nv_bfloat16>(d, groups, segments, a, b, b_is_v, w, lay, out, stream)
                : LaunchOuter<float>(d, groups, segments, a, b, b_is_v, w, lay, out, stream);
}

cudaError_t LaunchSmatGroupedReadsFast(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                       int segments, SmatReadKind kind, const float* M,
                                       const SmatMatrixLayout& lay, const void* a, const void* v,
                                       const float* g, const SmatTokenWeights& w, float* out_p,
                                       float* out_r, float* out_v, bool assign,
                                       cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatUseReadsBf16(d, kind, a, v)) {
    return LaunchSmatReadsBf16(d, groups, segments, kind, M, lay, a, v, g, w, out_p, out_r, out_v,
                               assign, stream);
  }
  if (SmatUseMmaGrouped(d, /*reads=*/true)) {
    return LaunchSmatGroupedReadsMma(d, groups, segments, kind, M, lay, a, v, g, w, out_p, out_r,
                                     out_v, assign, stream);
  }
  return fast_tiles::DispatchReads<LaunchReads>(d.bf16, kind, d, groups, segments, M, lay, a, v, g,
                                                w, out_p, out_r, out_v, assign, stream);
}

}  // namespace smat
