// The d = 3 tabulation U[h] = sum_{x on h} F[x] (Algorithm 2) with each
// loaded point summed into several lines from registers, and its adjoint
// F_bar[x] = sum_{h through x} U_bar[h] with each loaded line summed into
// several points (SlopeGroup's notes).
//
// TabulatePlaneKernel (smat_tabulate.cu) gives each thread one line and loads
// every (point, line) term from shared memory: q^3 16-byte loads per block, so
// the L1 is its limit (91.6% of its peak under Nsight Compute at q = 67). Here
// one load serves four lines, the loads per term fall to a quarter and the
// lines move between registers instead.
//
// The plane's geometry (MakeGeometry, D = 2): points x = (x0, x1), index
// x0 q + x1; line (e = 0, b) = {(k, b)}, (e = 1, b) = {(b, k)} and, for
// e = 1 + m, m >= 1, {(k, (b - k) / m)}, in increasing point index (k from 0).
// Label the lines of e = 0 by slope s = 0, j = b, and those of e = 1 + m by
// s = 1 / m, j = s b: at step k (point row x0 = k) line (s, j) passes x1 = j -
// s k. In a frame turned by sigma k at row k (z = x1 + sigma k), the lines of
// slope sigma + i sit at z = j - i k: they move i places to the left per row.
//
// A warp takes four slopes sigma .. sigma + 3 and four columns of the block:
// lane (L, c) = 4 L + c holds column c of the ring slots z in [L Wc, L Wc +
// Wc) (Wc = ceil(q / 8); the last lane's ring part is V = q - 7 Wc slots).
// Per row it loads its Wc points once and adds each to the four lines there;
// between rows the lines of slope sigma + i move i slots left, i of them from
// the next lane (one shuffle each), the last lane taking the ring's start from
// the first. A row of points is kept in shared memory as q + Wc - 1 slots of
// 16 bytes, x1 = 0 .. q - 1 and then x1 = 0 .. Wc - 2 again, so that a
// lane's Wc points are consecutive slots whatever the turn: one address a
// row, the loads at constant offsets from it.
//
// Each line sums its points in increasing k, starting from zero, as the CPU
// (TabulateIncidence) does, so the bits are the CPU's. The lines of e = 1
// (a point row each) are summed by one more task, by whole rows.
//
// H100, T = 524288, d = 3 (q = 67), 8 heads, W = 4160 (2026-12-05): Tabulate
// 2.16 -> 1.88 ms. Nsight Compute: shared-memory wavefronts 401 -> 171
// million, bank conflicts 77 -> 21 million; the kernel then issued on 59% of
// its cycles, three blocks of nine warps per SM (registers), and waited on the
// staging's global loads. Staged in two halves of asynchronous copies, the
// sums starting on the first: 1.88 -> 1.67-1.72 ms. Loading the next row
// during a row's adds (96 registers, two blocks per SM) was slower: 1.93 ms.
// The adjoint by the same rings (2026-12-06, H100, two rounds against the
// point per thread of TabulatePlaneKernel): TabulateBackward 2.21-2.26 ->
// 1.75 ms, the d = 3 forward+backward 14.59-14.66 -> 13.76-14.06 ms.
// The rows of q slots, x1 at slot x1 / Wc mod q (a wrap and a minimum per
// load) against the padded rows (2026-12-06, two runs, one binary):
// Tabulate 1.672-1.683 -> 1.627-1.638 ms, TabulateBackward 1.746-1.756 ->
// 1.664-1.693 ms, at two blocks per SM instead of three. It is then bound by
// the L1's wavefronts (75.7% of its peak, issue on 61% of the cycles): a lane
// whose ring part has wrapped past q reads slots q apart from the others', q
// is odd, and 94% of the loads at q = 67 take two wavefronts. 27% fewer
// instructions a row (runs of Wc rows unrolled, the frame turned with the
// middle slope) left the time as it was (PERFORMANCE.md, thirtieth pass).
// Each slope's flat_to_type lookups issued before its stores, not a lookup
// and its dependent store a line in turn (2026-12-06, H100, three binaries
// alternating): Tabulate 1.625-1.652 -> 1.575-1.577 ms at q = 67, 2.851 ->
// 2.536 at q = 83, 4.503 -> 4.113 at q = 103, 1.068 -> 1.092 at q = 53
// (PERFORMANCE.md, thirty-first pass). The adjoint's staging lookups eight
// at a time, not one before each copy (another H100, two binaries
// alternating): TabulateBackward 3.027 -> 2.563 ms at q = 83, 4.696 -> 4.060
// at q = 103, 1.610-1.612 -> 1.630-1.638 at q = 67, 1.070 -> 1.068 at q = 53.
// Not kept (2026-12-07, H100): the rows streamed through shared memory a
// batch of four at a time (three batches of copies in flight, a barrier a
// batch) and held twice over (2 q slots, so that no lane's part wraps and
// every load takes one wavefront), the slope groups split over two to four
// blocks: Tabulate 1.509-1.541 -> 1.721-1.943 ms at q = 67, 2.552 -> 3.180
// at q = 83, TabulateBackward 1.636-1.642 -> 1.754-1.796 (PERFORMANCE.md,
// thirty-third pass).
// Not kept (2026-12-07, H200): five or six slopes a group where the last
// lane's slots allow it (fewer loads per add; more shuffles and registers,
// a warp fewer a block): Tabulate 1.382-1.385 -> 1.427-1.444 ms at q = 67,
// 4.177 -> 4.228-4.287 at q = 103 (PERFORMANCE.md, thirty-fourth pass).
// The field sizes are template arguments so that every ring index is a
// constant: a register.
#include <cstdint>

