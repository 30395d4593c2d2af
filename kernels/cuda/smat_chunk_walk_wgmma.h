// The walk of ChunkStatesAndOutputs at r = dv = 64 on warpgroup MMAs
// (smat_chunk_walk_wgmma.sm90a.cu), launched by smat_chunk_walk.cu after the
// segments' starting states are written, in place of ChunkWalkKernel.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/smat_chunk_fwd_mma.cuh"
#include "kernels/cuda/smat_cuda_kernels.h"

namespace smat {

// Whether the walk runs on warpgroup MMAs, on a device of compute
// capability 9.0 (which runs the sm_90a kernels): by default where it keeps
// no states (S_in null: the forward for inference), where it is the faster;
// ChunkWalkKernel (mma.sync) where it writes S_in (see the kernel's notes).
// SMAT_CUDA_CHUNK_TILES (read on every launch) = "wgmma" or "mma" takes one
// of the two for both.
bool SmatWalkOnWgmma(bool keeps_states);

// The walk of d's segments `ws` (grid batch * H x segments) from `starts`
// (as WalkStartsKernel writes them), r = dv = 64, bf16 rows 16-byte aligned;
// `parts` as SmatBf16SplitParts.
cudaError_t LaunchChunkWalkWgmma(const SmatCudaDims& d, const SmatChunkRuns& ws, const void* phi,
                                 const void* psi, const void* v, const float* starts, float* S_in,
                                 const chunk_fwd_mma::Outputs& out, int parts, cudaStream_t stream);

}  // namespace smat
