// The fast path of the CUDA SMat-Attention tiles (c <= 128 tokens, r and
// dv <= 64): the chunk-local tiles F6 (eq. 10 gated by Lemma 4) and their
// adjoint B7 (eq. 19 of Appendix E) with one block of 256 threads per
// (chunk, b * H) and the whole chunk staged once in shared memory; and, with
// the same staging and product code, the grouped outer sums (F2, profile
// pooling, B5, the type-table gradient) and per-token reads (F7, B2, B4), 128
// tokens of a group at a time. smat_chunk.cu and smat_grouped.cu hold the
// general kernels (any c, r, dv) and pick this path when the sizes fit; the
// chunk tiles run on tensor cores (smat_chunk_mma.cu) where
// SmatUseMmaChunkTiles says so (SMAT_CUDA_CHUNK_TILES=ffma: the FFMA tiles
// below, "mma": tensor cores for every chunk tile).
//
// Every tile here has the same shape, so one kernel template serves all four:
//   X[row][col] = gate * (P[:, row] . Q[:, col]), masked to s <= t   (score)
//   side[m][n]  = sum_i Q[i][m] F[i][n]                              (chunk state)
//   main[m][n]  = sum_k X[k][m] R[k][n]                              (tile product)
//   out[m][n]  (+)= main[m][n] + w[m] side[m][n]
// with (t = query token, s = key token, K1 = r or p):
//   kind      P [K1][c]  Q [K1][c]  X       F [K1][64]  R [c][64]   out
//   forward   psi^T      phi^T      A^T     S_in        v           ybar (= ; col dv = den)
//   query     vbar^T     gbar^T     G^T     S_in^T      psi         phi_bar (+=)
//   key psi   gbar^T     vbar^T     G       D_bar^T     phi         psi_bar (+=)
//   key v     phi^T      psi^T      A       D_bar       gbar[:dv]   v_bar (+=)
// so the score tile is computed directly in the k-major orientation the tile
// product reads, and the only transposes happen once, while staging.
//
// Speed: tiles are staged with 16-byte loads where rows allow it and with no
// division per element; every product is a register-blocked fp32 FFMA loop
// whose operands are 16-byte shared-memory loads (a thread owns 8 rows x 4 or
// 8 columns; the row operand is a broadcast), the causal half of the score
// tile and of the tile product is skipped per warp, and the score tile reuses
// the staging buffers of P and Q. Exactness: fp32 FFMA throughout (no TF32, no
// bf16 rounding of fp32 operands), each output element summed in a fixed
// order, no atomics: fp32 inputs stay within 1e-5 of the CPU phases and every
// run gives the same bits.
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/smat_device.cuh"

namespace smat {
namespace {

using cuda_detail::ChunkRow;
using cuda_detail::TokenRow;

constexpr int kThreads = 256;
constexpr int kC = 128;      // chunk tokens held (rows of every token tile)
constexpr int kW = 64;       // widest r or dv
constexpr int kK1 = kW + 1;  // widest inner size of a score tile: p = dv + 1
constexpr int kLdF = 68;     // F rows: 16-byte aligned, 4-way conflicts when staged transposed

// Shared memory (floats): P and Q [kK1][kC] each (X [kC][kC] overlays them
// once the score tile is in registers), R [kC][kW], F [kK1][kLdF], then lam,
// w, two [2][kC] partial-sum arrays and the state column of the forward den.
constexpr int kOffQ = kK1 * kC;
constexpr int kOffR = 2 * kK1 * kC;
constexpr int kOffF = kOffR + kC * kW;
constexpr int kOffLam = kOffF + kK1 * kLdF;
constexpr int kOffW = kOffLam + kC;
constexpr int kOffPart = kOffW + kC;
constexpr int kOffPart2 = kOffPart + 2 * kC;
constexpr int kOffScol = kOffPart2 + 2 * kC;
constexpr int kSmemFloats = kOffScol + kW;
static_assert(kC * kC <= 2 * kK1 * kC, "the score tile must fit over P and Q");

enum class Kind { kForward, kQuery, kKeyPsi, kKeyV };

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }

// 16 bytes of a row: 4 floats or 8 bf16, widened exactly to fp32.
__device__ __forceinline__ void LoadVec(const float* src, float (&o)[4]) {
  const float4 x = __ldg(reinterpret_cast<const float4*>(src));
  o[0] = x.x;
  o[1] = x.y;
  o[2] = x.z;
  o[3] = x.w;
}
__device__ __forceinline__ void LoadVec(const __nv_bfloat16* src, float (&o)[8]) {
  const uint4 x = __ldg(reinterpret_cast<const uint4*>(src));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    o[2 * i] = f.x;
    o[2 * i + 1] = f.y;
  }
}

