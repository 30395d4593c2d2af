// The grouped products of the SMat op on tensor cores (mma.sync m16n8k16,
// bf16 operands, fp32 accumulation): the outer sums
//   out[(b, g, h), segment] = sum over the segment's tokens i of group g of
//                             (w_i a_i) b_i^T        (r x p)
// with a = psi or phi and b = vbar = [v, 1] or gbar: the chunk summaries (F2),
// profile pooling (F4), the chunk state gradients (B5) and the type-table
// gradient of B2 (LaunchSmatGroupedOuterSum's contract, smat_cuda_kernels.h),
// and the per-token reads of a group's matrix (F7, B2, B4; further down).
// SMAT_CUDA_GROUPED=mma selects them, =ffma the FFMA kernels of
// smat_grouped_fast.cu; unset, the defaults below decide (the outer sums
// here, the reads on FFMA). Outer sums of bf16 rows with unit weights go to
// the bf16-staged kernel of smat_outer_bf16.cu instead (H200, T = 524288,
// d = 2: ChunkSummaries 1.38 -> 0.55 ms, ProfilePooling 0.75 -> 0.33 ms,
// ChunkStateGradients 2.08 -> 1.58 ms).
//
// Shape. One block of 8 warps per (segment, group, b * H), the segment's
// tokens 128 at a time. A tile is staged k-major: At[m][t] = w_t a_t[m]
// (64 rows) and Bt[n][t] = b_t[n] (72 rows: p = 65 rounded up to n8 tiles), so
// a fragment register (two consecutive tokens of one row) is one 8-byte
// shared-memory load. Warp w owns rows 16 (w % 4) .. +15 of the output and
// n8 tiles 0-4 (w < 4) or 5-8, and walks the tile's tokens 16 at a time.
// 75.5 KB of shared memory and at most 128 registers: two blocks per SM, so
// one block's staging overlaps the other's products.
//
// Exactness (the scheme of smat_chunk_mma.cu). The tensor cores multiply bf16
// exactly and accumulate in fp32. w_t a_t (fp32) is split into three bf16
// parts x = x1 + x2 + x3 (24 significant bits: exact for normal fp32); b is one
// part when it is bf16 already (v and the ones of vbar for bf16 inputs), else
// three. The products kept are a1 b, a2 b, a3 b (3 MMAs) or a1b1, a1b2, a2b1,
// a1b3, a2b2, a3b1 (6 MMAs: every term down to 2^-16 relative); the
// correction terms go, smallest first, to an accumulator of their own that is
// added to the a1 b1 accumulator once at the end. The error is then that of an
// fp32 sum with a few extra roundings, as for the FFMA kernel (tests:
// tests/gpu/smat_gpu_test.cc, every grouped phase against the CPU within
// 1e-5). Determinism: each output is summed in a fixed order (16-token steps
// in list order, fixed term order), no atomics.
#include "kernels/cuda/smat_grouped_mma.h"

#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/smat_fast_tiles.cuh"
#include "kernels/cuda/smat_mma.cuh"

