// The chunk-local tiles F6 (eq. 10 gated by Lemma 4) and their adjoint B7
// (eq. 19 of Appendix E) on tensor cores: mma.sync m16n8k16 with bf16 operands
// and fp32 accumulation, for c <= 128 tokens and r, dv <= 64 (the sizes of the
// FFMA tiles of smat_chunk_fast.cu, which stay selectable with
// SMAT_CUDA_CHUNK_TILES=ffma and serve devices without the shared memory). By
// default the forward tile of bf16 inputs runs here and B7 of bf16 inputs as
// the single kernel of smat_chunk_bwd_mma.cu, the fp32 backward on FFMA (the
// faster of each; SMAT_CUDA_CHUNK_TILES=mma runs every chunk tile on tensor
// cores: the fused B7 for bf16 inputs, the three tiles below for fp32).
//
// The four tiles have the shape of smat_chunk_fast.cu (see its table):
//   X[row][col] = gate * (P[:, row] . Q[:, col]), masked to s <= t   (score)
//   side[m][n]  = sum_i Q[i][m] F[i][n]                              (chunk state)
//   main[m][n]  = sum_k X[k][m] R[k][n]                              (tile product)
//   out[m][n]  (+)= main[m][n] + w[m] side[m][n]
// One block of 8 warps per (chunk, b * H); warp w owns 16 output rows and all
// columns of each product, as m16n8 tiles.
//
// Exactness. A bf16 mma multiplies exactly and accumulates in fp32, so an
// operand that is bf16 already (phi, psi, v and the ones of vbar when the op's
// dtype is bf16) enters as one part. Every fp32 operand (fp32 inputs, gbar,
// S_in, D_bar, the score tile X) is split into three bf16 parts
// x = x1 + x2 + x3 (x1 = bf16(x), x2 = bf16(x - x1), x3 = bf16(x - x1 - x2):
// 24 significant bits, exact for normal fp32), and a product keeps the terms
// of relative order <= 2^-16: a1 b for an exact b (3 MMAs: a1 b, a2 b, a3 b),
// a1b1, a1b2, a2b1, a1b3, a2b2, a3b1 for two fp32 operands (6 MMAs). The
// correction terms are summed, small ones first, in an accumulator of their
// own that is added to the a1b1 accumulator once at the end, so the rounding
// of the large sum is the only error at fp32 level (one rounding per
// 16-term mma step: 8 steps for K = 128). The error budget is then that of an
// fp32 dot product with a few extra roundings: the phases stay within 1e-5 of
// the CPU, fp32 and bf16 inputs alike (tests/gpu/smat_gpu_test.cc).
//
// Determinism: every output element is summed in a fixed order (k ascending,
// fixed term order), no atomics.
//
// Shared memory holds fp32 (the split happens when a fragment is loaded, so
// one buffer serves all three parts of an fp32 operand); the leading
// dimensions are 4 mod 32 so that the fragment loads of a warp (rows
// 2 (lane % 4) + {0, 1, 8, 9}, columns lane / 4) hit 32 different banks.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "kernels/cuda/smat_chunk_launch.cuh"
#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_fast_tiles.cuh"