// Token rows of one (chunk, b, h): element (t, j) at base[t * stride + j].
template <typename T>
struct TokenTile {
  using Elem = T;
  const T* base;
  int64_t stride;
  int width;
  __device__ const T* Row(int t) const { return base + t * stride; }
};

// Rows of a token list: element (t, j) at src[rows[t] * width + j].
template <typename T>
struct ListedRows {
  using Elem = T;
  const T* src;
  const int64_t* rows;  // shared memory
  int width;
  __device__ const T* Row(int t) const { return src + rows[t] * width; }
};

template <typename T>
__device__ __forceinline__ TokenTile<T> Tile(const SmatCudaDims& d, const T* src, int width, int b,
                                             int h, int64_t c0) {
  return {src + TokenRow(d, b, c0, h) * width, static_cast<int64_t>(d.H) * width, width};
}

// Staging loops issue a batch of kBatch independent global loads per thread
// before the first shared-memory store, so the tile arrives in a few memory
// latencies rather than one per element.
constexpr int kBatch = 8;

// dst[i][t] (ld kC) = src[t][i] for i < width, 1 in row `width` when
// K1 > width (the ones of vbar), 0 for t >= ce. Threads walk t fastest, so the
// shared-memory stores of a warp hit 32 different banks.
template <typename T>
__device__ void StageTransposed(const TokenTile<T>& src, int ce, int K1, bool vec, float* dst) {
  constexpr int V = 16 / sizeof(T);
  if (vec) {
    const int total = kC * (src.width / V);
    for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * 4) {
      float x[4][V];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = e0 + u * kThreads, t = e & (kC - 1), q = e >> 7;
        if (e < total && t < ce) {
          LoadVec(src.base + t * src.stride + q * V, x[u]);
        } else {
#pragma unroll
          for (int z = 0; z < V; ++z) x[u][z] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = e0 + u * kThreads, t = e & (kC - 1), q = e >> 7;
        if (e < total) {
#pragma unroll
          for (int z = 0; z < V; ++z) dst[(q * V + z) * kC + t] = x[u][z];
        }
      }
    }
  } else {
    const int total = kC * src.width;
    for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * kBatch) {
      float x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e & (kC - 1), i = e >> 7;
        x[u] = e < total && t < ce ? ToF(__ldg(&src.base[t * src.stride + i])) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads;
        if (e < total) dst[e] = x[u];  // e = i * kC + t
      }
    }
  }
  for (int e = threadIdx.x; e < kC * (K1 - src.width); e += kThreads) {
    const int t = e & (kC - 1), i = src.width + (e >> 7);
    dst[i * kC + t] = t < ce && i == src.width ? 1.f : 0.f;
  }
}

// dst[t][j] (leading dim ld, a multiple of 4) = scale[t] * src[t][j] for
// t < ce, j < ncols (scale null: 1); then 1 in column ones_col (>= 0) and 0 up
// to column `cols`. Rows >= ce are not written (never read). `vec` requires
// ncols == width.
template <class Src>
__device__ void StageRows(const Src& src, int ce, int ncols, bool vec, float* dst, int ld = kW,
                          int cols = kW, int ones_col = -1, const float* scale = nullptr) {
  constexpr int V = 16 / sizeof(typename Src::Elem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int done = ncols;  // columns written by the loads below
  if (vec) {
    const int nq = ncols / V, total = ce * nq;
    const bool pow2 = (nq & (nq - 1)) == 0;  // shift and mask, no division
    const int lq = __ffs(nq) - 1;
    for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * 4) {
      float x[4][V];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = e0 + u * kThreads;
        const int t = pow2 ? e >> lq : e / nq, q = pow2 ? e & (nq - 1) : e % nq;
        if (e < total) LoadVec(src.Row(t) + q * V, x[u]);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = e0 + u * kThreads;
        const int t = pow2 ? e >> lq : e / nq, q = pow2 ? e & (nq - 1) : e % nq;
        if (e < total) {
          const float sc = scale != nullptr ? scale[t] : 1.f;
#pragma unroll
          for (int z = 0; z < V; z += 4)
            *reinterpret_cast<float4*>(&dst[t * ld + q * V + z]) =
                make_float4(sc * x[u][z], sc * x[u][z + 1], sc * x[u][z + 2], sc * x[u][z + 3]);
        }
      }
    }
  } else {
    // A warp per row, lanes along the row: coalesced loads, conflict-free stores.
    for (int t0 = warp; t0 < ce; t0 += kThreads / 32 * 4) {
      float x[4][3];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int z = 0; z < 3; ++z) {
          const int t = t0 + u * (kThreads / 32), j = lane + 32 * z;
          x[u][z] = t < ce && j < ncols ? ToF(__ldg(src.Row(t) + j)) : 0.f;
        }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int z = 0; z < 3; ++z) {
          const int t = t0 + u * (kThreads / 32), j = lane + 32 * z;
          if (t < ce && j < cols) {
            const float sc = scale != nullptr ? scale[t] : 1.f;
            dst[t * ld + j] = j < ncols ? sc * x[u][z] : (j == ones_col ? 1.f : 0.f);
          }
        }
    }
    done = cols;
  }
  for (int t = warp; t < ce; t += kThreads / 32)
    for (int j = done + lane; j < cols; j += 32) dst[t * ld + j] = j == ones_col ? 1.f : 0.f;
}

