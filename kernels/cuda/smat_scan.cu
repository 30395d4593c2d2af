// The short sequential phases of CUDA SMat-Attention: the chunk-local log-decay
// prefix (Lemma 4), the chunk offsets used by the grouped phases, the exclusive
// scan over chunks and its adjoint, the exclusive suffix scan (Appendix E), the
// normalisation with its row-local Jacobian, and the gate gradient.
//
// Scans are fp32 and run in a fixed order: over chunks, one thread per state
// element walks the chunks of its block in order (T/c steps); over tokens, each
// thread of a (b, h) block sums a contiguous run and one thread combines the
// runs in order. No atomics anywhere, so results are bitwise repeatable.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/cuda/smat_device.cuh"

namespace smat {
namespace {

using cuda_detail::ChunkRow;
using cuda_detail::kThreads;
using cuda_detail::LoadIn;
using cuda_detail::TokenRow;

// ---- F1 -----------------------------------------------------------------------
// One thread per (b, k, h), consecutive threads on consecutive heads so the
// logg reads of a warp share cache lines.
__global__ void ChunkLogDecayKernel(SmatCudaDims d, const float* __restrict__ logg,
                                    float* __restrict__ lam, float* __restrict__ chunk_decay) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(d.batch) * d.Lc * d.H) return;
  const int h = static_cast<int>(idx % d.H);
  const int64_t k = (idx / d.H) % d.Lc;
  const int b = static_cast<int>(idx / (static_cast<int64_t>(d.H) * d.Lc));
  const int64_t lo = k * d.chunk, hi = min(lo + d.chunk, static_cast<int64_t>(d.L));
  // Double accumulation, as on the CPU: lam sits in an exponent, so its
  // absolute error is the relative error of every weight.
  double acc = 0.0;
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t row = TokenRow(d, b, i, h);
    acc += logg[row];
    lam[row] = static_cast<float>(acc);
  }
  chunk_decay[ChunkRow(d, b, k, h)] = static_cast<float>(acc);
}

// ---- chunk offsets ---------------------------------------------------------------
// One block per (b, h). Distant chunks get the suffix sum over later distant
// chunks of the span, recent chunks the prefix sum over earlier recent chunks.
// Each thread owns a contiguous run of chunks; thread 0 folds the run totals in
// order.
__global__ void ChunkOffsetsKernel(SmatCudaDims d, const float* __restrict__ cd,
                                   float* __restrict__ off) {
  __shared__ double dist_run[kThreads], rec_run[kThreads];
  const int b = blockIdx.x / d.H, h = blockIdx.x % d.H;
  const int64_t first_global = d.t0 / d.chunk;
  const int64_t n_chunks = d.n / d.chunk;  // global chunks before n
  const int64_t run = (d.Lc + kThreads - 1) / kThreads;
  const int64_t lo = min(static_cast<int64_t>(d.Lc), threadIdx.x * run);
  const int64_t hi = min(static_cast<int64_t>(d.Lc), lo + run);
  double ds = 0.0, rs = 0.0;  // exponents: double sums, as on the CPU
  for (int64_t k = lo; k < hi; ++k) {
    const double c = cd[ChunkRow(d, b, k, h)];
    if (first_global + k < n_chunks) ds += c; else rs += c;
  }
  dist_run[threadIdx.x] = ds;
  rec_run[threadIdx.x] = rs;
  __syncthreads();
  if (threadIdx.x == 0) {
    // dist_run[t] <- sum over later runs (exclusive suffix); rec_run[t] <- sum
    // over earlier runs (exclusive prefix).
    double acc = 0.0;
    for (int t = kThreads - 1; t >= 0; --t) {
      const double x = dist_run[t];
      dist_run[t] = acc;
      acc += x;
    }
    acc = 0.0;
    for (int t = 0; t < kThreads; ++t) {
      const double x = rec_run[t];
      rec_run[t] = acc;
      acc += x;
    }
  }
  __syncthreads();
  // Distant: walk the run backwards; recent: forwards.
  double acc = dist_run[threadIdx.x];
  for (int64_t k = hi - 1; k >= lo; --k) {
    if (first_global + k < n_chunks) {
      off[ChunkRow(d, b, k, h)] = static_cast<float>(acc);
      acc += cd[ChunkRow(d, b, k, h)];
    }
  }
  acc = rec_run[threadIdx.x];
  for (int64_t k = lo; k < hi; ++k) {
    if (first_global + k >= n_chunks) {
      off[ChunkRow(d, b, k, h)] = static_cast<float>(acc);
      acc += cd[ChunkRow(d, b, k, h)];
    }
  }
}

