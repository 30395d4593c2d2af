// The walk of ChunkStatesAndOutputs (smat_chunk_walk.cu) at r = dv = 64 on
// warpgroup MMAs with one warpgroup per block: built for sm_90a alone
// (kernels/cuda/CMakeLists.txt) and launched on devices of compute
// capability 9.0 where SmatWalkChoice says so (smat_chunk_walk_wgmma.h): by
// default where the walk writes no S_in (the forward for inference). The
// walk with two warpgroups per block: smat_chunk_walk_wgmma.sm90a.cu; their
// shared pieces: smat_chunk_walk_wgmma.cuh.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_chunk_fwd_mma.cuh"
#include "kernels/cuda/smat_chunk_walk_wgmma.cuh"
#include "kernels/cuda/smat_chunk_walk_wgmma.h"
#include "kernels/cuda/smat_cuda_kernels.h"
#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_mma.cuh"
#include "kernels/cuda/smat_wgmma.cuh"

namespace smat {
namespace {

using namespace walk_wgmma;  // NOLINT: the walks' shared pieces
using chunk_fwd_mma::Outputs;
using cuda_detail::ChunkRow;
using cuda_detail::TokenRow;
using mma_tiles::CpAsync16;

// ChunkWalkWgmma64Kernel walks the segments of ChunkWalkWgmmaKernel with one
// warpgroup per block (128 threads, 50 KB of shared memory: four blocks per
// SM, twice the independent walks of ChunkWalkWgmmaKernel) and takes a chunk
// in pieces of up to 64 rows: the state entering a piece is the chunk's entering state
// plus the products of the chunk's earlier pieces, so each piece needs the
// causal sums of its own diagonal block only (64 x 64: the chunk's other key
// block is in the state), 16 of the 20 products per 64 rows that the
// two-warpgroup walk runs. Per piece: the state term and the scores as two
// asynchronous groups at once, the split scores times vbar, the rows
// finished and staged in phi's tile (free once its products are done), the
// update S += psi^T vbar and the column sums of psi, the o rows written
// while the update's products run. S_in[k] is the state entering chunk k's
// first piece.
//
// Speed (H200, bf16, batch 1, 8 heads, T = 524288, c = 128, 2026-12-02, two
// hosts, SmatForward for inference): d = 1 1.358-1.370 ms against 1.382-1.417
// for ChunkWalkWgmmaKernel, d = 2 2.020-2.054 against 2.108-2.173; writing
// S_in (ChunkStatesAndOutputs) d = 1 1.533 against 1.500-1.522 ms for
// ChunkWalkKernel, d = 2 1.658 against 1.686-1.695. So SmatWalkChoice takes
// it where the walk keeps no states.
constexpr int kThreads64 = 128;
constexpr int kRows64 = 64;
constexpr int kTile64 = kRows64 * wgmma::kRowBytes;  // a piece's token tile, [64][kW] swizzled
constexpr int k64OffPhi = 0, k64OffPsi = kTile64, k64OffV = 2 * kTile64;
constexpr int k64OffPlanes = 3 * kTile64;
constexpr int k64OffZ = k64OffPlanes + 3 * kPlaneBytes;
constexpr int k64OffZPart = k64OffZ + kW * 4;
constexpr int k64SmemBytes = k64OffZPart + 4 * kW * 4 + 1024;  // + room to align the base
static_assert(k64OffPlanes % 1024 == 0, "atoms on 1024-byte lines");
static_assert(4 * (k64SmemBytes + 1024) <= 228 * 1024, "four blocks per SM");

// grid (batch * H, s1 - s0), kThreads64 threads, k64SmemBytes of shared
// memory (four blocks per SM).
template <int kP>
__global__ void __launch_bounds__(kThreads64, 4)
    ChunkWalkWgmma64Kernel(SmatCudaDims d, SmatChunkRuns ws, const __nv_bfloat16* __restrict__ phi,
                           const __nv_bfloat16* __restrict__ psi,
                           const __nv_bfloat16* __restrict__ v, const float* __restrict__ starts,
                           float* __restrict__ S_in, Outputs out, int seg0) {
  char* sm;
  uint32_t sa;
  wgmma::DynamicSmem1024(&sm, &sa);
  const int tid = threadIdx.x, wi = tid >> 5;
  const int lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int bh = blockIdx.x, s = seg0 + static_cast<int>(blockIdx.y);
  const int b = bh / d.H, h = bh - b * d.H;
  int k0, k1;
  cuda_detail::RunChunks(ws, d.Lc, s, &k0, &k1);
  constexpr int64_t kState = int64_t{kW} * kP1;
  StagePlanes<3, kThreads64>(
      starts + (static_cast<int64_t>(bh) * (ws.seg_d + ws.seg_r) + s) * kState, nullptr, 1.f,
      reinterpret_cast<__nv_bfloat16*>(sm + k64OffPlanes), reinterpret_cast<float*>(sm + k64OffZ));
  __nv_bfloat16* const planes = reinterpret_cast<__nv_bfloat16*>(sm + k64OffPlanes);
  const float* const z = reinterpret_cast<const float*>(sm + k64OffZ);
  // The o rows wait in phi's tile once its products are done.
  __nv_bfloat16* const ostage = reinterpret_cast<__nv_bfloat16*>(sm + k64OffPhi);
  const int64_t stride = static_cast<int64_t>(d.H) * kW;
  const bool vec_out = (reinterpret_cast<uintptr_t>(out.o) & 15) == 0;
  __syncthreads();  // the planes and z staged
  for (int k = k0; k < k1; ++k) {
    const int64_t c0 = static_cast<int64_t>(k) * d.chunk;
    const int cl = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));
    const bool read = out.reads != nullptr && c0 >= out.recent_begin;  // chunks never cross n
    for (int u0 = 0; u0 < cl; u0 += kRows64) {
      const int ce = min(kRows64, cl - u0);
      const int64_t tok0 = TokenRow(d, b, c0 + u0, h);
      if (read) {
        for (int e = tid; e < 3 * ce; e += kThreads64) {
          const int m = e / 3, piece = e - 3 * m;
          const char* row =
              reinterpret_cast<const char*>(out.reads + (tok0 + int64_t{m} * d.H) * kP1);
          asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(row + 128 * piece));
        }
      }
      StageTileRows<kRows64, kThreads64>(phi + tok0 * kW, stride, ce, sa + k64OffPhi,
                                         sm + k64OffPhi);
      StageTileRows<kRows64, kThreads64>(psi + tok0 * kW, stride, ce, sa + k64OffPsi,
                                         sm + k64OffPsi);
      StageTileRows<kRows64, kThreads64>(v + tok0 * kW, stride, ce, sa + k64OffV, sm + k64OffV);
      mma_tiles::CpAsyncCommit();
      if (S_in != nullptr && u0 == 0) {
        WriteStateTo<kThreads64>(planes, z, S_in + ChunkRow(d, b, k, h) * kState);
      }
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
      wgmma::FenceProxyAsync();
      __syncthreads();  // the piece's tiles are in

