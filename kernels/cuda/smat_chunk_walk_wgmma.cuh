// The pieces the walks on warpgroup MMAs share (smat_chunk_walk_wgmma.sm90a.cu,
// two warpgroups per block; smat_chunk_walk_wgmma64.sm90a.cu, one): the
// widths, the state's planes and the products of a warpgroup's 64 query rows
// on them (B7 on warpgroup MMAs, smat_chunk_bwd_wgmma.sm90a.cu, takes some
// too). A warpgroup's thread holds rows 16 wi + g and 16 wi + g + 8 of its
// 64 (wi its warp in the warpgroup, g = lane / 4, tq = lane % 4), as the
// m64n64 accumulators lay them out. Built for sm_90a only.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_mma.cuh"
#include "kernels/cuda/smat_wgmma.cuh"

namespace smat {
namespace walk_wgmma {

using wgmma::Swz;
using wgmma::SwzElem;

constexpr int kW = 64;  // r = dv
constexpr int kP1 = kW + 1;
constexpr int kPlaneBytes = kW * wgmma::kRowBytes;  // a plane of the state

// The bf16 pair in a 32-bit word as floats (exact: a bf16 is the high half
// of its float).
__device__ __forceinline__ float LowBf16(uint32_t x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float HighBf16(uint32_t x) { return __uint_as_float(x & 0xFFFF0000u); }

// Rows [0, ce) of one bf16 feature (rows `stride` elements apart from `src`)
// into a kRows-row swizzled tile at shared address `tile` (`ptr` in the
// generic space), zeros past ce; the block's kThreads threads.
template <int kRows, int kThreads>
__device__ __forceinline__ void StageTileRows(const __nv_bfloat16* __restrict__ src, int64_t stride,
                                              int ce, uint32_t tile, char* ptr) {
  const int q = threadIdx.x & 7, t0 = threadIdx.x >> 3;
#pragma unroll
  for (int u = 0; u < kRows * 8 / kThreads; ++u) {
    const int t = t0 + kThreads / 8 * u;
    const uint32_t off = Swz(t, q);
    if (t < ce) {
      mma_tiles::CpAsync16(tile + off, src + t * stride + 8 * q);
    } else {
      *reinterpret_cast<uint4*>(ptr + off) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// The matrix M (kW x kP1 fp32, row-major, in global memory, or kShared: in
// shared memory; with Mc: M + scale Mc) into kP planes (rows m, columns
// n < kW, swizzled) and its column kW into col (where not null); the block's
// kThreads threads, a row's column pairs over four of them. The walks stage
// their starting state with it (three planes), B7 D_bar and S_in.
template <int kP, int kThreads, bool kShared = false>
__device__ __forceinline__ void StagePlanes(const float* __restrict__ M,
                                            const float* __restrict__ Mc, float scale,
                                            __nv_bfloat16* planes, float* col) {
  static_assert((4 * kW) % kThreads == 0, "whole rows per pass");
#pragma unroll
  for (int pass = 0; pass < 4 * kW / kThreads; ++pass) {
    const int row = (threadIdx.x >> 2) + kThreads / 4 * pass, pr = threadIdx.x & 3;
    const float* Mrow = M + row * kP1;
    const float* Crow = Mc != nullptr ? Mc + row * kP1 : nullptr;
    float x[8][2];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float* at = &Mrow[2 * (pr + 4 * j) + c];
        x[j][c] = kShared ? *at : __ldg(at);
      }
    if (Crow != nullptr) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          x[j][c] = fmaf(scale, __ldg(&Crow[2 * (pr + 4 * j) + c]), x[j][c]);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      mma_tiles::StoreSplitPair<kP>(planes + SwzElem(row, 2 * (pr + 4 * j)) / 2, kPlaneBytes / 2,
                                    x[j][0], x[j][1]);
    }
    if (pr == 0 && col != nullptr) {
      float y = __ldg(&Mrow[kW]);
      if (Crow != nullptr) y = fmaf(scale, __ldg(&Crow[kW]), y);
      col[row] = y;
    }
  }
}

// S_in[k] (kW x kP1 fp32, row-major) from the planes and z; kThreads threads.
template <int kThreads>
__device__ __forceinline__ void WriteStateTo(const __nv_bfloat16* planes, const float* z,
                                             float* __restrict__ out) {
  for (int e = threadIdx.x; e < kW * kP1; e += kThreads) {
    const int row = e / kP1, col = e - row * kP1;
    float x;
    if (col < kW) {
      const __nv_bfloat16* at = planes + SwzElem(row, col) / 2;
      x = (__bfloat162float(at[0]) + __bfloat162float(at[kPlaneBytes / 2])) +
          __bfloat162float(at[kPlaneBytes]);
    } else {
      x = z[row];
    }
    out[e] = x;
  }
}

// S[:, dv] (z) += the column sums of the first kRows rows of the swizzled psi
// tile, on 128 threads (a warpgroup: piece c of r, tokens kRows / 16 a
// thread), in a fixed order: a thread's tokens in turn, then over the
// threads of a warp, then the warps (part: [4][kW] fp32 scratch). kBlock:
// the block's barrier between the partial sums and the adds (a block of one
// warpgroup), else named barrier 1 of warpgroup 0.
template <int kRows, bool kBlock>
__device__ __forceinline__ void AddPsiColumnSums(const char* psi_tile, float* part, float* z) {
  constexpr int kPer = kRows / 16;
  const int tid = threadIdx.x, c = tid & 7, tg = tid >> 3;
  float x[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const uint4 u = *reinterpret_cast<const uint4*>(psi_tile + Swz(kPer * tg + i, c));
    const uint32_t y[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[2 * e] += LowBf16(y[e]);
      x[2 * e + 1] += HighBf16(y[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    x[e] += __shfl_xor_sync(0xffffffffu, x[e], 8);
    x[e] += __shfl_xor_sync(0xffffffffu, x[e], 16);
  }
  const int w = tid >> 5, lane = tid & 31;
  if (lane < 8) {
#pragma unroll
    for (int e = 0; e < 8; ++e) part[w * kW + 8 * c + e] = x[e];
  }
  if constexpr (kBlock) {
    __syncthreads();
  } else {
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
  }
  if (tid < kW) {
    z[tid] += (part[tid] + part[kW + tid]) + (part[2 * kW + tid] + part[3 * kW + tid]);
  }
}

// Column dv of the state term for query row m of the swizzled tile phi_tile:
// phi_m . S[:, dv] (z, fp32), this lane's 16 r, then summed over the quad.
__device__ __forceinline__ float StateColumnTerm(const char* phi_tile, int m, int tq,
                                                 const float* z) {
  float x = 0.f;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const uint4 u = *reinterpret_cast<const uint4*>(phi_tile + Swz(m, 2 * tq + c));
    const uint32_t y[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = 16 * tq + 8 * c + 2 * e;
      x = fmaf(LowBf16(y[e]), z[n], x);
      x = fmaf(HighBf16(y[e]), z[n + 1], x);
    }
  }
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// The state term phi S of the 64 rows at shared offset phi_off (m64n64k16
// products from shared memory, kP of the planes at planes_off, the smallest
// first; acc's old values unread). The caller fences and commits.
template <int kP>
__device__ __forceinline__ void StateTermProducts(float (&acc)[8][4], const wgmma::DescBase& db,
                                                  uint32_t phi_off, uint32_t planes_off) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const uint64_t da = db.At(phi_off + 32 * ks);
#pragma unroll
    for (int q = kP - 1; q >= 0; --q) {
      wgmma::MmaSS<0, 1>(acc, da, db.At(planes_off + q * kPlaneBytes + 2048 * ks),
                         ks > 0 || q < kP - 1);
    }
  }
}

// Issues acc += the kP bf16 parts of the 64 x 64 tile sc (A from registers,
// split here; the smallest part first) times the 64 rows at shared offset
// b_off (MN-major: the rows are the reduction). The caller commits and waits;
// the parts' registers are the products' until then.
template <int kP>
__device__ __forceinline__ void IssueSplitProducts(const float (&sc)[8][4],
                                                   const wgmma::DescBase& db, uint32_t b_off,
                                                   float (&acc)[8][4]) {
  uint32_t xa[4][kP][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    mma_tiles::SplitTileParts<kP>(*reinterpret_cast<const float(*)[2][4]>(&sc[2 * kk]), xa[kk]);
  }
  wgmma::Fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t desc = db.At(b_off + 16 * kk * wgmma::kRowBytes);
#pragma unroll
    for (int q = kP - 1; q >= 0; --q) wgmma::MmaRS<1>(acc, xa[kk][q], desc);
  }
}

// A key block's scores sc (waited for) into the rows: masked above the
// diagonal where `diagonal`, summed into ones (column dv), split into kP
// bf16 parts and multiplied by the block's 64 vbar rows at shared offset
// v_off into acc, waited for.
template <int kP>
__device__ __forceinline__ void CausalProducts(float (&sc)[8][4], bool diagonal, int wi, int g,
                                               int tq, const wgmma::DescBase& db, uint32_t v_off,
                                               float (&ones)[2], float (&acc)[8][4]) {
  if (diagonal) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (8 * j + 2 * tq + (e & 1) > 16 * wi + g + 8 * (e >> 1)) sc[j][e] = 0.f;
      }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) ones[e >> 1] += sc[j][e];
  IssueSplitProducts<kP>(sc, db, v_off, acc);
  wgmma::Commit();
  wgmma::Wait<0>();
  wgmma::FenceOperands(acc);
}

// The thread's state rows 16 wi + g (+ 8) read exactly from the three planes
// into su (the accumulator layout), and written back split.
__device__ __forceinline__ void ReadStateRows(const __nv_bfloat16* planes, int wi, int g, int tq,
                                              float (&su)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const __nv_bfloat16* at = planes + SwzElem(16 * wi + g + 8 * hr, 8 * j + 2 * tq) / 2;
      float x0 = 0.f, x1 = 0.f;
#pragma unroll
      for (int q = 0; q < 3; ++q) {
        const __nv_bfloat162 y =
            *reinterpret_cast<const __nv_bfloat162*>(at + q * (kPlaneBytes / 2));
        x0 += __low2float(y);
        x1 += __high2float(y);
      }
      su[j][2 * hr] = x0;
      su[j][2 * hr + 1] = x1;
    }
}
__device__ __forceinline__ void WriteStateRows(__nv_bfloat16* planes, int wi, int g, int tq,
                                               const float (&su)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      mma_tiles::StoreSplitPair<3>(planes + SwzElem(16 * wi + g + 8 * hr, 8 * j + 2 * tq) / 2,
                                   kPlaneBytes / 2, su[j][2 * hr], su[j][2 * hr + 1]);
    }
}

}  // namespace walk_wgmma
}  // namespace smat