// Local chunk range [*k0, *k1) of block blk inside the span.
__device__ __forceinline__ void BlockChunks(const SmatCudaDims& d, int blk, int64_t* k0,
                                            int64_t* k1) {
  const int64_t first_global = d.t0 / d.chunk;
  const int64_t n_chunks = d.n / d.chunk;
  const int64_t split = min(static_cast<int64_t>(d.Lc), cuda_detail::Max64(0, n_chunks - first_global));
  if (blk == 0) {
    *k0 = 0;
    *k1 = split;
  } else {
    *k0 = split;
    *k1 = d.Lc;
  }
}

// The chunks a step of the scans walks: their loads are issued before their
// updates. The loads do not depend on the carried state, and keeping several
// in flight per thread is what lets this one-thread-per-element walk stream.
// H200, T = 524288, 8 heads (17 x 8 blocks of 256 threads per part): with two
// parts of 2048 chunks (d = 2) 16 in flight are best (ChunkScan 0.36 ms,
// ChunkScanBackward 0.33; 0.39 and 0.38 with 8, 0.43 and 0.39 with 32); with
// one part of 4096 chunks and half the blocks (d = 1 as one causal block) 32
// (ChunkScanBackward 0.46 -> 0.40 ms, ChunkScan 0.51 -> 0.44).
constexpr int kScanUnrollTwoParts = 16, kScanUnrollOnePart = 32;

// Whether the span's chunks all lie in one part (BlockChunks' split at 0 or
// at Lc): then half the scans' blocks have nothing to walk.
bool ScanOnePart(const SmatCudaDims& d) {
  const int64_t split =
      std::min<int64_t>(d.Lc, std::max<int64_t>(0, d.n / d.chunk - d.t0 / d.chunk));
  return split == 0 || split == d.Lc;
}

// e[u] = exp(chunk_decay) of chunk k + u (1 past k_end, or ungated), for the
// kScanUnroll chunks a step of the scans walks; kStep -1 walks down (chunk
// k - u, past k_end below it). Lane u computes the u-th and the warp shares
// them, instead of each of the r p threads computing all of them; with `sum`
// the lane also adds its chunk's decay to *sum. All 32 lanes must call it.
template <int kScanUnroll, int kStep = 1>
__device__ __forceinline__ void ScanDecays(const SmatCudaDims& d, const float* __restrict__ cd,
                                           int b, int h, int64_t k, int64_t k_end, int lane,
                                           float (&e)[kScanUnroll], double* sum = nullptr) {
  static_assert(kScanUnroll <= 32, "a lane per chunk of the step");
  float mine = 1.f;
  const int64_t kl = k + kStep * lane;
  const bool ok = kStep > 0 ? kl < k_end : kl >= k_end;
  if (cd != nullptr && lane < kScanUnroll && ok) {
    const float c = cd[ChunkRow(d, b, kl, h)];
    mine = expf(c);
    if (sum != nullptr) *sum += c;
  }
#pragma unroll
  for (int u = 0; u < kScanUnroll; ++u) e[u] = __shfl_sync(0xffffffffu, mine, u);
}