// F from the chunk's r x p fp32 matrix M: transposed, F[i][n] = M[n][i]
// (i < p, n < r); else F[i][n] = M[i][n] (i < r, n < ncols). Zero elsewhere.
__device__ void StageChunkMatrix(const float* M, int r, int p, int ncols, bool transposed,
                                 float* F) {
  if (transposed) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int n0 = warp; n0 < kW; n0 += kThreads / 32 * 4) {
      float x[4][3];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int z = 0; z < 3; ++z) {
          const int n = n0 + u * (kThreads / 32), i = lane + 32 * z;
          x[u][z] = n < r && i < p ? __ldg(&M[n * p + i]) : 0.f;
        }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int z = 0; z < 3; ++z) {
          const int n = n0 + u * (kThreads / 32), i = lane + 32 * z;
          if (i < kK1) F[i * kLdF + n] = x[u][z];
        }
    }
  } else {
    for (int e0 = threadIdx.x; e0 < kW * kW; e0 += kThreads * kBatch) {
      float x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, i = e >> 6, n = e & (kW - 1);
        x[u] = i < r && n < ncols ? __ldg(&M[i * p + n]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, i = e >> 6, n = e & (kW - 1);
        F[i * kLdF + n] = x[u];
      }
    }
  }
}

// acc[i][4 h + j] += sum_{k in [k0, k1)} A[k][m0 + i] B[k][n0 + 64 h + j] for the
// column halves h with (kLo, kHi) set; A, B k-major with leading dims lda, ldb.
template <bool kLo, bool kHi, int kN>
__device__ __forceinline__ void Gemm(float (&acc)[8][kN], const float* A, int lda, int m0,
                                     const float* B, int ldb, int n0, int k0, int k1) {
#pragma unroll 4
  for (int k = k0; k < k1; ++k) {
    const float4 a0 = *reinterpret_cast<const float4*>(&A[k * lda + m0]);
    const float4 a1 = *reinterpret_cast<const float4*>(&A[k * lda + m0 + 4]);
    const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
    for (int h = 0; h < kN / 4; ++h) {
      if ((h == 0 && !kLo) || (h == 1 && !kHi)) continue;
      const float4 b = *reinterpret_cast<const float4*>(&B[k * ldb + n0 + 64 * h]);
      const float bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][4 * h + j] = fmaf(av[i], bv[j], acc[i][4 * h + j]);
    }
  }
}

template <int kN>
__device__ __forceinline__ void Zero(float (&acc)[8][kN]) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < kN; ++j) acc[i][j] = 0.f;
}