namespace smat {
namespace {

using cuda_detail::ChunkRow;
using cuda_detail::TokenRow;

constexpr int kThreads = 256;
constexpr int kC = 128;     // chunk tokens held
constexpr int kW = 64;      // widest r or dv
constexpr int kKPad = 80;   // widest inner size of a product (p = 65) rounded up to k16
constexpr int kLdT = 132;   // token-indexed rows (P, Q, X): 128 + 4
constexpr int kLdW = 68;    // width-indexed rows (R, F): 64 + 4

// Shared memory (floats): P, Q [kKPad][kLdT] (feature-major token tiles),
// X [kC][kLdT] (score tile, k-major for the tile product), R [kC][kLdW]
// (token rows), F [kKPad][kLdW] (the chunk's matrix), then lam, w, two [2][kC]
// partial-sum arrays and the state column of the forward den. 207 KB.
constexpr int kOffQ = kKPad * kLdT;
constexpr int kOffX = 2 * kKPad * kLdT;
constexpr int kOffR = kOffX + kC * kLdT;
constexpr int kOffF = kOffR + kC * kLdW;
constexpr int kOffLam = kOffF + kKPad * kLdW;
constexpr int kOffW = kOffLam + kC;
constexpr int kOffPart = kOffW + kC;
constexpr int kOffPart2 = kOffPart + 2 * kC;
constexpr int kOffScol = kOffPart2 + 2 * kC;
constexpr int kSmemFloats = kOffScol + kW;
static_assert(kOffR % 4 == 0 && kLdW % 4 == 0, "R rows are stored 16 bytes at a time");

enum class Kind { kForward, kQuery, kKeyPsi, kKeyV };

using fast_tiles::LoadVec;
using fast_tiles::ToF;

constexpr int kBatch = 8;  // independent global loads per thread before storing

// dst[i][t] (ld kLdT) = base[t * stride + i] for i < width, t < ce; row
// `width` is 1 for t < ce when `ones` (vbar = [v, 1]); every other element of
// rows < kKPad is 0 (the k padding of the products must be finite zeros).
template <typename T>
__device__ void StageTransposed(const T* base, int64_t stride, int width, int ce, bool ones,
                                bool vec, float* dst) {
  fast_tiles::StageTransposedRows<kLdT>(fast_tiles::TokenTile<T>{base, stride, width}, ce, vec,
                                        dst);
  for (int e = threadIdx.x; e < kC * (kKPad - width); e += kThreads) {
    const int t = e & (kC - 1), i = width + (e >> 7);
    dst[i * kLdT + t] = ones && i == width && t < ce ? 1.f : 0.f;
  }
}

// dst[t][n] (ld kLdW) = base[t * stride + n] for t < ce, n < ncols; 0 for the
// other t < kC, n < kW. `vec`: ncols % V == 0 and rows 16-byte aligned.
template <typename T>
__device__ void StageRows(const T* base, int64_t stride, int ncols, int ce, bool vec,
                          float* dst) {
  constexpr int V = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
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
        if (e < total) LoadVec(base + t * stride + q * V, x[u]);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = e0 + u * kThreads;
        const int t = pow2 ? e >> lq : e / nq, q = pow2 ? e & (nq - 1) : e % nq;
        if (e < total) {
#pragma unroll
          for (int z = 0; z < V; z += 4)
            *reinterpret_cast<float4*>(&dst[t * kLdW + q * V + z]) =
                make_float4(x[u][z], x[u][z + 1], x[u][z + 2], x[u][z + 3]);
        }
      }
    }
  } else {
    // A warp per row, lanes along the row: coalesced loads, conflict-free stores.
    for (int t0 = warp; t0 < ce; t0 += kThreads / 32 * 4) {
      float x[4][2];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int z = 0; z < 2; ++z) {
          const int t = t0 + u * (kThreads / 32), j = lane + 32 * z;
          x[u][z] = t < ce && j < ncols ? ToF(__ldg(base + t * stride + j)) : 0.f;
        }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int z = 0; z < 2; ++z) {
          const int t = t0 + u * (kThreads / 32), j = lane + 32 * z;
          if (t < ce && j < ncols) dst[t * kLdW + j] = x[u][z];
        }
    }
  }
  for (int e = threadIdx.x; e < kC * kW; e += kThreads) {
    const int t = e >> 6, n = e & (kW - 1);
    if (t >= ce || n >= ncols) dst[t * kLdW + n] = 0.f;
  }
}

// F [kKPad][kLdW] from the chunk's r x p fp32 matrix M: transposed,
// F[i][n] = M[n][i] (i < p, n < r); else F[i][n] = M[i][n] (i < r,
// n < ncols); 0 elsewhere.
__device__ void StageChunkMatrix(const float* M, int r, int p, int ncols, bool transposed,
                                 float* F) {
  constexpr int kTotal = kKPad * kW;
  for (int e0 = threadIdx.x; e0 < kTotal; e0 += kThreads * kBatch) {
    float x[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads;
      // Transposed: lanes along i, the contiguous index of M.
      const int i = transposed ? e % kKPad : e >> 6, n = transposed ? e / kKPad : e & (kW - 1);
      const bool in = e < kTotal && (transposed ? i < p && n < r : i < r && n < ncols);
      x[u] = in ? __ldg(transposed ? &M[n * p + i] : &M[i * p + n]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads;
      const int i = transposed ? e % kKPad : e >> 6, n = transposed ? e / kKPad : e & (kW - 1);
      if (e < kTotal) F[i * kLdW + n] = x[u];
    }
  }
}

// ---- tensor-core products -------------------------------------------------------

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  std::memcpy(&u, &h, sizeof(u));
  return u;
}

