// The chunk-local tiles F6 (eq. 10 gated by Lemma 4) and their adjoint B7
// (eq. 19 of Appendix E) on tensor cores: mma.sync m16n8k16 with bf16 operands
// and fp32 accumulation, for c <= 128 tokens and r, dv <= 64 (the sizes of the
// FFMA tiles of smat_chunk_fast.cu, which stay selectable with
// SMAT_CUDA_CHUNK_TILES=ffma and serve devices without the shared memory).
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
// Every operand is staged once as planes of bf16 pair words, one plane per
// part (the split happens once per element, while staging), so a fragment
// register is one shared-memory load per part. The score tile X stays fp32,
// over the P and Q planes: the tile product of each warp reads (and splits)
// only the X columns of its own output rows, so no element is split twice.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/smat_device.cuh"

namespace smat {
namespace {

using cuda_detail::ChunkRow;
using cuda_detail::TokenRow;

constexpr int kThreads = 256;
constexpr int kC = 128;      // chunk tokens held
constexpr int kW = 64;       // widest r or dv
constexpr int kKP = 40;      // pair words of a feature row: p = 65 padded to 80, / 2
constexpr int kLdT = 44;     // words per token row of the P, Q planes (12 mod 32)
constexpr int kLdR = 72;     // bf16 per token row of the R planes (144 bytes)
constexpr int kLdN = 72;     // words per row of the F planes (8 mod 32)
constexpr int kLdX = 132;    // floats per row of the fp32 score tile X: 128 + 4
constexpr int kPlaneT = kC * kLdT;       // words
constexpr int kPlaneR = kC * kLdR / 2;   // words
constexpr int kPlaneF = kKP * kLdN;      // words
constexpr int kMiscWords = 4 * kC + 2 * kC + kW;  // lam, w, part, part2 [2][kC], scol

// Shared memory (32-bit words) for operands of kPP, kPQ, kPR bf16 parts:
// P, Q planes (X, fp32 [kC][kLdX], overlays them once the score tile is in
// registers), R planes, three F planes, then lam, w, the partial sums of the
// forward den and its state column. 121 KB (bf16 forward) to 223 KB (fp32).
template <int kPP, int kPQ, int kPR>
struct Layout {
  static constexpr int kQ = kPP * kPlaneT;
  static constexpr int kPQEnd = (kPP + kPQ) * kPlaneT;
  static constexpr int kR = kPQEnd > kC * kLdX ? kPQEnd : kC * kLdX;
  static constexpr int kF = kR + kPR * kPlaneR;
  static constexpr int kMisc = kF + 3 * kPlaneF;
  static constexpr int kWords = kMisc + kMiscWords;
};
constexpr int64_t kMaxSmemBytes = 4 * Layout<3, 3, 3>::kWords;

enum class Kind { kForward, kQuery, kKeyPsi, kKeyV };

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }

// ---- bf16 parts -------------------------------------------------------------------

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  std::memcpy(&u, &h, sizeof(u));
  return u;
}
__device__ __forceinline__ float2 UnpackBf16(uint32_t u) {
  __nv_bfloat162 h;
  std::memcpy(&h, &u, sizeof(u));
  return __bfloat1622float2(h);
}

// The bf16 parts of the pair (x0, x1) (x0 in the low half, as mma expects):
// kParts = 1 for values that are bf16 already, 3 for fp32 (x1 + x2 + x3 = x).
template <int kParts>
__device__ __forceinline__ void Split(float x0, float x1, uint32_t (&part)[3]) {
  part[0] = PackBf16(x0, x1);
  if constexpr (kParts == 3) {
    const float2 h1 = UnpackBf16(part[0]);
    const float r0 = x0 - h1.x, r1 = x1 - h1.y;  // exact
    part[1] = PackBf16(r0, r1);
    const float2 h2 = UnpackBf16(part[1]);
    part[2] = PackBf16(r0 - h2.x, r1 - h2.y);  // exact, and exact in bf16
  }
}

