// B7 of ChunkBackward on warpgroup MMAs (smat_chunk_bwd_wgmma.sm90a.cu, built
// for sm_90a alone): phi_bar, psi_bar and v_bar of a chunk for ungated bf16
// inputs at r = dv = 64 from gbar's factors, written (SmatWrite::kAssign).
// LaunchSmatChunkOutputsBackwardFused (smat_chunk_bwd_mma.cu) takes it where
// SmatChunkBackwardOnWgmma says so; every other B7 stays on mma.sync there.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/smat_cuda_kernels.h"

namespace smat {

// Whether B7 runs on warpgroup MMAs where it fits: on a device of compute
// capability 9.0 unless SMAT_CUDA_CHUNK_TILES is "mma" (read on every launch).
bool SmatChunkBackwardOnWgmma();

// B7 as LaunchSmatChunkOutputsBackwardFused with assign and `factors`, for
// lam == nullptr, r = dv = 64, c <= 128, bf16 rows (phi, psi, v, d_o) 16-byte
// aligned, S_in 16-byte aligned and the outputs 8-byte aligned; `parts` as
// SmatBf16SplitParts. The rows `adds` names are added to, the others written.
cudaError_t LaunchChunkBackwardWgmma(const SmatCudaDims& d, const void* phi, const void* psi,
                                     const void* v, const float* S_in, const float* gbar,
                                     const float* D_bar, float* phi_bar, float* psi_bar,
                                     float* v_bar, const SmatDBarCarry& carry,
                                     const SmatGbarFactors& factors,
                                     const SmatChunkBackwardAdds& adds, int parts,
                                     cudaStream_t stream);

}  // namespace smat