// The bf16 parts of the pair (x0, x1) (x0 in the low half, as mma expects):
// kParts = 1 for values that are bf16 already, 3 for fp32 (x1 + x2 + x3 = x).
template <int kParts>
__device__ __forceinline__ void Split(float x0, float x1, uint32_t (&part)[3]) {
  part[0] = PackBf16(x0, x1);
  if constexpr (kParts == 3) {
    const __nv_bfloat162 h1 = __floats2bfloat162_rn(x0, x1);
    const float r0 = x0 - __low2float(h1), r1 = x1 - __high2float(h1);  // exact
    const __nv_bfloat162 h2 = __floats2bfloat162_rn(r0, r1);
    std::memcpy(&part[1], &h2, sizeof(uint32_t));
    part[2] = PackBf16(r0 - __low2float(h2), r1 - __high2float(h2));  // exact, then exact
  }
}

// c += a b for one m16n8k16 tile (a: 4 registers, b: 2, bf16 pairs).
__device__ __forceinline__ void Mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // SmatChunkMmaTilesFit keeps older devices off this path
#endif
}

// Accumulators of one warp: 16 rows x 8 n-tiles of 8 columns; hi sums the
// a1 b1 terms, lo the correction terms (unused when both operands are exact).
struct WarpAcc {
  float hi[8][4];
  float lo[8][4];
  __device__ __forceinline__ void Zero() {
    cuda_detail::ZeroAcc(hi);
    cuda_detail::ZeroAcc(lo);
  }
  // Element e of n-tile j: row g + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2.
  template <bool kSplit>
  __device__ __forceinline__ float Get(int j, int e) const {
    if constexpr (kSplit) {
      return hi[j][e] + lo[j][e];
    } else {
      return hi[j][e];
    }
  }
};

// acc(m0 + row, n0 + col) += sum_{k in [k0, k1)} A[k][m0 + row] B[k][n0 + col]
// for the warp's 16 rows and the n-tiles j in [jlo, jhi) (8 columns each); A,
// B k-major fp32 in shared memory, k0, k1 multiples of 16. kPA, kPB: bf16
// parts of A and B (1 or 3).
template <int kPA, int kPB>
__device__ __forceinline__ void WarpMma(WarpAcc& acc, const float* A, int lda, int m0,
                                        const float* B, int ldb, int n0, int k0, int k1, int jlo,
                                        int jhi) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const float* ab = A + 2 * tq * lda + m0 + g;
  const float* bb = B + 2 * tq * ldb + n0 + g;
  for (int k = k0; k < k1; k += 16) {
    const float* ak = ab + k * lda;
    uint32_t a[4][3];  // [register][part]
    Split<kPA>(ak[0], ak[lda], a[0]);                   // row g,     k 2tq, 2tq + 1
    Split<kPA>(ak[8], ak[lda + 8], a[1]);               // row g + 8
    Split<kPA>(ak[8 * lda], ak[9 * lda], a[2]);         // row g,     k 2tq + 8, + 9
    Split<kPA>(ak[8 * lda + 8], ak[9 * lda + 8], a[3]);  // row g + 8
    const float* bk = bb + k * ldb;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < jlo || j >= jhi) continue;
      uint32_t b[2][3];
      Split<kPB>(bk[8 * j], bk[ldb + 8 * j], b[0]);              // k 2tq, 2tq + 1, col g
      Split<kPB>(bk[8 * ldb + 8 * j], bk[9 * ldb + 8 * j], b[1]);  // k 2tq + 8, + 9
      // Correction terms, smallest first, then the leading term.