// ---- staging: operands as planes of bf16 parts ------------------------------------
// P, Q: token rows of pair words, word (t, kp) = elements (t, 2 kp), (t, 2 kp + 1),
// which is what one register of an mma fragment holds (rows t = lane / 4,
// words kp = lane % 4: 12 mod 32 words per row puts a warp's 32 loads in 32
// banks). A bf16 row is its own pair words, so exact bf16 operands are copied
// 16 bytes at a time, coalesced. R: token rows of bf16, read by ldmatrix.trans
// (144-byte rows: the 8 rows of a matrix fall in 8 different bank groups). F:
// rows kp of pair words (elements (2 kp, n), (2 kp + 1, n)), 8 mod 32 words.
// fp32 operands are split into their three parts once, while staging.

constexpr int kBatch = 4;  // staging items per thread in flight

// Token tile of one (chunk, b, h): element (t, i) = base[t * stride + i] for
// t < ce, i < width; 1 at i == width when `ones` (vbar = [v, 1]); else 0.
// `pairs`: elements (t, 2 j) and (t, 2 j + 1) can be read as one aligned
// 2-element load (even width and stride, base aligned).
template <typename T>
struct TokenSrc {
  const T* base;
  int64_t stride;
  int width, ce;
  bool ones, pairs;
  __device__ __forceinline__ float Get(int t, int i) const {
    if (t >= ce) return 0.f;
    if (i < width) return ToF(__ldg(base + t * stride + i));
    return ones && i == width ? 1.f : 0.f;
  }
  __device__ __forceinline__ float2 GetPair(int t, int i) const {  // i even
    if (pairs && t < ce && i + 1 < width) {
      if constexpr (std::is_same<T, float>::value) {
        return __ldg(reinterpret_cast<const float2*>(base + t * stride + i));
      } else {
        const auto* two = reinterpret_cast<const __nv_bfloat162*>(base + t * stride + i);
        return __bfloat1622float2(__ldg(two));
      }
    }
    return make_float2(Get(t, i), Get(t, i + 1));
  }
};

// P or Q planes: word (t, kp) for t < kC, kp < kp_end. `fast`: the operand
// is bf16 (one part) with width % 8 == 0 and 16-byte aligned rows, so its
// rows are copied 16 bytes at a time and only the padding words are formed.
template <int kParts, typename T>
__device__ void StageTokenWords(const TokenSrc<T>& src, int kp_end, bool fast, uint32_t* dst) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int kp0 = 0;  // words formed below from here on
  if constexpr (sizeof(T) != 2) fast = false;
  if (fast) {
    const int nq = src.width / 8, total = src.ce * nq;  // 16-byte pieces
    for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * kBatch) {
      uint4 x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e / nq, q = e - t * nq;
        if (e < total) x[u] = __ldg(reinterpret_cast<const uint4*>(src.base + t * src.stride) + q);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e / nq, q = e - t * nq;
        if (e < total) *reinterpret_cast<uint4*>(&dst[t * kLdT + 4 * q]) = x[u];
      }
    }
    kp0 = src.width / 2;
  }
  // The other words, 8 per row and 4 rows per warp task, one pair per lane.
  const int nkg = (kp_end - kp0 + 7) / 8;
  for (int task0 = warp; task0 < kC / 4 * nkg; task0 += kThreads / 32 * kBatch) {
    float2 x[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int task = task0 + u * (kThreads / 32), tg = task / nkg;
      const int t = 4 * tg + (lane >> 3), kp = kp0 + 8 * (task - tg * nkg) + (lane & 7);
      x[u] = task < kC / 4 * nkg && kp < kp_end && (!fast || t < src.ce)
                 ? src.GetPair(t, 2 * kp)
                 : make_float2(0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int task = task0 + u * (kThreads / 32), tg = task / nkg;
      const int t = 4 * tg + (lane >> 3), kp = kp0 + 8 * (task - tg * nkg) + (lane & 7);
      if (task >= kC / 4 * nkg || kp >= kp_end) continue;
      uint32_t w[3];
      Split<kParts>(x[u].x, x[u].y, w);
#pragma unroll
      for (int q = 0; q < kParts; ++q) dst[q * kPlaneT + t * kLdT + kp] = w[q];
    }
  }
  if (fast) {  // rows past the chunk's end
    for (int e = threadIdx.x; e < (kC - src.ce) * kp0; e += kThreads) {
      const int t = src.ce + e / kp0;
      dst[t * kLdT + e % kp0] = 0u;
    }
  }
}