// ---- F3 ---------------------------------------------------------------------------
// grid (ceil(r p / 256), batch * H, 2 blocks). Y carries the state with the
// incoming one, X the span's own part (span_state), both in chunk order.
template <int kScanUnroll>
__global__ void ChunkScanKernel(SmatCudaDims d, const float* __restrict__ D,
                                const float* __restrict__ cd, const float* __restrict__ incoming,
                                float* __restrict__ S_in, float* __restrict__ span_state,
                                float* __restrict__ span_decay) {
  const int64_t W = static_cast<int64_t>(d.r) * d.p;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int b = blockIdx.y / d.H, h = blockIdx.y % d.H, blk = blockIdx.z;
  int64_t k0, k1;
  BlockChunks(d, blk, &k0, &k1);
  const int64_t blk_row = (static_cast<int64_t>(b) * 2 + blk) * d.H + h;
  // The part's total decay: lane u sums the decays of chunks u, u + 32, ...
  // as ScanDecays loads them, then the lanes' sums are added in a fixed
  // order. (One thread walking every chunk first held its block's scan back:
  // gated, d = 1, T = 524288, ChunkScan took 0.70 ms against 0.51 ungated.)
  double decay = 0.0;
  // Threads past the state stay (no early return): the warp shares the decays.
  const bool live = w < W;
  const int lane = threadIdx.x & 31;
  float Y = (live && k0 < k1 && incoming != nullptr) ? incoming[blk_row * W + w] : 0.f;
  float X = 0.f;
  for (int64_t k = k0; k < k1; k += kScanUnroll) {
    float e[kScanUnroll], Dk[kScanUnroll];
#pragma unroll
    for (int u = 0; u < kScanUnroll; ++u) {
      const bool ok = k + u < k1;
      const int64_t row = ChunkRow(d, b, ok ? k + u : k, h);
      Dk[u] = ok && live ? D[row * W + w] : 0.f;
    }
    ScanDecays<kScanUnroll>(d, cd, b, h, k, k1, lane, e, &decay);
    if (!live) continue;
#pragma unroll
    for (int u = 0; u < kScanUnroll; ++u) {
      if (k + u >= k1) break;
      if (S_in != nullptr) S_in[ChunkRow(d, b, k + u, h) * W + w] = Y;
      Y = fmaf(e[u], Y, Dk[u]);
      X = fmaf(e[u], X, Dk[u]);
    }
  }
  if (live) span_state[blk_row * W + w] = X;
  if (w < 32) {
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) decay += __shfl_down_sync(0xffffffffu, decay, off);
    if (w == 0) span_decay[blk_row] = static_cast<float>(decay);
  }
}

// ---- B6 ---------------------------------------------------------------------------
// Sigma[k] = S_in_bar[k] + exp(cd[k]) Sigma[k+1], D_bar[k] = Sigma[k+1], walked
// from the last chunk of the block's part down.
template <int kScanUnroll>
__global__ void ChunkScanBackwardKernel(SmatCudaDims d, const float* __restrict__ S_in_bar,
                                        const float* __restrict__ cd,
                                        const float* __restrict__ incoming_grad,
                                        float* __restrict__ D_bar,
                                        float* __restrict__ span_state_grad) {
  const int64_t W = static_cast<int64_t>(d.r) * d.p;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool live = w < W;  // as in ChunkScanKernel: the warp shares the decays
  const int lane = threadIdx.x & 31;
  const int b = blockIdx.y / d.H, h = blockIdx.y % d.H, blk = blockIdx.z;
  int64_t k0, k1;
  BlockChunks(d, blk, &k0, &k1);
  const int64_t blk_row = (static_cast<int64_t>(b) * 2 + blk) * d.H + h;
  float Y = (live && k0 < k1 && incoming_grad != nullptr) ? incoming_grad[blk_row * W + w] : 0.f;
  float X = 0.f;                                              // the span's own part
  for (int64_t k = k1 - 1; k >= k0; k -= kScanUnroll) {
    float e[kScanUnroll], g[kScanUnroll];
#pragma unroll
    for (int u = 0; u < kScanUnroll; ++u) {
      const bool ok = k - u >= k0;
      const int64_t row = ChunkRow(d, b, ok ? k - u : k, h);
      g[u] = ok && live ? S_in_bar[row * W + w] : 0.f;
    }
    ScanDecays<kScanUnroll, -1>(d, cd, b, h, k, k0, lane, e);
    if (!live) continue;
#pragma unroll
    for (int u = 0; u < kScanUnroll; ++u) {
      if (k - u < k0) break;
      D_bar[ChunkRow(d, b, k - u, h) * W + w] = Y;
      Y = fmaf(e[u], Y, g[u]);
      X = fmaf(e[u], X, g[u]);
    }
  }
  if (live) span_state_grad[blk_row * W + w] = X;
}