namespace smat {
namespace {

using cuda_detail::TokenRow;
using mma_tiles::Mma;
using mma_tiles::Pack;
using fast_tiles::Aligned16;
using fast_tiles::kBatch;
using fast_tiles::LoadVec;
using fast_tiles::ToF;

constexpr int kThreads = 256;
constexpr int kC = 128;       // tokens staged at a time
constexpr int kMPad = 64;     // output rows: r <= 64
constexpr int kNPad = 72;     // output columns: p <= 72 (nine n8 tiles)
constexpr int kLd = kC + 8;   // 136 = 8 mod 32: a half-warp's 8-byte fragment loads hit 32 banks

constexpr int kOffB = kMPad * kLd;
constexpr int kOffW = kOffB + kNPad * kLd;
constexpr int kOffRows = kOffW + kC;  // int64 token rows from here (even: 8-byte aligned)
constexpr int kSmemBytes = kOffRows * 4 + kC * 8;
static_assert(kOffRows % 2 == 0, "token rows must be 8-byte aligned");

// Whether the tensor-core kernels run when SMAT_CUDA_GROUPED is unset
// ("mma": both, where they fit; "ffma": neither). Measured on an H200 (bf16,
// 8 heads, r = dv = 64, T = 524288, d = 2): the outer sums beat FFMA
// (ChunkSummaries 2.01 -> 1.40 ms, ProfilePooling 1.12 -> 0.76 ms,
// ChunkStateGradients 2.21 -> 2.09 ms); the reads below do not yet
// (TypeReads 1.25 -> 2.90 ms), so they stay opt-in.
constexpr bool kMmaOuterSumsByDefault = true;
constexpr bool kMmaReadsByDefault = false;

// Two fp32 values (lower k first) as one register of two bf16 (exact when
// they are bf16 values already).
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  return Pack(__floats2bfloat162_rn(lo, hi));
}

__device__ __forceinline__ void Split3(float2 x, uint32_t& p1, uint32_t& p2, uint32_t& p3) {
  mma_tiles::Split3(x.x, x.y, p1, p2, p3);
}

// dst[i][t] (ld kLd) = scale[t] * src(rows[t])[i] for i < width, t < nt
// (scale null: 1); row `ones_row` is 1 for t < nt; everything else up to row
// npad and token kC is 0 (the padding the products read must be finite
// zeros). Threads walk t fastest: the stores of a warp hit 32 banks.
template <typename T>
__device__ void StageKMajor(const T* __restrict__ src, const int64_t* rows, int width, int nt,
                            bool vec, const float* scale, int npad, int ones_row, float* dst) {
  constexpr int V = 16 / sizeof(T);
  if (vec) {  // width % V == 0 and rows 16-byte aligned
    const int total = kC * (width / V);
    for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * 4) {
      float x[4][V];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = e0 + u * kThreads, t = e & (kC - 1), q = e >> 7;
        if (e < total && t < nt) {
          LoadVec(src + rows[t] * width + q * V, x[u]);
        } else {
#pragma unroll
          for (int z = 0; z < V; ++z) x[u][z] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = e0 + u * kThreads, t = e & (kC - 1), q = e >> 7;
        if (e < total) {
          const float sc = scale != nullptr && t < nt ? scale[t] : 1.f;
#pragma unroll
          for (int z = 0; z < V; ++z) dst[(q * V + z) * kLd + t] = sc * x[u][z];
        }
      }
    }
  } else {
    const int total = kC * width;
    for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * kBatch) {
      float x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e & (kC - 1), i = e >> 7;
        x[u] = e < total && t < nt ? ToF(__ldg(&src[rows[t] * width + i])) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e & (kC - 1), i = e >> 7;
        if (e < total) {
          const float sc = scale != nullptr && t < nt ? scale[t] : 1.f;
          dst[i * kLd + t] = sc * x[u];
        }
      }
    }
  }
  for (int e = threadIdx.x; e < kC * (npad - width); e += kThreads) {
    const int t = e & (kC - 1), i = width + (e >> 7);
    dst[i * kLd + t] = i == ones_row && t < nt ? 1.f : 0.f;
  }
}

