// The bulk copy engine (the tensor-memory accelerator, TMA, sm_90) for the
// kernels on warpgroup MMAs: tensor maps of the token tensors, the copies of
// a tile of rows into shared memory against an mbarrier, and the mbarrier's
// arrive and wait. Built for sm_90a only (kernels/cuda/CMakeLists.txt).
//
// A token tensor [batch, L, H, 64] of bf16 is mapped in four dimensions
// (64 columns, H, L, batch), so that a box of 64 columns, one head and kRows
// tokens of one sequence lands in shared memory as kRows rows of 128 bytes in
// the 128-byte swizzle of smat_wgmma.cuh (the tile must start on a 1024-byte
// boundary), and the rows past the sequence's end come in as zeros. The copy
// always credits the whole box's bytes to the mbarrier, zeros included.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace smat {
namespace tma {

// --- host ---

// The driver's cuTensorMapEncodeTiled, found through the runtime (so that
// libsmat_cuda.so links no libcuda), or null where the runtime or driver
// lacks it.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeTiledFn EncodeTiled() {
  static const EncodeTiledFn fn = []() -> EncodeTiledFn {
#if CUDART_VERSION >= 12050
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return nullptr;
    }
    return reinterpret_cast<EncodeTiledFn>(p);
#else
    return nullptr;
#endif
  }();
  return fn;
}

// The map of token tensor x ([batch, L, H, 64] bf16, 16-byte aligned) whose
// box is kRows tokens of one head, 128-byte swizzled. False where the driver
// cannot encode it (the caller stages the rows itself).
inline bool TokenRowsMap(const void* x, int64_t batch, int64_t L, int64_t H, uint32_t rows,
                         CUtensorMap* map) {
  const EncodeTiledFn encode = EncodeTiled();
  if (encode == nullptr || (reinterpret_cast<uintptr_t>(x) & 15) != 0) return false;
  const cuuint64_t dims[4] = {64, static_cast<cuuint64_t>(H), static_cast<cuuint64_t>(L),
                              static_cast<cuuint64_t>(batch)};
  const cuuint64_t row = 64 * 2;  // bytes
  const cuuint64_t strides[3] = {row, row * H, row * H * L};
  const cuuint32_t box[4] = {64, 1, rows, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(x), dims, strides, box,
                unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// --- device ---

// An mbarrier at shared address `bar` expecting `count` arrivals a phase.
__device__ __forceinline__ void BarrierInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialized mbarriers visible to the bulk copy engine (then a
// block barrier makes them visible to the other threads).
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// This thread's arrival, announcing `bytes` more to come by bulk copies.
__device__ __forceinline__ void ArriveExpectBytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void Wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// The box at (column 0, head h, token t, sequence b) of `map` into shared
// memory at `dst` (1024-byte aligned), completing bytes on `bar`.
__device__ __forceinline__ void LoadRows(uint32_t dst, const CUtensorMap* map, int h, int t, int b,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(h), "r"(t), "r"(b), "r"(bar)
      : "memory");
}

}  // namespace tma
}  // namespace smat