// ---- F8 ---------------------------------------------------------------------------
// One block per kNormRows rows; a thread writes kV consecutive outputs of a
// row (kV = 2: pairs, dv even). Indices are 32-bit inside the tile.
constexpr int kNormRows = 64;

// kReads: the rows of recent tokens (local index >= recent_begin) divide
// ybar + reads, as the three phases of F6-F8 would. o = ybar * (1 / den), one
// reciprocal per row: the fused outputs kernel (smat_chunk_fwd_mma.cu)
// computes o the same way, bit for bit.
template <int kV, bool kReads>
__global__ void NormalizeKernel(SmatCudaDims d, int64_t rows_total, const float* __restrict__ ybar,
                                float eps, void* __restrict__ o, bool o_bf16,
                                float* __restrict__ den, const float* __restrict__ reads,
                                int64_t recent_begin) {
  __shared__ bool recent[kNormRows];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kNormRows;
  const int rows = static_cast<int>(cuda_detail::Min64(kNormRows, rows_total - row0));
  const int p = d.p, dv = d.dv;
  const float* y = ybar + row0 * p;
  const float* x = kReads ? reads + row0 * p : nullptr;
  if (kReads) {
    for (int row = threadIdx.x; row < rows; row += blockDim.x) {
      recent[row] = ((row0 + row) / d.H) % d.L >= recent_begin;
    }
    __syncthreads();
  }
  // Element j of the tile's row `row`, with its read where it has one.
  auto at = [&](int row, int j) {
    const float a = y[row * p + j];
    if (!kReads || !recent[row]) return a;
    return a + x[row * p + j];
  };
  const int64_t o0 = row0 * dv;
  for (int e = threadIdx.x * kV; e < rows * dv; e += blockDim.x * kV) {
    const int row = e / dv, j = e - row * dv;
    const float inv = 1.f / (at(row, dv) + eps);
    float val[kV];
#pragma unroll
    for (int u = 0; u < kV; ++u) val[u] = __fmul_rn(at(row, j + u), inv);
    if constexpr (kV == 2) {
      if (o_bf16) {
        reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(o) + o0)[e >> 1] =
            __floats2bfloat162_rn(val[0], val[1]);
      } else {
        reinterpret_cast<float2*>(static_cast<float*>(o) + o0)[e >> 1] =
            make_float2(val[0], val[1]);
      }
    } else if (o_bf16) {
      static_cast<__nv_bfloat16*>(o)[o0 + e] = __float2bfloat16(val[0]);
    } else {
      static_cast<float*>(o)[o0 + e] = val[0];
    }
  }
  for (int row = threadIdx.x; row < rows; row += blockDim.x) den[row0 + row] = at(row, dv) + eps;
}

// ---- B1 ---------------------------------------------------------------------------
// One warp per row; the dot product do . o is a fixed shuffle tree.
__global__ void NormalizeBackwardKernel(SmatCudaDims d, const void* __restrict__ d_o,
                                        bool do_bf16, const void* __restrict__ o, bool o_bf16,
                                        const float* __restrict__ den, float eps,
                                        float* __restrict__ gbar, float* __restrict__ dlam_row) {
  const int64_t rows = static_cast<int64_t>(d.batch) * d.L * d.H;
  const int lane = threadIdx.x & 31;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (row >= rows) return;
  const float dn = den[row];
  float dot = 0.f;
  for (int j = lane; j < d.dv; j += 32) {
    const float g = LoadIn(d_o, row * d.dv + j, do_bf16);
    dot = fmaf(g, LoadIn(o, row * d.dv + j, o_bf16), dot);
    gbar[row * d.p + j] = g / dn;
  }
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, s);
  if (lane == 0) {
    gbar[row * d.p + d.dv] = -dot / dn;
    if (dlam_row != nullptr) dlam_row[row] = eps * dot / dn;
  }
}