// GroupGrid (batch * H, segments, G), kThreads threads, kSmemBytes of shared memory.
// kBParts: 1 when b is bf16 (exact in one part), 3 when it is fp32.
template <typename In, int kBParts>
__global__ void __launch_bounds__(kThreads, 2)
    OuterSumMmaKernel(SmatCudaDims d, SmatTokenGroups groups, int segments, bool vec_in,
                      const In* __restrict__ a, const void* __restrict__ bsrc, bool b_is_v,
                      SmatTokenWeights tw, SmatMatrixLayout lay, float* __restrict__ out) {
  extern __shared__ float4 smem4[];
  float* At = reinterpret_cast<float*>(smem4);
  float* Bt = At + kOffB;
  float* w = At + kOffW;
  int64_t* rows = reinterpret_cast<int64_t*>(At + kOffRows);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;  // fragment row / column pair of this lane
  const cuda_detail::GroupBlock blk(groups, d, segments);
  const int r = d.r, p = d.p, dv = d.dv;
  const int m0 = (warp & 3) * 16;
  const int n_first = warp < 4 ? 0 : 5, n_count = warp < 4 ? 5 : 4;
  float acc[5][4], cor[5][4];
#pragma unroll
  for (int j = 0; j < 5; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = cor[j][e] = 0.f;

  for (int64_t j0 = blk.lo; j0 < blk.hi; j0 += kC) {
    const int nt = static_cast<int>(cuda_detail::Min64(kC, blk.hi - j0));
    __syncthreads();  // the previous tile is consumed
    if (tid < nt) {
      const int64_t i = blk.cur.Token(j0 + tid);
      rows[tid] = TokenRow(d, blk.b, i, blk.h);
      w[tid] = cuda_detail::TokenWeight(d, tw, blk.b, blk.h, i);
    }
    __syncthreads();
    StageKMajor(a, rows, r, nt, vec_in, w, kMPad, -1, At);
    if (b_is_v) {
      StageKMajor(static_cast<const In*>(bsrc), rows, dv, nt, vec_in, nullptr, kNPad, dv, Bt);
    } else {
      StageKMajor(static_cast<const float*>(bsrc), rows, p, nt, false, nullptr, kNPad, -1, Bt);
    }
    __syncthreads();
    const int ksteps = (nt + 15) >> 4;
    for (int ks = 0; ks < ksteps; ++ks) {
      const int k = ks * 16 + 2 * tig;
      const float* a_lo = At + (m0 + gid) * kLd + k;
      const float* a_hi = a_lo + 8 * kLd;
      uint32_t A1[4], A2[4], A3[4];
      Split3(*reinterpret_cast<const float2*>(a_lo), A1[0], A2[0], A3[0]);
      Split3(*reinterpret_cast<const float2*>(a_hi), A1[1], A2[1], A3[1]);
      Split3(*reinterpret_cast<const float2*>(a_lo + 8), A1[2], A2[2], A3[2]);
      Split3(*reinterpret_cast<const float2*>(a_hi + 8), A1[3], A2[3], A3[3]);
#pragma unroll
      for (int j = 0; j < 5; ++j) {
        if (j >= n_count) break;
        const float* bp = Bt + ((n_first + j) * 8 + gid) * kLd + k;
        const float2 y0 = *reinterpret_cast<const float2*>(bp);
        const float2 y1 = *reinterpret_cast<const float2*>(bp + 8);
        if constexpr (kBParts == 1) {
          const uint32_t b0 = PackBf16(y0.x, y0.y), b1 = PackBf16(y1.x, y1.y);
          Mma(cor[j], A3, b0, b1);
          Mma(cor[j], A2, b0, b1);
          Mma(acc[j], A1, b0, b1);
        } else {
          uint32_t B1[2], B2[2], B3[2];
          Split3(y0, B1[0], B2[0], B3[0]);
          Split3(y1, B1[1], B2[1], B3[1]);
          Mma(cor[j], A3, B1[0], B1[1]);
          Mma(cor[j], A2, B2[0], B2[1]);
          Mma(cor[j], A1, B3[0], B3[1]);
          Mma(cor[j], A2, B1[0], B1[1]);
          Mma(cor[j], A1, B2[0], B2[1]);
          Mma(acc[j], A1, B1[0], B1[1]);
        }
      }
    }
  }

  float* dst = blk.Matrix(out, lay, r, p, segments, blk.seg);
#pragma unroll
  for (int j = 0; j < 5; ++j) {
    if (j >= n_count) break;
    const int col = (n_first + j) * 8 + 2 * tig;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = m0 + gid + (e >= 2 ? 8 : 0), c = col + (e & 1);
      if (row < r && c < p) dst[row * p + c] = acc[j][e] + cor[j][e];
    }
  }
}

