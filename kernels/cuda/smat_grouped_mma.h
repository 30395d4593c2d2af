// The grouped SMat outer sums (F2 chunk summaries, profile pooling, B5 chunk
// state gradients, the type-table gradient of B2) on tensor cores: see
// smat_grouped_mma.cu. smat_grouped_fast.cu calls them where
// SmatUseMmaGrouped says so.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/smat_cuda_kernels.h"

namespace smat {

// Whether the outer sums (reads = false) or the per-token reads (reads =
// true) run here: the sizes fit (c <= 128, r <= 64, p <= 72), the device has
// sm_80 tensor cores and the shared memory, and SMAT_CUDA_GROUPED asks for
// them: "mma" both, "ffma" neither (the FFMA kernels of smat_grouped_fast.cu);
// unset, the outer sums run here and the reads on FFMA (the faster of each),
// except where the reads of smat_reads_bf16.cu take them (SmatUseReadsBf16).
bool SmatUseMmaGrouped(const SmatCudaDims& dims, bool reads);

// LaunchSmatGroupedOuterSum's contract (smat_cuda_kernels.h), on tensor cores.
cudaError_t LaunchSmatGroupedOuterSumMma(const SmatCudaDims& dims, const SmatTokenGroups& groups,
                                         int segments, const void* a, const void* b, bool b_is_v,
                                         const SmatTokenWeights& w, const SmatMatrixLayout& layout,
                                         float* out, cudaStream_t stream);

// The outer sums with bf16 rows (smat_outer_bf16.cu): bf16 inputs, r % 8 ==
// 0, r <= 64, p <= 72, 16-byte aligned rows (v: dv % 8 == 0); b = gbar with
// unit weights (w.lam and w.extra null), b = vbar with any. The same bits as
// the kernels of smat_grouped_mma.cu. LaunchSmatGroupedOuterSumMma runs them
// where they fit.
bool SmatOuterSumBf16Fits(const SmatCudaDims& dims, const void* a, const void* b, bool b_is_v,
                          const SmatTokenWeights& w);
cudaError_t LaunchSmatOuterSumBf16(const SmatCudaDims& dims, const SmatTokenGroups& groups,
                                   int segments, const void* a, const void* b, bool b_is_v,
                                   const SmatTokenWeights& w, const SmatMatrixLayout& layout,
                                   float* out, cudaStream_t stream);

// LaunchSmatGroupedReads's contract (smat_cuda_kernels.h), on tensor cores.
cudaError_t LaunchSmatGroupedReadsMma(const SmatCudaDims& dims, const SmatTokenGroups& groups,
                                      int segments, SmatReadKind kind, const float* M,
                                      const SmatMatrixLayout& m_layout, const void* a,
                                      const void* v, const float* g, const SmatTokenWeights& w,
                                      float* out_p, float* out_r, float* out_v, bool assign,
                                      cudaStream_t stream);

// The reads with the tokens as the rows of tensor-core products
// (smat_reads_bf16.cu): c <= 128, r, dv <= 64; kVecMat and kBoth with bf16
// inputs, r % 8 == 0 and 16-byte aligned rows (kBoth: dv % 8 == 0 too),
// kMatVec (gbar only) for either dtype. SmatUseReadsBf16: they fit and
// SMAT_CUDA_GROUPED is not "ffma" (kMatVec, slower than FFMA, only with
// "mma"); smat_grouped_fast.cu then runs them in place of the FFMA and
// general tensor-core reads.
bool SmatReadsBf16Fits(const SmatCudaDims& dims, SmatReadKind kind, const void* a, const void* v);
bool SmatUseReadsBf16(const SmatCudaDims& dims, SmatReadKind kind, const void* a, const void* v);
cudaError_t LaunchSmatReadsBf16(const SmatCudaDims& dims, const SmatTokenGroups& groups,
                                int segments, SmatReadKind kind, const float* M,
                                const SmatMatrixLayout& m_layout, const void* a, const void* v,
                                const float* g, const SmatTokenWeights& w, float* out_p,
                                float* out_r, float* out_v, bool assign, cudaStream_t stream);

// kVecMat (TypeReads) at r = dv = 64 with each group's matrix held in
// registers (smat_reads_held_bf16.cu): bf16 a with 16-byte aligned rows,
// c <= 128. LaunchSmatReadsBf16 runs it where its blocks hold a whole tile
// of tokens on average.
bool SmatHeldReadsFit(const SmatCudaDims& dims, const void* a);
cudaError_t LaunchSmatHeldReadsBf16(const SmatCudaDims& dims, const SmatTokenGroups& groups,
                                    int segments, const float* M, const SmatMatrixLayout& m_layout,
                                    const void* a, const SmatTokenWeights& w, float* out_p,
                                    bool assign, cudaStream_t stream);

// kVecMat (TypeReads) at r = dv = 64 for groups of few tokens
// (smat_reads_few_bf16.cu): resident blocks that walk the (group, segment,
// head) items with the next item's matrix and rows on their way. bf16 a,
// fp32 M, both 16-byte aligned, c <= 128; SMAT_CUDA_READS=tiles declines it.
// LaunchSmatReadsBf16 runs it where the held kernel's blocks would not hold
// a whole tile of tokens on average.
bool SmatFewReadsFit(const SmatCudaDims& dims, const float* M, const void* a);
cudaError_t LaunchSmatFewReadsBf16(const SmatCudaDims& dims, const SmatTokenGroups& groups,
                                   int segments, const float* M, const SmatMatrixLayout& m_layout,
                                   const void* a, const SmatTokenWeights& w, float* out_p,
                                   bool assign, cudaStream_t stream);

}  // namespace smat