      const wgmma::DescBase db(sa);
      // The state term and the scores, two groups in flight together.
      float acc[8][4], sc[8][4];
      wgmma::Fence();
      StateTermProducts<kP>(acc, db, k64OffPhi, k64OffPlanes);
      wgmma::Commit();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        wgmma::MmaSS<0, 0>(sc, db.At(k64OffPhi + 32 * ks), db.At(k64OffPsi + 32 * ks), ks > 0);
      }
      wgmma::Commit();
      float yd[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        yd[hr] = StateColumnTerm(sm + k64OffPhi, 16 * wi + g + 8 * hr, tq, z);
      }
      wgmma::Wait<0>();
      wgmma::FenceOperands(acc);
      wgmma::FenceOperands(sc);
      // The diagonal block: masked, summed into column dv, split, times vbar.
      float ones[2] = {0.f, 0.f};
      CausalProducts<kP>(sc, true, wi, g, tq, db, k64OffV, ones, acc);
      // The rows: column dv, the reads of recent rows, den and o (staged).
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float x = ones[hr];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        yd[hr] += x;
        const int m = 16 * wi + g + 8 * hr;
        const bool here = m < ce;
        const int64_t row = tok0 + int64_t{min(m, ce - 1)} * d.H;
        if (read && here) {
          const float* src = out.reads + row * kP1;
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e1 = 0; e1 < 2; ++e1) acc[j][2 * hr + e1] += src[8 * j + 2 * tq + e1];
          yd[hr] += src[kW];
        }
        const float dn = yd[hr] + out.eps, inv = 1.f / dn;
        if (here && tq == 0) out.den[row] = dn;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          *reinterpret_cast<__nv_bfloat162*>(ostage + SwzElem(m, 8 * j + 2 * tq) / 2) =
              __floats2bfloat162_rn(__fmul_rn(acc[j][2 * hr], inv),
                                    __fmul_rn(acc[j][2 * hr + 1], inv));
        }
      }
      // S += psi^T vbar: rows 16 wi + g (+ 8) of the state, read exactly from
      // the planes (each thread reads and later writes the same elements),
      // the products added, split back.
      float su[8][4];
      ReadStateRows(planes, wi, g, tq, su);
      wgmma::Fence();
