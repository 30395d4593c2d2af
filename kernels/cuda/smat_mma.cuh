// Pieces of the SMat tensor-core kernels (smat_chunk_bwd_mma.cu,
// smat_chunk_fwd_mma.cu, smat_grouped_mma.cu, smat_state_grads.cu): their
// launches' shared-memory attributes, shared-memory addresses, the gates'
// factors of the causal tiles,
// 16-byte cp.async, the staging of bf16 token rows, ldmatrix, the m16n8k16
// bf16 mma with fp32 accumulation, and the split of fp32 values into three
// bf16 parts x = x1 + x2 + x3 (24 significant bits: exact for normal fp32;
// two parts, 16 bits, where a kernel takes kP = 2; one, bf16 rounding, with
// kP = 1)
// with the products of the exactness scheme (smat_chunk_mma.cu): one exact
// operand 3 MMAs, two split operands the 6 terms down to 2^-16 relative, the
// correction terms summed smallest first in an accumulator (lo) of their own.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace smat {
namespace mma_tiles {

// Lets `kernel` take `bytes` of dynamic shared memory, with the largest
// shared-memory carveout, so that the blocks per SM its launch bounds ask
// for fit beside each other.
template <typename Kernel>
inline cudaError_t AllowSharedMemory(Kernel kernel, int bytes) {
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                              cudaSharedmemCarveoutMaxShared);
}

// f(std::integral_constant<int, kP>()) for parts = kP (3, 2, else 1): how a
// launcher turns SmatBf16SplitParts() into the kernels' kP.
template <typename F>
inline auto WithSplitParts(int parts, F&& f) {
  if (parts == 3) return f(std::integral_constant<int, 3>());
  if (parts == 2) return f(std::integral_constant<int, 2>());
  return f(std::integral_constant<int, 1>());
}

__device__ __forceinline__ uint32_t SmemAddr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void CpAsyncWaitAll() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// Two stages in flight: the copies issued so far as one group, and a wait
// for every group but the newest.
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void CpAsyncWaitOlder() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

// Four 8 x 8 bf16 matrices; lanes 8 i .. 8 i + 7 address the rows of matrix i.
__device__ __forceinline__ void Ldsm4(uint32_t (&x)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldsm4T(uint32_t (&x)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
               : "r"(addr));
}

// Two 8 x 8 bf16 matrices, transposed; lanes 0 .. 15 address their rows.
__device__ __forceinline__ void Ldsm2T(uint32_t (&x)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(x[0]), "=r"(x[1])
               : "r"(addr));
}