#define SMAT_MMA(C, PA, PB) Mma(C, a[0][PA], a[1][PA], a[2][PA], a[3][PA], b[0][PB], b[1][PB])
      if constexpr (kPA == 3 && kPB == 3) {
        SMAT_MMA(acc.lo[j], 0, 2);
        SMAT_MMA(acc.lo[j], 1, 1);
        SMAT_MMA(acc.lo[j], 2, 0);
        SMAT_MMA(acc.lo[j], 0, 1);
        SMAT_MMA(acc.lo[j], 1, 0);
      } else if constexpr (kPA == 3) {
        SMAT_MMA(acc.lo[j], 2, 0);
        SMAT_MMA(acc.lo[j], 1, 0);
      } else if constexpr (kPB == 3) {
        SMAT_MMA(acc.lo[j], 0, 2);
        SMAT_MMA(acc.lo[j], 0, 1);
      }
      SMAT_MMA(acc.hi[j], 0, 0);
#undef SMAT_MMA
    }
  }
}

// Whether a product of operands with these part counts has correction terms.
constexpr bool HasLo(int parts_a, int parts_b) { return parts_a == 3 || parts_b == 3; }

// grid ChunkGrid(d), 256 threads, kSmemFloats floats of shared memory.
// vec_in: phi, psi, v rows can be read 16 bytes at a time.
template <Kind kKind, typename In>
__global__ void __launch_bounds__(kThreads, 1)
    ChunkTileMmaKernel(SmatCudaDims d, bool vec_in, const In* __restrict__ phi,
                       const In* __restrict__ psi, const In* __restrict__ v,
                       const float* __restrict__ gbar, const float* __restrict__ lam,
                       const float* __restrict__ cd, const float* __restrict__ M,
                       float* __restrict__ out) {
  constexpr bool kRowsAreKeys = kKind == Kind::kForward || kKind == Kind::kQuery;
  constexpr bool kScoresGv = kKind == Kind::kQuery || kKind == Kind::kKeyPsi;
  // Parts of each operand: the inputs are exact in bf16 when the op's dtype
  // is; gbar, the chunk matrices and the score tile are fp32.
  constexpr int kIn = std::is_same<In, __nv_bfloat16>::value ? 1 : 3;
  constexpr int kSideA = kKind == Kind::kQuery ? 3 : kIn;   // Q (gbar^T for kQuery)
  constexpr int kScoreA = kKind == Kind::kKeyPsi ? 3 : kIn;  // P (gbar^T for kKeyPsi)
  constexpr int kScoreB = kKind == Kind::kQuery ? 3 : kIn;   // Q
  constexpr int kTileB = kKind == Kind::kKeyV ? 3 : kIn;     // R (gbar for kKeyV)
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  float* P = sm;
  float* Q = sm + kOffQ;
  float* X = sm + kOffX;
  float* R = sm + kOffR;
  float* F = sm + kOffF;
  float* lam_t = sm + kOffLam;
  float* w = sm + kOffW;
  float* part = sm + kOffPart;
  float* part2 = sm + kOffPart2;
  float* scol = sm + kOffScol;

  const int tid = threadIdx.x;
  const cuda_detail::ChunkBlock blk(d);
  const int64_t k = blk.k;
  const int b = blk.b, h = blk.h;
  const int64_t c0 = k * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));  // tokens held
  const int r = d.r, dv = d.dv, p = d.p;
  const int K1 = kScoresGv ? p : r;
  const int K1pad = (K1 + 15) & ~15;
  const int kLive = (ce + 15) & ~15;  // token rows that can be nonzero
  const int64_t crow = ChunkRow(d, b, k, h);
  const float* Mk = M + crow * static_cast<int64_t>(r) * p;

  // ---- staging ----
  const int64_t sr = static_cast<int64_t>(d.H) * r, sv = static_cast<int64_t>(d.H) * dv,
                sg = static_cast<int64_t>(d.H) * p;
  const In* tphi = phi + TokenRow(d, b, c0, h) * r;
  const In* tpsi = psi + TokenRow(d, b, c0, h) * r;
  const In* tv = v + TokenRow(d, b, c0, h) * dv;
  const float* tg = gbar != nullptr ? gbar + TokenRow(d, b, c0, h) * p : nullptr;
  if constexpr (kKind == Kind::kForward) {
    StageTransposed(tpsi, sr, r, ce, false, vec_in, P);
    StageTransposed(tphi, sr, r, ce, false, vec_in, Q);
    StageRows(tv, sv, dv, ce, vec_in, R);
    StageChunkMatrix(Mk, r, p, dv, false, F);
    for (int j = tid; j < kW; j += kThreads) scol[j] = j < r ? __ldg(&Mk[j * p + dv]) : 0.f;
  } else if constexpr (kKind == Kind::kQuery) {
    StageTransposed(tv, sv, dv, ce, true, vec_in, P);
    StageTransposed(tg, sg, p, ce, false, false, Q);
    StageRows(tpsi, sr, r, ce, vec_in, R);
    StageChunkMatrix(Mk, r, p, r, true, F);
  } else if constexpr (kKind == Kind::kKeyPsi) {
    StageTransposed(tg, sg, p, ce, false, false, P);
    StageTransposed(tv, sv, dv, ce, true, vec_in, Q);
    StageRows(tphi, sr, r, ce, vec_in, R);
    StageChunkMatrix(Mk, r, p, r, true, F);
  } else {
    StageTransposed(tphi, sr, r, ce, false, vec_in, P);
    StageTransposed(tpsi, sr, r, ce, false, vec_in, Q);
    StageRows(tg, sg, dv, ce, false, R);
    StageChunkMatrix(Mk, r, p, dv, false, F);
  }
  if (tid < kC) {
    const float l = lam != nullptr && tid < ce ? lam[TokenRow(d, b, c0 + tid, h)] : 0.f;
    lam_t[tid] = l;
    // Query side exp(lam_t), key side exp(chunk_decay - lam_s) (Lemma 4).
    w[tid] = lam == nullptr ? 1.f : (kRowsAreKeys ? expf(l) : expf(cd[crow] - l));
  }
  __syncthreads();

  // Warp w owns rows [m0, m0 + 16), m0 = 16 rb, rb = w for w < 4 and 11 - w
  // otherwise: the causal products run longer for later (keys) or earlier
  // (queries) rows, and warps w and w + 4 share a scheduler, so each gets one
  // short and one long row block.
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int rb = warp < 4 ? warp : 11 - warp, m0 = 16 * rb;
  const bool live = m0 < ce;

  if constexpr (kKind == Kind::kForward) {
    // den column: phi_t . S_in[:, dv], in two halves of r summed in order.
    const int t = tid & (kC - 1), half = tid >> 7;
    const int jh = (r + 1) / 2, j0 = half * jh, j1 = min(r, j0 + jh);
    float a = 0.f;
    for (int j = j0; j < j1; ++j) a = fmaf(Q[j * kLdT + t], scol[j], a);
    part[half * kC + t] = a;
  }

  // ---- score tile into X, in two halves of 64 columns ----
  constexpr bool kScoreSplit = HasLo(kScoreA, kScoreB);