// R planes: bf16 (t, j) for t < kC, j < kW (zero past ce and width).
// `fast` as for StageTokenWords.
template <int kParts, typename T>
__device__ void StageRowsBf16(const TokenSrc<T>& src, bool fast, __nv_bfloat16* dst) {
  if constexpr (sizeof(T) != 2) fast = false;
  if (fast) {
    const int nq = src.width / 8;
    for (int e0 = threadIdx.x; e0 < kC * (kW / 8); e0 += kThreads * kBatch) {
      uint4 x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e >> 3, q = e & 7;
        x[u] = make_uint4(0u, 0u, 0u, 0u);
        if (t < src.ce && q < nq) {
          x[u] = __ldg(reinterpret_cast<const uint4*>(src.base + t * src.stride) + q);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e >> 3, q = e & 7;
        *reinterpret_cast<uint4*>(&dst[t * kLdR + 8 * q]) = x[u];
      }
    }
    return;
  }
  for (int e0 = threadIdx.x; e0 < kC * kW; e0 += kThreads * kBatch) {
    float x[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads;
      x[u] = src.Get(e >> 6, e & (kW - 1));
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads, t = e >> 6, j = e & (kW - 1);
      // The parts of x: x1 = bf16(x), x2 = bf16(x - x1), x3 = bf16(x - x1 - x2).
      float rest = x[u];
#pragma unroll
      for (int q = 0; q < kParts; ++q) {
        const __nv_bfloat16 part = __float2bfloat16_rn(rest);
        dst[q * 2 * kPlaneR + t * kLdR + j] = part;
        rest -= __bfloat162float(part);
      }
    }
  }
}

// F planes (three parts) from the chunk's r x p fp32 matrix M, F[i][n] for
// i < 2 kp_end, n < kW: transposed, F[i][n] = M[n][i] (i < p, n < r); else
// F[i][n] = M[i][n] (i < r, n < ncols); 0 elsewhere.
__device__ void StageMatrixWords(const float* M, int r, int p, int ncols, bool transposed,
                                 int kp_end, uint32_t* dst) {
  const int total = kp_end * kW;
  for (int e0 = threadIdx.x; e0 < total; e0 += kThreads * kBatch) {
    float x[kBatch][2];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads, wt = e >> 5, lane = e & 31;
      const int n = 8 * (wt & 7) + (lane & 7), ip = 4 * (wt >> 3) + (lane >> 3);
#pragma unroll
      for (int z = 0; z < 2; ++z) {
        const int i = 2 * ip + z;
        const bool in = e < total && (transposed ? i < p && n < r : i < r && n < ncols);
        x[u][z] = in ? __ldg(transposed ? &M[n * p + i] : &M[i * p + n]) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads, wt = e >> 5, lane = e & 31;
      const int n = 8 * (wt & 7) + (lane & 7), ip = 4 * (wt >> 3) + (lane >> 3);
      if (e >= total) continue;
      uint32_t w[3];
      Split<3>(x[u][0], x[u][1], w);
#pragma unroll
      for (int q = 0; q < 3; ++q) dst[q * kPlaneF + ip * kLdN + n] = w[q];
    }
  }
}