// The padding columns [width, kLd) of `count` staged bf16 planes of kRows
// rows (plane q at planes + q kRows kLd): column width gets `first`, the
// others 0. One thread per row of a plane: no division by the pitch per
// element, as a walk over every element of the planes (e % kLd) takes.
// With width % 8 == 0 (planes 16-byte aligned) a row's padding goes as
// whole 16-byte pieces, conflict-free.
template <int kRows, int kLd, int kThreads>
__device__ __forceinline__ void FillPadColumns(__nv_bfloat16* planes, int count, int width,
                                               __nv_bfloat16 first) {
  static_assert(kLd % 8 == 0, "rows of whole 16-byte pieces");
  const __nv_bfloat16 zero = __float2bfloat16_rn(0.f);
  if (width % 8 == 0) {
    uint16_t bits;
    std::memcpy(&bits, &first, sizeof(bits));
    for (int e = threadIdx.x; e < kRows * count; e += kThreads) {
      uint4* row = reinterpret_cast<uint4*>(planes + e * kLd);
      for (int c = width / 8; c < kLd / 8; ++c) {
        row[c] = make_uint4(c == width / 8 ? bits : 0u, 0u, 0u, 0u);
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < kRows * count; e += kThreads) {
    __nv_bfloat16* row = planes + e * kLd;
    for (int c = width; c < kLd; ++c) row[c] = c == width ? first : zero;
  }
}

// A chunk's bf16 token rows into shared memory with a row pitch of kLd:
// dst[t][n] = src[t * stride + n] for t < ce, n < width; 0 for the other
// t < kRows, n < kWidth (columns kWidth..kLd-1 are left alone), by kThreads
// threads. vec: width % 8 == 0 and rows 16-byte aligned (cp.async, 16 bytes at
// a time); otherwise clamped element loads, kBatch in flight per thread.
template <int kRows, int kWidth, int kLd, int kThreads>
__device__ __forceinline__ void StageBf16Rows(const __nv_bfloat16* src, int64_t stride, int width,
                                              int ce, bool vec, __nv_bfloat16* dst) {
  static_assert(kWidth >= 8 && (kWidth & (kWidth - 1)) == 0 && kLd >= kWidth,
                "rows are staged 8 bf16 at a time, a power of two per row");
  constexpr int kPieces = kWidth / 8;
  constexpr int kWidthLog2 = __builtin_ctz(kWidth), kPiecesLog2 = kWidthLog2 - 3;
  if (vec) {
    for (int e = threadIdx.x; e < kRows * kPieces; e += kThreads) {
      const int t = e >> kPiecesLog2, q = e & (kPieces - 1);
      __nv_bfloat16* to = dst + t * kLd + 8 * q;
      if (t < ce && 8 * q < width) {
        CpAsync16(SmemAddr(to), src + t * stride + 8 * q);
      } else {
        *reinterpret_cast<uint4*>(to) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  } else {
    constexpr int kBatch = 8;
    for (int e0 = threadIdx.x; e0 < kRows * kWidth; e0 += kThreads * kBatch) {
      __nv_bfloat16 x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e >> kWidthLog2, n = e & (kWidth - 1);
        const __nv_bfloat16 y = src[min(t, ce - 1) * stride + min(n, width - 1)];
        x[u] = t < ce && n < width ? y : __float2bfloat16_rn(0.f);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = e0 + u * kThreads, t = e >> kWidthLog2, n = e & (kWidth - 1);
        dst[t * kLd + n] = x[u];
      }
    }
  }
}

// StageBf16Rows for a whole tile (ce = kRows, width = kWidth, vec): thread t
// copies piece t % (kWidth / 8) of rows t / (kWidth / 8) + u kThreads /
// (kWidth / 8), its addresses computed once instead of per piece (the general
// loop's index math had been a fifth of the chunk walk's instructions).
template <int kRows, int kWidth, int kLd, int kThreads>
__device__ __forceinline__ void StageWholeRows(const __nv_bfloat16* __restrict__ src,
                                               int64_t stride, __nv_bfloat16* dst) {
  constexpr int kPieces = kWidth / 8, kRowsPerPass = kThreads / kPieces;
  static_assert(kWidth % 8 == 0 && kThreads % kPieces == 0 && kRows % kRowsPerPass == 0,
                "whole passes of 16-byte pieces");
  const int t = threadIdx.x / kPieces, q = threadIdx.x % kPieces;
  const __nv_bfloat16* from = src + t * stride + 8 * q;
  const uint32_t to = SmemAddr(dst + t * kLd + 8 * q);
  const int64_t jump = kRowsPerPass * stride;
#pragma unroll
  for (int u = 0; u < kRows / kRowsPerPass; ++u) {
    CpAsync16(to + 2u * u * kRowsPerPass * kLd, from + u * jump);
  }
}

// The widths of a tile kernel: r, dv (p = dv + 1) and their 16-wide
// k-steps. kFull: r = dv = kTileWidth (the models' and the benchmark's
// widths, with the rows aligned) as compile-time constants, so that the loops
// over them unroll without bounds checks and the width tests fold away
// (Nsight Compute had counted integer instructions and branches at about 40%
// of these kernels' with the launch's widths); otherwise the launch's values.
constexpr int kTileWidth = 64;
template <bool kFull>
struct TileWidths {
  int r_ = 0, dv_ = 0;  // the launch's r and dv (not kFull)
  __device__ int r() const { return kFull ? kTileWidth : r_; }
  __device__ int dv() const { return kFull ? kTileWidth : dv_; }
  __device__ int p() const { return dv() + 1; }
  __device__ int kr() const { return (r() + 15) >> 4; }   // k-steps over r
  __device__ int kd() const { return (dv() + 15) >> 4; }  // and over dv
};

// c += a b for one m16n8k16 tile.
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // the launchers keep devices before sm_80 off these kernels
#endif
}

__device__ __forceinline__ uint32_t Pack(__nv_bfloat162 h) {
  uint32_t u;
  std::memcpy(&u, &h, sizeof(u));
  return u;
}

// The three bf16 parts of the pair (x0, x1), x0 in the low half.
__device__ __forceinline__ void Split3(float x0, float x1, uint32_t& p1, uint32_t& p2,
                                       uint32_t& p3) {
  const __nv_bfloat162 h1 = __floats2bfloat162_rn(x0, x1);
  const float r0 = x0 - __low2float(h1), r1 = x1 - __high2float(h1);  // exact
  const __nv_bfloat162 h2 = __floats2bfloat162_rn(r0, r1);
  p1 = Pack(h1);
  p2 = Pack(h2);
  p3 = Pack(__floats2bfloat162_rn(r0 - __low2float(h2), r1 - __high2float(h2)));
}

// A fragments (3 parts) of a 16 x 16 fp32 tile held as two m16n8 accumulators.
__device__ __forceinline__ void SplitTile(const float (&x)[2][4], uint32_t (&a)[3][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr)
      Split3(x[nt][2 * hr], x[nt][2 * hr + 1], a[0][2 * nt + hr], a[1][2 * nt + hr],
             a[2][2 * nt + hr]);
}

// Two parts, x = x1 + x2: 16 significant bits, relative error <= 2^-16.
__device__ __forceinline__ void Split2(float x0, float x1, uint32_t& p1, uint32_t& p2) {
  const __nv_bfloat162 h1 = __floats2bfloat162_rn(x0, x1);
  p1 = Pack(h1);
  p2 = Pack(__floats2bfloat162_rn(x0 - __low2float(h1), x1 - __high2float(h1)));
}

// kP (1, 2 or 3) parts of a pair, of a 16 x 16 tile's A fragments, or of a B
// fragment (SplitBParts, below), for kernels that take the number of parts
// as a template argument (see SmatBf16SplitParts).
template <int kP>
__device__ __forceinline__ void SplitPair(float x0, float x1, uint32_t (&p)[kP]) {
  static_assert(kP >= 1 && kP <= 3, "one, two or three parts");
  if constexpr (kP == 3) {
    Split3(x0, x1, p[0], p[1], p[2]);
  } else if constexpr (kP == 2) {
    Split2(x0, x1, p[0], p[1]);
  } else {
    p[0] = Pack(__floats2bfloat162_rn(x0, x1));
  }
}
template <int kP>
__device__ __forceinline__ void SplitTileParts(const float (&x)[2][4], uint32_t (&a)[kP][4]) {
  if constexpr (kP == 3) {
    SplitTile(x, a);
  } else if constexpr (kP == 1) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        a[0][2 * nt + hr] = Pack(__floats2bfloat162_rn(x[nt][2 * hr], x[nt][2 * hr + 1]));
  } else {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        Split2(x[nt][2 * hr], x[nt][2 * hr + 1], a[0][2 * nt + hr], a[1][2 * nt + hr]);
  }
}

// The kP parts of the pair (x0, x1) stored at `at` of kP bf16 planes `plane`
// elements apart, one 4-byte store per plane (`at` 4-byte aligned): how the
// staging loops put fp32 rows into planes a column pair at a time.
template <int kP>
__device__ __forceinline__ void StoreSplitPair(__nv_bfloat16* at, int plane, float x0, float x1) {
  uint32_t part[kP];
  SplitPair<kP>(x0, x1, part);
#pragma unroll
  for (int q = 0; q < kP; ++q) *reinterpret_cast<uint32_t*>(at + q * plane) = part[q];
}

// The fp32 elements of an 8-column n-tile's m16n8k16 B fragment from shared
// memory, element (k, n) = M[k * sk + n * sn] for k < kmax, n < nmax (0
// elsewhere); k0 the tile's first k, n the lane's column. Loads use clamped
// indices and are unconditional, so a caller's loads for several n-tiles issue
// together (no branch per element); the select zeroes what lies outside.
__device__ __forceinline__ void LoadB(const float* M, int sk, int sn, int k0, int n, int kmax,
                                      int nmax, int tq, float (&x)[4]) {
  const int nc = min(n, nmax - 1);
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int k = k0 + 2 * tq + (u & 1) + 8 * (u >> 1);
    const float y = M[min(k, kmax - 1) * sk + nc * sn];
    x[u] = k < kmax && n < nmax ? y : 0.f;
  }
}