#include "kernels/cuda/smat_cuda_kernels.h"
#include "kernels/cuda/smat_device.cuh"

namespace smat {
namespace {

using cuda_detail::Add4;

constexpr int kSlopes = 4;  // slopes per warp task
constexpr int kCols = 4;    // columns per block (one float4 per point)

__host__ __device__ constexpr int SlopeTasks(int q) { return (q + kSlopes - 1) / kSlopes + 1; }
__host__ __device__ constexpr int SlopeWarps(int q) { return (SlopeTasks(q) + 1) / 2; }
// Blocks per SM that the staged rows' shared memory allows (228 KB, 1 KB
// reserved per block), at most 4: the register budget __launch_bounds__ asks
// for. slots = StagedSlots(q, ..).
__host__ __device__ constexpr int SlopeBlocks(int slots) {
  return 233472 / (16 * slots + 1024) < 1   ? 1
         : 233472 / (16 * slots + 1024) > 4 ? 4
                                            : 233472 / (16 * slots + 1024);
}
// Slots of 16 bytes staged: q rows of points (the adjoint: q + 1 rows of
// lines), each of q + wc - 1 slots (its first wc - 1 slots again at its end).
__host__ __device__ constexpr int StagedSlots(int q, int wc, bool adjoint) {
  return (adjoint ? q + 1 : q) * (q + wc - 1);
}

// The forward: the lines of slopes sigma .. sigma + kG - 1 over the whole
// ring, for column c of the block; out_bh = out + bh B W + w0. The adjoint
// (kAdjoint): the points of columns x1 = sigma .. sigma + kG - 1; out_bh =
// out + bh P W + w0.
//
// The adjoint sums over the lines through a point in increasing direction e,
// starting from zero, as the CPU (TabulateIncidenceBackward) does: e = 0 (the
// line b = x1, one value for a whole column), then e = 1 + m, m = 0 .. q - 1,
// whose line through (x0, x1) is b = x0 + m x1 (e = 1, the point rows, is m =
// 0). The steps m take the place of the forward's rows k. In a frame turned
// by -sigma m at step m (u = sigma m - b) the point (x0, sigma + i) sits at u
// = -x0 - i m: it moves i places to the left per step, as the forward's lines
// do, so the shifts are the forward's. Step m loads row e = 1 + m at b = sigma
// m - u: lane L's lines are the consecutive slots from sigma m - L kWc -
// (kWc - 1) mod q on, in descending p.
template <bool kAdjoint, int kWc, int kV, int kG>
__device__ __forceinline__ void SlopeGroup(const float* __restrict__ tab, int sigma, int sync_row,
                                           const int32_t* __restrict__ flat_to_type,
                                           const int32_t* __restrict__ inverses, int64_t W,
                                           float* __restrict__ out_bh) {
  constexpr int kQ = 7 * kWc + kV;
  const int lane = static_cast<int>(threadIdx.x) & 31, L = lane >> 2, c = lane & 3;
  const bool last = L == 7;
  const int next = (lane + 4) & 31;  // the lane holding the next kWc ring slots

  // Ring slot z = L kWc + p at row k (forward: x1 = z - sigma k) is slot t0 +
  // p of the row, t0 = L kWc - sigma k mod q; at step m (adjoint: b = sigma m
  // - z) slot t0 + kWc - 1 - p, t0 = sigma m - L kWc - (kWc - 1) mod q. t0 is
  // kept in bytes (16 per slot), its wrap taken as an unsigned minimum.
  constexpr unsigned kRowBytes = 16u * (kQ + kWc - 1), kRing = 16u * kQ;
  unsigned t0 = 16u * (kAdjoint ? (kQ - ((L + 1) * kWc - 1) % kQ) % kQ : L * kWc);
  const unsigned dt = 16u * (kAdjoint ? sigma % kQ : (kQ - sigma % kQ) % kQ);
  const char* row = reinterpret_cast<const char*>(tab + c);

  float acc[kG][kWc];
#pragma unroll
  for (int i = 0; i < kG; ++i) {
    // The adjoint's first term, e = 0: line b = x1 = sigma + i.
    const float first = kAdjoint ? *reinterpret_cast<const float*>(row + 16u * (sigma + i)) : 0.f;
#pragma unroll
    for (int p = 0; p < kWc; ++p) acc[i][p] = kAdjoint ? 0.f + first : 0.f;
  }
  if (kAdjoint) row += kRowBytes;  // step m = 0 reads row e = 1

  auto load_row = [&](float(&x)[kWc]) {
    const char* at = row + t0;
#pragma unroll
    for (int p = 0; p < kWc; ++p) {
      x[p] = *reinterpret_cast<const float*>(at + 16 * (kAdjoint ? kWc - 1 - p : p));
    }
    t0 = min(t0 + dt, t0 + dt - kRing);
    row += kRowBytes;
  };

  float x[kWc];
  load_row(x);
#pragma unroll
  for (int p = 0; p < kWc; ++p) {
#pragma unroll
    for (int i = 0; i < kG; ++i) acc[i][p] += x[p];
  }
#pragma unroll 2
  for (int k = 1; k < kQ; ++k) {
    if (k == sync_row) {  // the block's second half of the rows has landed
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      __syncthreads();
    }
    load_row(x);
    // The lines (adjoint: points) of slope sigma + i move i slots left as
    // they take row k's points (step m's lines).
#pragma unroll
    for (int p = 0; p < kWc; ++p) acc[0][p] += x[p];
#pragma unroll
    for (int i = 1; i < kG; ++i) {
      float got[kG];
#pragma unroll
      for (int r = 0; r < i; ++r) got[r] = __shfl_sync(0xffffffffu, acc[i][r], next);
#pragma unroll
      for (int p = 0; p < kWc; ++p) {
        const float moved = p + i < kWc ? acc[i][p + i] : got[p + i - kWc];
        // The last lane's ring part ends at kV: its slots from kV - i on
        // take the ring's first slots, from the first lane.
        acc[i][p] = ((p < kV && p + i >= kV && last) ? got[p + i - kV] : moved) + x[p];
      }
    }
  }

  // After row (step) q - 1, ring slot z holds the line j = z + i (q - 1) = z
  // - i (the point x0 = -z - i (q - 1) = i - z). The forward looks each
  // line's row up in flat_to_type. All of a slope's lookups are issued before
  // its stores, so that the warp waits for one load's latency a slope, not
  // one a line. The last lane's slots from kV on hold no line: they look up
  // slot q - 1 and store nothing.
#pragma unroll
  for (int i = 0; i < kG; ++i) {
    const int s = sigma + i;
    const int m = kAdjoint || s == 0 ? 0 : __ldg(&inverses[s]);
    int row_out[kWc];
#pragma unroll
    for (int p = 0; p < kWc; ++p) {
      const int z = min(L * kWc + p, kQ - 1);
      if (kAdjoint) {
        const int x0 = i - z < 0 ? i - z + kQ : i - z;
        row_out[p] = x0 * kQ + s;
      } else {
        const int j = z - i < 0 ? z - i + kQ : z - i;
        const int e = s == 0 ? 0 : 1 + m;
        const int b = s == 0 ? j : (j * m) % kQ;
        row_out[p] = __ldg(&flat_to_type[e * kQ + b]);
      }
    }
#pragma unroll
    for (int p = 0; p < kWc; ++p) {
      if (L * kWc + p < kQ) out_bh[static_cast<int64_t>(row_out[p]) * W + c] = acc[i][p];
    }
    // The next slope's lookups after these stores, in the registers of this
    // slope's row indices.
    asm volatile("" ::: "memory");
  }
}

// grid (W / kCols, batch_heads), 32 SlopeWarps(q) threads, 16 StagedSlots(q,
// kWc, kAdjoint) bytes of shared memory. W a multiple of 4, in and out
// 16-byte aligned.
template <bool kAdjoint, int kWc, int kV>
__global__ void __launch_bounds__(32 * SlopeWarps(7 * kWc + kV),
                                  SlopeBlocks(StagedSlots(7 * kWc + kV, kWc, kAdjoint)))
    TabulateSlopesKernel(int64_t W, const int32_t* __restrict__ flat_to_type,
                         const int32_t* __restrict__ inverses, const float* __restrict__ in,
                         float* __restrict__ out) {
  constexpr int kQ = 7 * kWc + kV, kP = kQ * kQ, kB = kQ * (kQ + 1);
  constexpr int kIn = kAdjoint ? kB : kP, kOut = kAdjoint ? kP : kB;
  constexpr int kThreads = 32 * SlopeWarps(kQ), kSlotsPerRow = kQ + kWc - 1;
  // Point (x0, x1) at x0 kSlotsPerRow + x1, and for x1 < kWc - 1 at x0
  // kSlotsPerRow + q + x1 as well; the adjoint's line (e, b) at e
  // kSlotsPerRow + b (+ q).
  extern __shared__ float4 tab4[];
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * kCols, bh = blockIdx.y;
  const float* src = in + bh * kIn * W + w0;

  constexpr int kGroups = SlopeTasks(kQ) - 1, kLastG = kQ - kSlopes * (kGroups - 1);
  static_assert(SlopeWarps(kQ) <= kGroups, "every warp's first task is a slope group");
  // Point rows x0 < kHalf (the adjoint: directions e <= kHalf), then the rest,
  // as two groups of asynchronous copies: the sums start on the first half
  // (each slope group's first task waits for the second at row (step) kHalf).
  constexpr int kHalf = kQ / 2, kHalfRows = (kAdjoint ? kHalf + 1 : kHalf) * kQ;
  // The adjoint stages line (e, b) from row flat_to_type[e q + b] of U_bar:
  // each thread looks up kBatch rows before it issues their copies, so that
  // it waits for one lookup's latency a batch (a copy's "memory" clobber
  // keeps the next lookup behind it).
  constexpr int kBatch = kAdjoint ? 8 : 1;
#pragma unroll
  for (int stage = 0; stage < 2; ++stage) {
    const int begin = stage == 0 ? 0 : kHalfRows, end = stage == 0 ? kHalfRows : kIn;
    for (int f0 = begin + static_cast<int>(threadIdx.x); f0 < end; f0 += kBatch * kThreads) {
      int from[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int f = min(f0 + u * kThreads, end - 1);
        from[u] = kAdjoint ? __ldg(&flat_to_type[f]) : f;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int f = f0 + u * kThreads;
        if (f >= end) break;
        const int x0 = f / kQ, x1 = f - x0 * kQ;  // the adjoint: e, b
        const float* from_row = src + static_cast<int64_t>(from[u]) * W;
        const int slot = x0 * kSlotsPerRow + x1;
        const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(&tab4[slot]));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(from_row)
                     : "memory");
        if (x1 < kWc - 1) {  // again at the row's end
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + 16u * kQ),
                       "l"(from_row)
                       : "memory");
        }
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  __syncthreads();