// grid (Lc, batch * H), 256 threads, kSmemFloats floats of shared memory.
// vec_in: phi, psi, v rows can be read 16 bytes at a time.
template <Kind kKind, typename In>
__global__ void __launch_bounds__(kThreads, 1)
    ChunkTileKernel(SmatCudaDims d, bool vec_in, const In* __restrict__ phi,
                    const In* __restrict__ psi, const In* __restrict__ v,
                    const float* __restrict__ gbar, const float* __restrict__ lam,
                    const float* __restrict__ cd, const float* __restrict__ M,
                    float* __restrict__ out) {
  constexpr bool kRowsAreKeys = kKind == Kind::kForward || kKind == Kind::kQuery;
  constexpr bool kScoresGv = kKind == Kind::kQuery || kKind == Kind::kKeyPsi;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  float* P = sm;
  float* Q = sm + kOffQ;
  float* X = sm;  // over P and Q once they are no longer read
  float* R = sm + kOffR;
  float* F = sm + kOffF;
  float* lam_t = sm + kOffLam;
  float* w = sm + kOffW;
  float* part = sm + kOffPart;
  float* part2 = sm + kOffPart2;
  float* scol = sm + kOffScol;

  const int tid = threadIdx.x;
  const int64_t k = blockIdx.x;
  const int b = blockIdx.y / d.H, h = blockIdx.y % d.H;
  const int64_t c0 = k * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));  // tokens held
  const int r = d.r, dv = d.dv, p = d.p;
  const int K1 = kScoresGv ? p : r;
  const int64_t crow = ChunkRow(d, b, k, h);
  const float* Mk = M + crow * static_cast<int64_t>(r) * p;

  // ---- staging ----
  const TokenTile<In> tphi = Tile(d, phi, r, b, h, c0), tpsi = Tile(d, psi, r, b, h, c0),
                      tv = Tile(d, v, dv, b, h, c0);
  const TokenTile<float> tg = Tile(d, gbar, p, b, h, c0);
  if constexpr (kKind == Kind::kForward) {
    StageTransposed(tpsi, ce, K1, vec_in, P);
    StageTransposed(tphi, ce, K1, vec_in, Q);
    StageRows(tv, ce, dv, vec_in, R);
    StageChunkMatrix(Mk, r, p, dv, false, F);
    for (int j = tid; j < kW; j += kThreads) scol[j] = j < r ? __ldg(&Mk[j * p + dv]) : 0.f;
  } else if constexpr (kKind == Kind::kQuery) {
    StageTransposed(tv, ce, K1, vec_in, P);
    StageTransposed(tg, ce, K1, false, Q);
    StageRows(tpsi, ce, r, vec_in, R);
    StageChunkMatrix(Mk, r, p, r, true, F);
  } else if constexpr (kKind == Kind::kKeyPsi) {
    StageTransposed(tg, ce, K1, false, P);
    StageTransposed(tv, ce, K1, vec_in, Q);
    StageRows(tphi, ce, r, vec_in, R);
    StageChunkMatrix(Mk, r, p, r, true, F);
  } else {
    StageTransposed(tphi, ce, K1, vec_in, P);
    StageTransposed(tpsi, ce, K1, vec_in, Q);
    StageRows(tg, ce, dv, false, R);
    StageChunkMatrix(Mk, r, p, dv, false, F);
  }
  if (tid < kC) {
    const float l = lam != nullptr && tid < ce ? lam[TokenRow(d, b, c0 + tid, h)] : 0.f;
    lam_t[tid] = l;
    // Query side exp(lam_t), key side exp(chunk_decay - lam_s) (Lemma 4).
    w[tid] = lam == nullptr ? 1.f : (kRowsAreKeys ? expf(l) : expf(cd[crow] - l));
  }
  __syncthreads();

  // Warp w owns rows [16 rb, 16 rb + 16) with rb = w for w < 4 and 11 - w
  // otherwise: the causal loops below run longer for later rows, and warps w
  // and w + 4 share a scheduler, so each scheduler gets one short and one
  // long row block (rb and 7 - rb).
  const int warp = tid >> 5, rb = warp < 4 ? warp : 11 - warp;
  const int ty = 2 * rb + ((tid >> 4) & 1), tx = tid & 15;
  const int m0 = ty * 8, n0 = tx * 4;

  // ---- chunk-state product, before Q is overwritten ----
  float side[8][4];
  Zero(side);
  Gemm<true, false>(side, Q, kC, m0, F, kLdF, n0, 0, K1);
  if constexpr (kKind == Kind::kForward) {
    // den column: phi_t . S_in[:, dv], in two halves of r summed in order.
    const int t = tid & (kC - 1), half = tid >> 7;
    const int jh = (r + 1) / 2, j0 = half * jh, j1 = min(r, j0 + jh);
    float acc = 0.f;
    for (int j = j0; j < j1; ++j) acc = fmaf(Q[j * kC + t], scol[j], acc);
    part[half * kC + t] = acc;
  }

  // ---- score tile: rows [16 rb, 16 rb + 16), columns in two halves ----
  float x[8][8];
  Zero(x);
  const int wr0 = 16 * rb;
  // Rows are keys s (columns t >= s matter): the low column half is dead for
  // warps whose first row is >= 64. Rows are queries t (columns s <= t): the
  // high half is dead for warps whose last row is < 64.
  if (kRowsAreKeys && wr0 >= kC / 2) {
    Gemm<false, true>(x, P, kC, m0, Q, kC, n0, 0, K1);
  } else if (!kRowsAreKeys && wr0 + 15 < kC / 2) {
    Gemm<true, false>(x, P, kC, m0, Q, kC, n0, 0, K1);
  } else {
    Gemm<true, true>(x, P, kC, m0, Q, kC, n0, 0, K1);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int row = m0 + i, col = n0 + 64 * (j >> 2) + (j & 3);
      const int s = kRowsAreKeys ? row : col, t = kRowsAreKeys ? col : row;
      const float g = lam != nullptr ? expf(lam_t[t] - lam_t[s]) : 1.f;
      x[i][j] = s <= t ? x[i][j] * g : 0.f;
    }
  __syncthreads();  // every read of P and Q is done
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      *reinterpret_cast<float4*>(&X[(m0 + i) * kC + n0 + 64 * hh]) =
          make_float4(x[i][4 * hh], x[i][4 * hh + 1], x[i][4 * hh + 2], x[i][4 * hh + 3]);
  __syncthreads();

  if constexpr (kKind == Kind::kForward) {
    // den column: sum_s A[t, s], in two halves of s summed in order.
    const int t = tid & (kC - 1), half = tid >> 7;
    float acc = 0.f;
    for (int s = half * (kC / 2); s < (half + 1) * (kC / 2); ++s) acc += X[s * kC + t];
    part2[half * kC + t] = acc;
  }

  // ---- tile product: out rows m (X columns), k over the live X rows ----
  float acc[8][4];
  Zero(acc);
  int k0 = 0, k1 = ce;
  if (kRowsAreKeys) {
    k1 = min(ce, wr0 + 16);  // keys s <= t, t < wr0 + 16
  } else {
    k0 = wr0;  // queries t >= s
  }
  Gemm<true, false>(acc, X, kC, m0, R, kW, n0, k0, k1);

  // ---- outputs ----
  const int width = kKind == Kind::kForward || kKind == Kind::kKeyV ? dv : r;
  const int ld_out = kKind == Kind::kForward ? p : width;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int m = m0 + i;
    if (m >= ce) continue;
    float* o = out + TokenRow(d, b, c0 + m, h) * ld_out;
    const float wm = w[m];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + j;
      if (n >= width) continue;
      const float val = fmaf(wm, side[i][j], acc[i][j]);
      if constexpr (kKind == Kind::kForward) {
        o[n] = val;
      } else {
        o[n] += val;
      }
    }
  }
  if constexpr (kKind == Kind::kForward) {
    __syncthreads();
    for (int t = tid; t < ce; t += kThreads) {
      out[TokenRow(d, b, c0 + t, h) * p + dv] =
          fmaf(w[t], part[t] + part[kC + t], part2[t] + part2[kC + t]);
    }
  }
}