// Their three bf16 parts, b[part][register] (for Mma1x3, Mma3x3).
__device__ __forceinline__ void SplitB(const float (&x)[4], uint32_t (&b)[3][2]) {
  Split3(x[0], x[1], b[0][0], b[1][0], b[2][0]);
  Split3(x[2], x[3], b[0][1], b[1][1], b[2][1]);
}

template <int kP>
__device__ __forceinline__ void SplitBParts(const float (&x)[4], uint32_t (&b)[kP][2]) {
  if constexpr (kP == 3) {
    SplitB(x, b);
  } else if constexpr (kP == 1) {
    b[0][0] = Pack(__floats2bfloat162_rn(x[0], x[1]));
    b[0][1] = Pack(__floats2bfloat162_rn(x[2], x[3]));
  } else {
    Split2(x[0], x[1], b[0][0], b[1][0]);
    Split2(x[2], x[3], b[0][1], b[1][1]);
  }
}

// The causal mask of a 16 x 16 score tile held as two m16n8 accumulators
// (lane g = lane / 4, tq = lane % 4; bk.ce the chunk's tokens): keeps the
// pairs s <= t < ce, zeroes the rest. Only the diagonal block and the chunk's
// last partial block hold pairs outside. Query tiles (kKeyRows false): rows the
// tokens t of query block i, columns the tokens s of key block j; key tiles
// (B7's key rows): the transpose, rows s of block j, columns t of block i.
template <bool kKeyRows, class Blk>
__device__ __forceinline__ void MaskTile(const Blk& bk, int i, int j, int g, int tq,
                                         float (&sc)[2][4]) {
  if (j == i || 16 * i + 16 > bk.ce) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * (kKeyRows ? j : i) + g + 8 * (e >> 1);
        const int col = 16 * (kKeyRows ? i : j) + 8 * nt + 2 * tq + (e & 1);
        const int t = kKeyRows ? col : row, s = kKeyRows ? row : col;
        if (!(s <= t && t < bk.ce)) sc[nt][e] = 0.f;
      }
  }
}
template <class Blk>
__device__ __forceinline__ void MaskQueryTile(const Blk& bk, int i, int j, int g, int tq,
                                              float (&sc)[2][4]) {
  MaskTile<false>(bk, i, j, g, tq, sc);
}