  float* out_bh = out + bh * kOut * W + w0;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  // The adjoint's tasks are its kGroups column groups; the forward's one
  // more, the lines of e = 1.
  constexpr int kTasks = kAdjoint ? kGroups : SlopeTasks(kQ);
  for (int task = warp; task < kTasks; task += SlopeWarps(kQ)) {
    if (task < kGroups) {
      const float* tab = reinterpret_cast<const float*>(tab4);
      const int sync_row = task == warp ? kHalf : -1;
      if (task < kGroups - 1 || kLastG == kSlopes) {
        SlopeGroup<kAdjoint, kWc, kV, kSlopes>(tab, kSlopes * task, sync_row, flat_to_type,
                                               inverses, W, out_bh);
      } else {
        SlopeGroup<kAdjoint, kWc, kV, kLastG>(tab, kSlopes * task, sync_row, flat_to_type, inverses,
                                              W, out_bh);
      }
      continue;
    }
    // The forward's e = 1: line b is point row b, x1 = 0 .. q - 1.
    if constexpr (!kAdjoint) {
      for (int b = lane; b < kQ; b += 32) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        const float4* r = tab4 + b * kSlotsPerRow;
        for (int k = 0; k < kQ; ++k) Add4(acc, r[k]);
        const int h = __ldg(&flat_to_type[kQ + b]);
        *reinterpret_cast<float4*>(out_bh + static_cast<int64_t>(h) * W) = acc;
      }
    }
  }
}