// ---- grouped outer sums: chunk summaries (F2), pooling, state gradients ------
// out[(b, g, h), seg] = sum over the segment's tokens i of group g of
// (w_i a_i) b_i^T (r x p): a = psi or phi (input dtype), b = vbar = [v, 1] or
// gbar (fp32, width p); LaunchSmatGroupedOuterSum's contract. grid (segments,
// G, batch * H), 256 threads, 128 tokens staged at a time; a thread owns 4 x 4
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
  const int seg = blockIdx.x, g = blockIdx.y;
  const int bh = blockIdx.z, b = bh / d.H, h = bh % d.H;
  const cuda_detail::GroupCursor cur(groups, d, bh, g);
  int64_t lo, hi;
  cuda_detail::SegmentRange(cur.count, segments, seg, &lo, &hi);
  const int r = d.r, p = d.p, dv = d.dv;
  const int ty = tid >> 4, tx = tid & 15;
  const int crow = tid >> 2, part = tid & 3;  // column-64 role
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  float sum64 = 0.f;
  for (int64_t j0 = lo; j0 < hi; j0 += kC) {
    const int nt = static_cast<int>(cuda_detail::Min64(kC, hi - j0));
    __syncthreads();  // the previous tile is consumed
    if (tid < nt) {
      const int64_t i = cur.Token(j0 + tid);
      rows[tid] = TokenRow(d, b, i, h);
      w[tid] = cuda_detail::TokenWeight(d, tw, b, h, i);
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
  float* dst = out + ((static_cast<int64_t>(b) * lay.ob + static_cast<int64_t>(g) * lay.og +
                       static_cast<int64_t>(h) * lay.oh) *
                          segments +
                      seg) *
                         static_cast<int64_t>(r) * p;
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
// grid (segments, G, batch * H), 256 threads; rows = tokens (8 per thread),
// 4 columns per thread, k in increasing order; column 64 of out_p (p = 65) by
// two half sums added in order. Shared: Ma [64][kLdF] = M, Mg [kK1][kLdF] =
// M^T, At [64][kC], Bt [kK1][kC], rows, w, partial sums.
constexpr int kReadsSmemFloats = kW * kLdF + kK1 * kLdF + kW * kC + kK1 * kC + 2 * kC + 2 * kC +
                                 2 * kC;  // the last 2 kC: rows, kC int64

template <typename T>
__device__ void StageTransposedRows(const T* src, int width, const int64_t* rows, int nt, int K1,
                                    bool vec, float* dst) {
  constexpr int V = 16 / sizeof(T);
  if (vec) {
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
#pragma unroll
          for (int z = 0; z < V; ++z) dst[(q * V + z) * kC + t] = x[u][z];
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
        const int e = e0 + u * kThreads;
        if (e < total) dst[e] = x[u];
      }
    }
  }
  for (int e = threadIdx.x; e < kC * (K1 - width); e += kThreads) {
    const int t = e & (kC - 1), i = width + (e >> 7);
    dst[i * kC + t] = t < nt && i == width ? 1.f : 0.f;
  }
}