// The gates' factors of a chunk's causal tiles (the fused B7 kernel),
// 16-token blocks, lam the chunk's log decays in shared memory (kC of them,
// ce held). Off the diagonal (query block i > key block j, so block j is
// whole) W[t, s] = exp(lam_t - lam_s) is the product
//   rf[t] bb[i][j] cf[s],  rf[t] = exp(lam_t - lam_{e(i - 1)}),
//   bb[i][j] = exp(lam_{e(i - 1)} - lam_{e(j)}),  cf[s] = exp(lam_{e(j)} - lam_s),
// e(j) = 16 j + 15 the last token of block j: each an exp of a later lam
// minus an earlier one, as every gate is applied (no overflow for
// non-positive log-gates), within a few roundings of the exp of the sum.
// kC + (kC / 16)^2 exps per chunk against 8 per lane and tile when each tile
// takes its own (the diagonal tiles still do). out: rf [kC], cf [kC], bb
// [kC / 16][kC / 16]; kThreads >= kC + (kC / 16)^2 threads call it.
// H200, bf16, T = 524288, d = 2, gated: B7 6.11 -> 6.01 ms. The forward tile
// (smat_chunk_fwd_mma.cu), with a third of B7's gated tiles, showed no change
// (NormalizedOutputs 2.095 -> 2.099 ms) and keeps its exps.
template <int kC, int kThreads>
__device__ __forceinline__ void GateFactors(int ce, const float* lam, float* out) {
  constexpr int kBlocks = kC / 16;
  static_assert(kThreads >= kC + kBlocks * kBlocks, "one thread per factor");
  const int tid = threadIdx.x;
  if (tid < kC) {
    const int blk = tid >> 4, last = min(16 * blk + 15, ce - 1);
    out[tid] = blk > 0 && tid < ce ? expf(lam[tid] - lam[16 * blk - 1]) : 1.f;
    out[kC + tid] = tid < ce ? expf(lam[last] - lam[tid]) : 1.f;
  } else if (tid < kC + kBlocks * kBlocks) {
    const int e = tid - kC, bi = e / kBlocks, bj = e % kBlocks;
    out[2 * kC + e] = bj < bi && 16 * bi < ce ? expf(lam[16 * bi - 1] - lam[16 * bj + 15]) : 0.f;
  }
}