template <bool kAdjoint, int kWc, int kV>
cudaError_t LaunchSlopes(int64_t batch_heads, int64_t W, const int32_t* flat_to_type,
                         const int32_t* inverses, const float* in, float* out,
                         cudaStream_t stream) {
  constexpr int kQ = 7 * kWc + kV;
  static_assert(kV >= kSlopes - 1 && kV <= kWc, "the last lane needs kSlopes - 1 ring slots");
  auto kernel = TabulateSlopesKernel<kAdjoint, kWc, kV>;
  const int smem = static_cast<int>(sizeof(float4)) * StagedSlots(kQ, kWc, kAdjoint);
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(W / kCols), static_cast<unsigned>(batch_heads));
  kernel<<<grid, 32 * SlopeWarps(kQ), smem, stream>>>(W, flat_to_type, inverses, in, out);
  return cudaGetLastError();
}

// The field sizes served: kWc = ceil(q / 8) and kV = q - 7 kWc >= 3 (so that a
// shift of up to three slots reads the last lane's own slots), from q = 31 up
// to 113, the largest whose rows fit in the 227 KB of an H100's or H200's
// shared memory (the adjoint's: 226.2 KB).
#define SMAT_SLOPE_FIELDS(X) \
  X(31, 4, 3)                \
  X(47, 6, 5)                \
  X(53, 7, 4)                \
  X(59, 8, 3)                \
  X(61, 8, 5)                \
  X(67, 9, 4)                \
  X(71, 9, 8)                \
  X(73, 10, 3)               \
  X(79, 10, 9)               \
  X(83, 11, 6)               \
  X(89, 12, 5)               \
  X(97, 13, 6)               \
  X(101, 13, 10)             \
  X(103, 13, 12)             \
  X(107, 14, 9)              \
  X(109, 14, 11)             \
  X(113, 15, 8)

}  // namespace