template <typename In, int kBParts>
cudaError_t Launch(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                   const void* a, const void* b, bool b_is_v, const SmatTokenWeights& w,
                   const SmatMatrixLayout& lay, float* out, cudaStream_t stream) {
  auto kernel = OuterSumMmaKernel<In, kBParts>;
  // No carveout preference: asking for the largest shared-memory carveout
  // measured slower on an H200 (ChunkStateGradients 2.09 -> 2.40 ms; its fp32
  // rows are staged by scalar loads that L1 serves).
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  constexpr int V = 16 / sizeof(In);
  const bool vec = d.r % V == 0 && d.dv % V == 0 && Aligned16(a) && (!b_is_v || Aligned16(b));
  const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(d, groups, segments, vec,
                                                 static_cast<const In*>(a), b, b_is_v, w, lay, out);
  return cudaGetLastError();
}

// ---- per-token reads of a group's r x p matrix M (F7, B2, B4) ------------------
// LaunchSmatGroupedReads's contract: per token i of the segment,
//   kVecMat: out_p[i] += w_i (a_i^T M)           tokens x r  by  r x p
//   kMatVec: out_r[i] += w_i (M g_i)             tokens x p  by  p x r
//   kBoth:   out_r[i] += w_i (M vbar_i),  out_v[i] += w_i (M^T a_i)[0:dv]
// Rows of the products are tokens: warp w owns tokens 16 w .. 16 w + 15 of the
// 128 staged, and every output column. The token operand is staged row-major
// (As[t][k], fp32, the k padding zero), M once per block as three planes of
// bf16 pairs along k (M = M1 + M2 + M3, so a B fragment register is one 4-byte
// load): Pv for the vec-mat product (B[k][n] = M[k][n]), Pm for the mat-vec
// one (B[k][n] = M[n][k]). The token operand is one part when it is bf16 (a,
// vbar), three when fp32 (fp32 inputs, gbar); the products keep the terms of
// the outer sums above. The weight multiplies the finished product, as in the
// FFMA kernel: out += w_i * (row i of the product).
constexpr int kLdA = 88;    // As rows: k <= 80; 88 = 24 mod 32, conflict-free 8-byte loads
constexpr int kLdPv = 36;   // Pv rows (n < 72): 32 pairs of k < 64, + 4
constexpr int kLdPm = 44;   // Pm rows (n < 64): 40 pairs of k < 80, + 4
constexpr int kPvWords = kNPad * kLdPv;
constexpr int kPmWords = kMPad * kLdPm;
constexpr int kROffPv = kC * kLdA;                  // in 4-byte words
constexpr int kROffPm = kROffPv + 3 * kPvWords;
constexpr int kROffW = kROffPm + 3 * kPmWords;
constexpr int kROffRows = kROffW + kC;
constexpr int kReadsSmemBytes = kROffRows * 4 + kC * 8;
static_assert(kROffRows % 2 == 0, "token rows must be 8-byte aligned");

// Planes of M (r x p, row-major in global memory) as bf16 pairs along k:
// vec-mat (Pv[n][kp] = pair (M[2kp][n], M[2kp+1][n]), n < 72, k < 64) or
// mat-vec (Pm[n][kp] = pair (M[n][2kp], M[n][2kp+1]), n < 64, k < 80); zero
// outside M.
__device__ void StagePlanes(const float* __restrict__ M, int r, int p, bool vecmat,
                            uint32_t* planes) {
  const int rows = vecmat ? kNPad : kMPad, pairs = vecmat ? 32 : 40;
  const int ld = vecmat ? kLdPv : kLdPm, words = vecmat ? kPvWords : kPmWords;
  for (int e = threadIdx.x; e < rows * pairs; e += kThreads) {
    const int n = e / pairs, kp = e - n * pairs, k = 2 * kp;
    float2 x;
    if (vecmat) {
      x.x = k < r && n < p ? __ldg(&M[k * p + n]) : 0.f;
      x.y = k + 1 < r && n < p ? __ldg(&M[(k + 1) * p + n]) : 0.f;
    } else {
      x.x = n < r && k < p ? __ldg(&M[n * p + k]) : 0.f;
      x.y = n < r && k + 1 < p ? __ldg(&M[n * p + k + 1]) : 0.f;
    }
    uint32_t p1, p2, p3;
    Split3(x, p1, p2, p3);
    planes[n * ld + kp] = p1;
    planes[words + n * ld + kp] = p2;
    planes[2 * words + n * ld + kp] = p3;
  }
}