// c (hi, lo) += A B with A exact (1 part) and B in 3 parts (b[part][reg]).
__device__ __forceinline__ void Mma1x3(float (&hi)[4], float (&lo)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[3][2]) {
  Mma(lo, a, b[2][0], b[2][1]);
  Mma(lo, a, b[1][0], b[1][1]);
  Mma(hi, a, b[0][0], b[0][1]);
}
// A in 3 parts, B exact.
__device__ __forceinline__ void Mma3x1(float (&hi)[4], float (&lo)[4], const uint32_t (&a)[3][4],
                                       uint32_t b0, uint32_t b1) {
  Mma(lo, a[2], b0, b1);
  Mma(lo, a[1], b0, b1);
  Mma(hi, a[0], b0, b1);
}
// Both in 3 parts: the terms of relative order <= 2^-16, smallest first.
__device__ __forceinline__ void Mma3x3(float (&hi)[4], float (&lo)[4], const uint32_t (&a)[3][4],
                                       const uint32_t (&b)[3][2]) {
  Mma(lo, a[0], b[2][0], b[2][1]);
  Mma(lo, a[1], b[1][0], b[1][1]);
  Mma(lo, a[2], b[0][0], b[0][1]);
  Mma(lo, a[0], b[1][0], b[1][1]);
  Mma(lo, a[1], b[0][0], b[0][1]);
  Mma(hi, a[0], b[0][0], b[0][1]);
}

// The same with kP parts (1, 2 or 3) of each split operand. hi and lo may be
// one accumulator: then every term goes to it, the smallest first. Two parts: A B in
// 1 + 1 MMAs (one exact operand) or the three terms a1 b1, a1 b2, a2 b1 (both
// split): each split operand off by at most 2^-16 relative (three parts:
// exact), and a2 b2 (<= 2^-16 relative) left out. One part: one MMA into hi,
// each split operand rounded to bf16 (2^-9 relative).
template <int kP>
__device__ __forceinline__ void Mma1xP(float (&hi)[4], float (&lo)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[kP][2]) {
  if constexpr (kP == 3) {
    Mma1x3(hi, lo, a, b);
  } else if constexpr (kP == 1) {
    Mma(hi, a, b[0][0], b[0][1]);
  } else {
    Mma(lo, a, b[1][0], b[1][1]);
    Mma(hi, a, b[0][0], b[0][1]);
  }
}
template <int kP>
__device__ __forceinline__ void MmaPx1(float (&hi)[4], float (&lo)[4], const uint32_t (&a)[kP][4],
                                       uint32_t b0, uint32_t b1) {
  if constexpr (kP == 3) {
    Mma3x1(hi, lo, a, b0, b1);
  } else if constexpr (kP == 1) {
    Mma(hi, a[0], b0, b1);
  } else {
    Mma(lo, a[1], b0, b1);
    Mma(hi, a[0], b0, b1);
  }
}
template <int kP>
__device__ __forceinline__ void MmaPxP(float (&hi)[4], float (&lo)[4], const uint32_t (&a)[kP][4],
                                       const uint32_t (&b)[kP][2]) {
  if constexpr (kP == 3) {
    Mma3x3(hi, lo, a, b);
  } else if constexpr (kP == 1) {
    Mma(hi, a[0], b[0][0], b[0][1]);
  } else {
    Mma(lo, a[0], b[1][0], b[1][1]);
    Mma(lo, a[1], b[0][0], b[0][1]);
    Mma(hi, a[0], b[0][0], b[0][1]);
  }
}

}  // namespace mma_tiles
}  // namespace smat