// The same for dv <= kNormTileDv, dv even, d_o and o paired (4- or 8-byte
// aligned): one block per kNormRows rows. d_o and o are read as pairs in row
// order (all of a thread's loads issue before the first use), gbar is formed
// in shared memory and leaves as whole 16-byte pieces of its contiguous tile
// (rows of p = dv + 1 floats, which per-row stores write misaligned), and each
// row's dot product is summed by one warp in a fixed order (pair products,
// then lanes by xor steps).
constexpr int kNormTileDv = 64;

__device__ __forceinline__ float2 LoadPair(const void* p, int64_t pair, bool bf16) {
  if (bf16) return __bfloat1622float2(static_cast<const __nv_bfloat162*>(p)[pair]);
  return static_cast<const float2*>(p)[pair];
}

__global__ void __launch_bounds__(kThreads)
    NormalizeBackwardTileKernel(SmatCudaDims d, int64_t rows_total, const void* __restrict__ d_o,
                                bool do_bf16, const void* __restrict__ o, bool o_bf16,
                                const float* __restrict__ den, float eps,
                                float* __restrict__ gbar, float* __restrict__ dlam_row) {
  __shared__ float4 tile4[(kNormRows * (kNormTileDv + 1) + 3) / 4];
  __shared__ float prod[kNormRows][kNormTileDv / 2];
  __shared__ float dns[kNormRows];
  float* tile = reinterpret_cast<float*>(tile4);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kNormRows;
  const int rows = static_cast<int>(cuda_detail::Min64(kNormRows, rows_total - row0));
  const int dv = d.dv, p = d.p, half = dv / 2, pairs = rows * half;
  const int tid = threadIdx.x;
  if (tid < rows) dns[tid] = den[row0 + tid];
  const int64_t pair0 = row0 * half;
  constexpr int kPer = kNormRows * (kNormTileDv / 2) / kThreads;  // pairs per thread
  float2 g[kPer], y[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int e = tid + u * kThreads;
    const int64_t at = pair0 + (e < pairs ? e : 0);
    g[u] = LoadPair(d_o, at, do_bf16);
    y[u] = LoadPair(o, at, o_bf16);
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int e = tid + u * kThreads;
    if (e >= pairs) continue;
    const int row = e / half, jp = e - row * half;
    const float dn = dns[row];
    tile[row * p + 2 * jp] = g[u].x / dn;
    tile[row * p + 2 * jp + 1] = g[u].y / dn;
    prod[row][jp] = fmaf(g[u].y, y[u].y, g[u].x * y[u].x);
  }
  __syncthreads();
  const int lane = tid & 31;
  for (int row = tid >> 5; row < rows; row += kThreads / 32) {
    float dot = lane < half ? prod[row][lane] : 0.f;
#pragma unroll
    for (int sh = 16; sh > 0; sh >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, sh);
    if (lane == 0) {
      const float dn = dns[row];
      tile[row * p + dv] = -dot / dn;
      if (dlam_row != nullptr) dlam_row[row0 + row] = eps * dot / dn;
    }
  }
  __syncthreads();
  float* out = gbar + row0 * p;
  const int n = rows * p;
  if ((reinterpret_cast<uintptr_t>(out) & 15) == 0) {
    for (int i = tid; i < n / 4; i += kThreads) reinterpret_cast<float4*>(out)[i] = tile4[i];
    for (int i = (n / 4) * 4 + tid; i < n; i += kThreads) out[i] = tile[i];
  } else {
    for (int i = tid; i < n; i += kThreads) out[i] = tile[i];
  }
}

// ---- B8 ---------------------------------------------------------------------------
// dlam_t = dlam_row_t - psi_t . psi_bar_t, one warp per row.
__global__ void GateRowGradKernel(SmatCudaDims d, const void* __restrict__ psi,
                                  const float* __restrict__ psi_bar,
                                  const float* __restrict__ dlam_row, float* __restrict__ dlam) {
  const int64_t rows = static_cast<int64_t>(d.batch) * d.L * d.H;
  const int lane = threadIdx.x & 31;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (row >= rows) return;
  float dot = 0.f;
  for (int i = lane; i < d.r; i += 32)
    dot = fmaf(LoadIn(psi, row * d.r + i, d.bf16), psi_bar[row * d.r + i], dot);
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, s);
  if (lane == 0) dlam[row] = dlam_row[row] - dot;
}