#pragma unroll 1
  for (int hh = 0; hh < 2; ++hh) {
    // Live 8-column tiles: rows are keys s, columns t >= s matter (t >= m0);
    // rows are queries t, columns s <= t matter (s < m0 + 16).
    const int jlo = kRowsAreKeys ? max(0, (m0 - 64 * hh) / 8) : 0;
    const int jhi = kRowsAreKeys ? 8 : min(8, max(0, (m0 + 16 - 64 * hh) / 8));
    WarpAcc acc;
    acc.Zero();
    if (live && jlo < jhi) {
      WarpMma<kScoreA, kScoreB>(acc, P, kLdT, m0, Q, kLdT, 64 * hh, 0, K1pad, jlo, jhi);
    }
    // Gate and mask; the dead tiles hold zeros (their accumulators are 0).
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int row = m0 + g + 8 * e2, col = 64 * hh + 8 * j + 2 * tq;
        float x2[2];
#pragma unroll
        for (int e1 = 0; e1 < 2; ++e1) {
          const int c = col + e1;
          const int s = kRowsAreKeys ? row : c, t = kRowsAreKeys ? c : row;
          x2[e1] = 0.f;
          if (s <= t) {
            const float gate = lam != nullptr ? expf(lam_t[t] - lam_t[s]) : 1.f;
            x2[e1] = acc.Get<kScoreSplit>(j, 2 * e2 + e1) * gate;
          }
        }
        *reinterpret_cast<float2*>(&X[row * kLdT + col]) = make_float2(x2[0], x2[1]);
      }
  }
  __syncthreads();

  if constexpr (kKind == Kind::kForward) {
    // den column: sum_s A[t, s], in two halves of s summed in order.
    const int t = tid & (kC - 1), half = tid >> 7;
    float a = 0.f;
    for (int s = half * (kC / 2); s < (half + 1) * (kC / 2); ++s) a += X[s * kLdT + t];
    part2[half * kC + t] = a;
  }

  // ---- tile product (X is fp32: 3 parts) and chunk-state product ----
  constexpr bool kTileSplit = true;
  constexpr bool kSideSplit = true;  // F is fp32
  WarpAcc main;
  main.Zero();
  WarpAcc side;
  side.Zero();
  if (live) {
    // Rows are keys: out row t sums keys s <= t < m0 + 16. Rows are queries:
    // out row s sums queries t >= s >= m0.
    const int k0 = kRowsAreKeys ? 0 : m0;
    const int k1 = kRowsAreKeys ? min(kLive, m0 + 16) : kLive;
    WarpMma<3, kTileB>(main, X, kLdT, m0, R, kLdW, 0, k0, k1, 0, 8);
    WarpMma<kSideA, 3>(side, Q, kLdT, m0, F, kLdW, 0, 0, K1pad, 0, 8);
  }

  // ---- outputs ----
  const int width = kKind == Kind::kForward || kKind == Kind::kKeyV ? dv : r;
  const int ld_out = kKind == Kind::kForward ? p : width;