#pragma unroll
      for (int kk = 0; kk < kRows64 / 16; ++kk) {  // rows past ce are zeros
        wgmma::MmaSS<1, 1>(su, db.At(k64OffPsi + 16 * kk * wgmma::kRowBytes),
                           db.At(k64OffV + 16 * kk * wgmma::kRowBytes));
      }
      wgmma::Commit();
      // Past its barrier every o row is staged.
      AddPsiColumnSums<kRows64, true>(sm + k64OffPsi, reinterpret_cast<float*>(sm + k64OffZPart),
                                      reinterpret_cast<float*>(sm + k64OffZ));
      // The piece's o rows out while the update's products run.
      {
        const int64_t row0 = tok0;
        for (int e = tid; e < ce * 8; e += kThreads64) {
          const int t = e >> 3, q = e & 7;
          const uint4 x = *reinterpret_cast<const uint4*>(sm + k64OffPhi + Swz(t, q));
          __nv_bfloat16* dst = out.o + (row0 + int64_t{t} * d.H) * kW + 8 * q;
          if (vec_out) {
            *reinterpret_cast<uint4*>(dst) = x;
          } else {
            const __nv_bfloat16* xs = reinterpret_cast<const __nv_bfloat16*>(&x);
#pragma unroll
            for (int i = 0; i < 8; ++i) dst[i] = xs[i];
          }
        }
      }
      wgmma::Wait<0>();
      wgmma::FenceOperands(su);
      WriteStateRows(planes, wi, g, tq, su);
      wgmma::FenceProxyAsync();  // the planes' stores, before the next piece's products
      __syncthreads();           // the tiles free again, the planes and z updated
    }
  }
}

}  // namespace

cudaError_t LaunchChunkWalkWgmma64(const SmatCudaDims& d, const SmatChunkRuns& ws, int s0, int s1,
                                   const void* phi, const void* psi, const void* v,
                                   const float* starts, float* S_in,
                                   const chunk_fwd_mma::Outputs& out, int parts,
                                   cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(d.batch * d.H), static_cast<unsigned>(s1 - s0));
  auto bf = [](const void* x) { return static_cast<const __nv_bfloat16*>(x); };
  return mma_tiles::WithSplitParts(parts, [&](auto kp) {
    auto kernel = ChunkWalkWgmma64Kernel<decltype(kp)::value>;
    cudaError_t err = mma_tiles::AllowSharedMemory(kernel, k64SmemBytes);
    if (err != cudaSuccess) return err;
    kernel<<<grid, kThreads64, k64SmemBytes, stream>>>(d, ws, bf(phi), bf(psi), bf(v), starts, S_in,
                                                       out, s0);
    return cudaGetLastError();
  });
}

}  // namespace smat
