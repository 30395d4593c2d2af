// The walk of ChunkStatesAndOutputs at r = dv = 64 on warpgroup MMAs
// (smat_chunk_walk_wgmma.sm90a.cu), launched by smat_chunk_walk.cu after the
// segments' starting states are written, in place of ChunkWalkKernel.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/smat_chunk_fwd_mma.cuh"
#include "kernels/cuda/smat_cuda_kernels.h"

namespace smat {

// Which kernel walks the chunks at r = dv = 64: ChunkWalkKernel (mma.sync,
// smat_chunk_walk.cu), or on warpgroup MMAs on a device of compute
// capability 9.0 (which runs the sm_90a kernels): two warpgroups per block
// and a whole chunk per step (kWgmma), or one warpgroup per block and 64 rows
// per step, four blocks per SM (kWgmma64; three with the bulk copy engine,
// SmatWalk64Tma). By default kWgmma64 where `prefer64` (the caller's: where
// the walk keeps no states, the forward for inference, or where it adds no
// reads and has the bulk copy engine), else kMma: the faster there (see the
// kernels' notes). SMAT_CUDA_CHUNK_TILES (read on every launch) = "mma",
// "wgmma" or "wgmma64" takes one of them for both (where the device has
// warpgroup MMAs).
enum class SmatWalk { kMma, kWgmma, kWgmma64 };
SmatWalk SmatWalkChoice(bool prefer64);

// The walk of segments [s0, s1) of d's `ws` (grid batch * H x (s1 - s0))
// from `starts` (as WalkStartsKernel writes them), r = dv = 64, bf16 rows
// 16-byte aligned, `parts` as SmatBf16SplitParts: on two warpgroups per block
// (kWgmma, smat_chunk_walk_wgmma.sm90a.cu) or one (kWgmma64,
// smat_chunk_walk_wgmma64.sm90a.cu).
cudaError_t LaunchChunkWalkWgmma(const SmatCudaDims& d, const SmatChunkRuns& ws, int s0, int s1,
                                 const void* phi, const void* psi, const void* v,
                                 const float* starts, float* S_in,
                                 const chunk_fwd_mma::Outputs& out, int parts, cudaStream_t stream);
cudaError_t LaunchChunkWalkWgmma64(const SmatCudaDims& d, const SmatChunkRuns& ws, int s0, int s1,
                                   const void* phi, const void* psi, const void* v,
                                   const float* starts, float* S_in,
                                   const chunk_fwd_mma::Outputs& out, int parts,
                                   cudaStream_t stream);

// The kWgmma64 walk with the rows brought in by the bulk copy engine one
// piece ahead (three blocks per SM), where SmatWalk64Tma(d) says so; else
// (no tensor maps from the driver) LaunchChunkWalkWgmma64.
inline constexpr int kWalk64TmaBlocksPerSm = 3;
bool SmatWalk64Tma(const SmatCudaDims& d);
cudaError_t LaunchChunkWalkWgmma64Tma(const SmatCudaDims& d, const SmatChunkRuns& ws, int s0,
                                      int s1, const void* phi, const void* psi, const void* v,
                                      const float* starts, float* S_in,
                                      const chunk_fwd_mma::Outputs& out, int parts,
                                      cudaStream_t stream);

}  // namespace smat