#pragma unroll
  for (int e2 = 0; e2 < 2; ++e2) {
    const int m = m0 + g + 8 * e2;
    if (m >= ce) continue;
    float* o = out + TokenRow(d, b, c0 + m, h) * ld_out;
    const float wm = w[m];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e1 = 0; e1 < 2; ++e1) {
        const int n = 8 * j + 2 * tq + e1;
        if (n >= width) continue;
        const int e = 2 * e2 + e1;
        const float val = fmaf(wm, side.Get<kSideSplit>(j, e), main.Get<kTileSplit>(j, e));
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

// Which tiles run by default where both fit (SMAT_CUDA_CHUNK_TILES = "mma" or
// "ffma" overrides): the faster on an H200 at the benchmark shape (r = dv = 64,
// c = 128, 2026-11-30). Forward, bf16 inputs: 4.95 ms here against 6.04 ms
// with FFMA (gated 5.96 against 6.32); fp32 inputs, whose every product takes
// 6 MMAs and splits on every fragment load: 7.94 against 6.71. Backward, fp32
// inputs: the three tiles below took 35.9 ms against 21.7 ms (see
// docs/PERFORMANCE.md for why); bf16 inputs: the fused kernel of
// smat_chunk_bwd_mma.cu (one staging for all three outputs), 8.5 ms against
// 21.7 ms with FFMA (gated 8.5 against 22.5; 2026-12-01).
constexpr bool kMmaForwardBf16ByDefault = true;
constexpr bool kMmaForwardF32ByDefault = false;
constexpr bool kMmaBackwardBf16ByDefault = true;
constexpr bool kMmaBackwardF32ByDefault = false;
// The forward of bf16 inputs on tensor cores: the fused kernel of
// smat_chunk_fwd_mma.cu (cp.async staging, ldmatrix, two blocks per SM)
// rather than the tile below: 1.72 ms against 4.95 ms at the shape above
// (gated 2.21 ms; H200, 2026-12-01).
constexpr bool kFusedForwardBf16 = true;
// The bf16 parts of the fp32 operands in the fused tiles of bf16 inputs (see
// SmatBf16SplitParts): three, so that every phase keeps fp32 accuracy (1e-5
// of the CPU phases with a wide margin: 4e-7 measured); two are faster (H200,
// d = 2, 2026-12-01: B7 5.63 -> 5.18 ms, NormalizedOutputs 1.50 -> 1.35 ms)
// at up to 5.8e-6 of the CPU phases; one (bf16 products, as
// flash-linear-attention computes) faster still (d = 2: B7 4.81 -> 4.13 ms,
// the walk 1.70 -> 1.45 ms; d = 1 forward 1.52 -> 1.23 ms) at up to 3.4e-3.
constexpr int kBf16SplitPartsByDefault = 3;

// The tile kernels, for the launchers of smat_chunk_launch.cuh.
struct ChunkMmaTiles : chunk_launch::TileBlock<Kind, kThreads, sizeof(float) * kSmemFloats> {
  template <Kind kKind, typename In>
  static auto Kernel() {
    return ChunkTileMmaKernel<kKind, In>;
  }
};

}  // namespace

