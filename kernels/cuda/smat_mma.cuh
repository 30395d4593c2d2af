// Pieces of the SMat tensor-core kernels (smat_chunk_bwd_mma.cu,
// smat_chunk_fwd_mma.cu, smat_grouped_mma.cu): shared-memory addresses,
// 16-byte cp.async, ldmatrix, the m16n8k16 bf16 mma with fp32 accumulation,
// and the split of fp32 values into three bf16 parts x = x1 + x2 + x3
// (24 significant bits: exact for normal fp32) with the products of the
// exactness scheme (smat_chunk_mma.cu): one exact operand 3 MMAs, two split
// operands the 6 terms down to 2^-16 relative, the correction terms summed
// smallest first in an accumulator (lo) of their own.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace smat {
namespace mma_tiles {

__device__ __forceinline__ uint32_t SmemAddr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void CpAsyncWaitAll() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
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

}  // namespace mma_tiles
}  // namespace smat