template <SmatReadKind kRead, typename In>
__global__ void __launch_bounds__(kThreads)
    GroupReadsKernel(SmatCudaDims d, SmatTokenGroups groups, int segments, bool vec_in,
                     const float* __restrict__ M, SmatMatrixLayout lay, const In* __restrict__ a,
                     const In* __restrict__ v, const float* __restrict__ gsrc,
                     SmatTokenWeights tw, float* __restrict__ out_p, float* __restrict__ out_r,
                     float* __restrict__ out_v) {
  constexpr bool kA = kRead != SmatReadKind::kMatVec;  // a-side product (out_p or out_v)
  constexpr bool kG = kRead != SmatReadKind::kVecMat;  // b-side product (out_r)
  extern __shared__ float4 smem4[];
  float* Ma = reinterpret_cast<float*>(smem4);
  float* Mg = Ma + kW * kLdF;
  float* At = Mg + kK1 * kLdF;
  float* Bt = At + kW * kC;
  float* w = Bt + kK1 * kC;
  float* part = w + 2 * kC;
  int64_t* rows = reinterpret_cast<int64_t*>(part + 2 * kC);
  const int seg = blockIdx.x, g = blockIdx.y;
  const int bh = blockIdx.z, b = bh / d.H, h = bh % d.H;
  const cuda_detail::GroupCursor cur(groups, d, bh, g);
  int64_t lo, hi;
  cuda_detail::SegmentRange(cur.count, segments, seg, &lo, &hi);
  if (lo >= hi) return;  // uniform over the block
  const int r = d.r, p = d.p, dv = d.dv, tid = threadIdx.x;
  const float* Mk = M + (static_cast<int64_t>(b) * lay.ob + static_cast<int64_t>(g) * lay.og +
                         static_cast<int64_t>(h) * lay.oh) *
                            static_cast<int64_t>(r) * p;
  if (kA) StageChunkMatrix(Mk, r, p, p < kW ? p : kW, false, Ma);
  if (kG) StageChunkMatrix(Mk, r, p, r, true, Mg);
  const int ty = tid >> 4, tx = tid & 15, m0 = ty * 8, n0 = tx * 4;
  const int wa = kRead == SmatReadKind::kVecMat ? p : dv;  // a-side output width
  for (int64_t j0 = lo; j0 < hi; j0 += kC) {
    const int nt = static_cast<int>(cuda_detail::Min64(kC, hi - j0));
    __syncthreads();  // the previous tile's reads of At, Bt, w, rows are done
    if (tid < nt) {
      const int64_t i = cur.Token(j0 + tid);
      rows[tid] = TokenRow(d, b, i, h);
      w[tid] = cuda_detail::TokenWeight(d, tw, b, h, i);
    }
    __syncthreads();
    if (kA) StageTransposedRows(a, r, rows, nt, r, vec_in, At);
    if (kRead == SmatReadKind::kBoth) StageTransposedRows(v, dv, rows, nt, p, vec_in, Bt);
    if (kRead == SmatReadKind::kMatVec) StageTransposedRows(gsrc, p, rows, nt, p, false, Bt);
    __syncthreads();
    if (kA) {
      float acc[8][4];
      Zero(acc);
      Gemm<true, false>(acc, At, kC, m0, Ma, kLdF, n0, 0, r);
      float* out = kRead == SmatReadKind::kVecMat ? out_p : out_v;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int t = m0 + i;
        if (t >= nt) continue;
        float* o = out + rows[t] * wa;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int n = n0 + jj;
          if (n < wa && n < kW) o[n] += w[t] * acc[i][jj];
        }
      }
      if (kRead == SmatReadKind::kVecMat && p > kW) {
        // Column 64: a_t . M[:, 64] in two halves of r, added in order.
        const int t = tid & (kC - 1), half = tid >> 7;
        const int kh = (r + 1) / 2, k0 = half * kh, k1 = min(r, k0 + kh);
        float sum = 0.f;
        for (int k = k0; k < k1; ++k) sum = fmaf(At[k * kC + t], __ldg(&Mk[k * p + kW]), sum);
        part[half * kC + t] = sum;
        __syncthreads();
        if (tid < nt) out_p[rows[tid] * p + kW] += w[tid] * (part[tid] + part[kC + tid]);
      }
    }
    if (kG) {
      float acc[8][4];
      Zero(acc);
      Gemm<true, false>(acc, Bt, kC, m0, Mg, kLdF, n0, 0, p);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int t = m0 + i;
        if (t >= nt) continue;
        float* o = out_r + rows[t] * r;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int n = n0 + jj;
          if (n < r) o[n] += w[t] * acc[i][jj];
        }
      }
    }
  }
}

bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

template <Kind kKind, typename In>
cudaError_t LaunchKind(const SmatCudaDims& d, const void* phi, const void* psi, const void* v,
                       const float* gbar, const float* lam, const float* cd, const float* M,
                       float* out, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(float) * kSmemFloats;
  auto kernel = ChunkTileKernel<kKind, In>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  constexpr int V = 16 / sizeof(In);
  const bool vec = d.r % V == 0 && d.dv % V == 0 && Aligned16(phi) && Aligned16(psi) &&
                   Aligned16(v);
  const dim3 grid(static_cast<unsigned>(d.Lc), static_cast<unsigned>(d.batch * d.H));
  kernel<<<grid, kThreads, kSmem, stream>>>(d, vec, static_cast<const In*>(phi),
                                            static_cast<const In*>(psi),
                                            static_cast<const In*>(v), gbar, lam, cd, M, out);
  return cudaGetLastError();
}

template <Kind kKind>
cudaError_t LaunchAny(const SmatCudaDims& d, const void* phi, const void* psi, const void* v,
                      const float* gbar, const float* lam, const float* cd, const float* M,
                      float* out, cudaStream_t stream) {
  return d.bf16 ? LaunchKind<kKind, __nv_bfloat16>(d, phi, psi, v, gbar, lam, cd, M, out, stream)
                : LaunchKind<kKind, float>(d, phi, psi, v, gbar, lam, cd, M, out, stream);
}

template <SmatReadKind kRead, typename In>
cudaError_t LaunchReads(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                        const float* M, const SmatMatrixLayout& lay, const void* a, const void* v,
                        const float* g, const SmatTokenWeights& w, float* out_p, float* out_r,
                        float* out_v, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(float) * kReadsSmemFloats;
  auto kernel = GroupReadsKernel<kRead, In>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  constexpr int V = 16 / sizeof(In);
  const bool vec = d.r % V == 0 && d.dv % V == 0 && Aligned16(a) && Aligned16(v);
  const dim3 grid(segments, groups.num_groups, d.batch * d.H);
  kernel<<<grid, kThreads, kSmem, stream>>>(d, groups, segments, vec, M, lay,
                                            static_cast<const In*>(a), static_cast<const In*>(v),
                                            g, w, out_p, out_r, out_v);
  return cudaGetLastError();
}

