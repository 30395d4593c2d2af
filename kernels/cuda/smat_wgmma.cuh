// Warpgroup MMAs (wgmma, sm_90a) for the bf16 tiles: 128-byte swizzled
// shared-memory tiles, their matrix descriptors, and m64n64k16 products with
// fp32 accumulators, A from shared memory or from registers.
//
// A tile here is rows of 64 bf16 (128 bytes) in the 128-byte swizzle of the
// tensor-memory accelerator: the 16-byte piece c of row t sits at piece
// c ^ (t % 8) of its row, so eight consecutive rows form a 1024-byte atom and
// any eight lanes reading one piece of eight consecutive rows hit all 32
// banks. Tiles start on 1024-byte boundaries. Such a tile is read
//   - K-major (the row index is M or N, the 64 columns are K): an operand
//     whose rows are tokens and whose reduction runs over the columns
//     (phi as A and psi as B of the scores phi psi^T); a k-step of 16 starts
//     32 bytes further along the rows;
//   - MN-major (the row index is K, the 64 columns are M or N): an operand
//     reduced over its rows (vbar as B of P vbar, psi as A of psi^T vbar, a
//     state plane as B of phi S); a k-step of 16 starts 16 rows (2048 bytes)
//     further down.
// The accumulator of m64n64k16 holds, in warp w of the warpgroup, rows
// 16 w .. 16 w + 15 exactly as eight m16n8 tiles of mma.sync hold them
// (d[j][0..1]: row g, columns 8 j + 2 tq, + 1; d[j][2..3]: row g + 8), and
// A from registers takes the m16n8k16 A fragment of the same rows.
//
// Every wgmma reads shared memory through the async proxy: stores of the
// generic proxy (st.shared, cp.async) must be followed by FenceProxyAsync()
// in the storing thread before the barrier that orders them before the
// wgmma. Registers written by other instructions (accumulators, A fragments)
// need Fence() before the wgmma that reads them, and a wgmma's registers are
// only the caller's again after Wait<0>() and FenceOperands().
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace smat {
namespace wgmma {

constexpr int kRowBytes = 128;  // 64 bf16
constexpr int kAtomBytes = 8 * kRowBytes;

// Byte offset of the 16-byte piece c (0-7) of row t in a swizzled tile.
__device__ __forceinline__ uint32_t Swz(int t, int c) {
  return static_cast<uint32_t>(t * kRowBytes + ((c ^ (t & 7)) << 4));
}
// Byte offset of element (t, n) (n < 64) in a swizzled tile.
__device__ __forceinline__ uint32_t SwzElem(int t, int n) { return Swz(t, n >> 3) + 2 * (n & 7); }

// The block's dynamic shared memory from its first 1024-byte boundary, on
// which the atoms of the swizzled tiles must lie (a kernel asks for 1024
// bytes more than it uses): the generic pointer and the shared address.
__device__ __forceinline__ void DynamicSmem1024(char** ptr, uint32_t* addr) {
  extern __shared__ float4 smem4[];
  char* sm = reinterpret_cast<char*>(smem4);
  const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(sm));
  const uint32_t pad = ((sa + 1023u) & ~1023u) - sa;
  *ptr = sm + pad;
  *addr = sa + pad;
}

// Descriptors of 128-byte swizzled operands at byte offsets from one shared
// address: DescBase(addr).At(offset). 8-row groups lie 1024 bytes apart (the
// stride byte offset; K-major: along M/N, MN-major: along K); the leading
// byte offset is not read for these shapes (one 64-wide atom along M/N;
// K-major reads it as 1). The base goes through an opaque move, so that a
// loop recomputes its descriptors (two integer adds each) rather than
// holding dozens of loop-invariant 64-bit values in registers.
struct DescBase {
  uint32_t lo;
  __device__ __forceinline__ explicit DescBase(uint32_t addr) {
    asm volatile("mov.b32 %0, %1;\n" : "=r"(lo) : "r"(((addr & 0x3FFFF) >> 4) | (1u << 16)));
  }
  __device__ __forceinline__ uint64_t At(uint32_t offset) const {
    return (static_cast<uint64_t>((kAtomBytes >> 4) | (1u << 30)) << 32) | (lo + (offset >> 4));
  }
};

__device__ __forceinline__ void Fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void Commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kN>
__device__ __forceinline__ void Wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kN) : "memory");
}
// Generic-proxy stores to shared memory, visible to the async proxy (wgmma).
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving reads or writes of `d` across the
// surrounding wgmma fences, commits and waits.
__device__ __forceinline__ void FenceOperands(float (&d)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

#define SMAT_WGMMA_D32                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SMAT_WGMMA_D32_OPERANDS(d)                                                              \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),     \
      "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
      "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
      "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
      "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
      "+f"(d[7][2]), "+f"(d[7][3])

// d += A B (or with accumulate false d = A B, d's old values unread),
// m64n64k16, bf16 operands, fp32 accumulators; A and B from shared memory
// (kTransA / kTransB: 1 for an MN-major operand, 0 for K-major).
template <int kTransA, int kTransB>
__device__ __forceinline__ void MmaSS(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b,
                                      bool accumulate = true) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SMAT_WGMMA_D32
      ", %32, %33, p, 1, 1, %35, %36;\n}\n"
      : SMAT_WGMMA_D32_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kTransA), "n"(kTransB));
#else
  __trap();  // built for sm_90a only (kernels/cuda/CMakeLists.txt)
#endif
}

// d += A B, m64n64k16, A from registers (the warp's m16n8k16 A fragment of
// its 16 rows), B from shared memory.
template <int kTransB>
__device__ __forceinline__ void MmaRS(float (&d)[8][4], const uint32_t (&a)[4], uint64_t desc_b,
                                      bool accumulate = true) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SMAT_WGMMA_D32
      ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : SMAT_WGMMA_D32_OPERANDS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)),
        "n"(kTransB));
#else
  __trap();
#endif
}

#undef SMAT_WGMMA_D32
#undef SMAT_WGMMA_D32_OPERANDS

}  // namespace wgmma
}  // namespace smat