// The same for r = 8, 16, 32 or 64 and 16-byte aligned rows: the rows of all
// tokens and heads are contiguous, so r / 8 threads share a row, each with 8
// elements (one 16-byte load of bf16 psi, or two of fp32, and two of psi_bar),
// and a warp's loads cover 32 / (r / 8) whole rows. A thread sums its 8
// products in order, the row's threads combine by xor steps; kGateRowSteps rows
// per thread have their loads in flight together. H200, bf16, T = 524288,
// 8 heads, r = 64, with the suffix sums (LogDecayBackward): 0.55 ms, against
// 0.92 ms one warp per row.
constexpr int kGateRowSteps = 4;

template <bool kBf16>
__global__ void __launch_bounds__(kThreads)
    GateRowGradTileKernel(int64_t rows, int r, const void* __restrict__ psi,
                          const float* __restrict__ psi_bar, const float* __restrict__ dlam_row,
                          float* __restrict__ dlam) {
  const int per_row = r >> 3;  // threads of a row: 1, 2, 4 or 8
  const int rows_per_step = kThreads / per_row;
  const int tid = threadIdx.x, part = tid & (per_row - 1);
  const int64_t row0 =
      static_cast<int64_t>(blockIdx.x) * rows_per_step * kGateRowSteps + tid / per_row;
  float x[kGateRowSteps][8], y[kGateRowSteps][8];
#pragma unroll
  for (int u = 0; u < kGateRowSteps; ++u) {
    const int64_t row = row0 + static_cast<int64_t>(u) * rows_per_step;
    const int64_t at = (row < rows ? row : 0) * r + 8 * part;  // element offset
    if constexpr (kBf16) {
      const uint4 q = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(psi) + at);
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        x[u][2 * i] = f.x;
        x[u][2 * i + 1] = f.y;
      }
    } else {
      const float4* f = reinterpret_cast<const float4*>(static_cast<const float*>(psi) + at);
      const float4 a = f[0], b = f[1];
      x[u][0] = a.x, x[u][1] = a.y, x[u][2] = a.z, x[u][3] = a.w;
      x[u][4] = b.x, x[u][5] = b.y, x[u][6] = b.z, x[u][7] = b.w;
    }
    const float4* g = reinterpret_cast<const float4*>(psi_bar + at);
    const float4 a = g[0], b = g[1];
    y[u][0] = a.x, y[u][1] = a.y, y[u][2] = a.z, y[u][3] = a.w;
    y[u][4] = b.x, y[u][5] = b.y, y[u][6] = b.z, y[u][7] = b.w;
  }
#pragma unroll
  for (int u = 0; u < kGateRowSteps; ++u) {
    const int64_t row = row0 + static_cast<int64_t>(u) * rows_per_step;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) dot = fmaf(x[u][i], y[u][i], dot);
    for (int s = per_row >> 1; s > 0; s >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, s);
    if (part == 0 && row < rows) dlam[row] = dlam_row[row] - dot;
  }
}

// logg_bar[i] = suffix_in + sum_{j >= i} dlam[j] within the span, in segments
// of kSuffixSeg tokens, a block per (segment, b * h): kPass 0 writes each
// segment's total; kPass 1 adds the totals of the later segments (last first)
// as the segment's carry and writes its suffix sums. Inside a segment thread t
// sums tokens [kSuffixPer t, kSuffixPer (t + 1)) last first, and thread 0 folds
// the threads' sums last first; every sum has that one order, so the same
// inputs give the same bits. The block of segment 0 writes span_sum. (One block
// per (b, h) walking the whole span took 1.9 ms at T = 524288 with 8 heads.)
constexpr int kSuffixPer = 8;
constexpr int kSuffixSeg = kSuffixPer * kThreads;

int64_t SuffixSegments(const SmatCudaDims& d) { return (d.L + kSuffixSeg - 1) / kSuffixSeg; }