template <typename In>
cudaError_t LaunchReadsKind(const SmatCudaDims& d, const SmatTokenGroups& groups, int segments,
                            SmatReadKind kind, const float* M, const SmatMatrixLayout& lay,
                            const void* a, const void* v, const float* g,
                            const SmatTokenWeights& w, float* out_p, float* out_r, float* out_v,
                            cudaStream_t stream) {
  switch (kind) {
    case SmatReadKind::kVecMat:
      return LaunchReads<SmatReadKind::kVecMat, In>(d, groups, segments, M, lay, a, v, g, w, out_p,
                                                    out_r, out_v, stream);
    case SmatReadKind::kMatVec:
      return LaunchReads<SmatReadKind::kMatVec, In>(d, groups, segments, M, lay, a, v, g, w, out_p,
                                                    out_r, out_v, stream);
    case SmatReadKind::kBoth:
      return LaunchReads<SmatReadKind::kBoth, In>(d, groups, segments, M, lay, a, v, g, w, out_p,
                                                  out_r, out_v, stream);
  }
  return cudaErrorInvalidValue;
}

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
  const dim3 grid(segments, groups.num_groups, d.batch * d.H);
  kernel<<<grid, kThreads, kSmem, stream>>>(d, groups, segments, vec, static_cast<const In*>(a), b,
                                            b_is_v, w, lay, out);
  return cudaGetLastError();
}

}  // namespace

bool SmatChunkFastTilesFit(const SmatCudaDims& d) {
  return d.chunk <= kC && d.r <= kW && d.dv <= kW;
}

int64_t SmatChunkFastTilesSmemBytes() { return sizeof(float) * kSmemFloats; }

cudaError_t LaunchSmatChunkOutputsFast(const SmatCudaDims& d, const void* phi, const void* psi,
                                       const void* v, const float* lam, const float* S_in,
                                       float* ybar, cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatUseMmaChunkTiles(d, /*backward=*/false)) {
    return LaunchSmatChunkOutputsMma(d, phi, psi, v, lam, S_in, ybar, stream);
  }
  return LaunchAny<Kind::kForward>(d, phi, psi, v, nullptr, lam, nullptr, S_in, ybar, stream);
}

cudaError_t LaunchSmatChunkOutputsBackwardFast(const SmatCudaDims& d, const void* phi,
                                               const void* psi, const void* v, const float* lam,
                                               const float* chunk_decay, const float* S_in,
                                               const float* gbar, const float* D_bar,
                                               float* phi_bar, float* psi_bar, float* v_bar,
                                               cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatUseMmaChunkTiles(d, /*backward=*/true)) {
    return LaunchSmatChunkOutputsBackwardMma(d, phi, psi, v, lam, chunk_decay, S_in, gbar, D_bar,
                                             phi_bar, psi_bar, v_bar, stream);
  }
  cudaError_t err = LaunchAny<Kind::kQuery>(d, phi, psi, v, gbar, lam, chunk_decay, S_in,
                                            phi_bar, stream);
  if (err != cudaSuccess) return err;
  err = LaunchAny<Kind::kKeyPsi>(d, phi, psi, v, gbar, lam, chunk_decay, D_bar, psi_bar, stream);
  if (err != cudaSuccess) return err;
  return LaunchAny<Kind::kKeyV>(d, phi, psi, v, gbar, lam, chunk_decay, D_bar, v_bar, stream);
}

cudaError_t LaunchSmatGroupedOuterSumFast(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                          int segments, const void* a, const void* b,
                                          bool b_is_v, const SmatTokenWeights& w,
                                          const SmatMatrixLayout& lay, float* out,
                                          cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  return d.bf16 ? LaunchOuter<__nv_bfloat16>(d, groups, segments, a, b, b_is_v, w, lay, out, stream)
                : LaunchOuter<float>(d, groups, segments, a, b, b_is_v, w, lay, out, stream);
}

cudaError_t LaunchSmatGroupedReadsFast(const SmatCudaDims& d, const SmatTokenGroups& groups,
                                       int segments, SmatReadKind kind, const float* M,
                                       const SmatMatrixLayout& lay, const void* a, const void* v,
                                       const float* g, const SmatTokenWeights& w, float* out_p,
                                       float* out_r, float* out_v, cudaStream_t stream) {
  if (groups.num_groups == 0 || d.batch * d.H == 0) return cudaSuccess;
  return d.bf16 ? LaunchReadsKind<__nv_bfloat16>(d, groups, segments, kind, M, lay, a, v, g, w,
                                                 out_p, out_r, out_v, stream)
                : LaunchReadsKind<float>(d, groups, segments, kind, M, lay, a, v, g, w, out_p,
                                         out_r, out_v, stream);
}

}  // namespace smat