// acc/cor[j] = As[m0 .. m0 + 15][:] x B over `ksteps` 16-wide k steps, for the
// n8 tiles j0 + j, j < count <= kTiles (B from planes with leading dimension
// ld words).
template <int kAParts, int kTiles>
__device__ __forceinline__ void ReadProduct(const float* As, int m0, const uint32_t* planes,
                                            int words, int ld, int j0, int count, int ksteps,
                                            float (&acc)[kTiles][4], float (&cor)[kTiles][4]) {
  const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = cor[j][e] = 0.f;
  for (int ks = 0; ks < ksteps; ++ks) {
    const float* a_lo = As + (m0 + gid) * kLdA + ks * 16 + 2 * tig;
    const float* a_hi = a_lo + 8 * kLdA;
    const float2 x[4] = {*reinterpret_cast<const float2*>(a_lo),
                         *reinterpret_cast<const float2*>(a_hi),
                         *reinterpret_cast<const float2*>(a_lo + 8),
                         *reinterpret_cast<const float2*>(a_hi + 8)};
    uint32_t A1[4], A2[4], A3[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (kAParts == 1) {
        A1[i] = PackBf16(x[i].x, x[i].y);
      } else {
        Split3(x[i], A1[i], A2[i], A3[i]);
      }
    }
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      if (j >= count) break;
      const uint32_t* bp = planes + ((j0 + j) * 8 + gid) * ld + ks * 8 + tig;
      const uint32_t b10 = bp[0], b11 = bp[4];
      const uint32_t b20 = bp[words], b21 = bp[words + 4];
      const uint32_t b30 = bp[2 * words], b31 = bp[2 * words + 4];
      if constexpr (kAParts == 1) {
        Mma(cor[j], A1, b30, b31);
        Mma(cor[j], A1, b20, b21);
        Mma(acc[j], A1, b10, b11);
      } else {
        Mma(cor[j], A3, b10, b11);
        Mma(cor[j], A2, b20, b21);
        Mma(cor[j], A1, b30, b31);
        Mma(cor[j], A2, b10, b11);
        Mma(cor[j], A1, b20, b21);
        Mma(acc[j], A1, b10, b11);
      }
    }
  }
}

// out[rows[t] * width + n] += w[t] * (acc + cor) for the staged tokens t < nt
// and the columns n < width of n8 tiles j0 .. j0 + kTiles - 1 (= with assign;
// the weight's product rounded on its own, as in the FFMA kernel).
template <int kTiles>
__device__ __forceinline__ void ReadEpilogue(const float (&acc)[kTiles][4],
                                             const float (&cor)[kTiles][4], int m0, int j0,
                                             int count, int nt, const int64_t* rows, const float* w,
                                             int width, bool assign, float* __restrict__ out) {
  const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int t = m0 + gid + 8 * half;
    if (t >= nt) continue;
    float* o = out + rows[t] * width;
    const float wt = w[t];
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = (j0 + j) * 8 + 2 * tig + e;
        if (j < count && n < width) {
          const float x = __fmul_rn(wt, acc[j][2 * half + e] + cor[j][2 * half + e]);
          o[n] = assign ? x : o[n] + x;
        }
      }
  }
}