// ---- tensor-core products -------------------------------------------------------

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

// Operand A (16 rows from m0, k16 from k) or B (n-tile from n, k16 from k) of
// an mma from kParts planes of pair words, token rows (P, Q: word (t, kp) at
// t * kLdT + kp).
template <int kParts>
struct TokenWords {
  const uint32_t* w;
  __device__ __forceinline__ void LoadA(int k, int m0, uint32_t (&a)[4][3]) const {
    const int lane = threadIdx.x & 31;
    const uint32_t* s = w + (m0 + (lane >> 2)) * kLdT + k / 2 + (lane & 3);
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      a[0][q] = s[q * kPlaneT];                 // row g,     k 2tq, 2tq + 1
      a[1][q] = s[q * kPlaneT + 8 * kLdT];      // row g + 8
      a[2][q] = s[q * kPlaneT + 4];             // row g,     k 2tq + 8, + 9
      a[3][q] = s[q * kPlaneT + 8 * kLdT + 4];  // row g + 8
    }
  }
  __device__ __forceinline__ void LoadB(int k, int n, uint32_t (&b)[2][3]) const {
    const int lane = threadIdx.x & 31;
    const uint32_t* s = w + (n + (lane >> 2)) * kLdT + k / 2 + (lane & 3);
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      b[0][q] = s[q * kPlaneT];      // k 2tq, 2tq + 1, column g
      b[1][q] = s[q * kPlaneT + 4];  // k 2tq + 8, + 9
    }
  }
};

// Operand B from kParts planes of bf16 token rows (R: element (t, j) at
// t * kLdR + j): ldmatrix.trans of the two 8 x 8 blocks (k, k + 8) x (n .. n + 8).
template <int kParts>
struct RowsB {
  const __nv_bfloat16* x;
  __device__ __forceinline__ void LoadB(int k, int n, uint32_t (&b)[2][3]) const {
    const int lane = threadIdx.x & 31;
    const uint32_t addr =
        static_cast<uint32_t>(__cvta_generic_to_shared(x + (k + (lane & 15)) * kLdR + n));
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                   : "=r"(b[0][q]), "=r"(b[1][q])
                   : "r"(addr + q * 4 * kPlaneR));
#else
      __trap();
#endif
    }
  }
};

// The same for pair words in rows kp (F: word (kp, n) at kp * ld + n).
template <int kParts>
struct Words {
  const uint32_t* w;
  int ld, plane;
  __device__ __forceinline__ void LoadA(int k, int m0, uint32_t (&a)[4][3]) const {
    const int lane = threadIdx.x & 31;
    const uint32_t* s = w + (k / 2 + (lane & 3)) * ld + m0 + (lane >> 2);
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      a[0][q] = s[q * plane];                // row g,     k 2tq, 2tq + 1
      a[1][q] = s[q * plane + 8];            // row g + 8
      a[2][q] = s[q * plane + 4 * ld];       // row g,     k 2tq + 8, + 9
      a[3][q] = s[q * plane + 4 * ld + 8];   // row g + 8
    }
  }
  __device__ __forceinline__ void LoadB(int k, int n, uint32_t (&b)[2][3]) const {
    const int lane = threadIdx.x & 31;
    const uint32_t* s = w + (k / 2 + (lane & 3)) * ld + n + (lane >> 2);
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      b[0][q] = s[q * plane];           // k 2tq, 2tq + 1, column g
      b[1][q] = s[q * plane + 4 * ld];  // k 2tq + 8, + 9
    }
  }
};