bool SmatTabulateSlopesServes(int64_t q, bool adjoint) {
  int wc = 0;
  switch (q) {
#define SMAT_SLOPE_CASE(q, c, v) \
  case q:                        \
    wc = c;                      \
    break;
    SMAT_SLOPE_FIELDS(SMAT_SLOPE_CASE)
#undef SMAT_SLOPE_CASE
    default:
      return false;
  }
  int device = 0, smem_limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    return false;
  }
  const int q32 = static_cast<int>(q);
  return static_cast<int64_t>(sizeof(float4)) * StagedSlots(q32, wc, adjoint) <= smem_limit;
}

cudaError_t LaunchSmatTabulateSlopes(int64_t batch_heads, int64_t W, int64_t q,
                                     const int32_t* flat_to_type, const int32_t* inverses,
                                     bool adjoint, const float* in, float* out,
                                     cudaStream_t stream) {
  if (batch_heads == 0 || W == 0) return cudaSuccess;
  switch (q) {
#define SMAT_SLOPE_CASE(q, wc, v)                                                                \
  case q:                                                                                        \
    return adjoint ? LaunchSlopes<true, wc, v>(batch_heads, W, flat_to_type, inverses, in, out,  \
                                               stream)                                           \
                   : LaunchSlopes<false, wc, v>(batch_heads, W, flat_to_type, inverses, in, out, \
                                                stream);
    SMAT_SLOPE_FIELDS(SMAT_SLOPE_CASE)
#undef SMAT_SLOPE_CASE
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace smat