template <int kPass>
__global__ void __launch_bounds__(kThreads)
    SuffixSumKernel(SmatCudaDims d, const float* __restrict__ dlam,
                    const float* __restrict__ suffix_in, float* __restrict__ seg_total,
                    float* __restrict__ logg_bar, float* __restrict__ span_sum) {
  __shared__ float runs[kThreads];
  const int bh = blockIdx.y, b = bh / d.H, h = bh % d.H;
  const int64_t nseg = gridDim.x, seg = blockIdx.x;
  const int64_t lo = cuda_detail::Min64(d.L, seg * kSuffixSeg + threadIdx.x * kSuffixPer);
  const int64_t hi = cuda_detail::Min64(d.L, lo + kSuffixPer);
  float x[kSuffixPer];
#pragma unroll
  for (int u = 0; u < kSuffixPer; ++u) x[u] = lo + u < hi ? dlam[TokenRow(d, b, lo + u, h)] : 0.f;
  float s = 0.f;
#pragma unroll
  for (int u = kSuffixPer - 1; u >= 0; --u) s += x[u];
  runs[threadIdx.x] = s;
  __syncthreads();
  float* totals = seg_total + static_cast<int64_t>(bh) * nseg;
  if (threadIdx.x == 0) {
    float carry = 0.f;
    if (kPass == 1) {
      for (int64_t k = nseg - 1; k > seg; --k) carry += totals[k];
    }
    float acc = carry;
    for (int t = kThreads - 1; t >= 0; --t) {
      const float y = runs[t];
      runs[t] = acc;
      acc += y;
    }
    if (kPass == 0) totals[seg] = acc;
    if (kPass == 1 && seg == 0) span_sum[bh] = acc;
  }
  if (kPass == 0) return;
  __syncthreads();
  const float base = suffix_in != nullptr ? suffix_in[bh] : 0.f;
  float acc = runs[threadIdx.x];
#pragma unroll
  for (int u = kSuffixPer - 1; u >= 0; --u) {
    if (lo + u >= hi) continue;
    acc += x[u];
    logg_bar[TokenRow(d, b, lo + u, h)] = base + acc;
  }
}

int GridFor(int64_t n, int threads) { return static_cast<int>((n + threads - 1) / threads); }

}  // namespace

cudaError_t LaunchSmatChunkLogDecay(const SmatCudaDims& d, const float* logg, float* lam,
                                    float* chunk_decay, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(d.batch) * d.Lc * d.H;
  if (n == 0) return cudaSuccess;
  ChunkLogDecayKernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(d, logg, lam, chunk_decay);
  return cudaGetLastError();
}

cudaError_t LaunchSmatChunkOffsets(const SmatCudaDims& d, const float* chunk_decay, float* off,
                                   cudaStream_t stream) {
  ChunkOffsetsKernel<<<d.batch * d.H, kThreads, 0, stream>>>(d, chunk_decay, off);
  return cudaGetLastError();
}

cudaError_t LaunchSmatChunkScan(const SmatCudaDims& d, const float* D, const float* chunk_decay,
                                const float* incoming, float* S_in, float* span_state,
                                float* span_decay, cudaStream_t stream) {
  const dim3 grid(GridFor(static_cast<int64_t>(d.r) * d.p, kThreads), d.batch * d.H, 2);
  auto kernel =
      ScanOnePart(d) ? ChunkScanKernel<kScanUnrollOnePart> : ChunkScanKernel<kScanUnrollTwoParts>;
  kernel<<<grid, kThreads, 0, stream>>>(d, D, chunk_decay, incoming, S_in, span_state, span_decay);
  return cudaGetLastError();
}

cudaError_t LaunchSmatChunkScanBackward(const SmatCudaDims& d, const float* S_in_bar,
                                        const float* chunk_decay, const float* incoming_grad,
                                        float* D_bar, float* span_state_grad,
                                        cudaStream_t stream) {
  const dim3 grid(GridFor(static_cast<int64_t>(d.r) * d.p, kThreads), d.batch * d.H, 2);
  auto kernel = ScanOnePart(d) ? ChunkScanBackwardKernel<kScanUnrollOnePart>
                               : ChunkScanBackwardKernel<kScanUnrollTwoParts>;
  kernel<<<grid, kThreads, 0, stream>>>(d, S_in_bar, chunk_decay, incoming_grad, D_bar,
                                        span_state_grad);
  return cudaGetLastError();
}