// Operand A from an fp32 k-major tile ([k][ld] floats), split when loaded
// (the score tile: each warp reads only the columns of its own rows).
struct SplitFloatsA {
  const float* x;
  int ld;
  __device__ __forceinline__ void LoadA(int k, int m0, uint32_t (&a)[4][3]) const {
    const int lane = threadIdx.x & 31;
    const float* s = x + (k + 2 * (lane & 3)) * ld + m0 + (lane >> 2);
    Split<3>(s[0], s[ld], a[0]);
    Split<3>(s[8], s[ld + 8], a[1]);
    Split<3>(s[8 * ld], s[9 * ld], a[2]);
    Split<3>(s[8 * ld + 8], s[9 * ld + 8], a[3]);
  }
};

// Accumulators of one warp: 16 rows x 8 n-tiles of 8 columns; hi sums the
// a1 b1 terms, lo the correction terms (unused when both operands are exact).
// Element e of n-tile j: row g + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2.
struct WarpAcc {
  float hi[8][4];
  float lo[8][4];
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) hi[j][e] = lo[j][e] = 0.f;
  }
};

// Whether a product of operands with these part counts has correction terms.
constexpr bool HasLo(int parts_a, int parts_b) { return parts_a == 3 || parts_b == 3; }

template <bool kLo>
__device__ __forceinline__ float Total(const WarpAcc& acc, int j, int e) {
  if constexpr (kLo) {
    return acc.hi[j][e] + acc.lo[j][e];
  } else {
    return acc.hi[j][e];
  }
}

