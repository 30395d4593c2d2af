// The shared pieces of the fused forward tile of bf16 inputs
// (smat_chunk_fwd_mma.cu) and of the walk that carries the chunks' states in
// shared memory (smat_chunk_walk.cu): the block shape and shared-memory
// layout, where the rows go (Outputs), the per-block state every warp reads
// (Block) and a state's staging into bf16 planes (StageState). The tiles
// themselves, the kernels and their launchers stay in the .cu files.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_mma.cuh"

namespace smat {
namespace chunk_fwd_mma {

using cuda_detail::ChunkRow;
using cuda_detail::TokenRow;
using namespace mma_tiles;  // NOLINT: the tensor-core pieces are this file's vocabulary

constexpr int kThreads = 256;
constexpr int kC = 128;  // chunk tokens held
constexpr int kW = 64;   // widest r or dv
static_assert(kW == kTileWidth, "kFull means the widest tile");
constexpr int kLd = 72;           // bf16 row pitch of every staged tile
constexpr int kTile = kC * kLd;   // a token tile
constexpr int kPlane = kW * kLd;  // a plane of S_in
constexpr int kPhi = 0, kPsi = 1, kV = 2;
constexpr int kOffS = 3 * kTile;                // the three planes of S_in
constexpr int kOffTokens = kOffS + 3 * kPlane;  // fp32 lam, wq [kC] (bf16 units)
constexpr int kSmemBytes = kOffTokens * 2 + 2 * kC * 4;
static_assert(kOffTokens % 8 == 0, "the fp32 arrays must be 16-byte aligned");
// Finishing the outputs (kNorm) adds the left halves of the rows (columns
// 0-31, fp32, [kC][kLdY]) and each row's normaliser: 101 KB, still two
// blocks per SM.
constexpr int kLdY = 36;
constexpr int kSmemNormBytes = kSmemBytes + (kC * kLdY + kC) * 4;

// Where the rows go: ybar (written), or with kNorm o and den after the reads
// of recent rows are added (see LaunchSmatNormalizedOutputsFused).
struct Outputs {
  float* ybar;
  const float* reads;  // [batch, L, H, p], rows of local tokens >= recent_begin
  int64_t recent_begin;
  float eps;
  __nv_bfloat16* o;  // [batch, L, H, dv]
  float* den;        // [batch, L, H]
};

// kFull: r = dv = kW and 16-byte aligned rows (mma_tiles::TileWidths).
template <bool kFull>
struct Block : TileWidths<kFull> {
  __nv_bfloat16* base;
  int ce, nb;
  int g, tq;
  int off_a, off_bn, off_bt;  // ldmatrix lane offsets (see smat_chunk_bwd_mma.cu)
  __device__ const float* lam() const { return reinterpret_cast<const float*>(base + kOffTokens); }
  __device__ const float* wq() const { return lam() + kC; }
  // kNorm: the left halves of the rows and the normalisers' reciprocals.
  __device__ float* yleft() const { return reinterpret_cast<float*>(base) + kSmemBytes / 4; }
  __device__ float* inv_den() const { return yleft() + kC * kLdY; }
  __device__ uint32_t Addr(int elem, int row, int col, int off) const {
    return SmemAddr(base) + 2u * static_cast<uint32_t>(elem + row * kLd + col + off);
  }
};

// A state S (r x p fp32, rows p apart) into kP bf16 planes [kW][kLd] at
// `planes`, zero outside r x p. Thread t splits the column pairs (t % 4) + 4 j
// of row t / 4 (StoreSplitPair, one 4-byte store per plane); all loads of a
// thread issue before the first use (clamped indices, no branches).
template <int kP>
__device__ __forceinline__ void StageState(const float* __restrict__ S, int r, int p,
                                           __nv_bfloat16* planes) {
  static_assert(kThreads == 4 * kW && kLd % 8 == 0, "four threads per row of S_in");
  constexpr int kPairs = kLd / 8;  // column pairs per thread
  const int row = threadIdx.x >> 2, pair0 = threadIdx.x & 3;
  const float* Srow = S + min(row, r - 1) * p;
  float x[kPairs][2];
#pragma unroll
  for (int j = 0; j < kPairs; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int n = 2 * (pair0 + 4 * j) + c;
      const float y = __ldg(&Srow[min(n, p - 1)]);
      x[j][c] = row < r && n < p ? y : 0.f;
    }
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    StoreSplitPair<kP>(&planes[row * kLd + 2 * (pair0 + 4 * j)], kPlane, x[j][0], x[j][1]);
  }
}

// The block's Block: widths, lane offsets (see ChunkForwardFusedKernel).
template <bool kFull>
__device__ __forceinline__ Block<kFull> MakeBlock(__nv_bfloat16* base, int r, int dv) {
  Block<kFull> bk;
  bk.base = base;
  bk.ce = 0;
  bk.nb = 0;
  bk.r_ = r;
  bk.dv_ = dv;
  const int lane = threadIdx.x & 31;
  bk.g = lane >> 2;
  bk.tq = lane & 3;
  bk.off_a = (lane & 15) * kLd + (lane >> 4) * 8;
  bk.off_bn = ((lane & 7) + ((lane >> 4) << 3)) * kLd + ((lane >> 3) & 1) * 8;
  bk.off_bt = ((lane & 7) + ((lane >> 3) & 1) * 8) * kLd + (lane >> 4) * 8;
  return bk;
}

}  // namespace chunk_fwd_mma
}  // namespace smat