cudaError_t LaunchSmatNormalize(const SmatCudaDims& d, const float* ybar, float eps, void* o,
                                bool o_bf16, float* den, const float* reads, int64_t recent_begin,
                                cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(d.batch) * d.L * d.H;
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows + kNormRows - 1) / kNormRows;
  auto kernel = d.dv % 2 == 0
                    ? (reads != nullptr ? NormalizeKernel<2, true> : NormalizeKernel<2, false>)
                    : (reads != nullptr ? NormalizeKernel<1, true> : NormalizeKernel<1, false>);
  kernel<<<blocks, kThreads, 0, stream>>>(d, rows, ybar, eps, o, o_bf16, den, reads, recent_begin);
  return cudaGetLastError();
}

cudaError_t LaunchSmatNormalizeBackward(const SmatCudaDims& d, const void* d_o, bool do_bf16,
                                        const void* o, bool o_bf16, const float* den, float eps,
                                        float* gbar, float* dlam_row, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(d.batch) * d.L * d.H;
  if (rows == 0) return cudaSuccess;
  auto aligned = [](const void* ptr, bool bf16) {
    return (reinterpret_cast<uintptr_t>(ptr) & (bf16 ? 3 : 7)) == 0;
  };
  if (d.dv % 2 == 0 && d.dv <= kNormTileDv && aligned(d_o, do_bf16) && aligned(o, o_bf16)) {
    // H200, T = 524288, 8 heads, dv = 64, fp32 d_o, bf16 o: see docs/PERFORMANCE.md.
    const int64_t blocks = (rows + kNormRows - 1) / kNormRows;
    NormalizeBackwardTileKernel<<<blocks, kThreads, 0, stream>>>(d, rows, d_o, do_bf16, o, o_bf16,
                                                                 den, eps, gbar, dlam_row);
    return cudaGetLastError();
  }
  NormalizeBackwardKernel<<<GridFor(rows * 32, kThreads), kThreads, 0, stream>>>(
      d, d_o, do_bf16, o, o_bf16, den, eps, gbar, dlam_row);
  return cudaGetLastError();
}

int64_t SmatLogDecayBackwardScratch(const SmatCudaDims& d) {
  return static_cast<int64_t>(d.batch) * d.H * (d.L + SuffixSegments(d));
}

cudaError_t LaunchSmatLogDecayBackward(const SmatCudaDims& d, const void* psi,
                                       const float* psi_bar, const float* dlam_row,
                                       const float* suffix_in, float* dlam, float* logg_bar,
                                       float* span_sum, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(d.batch) * d.L * d.H;
  if (rows == 0) return cudaSuccess;
  const bool tile = (d.r == 8 || d.r == 16 || d.r == 32 || d.r == 64) &&
                    (reinterpret_cast<uintptr_t>(psi) & 15) == 0 &&
                    (reinterpret_cast<uintptr_t>(psi_bar) & 15) == 0;
  if (tile) {
    const int64_t rows_per_block = static_cast<int64_t>(kThreads / (d.r / 8)) * kGateRowSteps;
    const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
    auto kernel = d.bf16 ? GateRowGradTileKernel<true> : GateRowGradTileKernel<false>;
    kernel<<<blocks, kThreads, 0, stream>>>(rows, d.r, psi, psi_bar, dlam_row, dlam);
  } else {
    GateRowGradKernel<<<GridFor(rows * 32, kThreads), kThreads, 0, stream>>>(d, psi, psi_bar,
                                                                             dlam_row, dlam);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  // The segment totals after dLambda in the scratch (SmatLogDecayBackwardScratch).
  float* totals = dlam + static_cast<int64_t>(d.batch) * d.L * d.H;
  const dim3 grid(static_cast<unsigned>(SuffixSegments(d)), static_cast<unsigned>(d.batch * d.H));
  SuffixSumKernel<0><<<grid, kThreads, 0, stream>>>(d, dlam, suffix_in, totals, logg_bar,
                                                    span_sum);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  SuffixSumKernel<1><<<grid, kThreads, 0, stream>>>(d, dlam, suffix_in, totals, logg_bar,
                                                    span_sum);
  return cudaGetLastError();
}

}  // namespace smat