// acc(m0 + row, n0 + col) += sum_{k in [k0, k1)} A[k][m0 + row] B[k][n0 + col]
// for the warp's 16 rows and the n-tiles j in [jlo, jhi); k0, k1 multiples of
// 16. Correction terms go to acc.lo, smallest first; the leading term to acc.hi.
template <int kPA, int kPB, class OpA, class OpB>
__device__ __forceinline__ void WarpMma(WarpAcc& acc, const OpA& A, int m0, const OpB& B, int n0,
                                        int k0, int k1, int jlo, int jhi) {
  for (int k = k0; k < k1; k += 16) {
    uint32_t a[4][3];
    A.LoadA(k, m0, a);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < jlo || j >= jhi) continue;
      uint32_t b[2][3];
      B.LoadB(k, n0 + 8 * j, b);
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

// grid (Lc, batch * H), 256 threads, 4 * Layout::kWords bytes of shared memory.
template <Kind kKind, typename In>
struct TileTraits {
  // Parts of each operand: the inputs are exact in bf16 when the op's dtype
  // is; gbar, the chunk matrices and the score tile are fp32.
  static constexpr int kIn = std::is_same<In, __nv_bfloat16>::value ? 1 : 3;
  static constexpr int kPP = kKind == Kind::kKeyPsi ? 3 : kIn;  // P (gbar^T for kKeyPsi)
  static constexpr int kPQ = kKind == Kind::kQuery ? 3 : kIn;   // Q (gbar^T for kQuery)
  static constexpr int kPR = kKind == Kind::kKeyV ? 3 : kIn;    // R (gbar for kKeyV)
  using L = Layout<kPP, kPQ, kPR>;
};

template <Kind kKind, typename In>
__global__ void __launch_bounds__(kThreads, 1)
    ChunkTileMmaKernel(SmatCudaDims d, bool pairs, bool wide, const In* __restrict__ phi,
                       const In* __restrict__ psi,
                       const In* __restrict__ v, const float* __restrict__ gbar,
                       const float* __restrict__ lam, const float* __restrict__ cd,
                       const float* __restrict__ M, float* __restrict__ out) {
  using Tr = TileTraits<kKind, In>;
  using L = typename Tr::L;
  constexpr int kPP = Tr::kPP, kPQ = Tr::kPQ, kPR = Tr::kPR;
  constexpr bool kRowsAreKeys = kKind == Kind::kForward || kKind == Kind::kQuery;
  constexpr bool kScoresGv = kKind == Kind::kQuery || kKind == Kind::kKeyPsi;
  extern __shared__ uint4 smem_words[];
  uint32_t* sm = reinterpret_cast<uint32_t*>(smem_words);
  uint32_t* P = sm;
  uint32_t* Q = sm + L::kQ;
  float* X = reinterpret_cast<float*>(sm);  // over P and Q once they are read
  uint32_t* R = sm + L::kR;
  uint32_t* F = sm + L::kF;
  float* lam_t = reinterpret_cast<float*>(sm + L::kMisc);
  float* w = lam_t + kC;
  float* part = w + kC;
  float* part2 = part + 2 * kC;
  float* scol = part2 + 2 * kC;

  const int tid = threadIdx.x;
  const int64_t k = blockIdx.x;
  const int b = blockIdx.y / d.H, h = blockIdx.y % d.H;
  const int64_t c0 = k * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));  // tokens held
  const int r = d.r, dv = d.dv, p = d.p;
  const int K1 = kScoresGv ? p : r;
  const int K1pad = (K1 + 15) & ~15;
  const int kLive = (ce + 15) & ~15;  // token rows that can be nonzero
  const int64_t crow = ChunkRow(d, b, k, h);
  const float* Mk = M + crow * static_cast<int64_t>(r) * p;

  // ---- staging ----
  const int64_t row0 = TokenRow(d, b, c0, h);
  const TokenSrc<In> sphi{phi + row0 * r, static_cast<int64_t>(d.H) * r, r, ce, false, pairs};
  const TokenSrc<In> spsi{psi + row0 * r, static_cast<int64_t>(d.H) * r, r, ce, false, pairs};
  const TokenSrc<In> svbar{v + row0 * dv, static_cast<int64_t>(d.H) * dv, dv, ce, true, pairs};
  const TokenSrc<float> sg{gbar != nullptr ? gbar + row0 * p : nullptr,
                           static_cast<int64_t>(d.H) * p, p, ce, false, false};
  const int kp_end = K1pad / 2;
  // 16-byte copies of bf16 rows: widths of whole 16-byte pieces, aligned rows.
  constexpr bool kBf16 = std::is_same<In, __nv_bfloat16>::value;
  const bool fast_r = kBf16 && wide && r % 8 == 0, fast_v = kBf16 && wide && dv % 8 == 0;
  __nv_bfloat16* Rb = reinterpret_cast<__nv_bfloat16*>(R);
  if constexpr (kKind == Kind::kForward) {
    StageTokenWords<kPP>(spsi, kp_end, fast_r, P);
    StageTokenWords<kPQ>(sphi, kp_end, fast_r, Q);
    StageRowsBf16<kPR>(TokenSrc<In>{svbar.base, svbar.stride, dv, ce, false, false}, fast_v, Rb);
    StageMatrixWords(Mk, r, p, dv, false, kp_end, F);
    for (int j = tid; j < kW; j += kThreads) scol[j] = j < r ? __ldg(&Mk[j * p + dv]) : 0.f;
  } else if constexpr (kKind == Kind::kQuery) {
    StageTokenWords<kPP>(svbar, kp_end, fast_v, P);
    StageTokenWords<kPQ>(sg, kp_end, false, Q);
    StageRowsBf16<kPR>(spsi, fast_r, Rb);
    StageMatrixWords(Mk, r, p, r, true, kp_end, F);
  } else if constexpr (kKind == Kind::kKeyPsi) {
    StageTokenWords<kPP>(sg, kp_end, false, P);
    StageTokenWords<kPQ>(svbar, kp_end, fast_v, Q);
    StageRowsBf16<kPR>(sphi, fast_r, Rb);
    StageMatrixWords(Mk, r, p, r, true, kp_end, F);
  } else {
    StageTokenWords<kPP>(sphi, kp_end, fast_r, P);
    StageTokenWords<kPQ>(spsi, kp_end, fast_r, Q);
    StageRowsBf16<kPR>(TokenSrc<float>{sg.base, sg.stride, dv, ce, false, false}, false, Rb);
    StageMatrixWords(Mk, r, p, dv, false, kp_end, F);
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
    // den column: phi_t . S_in[:, dv], in two halves of r summed in order
    // (phi_t from its parts, whose fp32 sum is exact).
    const int t = tid & (kC - 1), half = tid >> 7;
    const int jh = (r + 1) / 2, j0 = half * jh, j1 = min(r, j0 + jh);
    float a = 0.f;
    for (int j = j0; j < j1; ++j) {
      float x = 0.f;
#pragma unroll
      for (int q = 0; q < kPQ; ++q) {
        const float2 f = UnpackBf16(Q[q * kPlaneT + t * kLdT + (j >> 1)]);
        x += (j & 1) ? f.y : f.x;
      }
      a = fmaf(x, scol[j], a);
    }
    part[half * kC + t] = a;
  }

  // ---- score tile, kept in registers until P and Q are no longer read ----
  float xs[2][8][4];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    // Live 8-column tiles: rows are keys s, columns t >= s matter (t >= m0);
    // rows are queries t, columns s <= t matter (s < m0 + 16).
    const int jlo = kRowsAreKeys ? max(0, (m0 - 64 * hh) / 8) : 0;
    const int jhi = kRowsAreKeys ? 8 : min(8, max(0, (m0 + 16 - 64 * hh) / 8));
    WarpAcc acc;
    acc.Zero();
    if (live && jlo < jhi) {
      WarpMma<kPP, kPQ>(acc, TokenWords<kPP>{P}, m0, TokenWords<kPQ>{Q}, 64 * hh, 0, K1pad,
                        jlo, jhi);
    }
    // Gate and mask; the dead tiles hold zeros (their accumulators are 0).
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = m0 + g + 8 * (e >> 1), col = 64 * hh + 8 * j + 2 * tq + (e & 1);
        const int s = kRowsAreKeys ? row : col, t = kRowsAreKeys ? col : row;
        float x = 0.f;
        if (s <= t) {
          x = Total<HasLo(kPP, kPQ)>(acc, j, e);
          if (lam != nullptr) x *= expf(lam_t[t] - lam_t[s]);
        }
        xs[hh][j][e] = x;
      }
  }

  // ---- chunk-state product (reads Q) ----
  float sd[8][4];
  {
    WarpAcc acc;
    acc.Zero();
    if (live) {
      WarpMma<kPQ, 3>(acc, TokenWords<kPQ>{Q}, m0, Words<3>{F, kLdN, kPlaneF}, 0, 0,
                      K1pad, 0, 8);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) sd[j][e] = Total<true>(acc, j, e);
  }
  __syncthreads();  // every read of P and Q is done
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e2 = 0; e2 < 2; ++e2) {
        const int row = m0 + g + 8 * e2, col = 64 * hh + 8 * j + 2 * tq;
        *reinterpret_cast<float2*>(&X[row * kLdX + col]) =
            make_float2(xs[hh][j][2 * e2], xs[hh][j][2 * e2 + 1]);
      }
  __syncthreads();

  if constexpr (kKind == Kind::kForward) {
    // den column: sum_s A[t, s], in two halves of s summed in order.
    const int t = tid & (kC - 1), half = tid >> 7;
    float a = 0.f;
    for (int s = half * (kC / 2); s < (half + 1) * (kC / 2); ++s) a += X[s * kLdX + t];
    part2[half * kC + t] = a;
  }

  // ---- tile product: X (fp32, split per warp) times R ----
  WarpAcc main;
  main.Zero();
  if (live) {
    // Rows are keys: out row t sums keys s <= t < m0 + 16. Rows are queries:
    // out row s sums queries t >= s >= m0.
    const int k0 = kRowsAreKeys ? 0 : m0;
    const int k1 = kRowsAreKeys ? min(kLive, m0 + 16) : kLive;
    WarpMma<3, kPR>(main, SplitFloatsA{X, kLdX}, m0, RowsB<kPR>{Rb}, 0, k0, k1, 0, 8);
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
        const float val = fmaf(wm, sd[j][e], Total<true>(main, j, e));
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

template <Kind kKind, typename In>
cudaError_t LaunchKind(const SmatCudaDims& d, const void* phi, const void* psi, const void* v,
                       const float* gbar, const float* lam, const float* cd, const float* M,
                       float* out, cudaStream_t stream) {
  constexpr size_t kSmem = 4 * TileTraits<kKind, In>::L::kWords;
  auto kernel = ChunkTileMmaKernel<kKind, In>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  // Rows of phi, psi, v start at multiples of r or dv elements.
  const uintptr_t align = reinterpret_cast<uintptr_t>(phi) | reinterpret_cast<uintptr_t>(psi) |
                          reinterpret_cast<uintptr_t>(v);
  const bool pairs = d.r % 2 == 0 && d.dv % 2 == 0 && align % (2 * sizeof(In)) == 0;
  const bool wide = align % 16 == 0;  // with r or dv % 8 == 0: 16-byte aligned bf16 rows
  const dim3 grid(static_cast<unsigned>(d.Lc), static_cast<unsigned>(d.batch * d.H));
  kernel<<<grid, kThreads, kSmem, stream>>>(d, pairs, wide, static_cast<const In*>(phi),
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

// Which tiles run by default where both fit (SMAT_CUDA_CHUNK_TILES = "mma" or
// "ffma" overrides): the faster on an H200 at the benchmark shape
// (docs/PERFORMANCE.md).
constexpr bool kMmaForwardByDefault = true;
constexpr bool kMmaBackwardByDefault = true;

}  // namespace

bool SmatChunkMmaTilesFit(const SmatCudaDims& d) {
  if (!SmatChunkFastTilesFit(d)) return false;
  int dev = 0, major = 0, smem = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
          cudaSuccess) {
    return false;
  }
  return major >= 8 && static_cast<int64_t>(smem) >= SmatChunkMmaTilesSmemBytes();
}

bool SmatUseMmaChunkTiles(const SmatCudaDims& d, bool backward) {
  const char* env = std::getenv("SMAT_CUDA_CHUNK_TILES");
  if (env != nullptr && std::strcmp(env, "ffma") == 0) return false;
  if (!SmatChunkMmaTilesFit(d)) return false;
  if (env != nullptr && std::strcmp(env, "mma") == 0) return true;
  return backward ? kMmaBackwardByDefault : kMmaForwardByDefault;
}

int64_t SmatChunkMmaTilesSmemBytes() { return kMaxSmemBytes; }

cudaError_t LaunchSmatChunkOutputsMma(const SmatCudaDims& d, const void* phi, const void* psi,
                                      const void* v, const float* lam, const float* S_in,
                                      float* ybar, cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  return LaunchAny<Kind::kForward>(d, phi, psi, v, nullptr, lam, nullptr, S_in, ybar, stream);
}

cudaError_t LaunchSmatChunkOutputsBackwardMma(const SmatCudaDims& d, const void* phi,
                                              const void* psi, const void* v, const float* lam,
                                              const float* chunk_decay, const float* S_in,
                                              const float* gbar, const float* D_bar,
                                              float* phi_bar, float* psi_bar, float* v_bar,
                                              cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  cudaError_t err = LaunchAny<Kind::kQuery>(d, phi, psi, v, gbar, lam, chunk_decay, S_in,
                                            phi_bar, stream);
  if (err != cudaSuccess) return err;
  err = LaunchAny<Kind::kKeyPsi>(d, phi, psi, v, gbar, lam, chunk_decay, D_bar, psi_bar, stream);
  if (err != cudaSuccess) return err;
  return LaunchAny<Kind::kKeyV>(d, phi, psi, v, gbar, lam, chunk_decay, D_bar, v_bar, stream);
}

}  // namespace smat