// One read product over the n8 tiles [0, n_tiles), in passes of at most 5
// tiles (the accumulators of a pass stay in registers).
template <int kAParts>
__device__ __forceinline__ void ReadAll(const float* As, int m0, const uint32_t* planes, int words,
                                        int ld, int n_tiles, int ksteps, int nt,
                                        const int64_t* rows, const float* w, int width, bool assign,
                                        float* __restrict__ out) {
  for (int j0 = 0; j0 < n_tiles; j0 += 5) {
    const int count = min(5, n_tiles - j0);
    float acc[5][4], cor[5][4];
    ReadProduct<kAParts, 5>(As, m0, planes, words, ld, j0, count, ksteps, acc, cor);
    ReadEpilogue<5>(acc, cor, m0, j0, count, nt, rows, w, width, assign, out);
  }
}

// GroupGrid (batch * H, segments, G), kThreads threads, kReadsSmemBytes.
template <SmatReadKind kRead, typename In>
__global__ void __launch_bounds__(kThreads, 2)
    ReadsMmaKernel(SmatCudaDims d, SmatTokenGroups groups, int segments, bool vec_in,
                   const float* __restrict__ M, SmatMatrixLayout lay, const In* __restrict__ a,
                   const In* __restrict__ v, const float* __restrict__ gsrc, SmatTokenWeights tw,
                   float* __restrict__ out_p, float* __restrict__ out_r, float* __restrict__ out_v,
                   bool assign) {
  using fast_tiles::ListedRows;
  using fast_tiles::StageRows;
  constexpr int kTokenParts = std::is_same_v<In, float> ? 3 : 1;
  extern __shared__ float4 smem4[];
  float* As = reinterpret_cast<float*>(smem4);
  uint32_t* Pv = reinterpret_cast<uint32_t*>(As) + kROffPv;
  uint32_t* Pm = reinterpret_cast<uint32_t*>(As) + kROffPm;
  float* w = As + kROffW;
  int64_t* rows = reinterpret_cast<int64_t*>(As + kROffRows);
  const cuda_detail::GroupBlock blk(groups, d, segments);
  if (blk.lo >= blk.hi) return;  // uniform over the block
  const int r = d.r, p = d.p, dv = d.dv, tid = threadIdx.x, m0 = (tid >> 5) * 16;
  const float* Mk = blk.Matrix(M, lay, r, p);
  if (kRead != SmatReadKind::kMatVec) StagePlanes(Mk, r, p, /*vecmat=*/true, Pv);
  if (kRead != SmatReadKind::kVecMat) StagePlanes(Mk, r, p, /*vecmat=*/false, Pm);
  const int kr = (r + 15) >> 4, kp = (p + 15) >> 4;  // k steps over r and over p
  for (int64_t j0 = blk.lo; j0 < blk.hi; j0 += kC) {
    const int nt = static_cast<int>(cuda_detail::Min64(kC, blk.hi - j0));
    __syncthreads();  // the previous tile's reads of As, w, rows are done
    if (tid < nt) {
      const int64_t i = blk.cur.Token(j0 + tid);
      rows[tid] = TokenRow(d, blk.b, i, blk.h);
      w[tid] = cuda_detail::TokenWeight(d, tw, blk.b, blk.h, i);
    }
    __syncthreads();
    if (kRead == SmatReadKind::kVecMat) {
      StageRows(ListedRows<In>{a, rows, r}, nt, r, vec_in, As, kLdA, 16 * kr);
      __syncthreads();
      ReadAll<kTokenParts>(As, m0, Pv, kPvWords, kLdPv, (p + 7) >> 3, kr, nt, rows, w, p, assign,
                           out_p);
    } else if (kRead == SmatReadKind::kMatVec) {
      StageRows(ListedRows<float>{gsrc, rows, p}, nt, p, false, As, kLdA, 16 * kp);
      __syncthreads();
      ReadAll<3>(As, m0, Pm, kPmWords, kLdPm, (r + 7) >> 3, kp, nt, rows, w, r, assign, out_r);
    } else {
      StageRows(ListedRows<In>{v, rows, dv}, nt, dv, vec_in, As, kLdA, 16 * kp, dv);
      __syncthreads();
      ReadAll<kTokenParts>(As, m0, Pm, kPmWords, kLdPm, (r + 7) >> 3, kp, nt, rows, w, r, assign,
                           out_r);
      __syncthreads();  // As is restaged with a
      StageRows(ListedRows<In>{a, rows, r}, nt, r, vec_in, As, kLdA, 16 * kr);
      __syncthreads();
      ReadAll<kTokenParts>(As, m0, Pv, kPvWords, kLdPv, (dv + 7) >> 3, kr, nt, rows, w, dv, assign,
                           out_v);
    }
  }
}

