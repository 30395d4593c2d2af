// The launches of the chunk tiles F6 / B7 that the FFMA tiles
// (smat_chunk_fast.cu) and the tensor-core tiles (smat_chunk_mma.cu) share.
// Each of those files has one kernel template of the four tile kinds (its own
// enum Kind: kForward, kQuery, kKeyPsi, kKeyV) and the input type In (fp32 or
// bf16), all with the signature
//   (SmatCudaDims d, bool vec_in, const In* phi, const In* psi, const In* v,
//    const float* gbar, const float* lam, const float* cd, const float* M,
//    float* out),
// one block per (chunk, b * H) (ChunkGrid). Only the kernel and its block
// differ; a file names them for the launchers below in a struct Tiles:
//   struct Tiles : chunk_launch::TileBlock<Kind, threads, shared-memory bytes> {
//     template <Kind kKind, typename In>
//     static auto Kernel() { return TileKernel<kKind, In>; }
//   };
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels/cuda/smat_cuda_kernels.h"
#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_fast_tiles.cuh"

namespace smat {
namespace chunk_launch {

// The block of a file's tiles: the kinds' enum, the threads and the bytes of
// dynamic shared memory of one block.
template <typename Kind, int kThreads, size_t kSmem>
struct TileBlock {
  using TileKind = Kind;
  static constexpr int kBlockThreads = kThreads;
  static constexpr size_t kSmemBytes = kSmem;
};

// The tile of kind kKind with inputs In: out from phi, psi, v, gbar, the gates
// lam and cd and the chunk matrix M. vec_in: the phi, psi and v rows can be
// read 16 bytes at a time.
template <typename Tiles, typename Tiles::TileKind kKind, typename In>
cudaError_t LaunchTileAs(const SmatCudaDims& d, const void* phi, const void* psi, const void* v,
                         const float* gbar, const float* lam, const float* cd, const float* M,
                         float* out, cudaStream_t stream) {
  constexpr size_t kSmem = Tiles::kSmemBytes;
  auto kernel = Tiles::template Kernel<kKind, In>();
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  constexpr int V = 16 / sizeof(In);
  const bool vec = d.r % V == 0 && d.dv % V == 0 && fast_tiles::Aligned16(phi) &&
                   fast_tiles::Aligned16(psi) && fast_tiles::Aligned16(v);
  const dim3 grid = cuda_detail::ChunkGrid(d);
  kernel<<<grid, Tiles::kBlockThreads, kSmem, stream>>>(
      d, vec, static_cast<const In*>(phi), static_cast<const In*>(psi), static_cast<const In*>(v),
      gbar, lam, cd, M, out);
  return cudaGetLastError();
}

// LaunchTileAs for the inputs' dtype: bf16 when d.bf16, else fp32.
template <typename Tiles, typename Tiles::TileKind kKind>
cudaError_t LaunchTile(const SmatCudaDims& d, const void* phi, const void* psi, const void* v,
                       const float* gbar, const float* lam, const float* cd, const float* M,
                       float* out, cudaStream_t stream) {
  return d.bf16 ? LaunchTileAs<Tiles, kKind, __nv_bfloat16>(d, phi, psi, v, gbar, lam, cd, M, out,
                                                            stream)
                : LaunchTileAs<Tiles, kKind, float>(d, phi, psi, v, gbar, lam, cd, M, out, stream);
}

// B7 as the three tiles that add (+=): the outputs set to 0 first when
// assign, then phi_bar from the query tile (M = S_in), psi_bar and v_bar from
// the key tiles (M = D_bar).
template <typename Tiles>
cudaError_t LaunchBackwardTiles(const SmatCudaDims& d, const void* phi, const void* psi,
                                const void* v, const float* lam, const float* chunk_decay,
                                const float* S_in, const float* gbar, const float* D_bar,
                                float* phi_bar, float* psi_bar, float* v_bar, bool assign,
                                cudaStream_t stream) {
  using Kind = typename Tiles::TileKind;
  cudaError_t err =
      assign ? ZeroSmatChunkOutputsBackward(d, phi_bar, psi_bar, v_bar, stream) : cudaSuccess;
  if (err != cudaSuccess) return err;
  err = LaunchTile<Tiles, Kind::kQuery>(d, phi, psi, v, gbar, lam, chunk_decay, S_in, phi_bar,
                                        stream);
  if (err != cudaSuccess) return err;
  err = LaunchTile<Tiles, Kind::kKeyPsi>(d, phi, psi, v, gbar, lam, chunk_decay, D_bar, psi_bar,
                                         stream);
  if (err != cudaSuccess) return err;
  return LaunchTile<Tiles, Kind::kKeyV>(d, phi, psi, v, gbar, lam, chunk_decay, D_bar, v_bar,
                                        stream);
}

}  // namespace chunk_launch
}  // namespace smat