bool SmatChunkMmaTilesFit(const SmatCudaDims& d) {
  if (!SmatChunkFastTilesFit(d)) return false;
  return SmatDeviceRunsMma(SmatChunkMmaTilesSmemBytes());
}

bool SmatUseMmaChunkTiles(const SmatCudaDims& d, bool backward) {
  const char* env = std::getenv("SMAT_CUDA_CHUNK_TILES");
  if (env != nullptr && std::strcmp(env, "ffma") == 0) return false;
  if (!SmatChunkMmaTilesFit(d)) return false;
  if (env != nullptr && std::strcmp(env, "mma") == 0) return true;
  if (backward) return d.bf16 ? kMmaBackwardBf16ByDefault : kMmaBackwardF32ByDefault;
  return d.bf16 ? kMmaForwardBf16ByDefault : kMmaForwardF32ByDefault;
}

int64_t SmatChunkMmaTilesSmemBytes() { return sizeof(float) * kSmemFloats; }

int SmatBf16SplitParts() {
  const char* env = std::getenv("SMAT_CUDA_BF16_PARTS");
  if (env == nullptr || *env == '\0') return kBf16SplitPartsByDefault;
  if (std::strcmp(env, "1") == 0) return 1;
  if (std::strcmp(env, "2") == 0) return 2;
  if (std::strcmp(env, "3") == 0) return 3;
  static std::once_flag warned;
  std::call_once(warned, [env] {
    std::fprintf(stderr, "smat: SMAT_CUDA_BF16_PARTS=\"%s\" is not 1, 2 or 3; using %d\n", env,
                 kBf16SplitPartsByDefault);
  });
  return kBf16SplitPartsByDefault;
}

namespace {
// Whether the tensor-core forward tile is the fused bf16 kernel.
bool FusedForwardFits(const SmatCudaDims& d) {
  return kFusedForwardBf16 && SmatChunkForwardFusedFits(d);
}
}  // namespace

bool SmatChunkMmaForwardFused(const SmatCudaDims& d) {
  return SmatUseMmaChunkTiles(d, /*backward=*/false) && FusedForwardFits(d);
}

cudaError_t LaunchSmatChunkOutputsMma(const SmatCudaDims& d, const void* phi, const void* psi,
                                      const void* v, const float* lam, const float* S_in,
                                      float* ybar, cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (FusedForwardFits(d)) {
    return LaunchSmatChunkOutputsForwardFused(d, phi, psi, v, lam, S_in, ybar, stream);
  }
  return chunk_launch::LaunchTile<ChunkMmaTiles, Kind::kForward>(d, phi, psi, v, nullptr, lam,
                                                                 nullptr, S_in, ybar, stream);
}

cudaError_t LaunchSmatChunkOutputsBackwardMma(const SmatCudaDims& d, const void* phi,
                                              const void* psi, const void* v, const float* lam,
                                              const float* chunk_decay, const float* S_in,
                                              const float* gbar, const float* D_bar,
                                              float* phi_bar, float* psi_bar, float* v_bar,
                                              bool assign, cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatChunkBackwardFusedFits(d)) {
    return LaunchSmatChunkOutputsBackwardFused(d, phi, psi, v, lam, chunk_decay, S_in, gbar,
                                               D_bar, phi_bar, psi_bar, v_bar, assign, stream);
  }
  return chunk_launch::LaunchBackwardTiles<ChunkMmaTiles>(
      d, phi, psi, v, lam, chunk_decay, S_in, gbar, D_bar, phi_bar, psi_bar, v_bar, assign, stream);
}

}  // namespace smat