template <SmatReadKind kRead, typename In>
struct LaunchReads {
  static cudaError_t Run(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                         const float* M, const SmatMatrixLayout& lay, const void* a, const void* v,
                         const float* g, const SmatTokenWeights& w, float* out_p, float* out_r,
                         float* out_v, bool assign, cudaStream_t stream) {
    auto kernel = ReadsMmaKernel<kRead, In>;
    const cudaError_t err = mma_tiles::AllowSharedMemory(kernel, kReadsSmemBytes);
    if (err != cudaSuccess) return err;
    constexpr int V = 16 / sizeof(In);
    const bool vec = d.r % V == 0 && d.dv % V == 0 && Aligned16(a) && Aligned16(v);
    const dim3 grid = cuda_detail::GroupGrid(segments, groups.num_groups, d.batch * d.H);
    kernel<<<grid, kThreads, kReadsSmemBytes, stream>>>(
        d, groups, segments, vec, M, lay, static_cast<const In*>(a), static_cast<const In*>(v), g,
        w, out_p, out_r, out_v, assign);
    return cudaGetLastError();
  }
};

}  // namespace

bool SmatUseMmaGrouped(const SmatCudaDims& d, bool reads) {
  const char* env = std::getenv("SMAT_CUDA_GROUPED");
  if (env != nullptr && std::strcmp(env, "ffma") == 0) return false;
  const bool forced = env != nullptr && std::strcmp(env, "mma") == 0;
  if (!forced && !(reads ? kMmaReadsByDefault : kMmaOuterSumsByDefault)) return false;
  if (d.chunk > kC || d.r > kMPad || d.p > kNPad) return false;
  return SmatDeviceRunsMma(kSmemBytes > kReadsSmemBytes ? kSmemBytes : kReadsSmemBytes);
}

cudaError_t LaunchSmatGroupedOuterSumMma(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                         int segments, const void* a, const void* b, bool b_is_v,
                                         const SmatTokenWeights& w, const SmatMatrixLayout& lay,
                                         float* out, cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatOuterSumBf16Fits(d, a, b, b_is_v, w)) {
    return LaunchSmatOuterSumBf16(d, groups, segments, a, b, b_is_v, w, lay, out, stream);
  }
  if (d.bf16) {
    return b_is_v ? Launch<__nv_bfloat16, 1>(d, groups, segments, a, b, b_is_v, w, lay, out, stream)
                  : Launch<__nv_bfloat16, 3>(d, groups, segments, a, b, b_is_v, w, lay, out,
                                             stream);
  }
  return Launch<float, 3>(d, groups, segments, a, b, b_is_v, w, lay, out, stream);
}

cudaError_t LaunchSmatGroupedReadsMma(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                      int segments, SmatReadKind kind, const float* M,
                                      const SmatMatrixLayout& lay, const void* a, const void* v,
                                      const float* g, const SmatTokenWeights& w, float* out_p,
                                      float* out_r, float* out_v, bool assign,
                                      cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  return fast_tiles::DispatchReads<LaunchReads>(d.bf16, kind, d, groups, segments, M, lay, a, v, g,
                                                w, out_p, out_r, out_v, assign, stream);
}

}  // namespace smat
