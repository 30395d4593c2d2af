// The walk of ChunkStatesAndOutputs (smat_chunk_walk.cu) at r = dv = 64 on
// warpgroup MMAs: built for sm_90a alone (kernels/cuda/CMakeLists.txt) and
// launched on devices of compute capability 9.0 where SmatWalkChoice says
// so: by default where the walk writes no S_in (the forward for inference),
// there one warpgroup per block (ChunkWalkWgmma64Kernel,
// smat_chunk_walk_wgmma64.sm90a.cu; the shared pieces:
// smat_chunk_walk_wgmma.cuh).
//
// ChunkWalkWgmmaKernel: one block walks a segment's chunks of one (b, h)
// from the state entering it, as ChunkWalkKernel does, with the same three
// bf16 planes holding the state's 64 x 64 block exactly; its column dv (the sums of psi that become
// the denominators) is held in fp32 beside them. Per chunk, warpgroup wg
// (warps 4 wg .. 4 wg + 3) takes query rows 64 wg .. 64 wg + 63:
//   1. the state term phi S, m64n64k16 from the swizzled phi tile and each
//      plane (kP of them, the smallest first), and phi . S[:, dv] on the
//      CUDA cores; then the block's barrier (the state is read);
//   2. the causal sums over key blocks of 64 (wg + 1 of them): the scores
//      phi psi^T (m64n64k16 from shared memory), the diagonal block masked,
//      their row sums in fp32 (column dv of vbar is ones), then the scores in
//      kP bf16 parts times vbar (A from registers);
//   3. warpgroup 0: S += psi^T vbar over the chunk (exact bf16 products) and
//      S[:, dv] += the chunk's column sums of psi, back into the planes;
//   4. the rows finished as FinishQueryRows does (the reads of recent rows,
//      den, o = y / den in bf16), staged and written while the next chunk
//      loads.
// Each warpgroup's products run as one asynchronous group that a warpgroup
// waits for before it reads their results; the score tiles of the diagonal
// blocks are computed whole and masked (6 of their 16 tiles of 16 x 16 lie
// above the diagonal: 15% of a chunk's products).
//
// Speed (H200, bf16, batch 1, 8 heads, T = 524288, c = 128, 2026-12-02, one
// binary, SMAT_CUDA_CHUNK_TILES choosing the walk; the phase
// ChunkStatesAndOutputs includes the totals, 0.29 ms): writing S_in, 1.526
// ms at d = 1 against 1.490-1.494 ms for ChunkWalkKernel (d = 2: 1.761
// against 1.688-1.691); without S_in, SmatForward for inference takes 1.407
// ms at d = 1 against 1.476-1.488 ms, and 2.154 against 2.199-2.232 ms at
// d = 2. Not kept: one block per SM (255 registers) with the next chunk's
// rows loading into a second stage while a chunk runs, the first key
// block's scores in the state term's group and the next key block's beside
// the products: 1.983 ms at d = 1 (Nsight Compute: 0.52 eligible warps per
// scheduler, the CUDA-core work between the groups, the split, the sums and
// the stores, run by 8 warps per SM where ChunkWalkKernel has 16); at two
// blocks per SM those groups need more than 128 registers (up to 300 bytes
// of spills).
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "kernels/cuda/smat_chunk_fwd_mma.cuh"
#include "kernels/cuda/smat_chunk_walk_wgmma.cuh"
#include "kernels/cuda/smat_chunk_walk_wgmma.h"
#include "kernels/cuda/smat_cuda_kernels.h"
#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_mma.cuh"
#include "kernels/cuda/smat_wgmma.cuh"

namespace smat {
namespace {

using chunk_fwd_mma::Outputs;
using cuda_detail::ChunkRow;
using cuda_detail::TokenRow;
using mma_tiles::CpAsync16;
using namespace walk_wgmma;  // NOLINT: the walks' shared pieces

constexpr int kThreads = 256;
constexpr int kC = 128;                            // chunk tokens held
constexpr int kTileBytes = kC * wgmma::kRowBytes;  // a token tile, [kC][kW] swizzled
constexpr int kOffPhi = 0, kOffPsi = kTileBytes, kOffV = 2 * kTileBytes;
constexpr int kOffPlanes = 3 * kTileBytes;
constexpr int kOffZ = kOffPlanes + 3 * kPlaneBytes;  // fp32 S[:, dv]
constexpr int kOffZPart = kOffZ + kW * 4;            // fp32 [4][kW]: psi's column sums by warp
constexpr int kOutLd = 72;                           // bf16 pitch of the staged o rows
constexpr int kOffOut = kOffZPart + 4 * kW * 4;
constexpr int kSmemBytes = kOffOut + kC * kOutLd * 2 + 1024;  // + room to align the base
static_assert(kOffPlanes % 1024 == 0 && kPlaneBytes % 1024 == 0, "atoms on 1024-byte lines");

// The o rows of the chunk at c0 (ce tokens) from the staging rows to memory.
__device__ __forceinline__ void StoreRows(const SmatCudaDims& d, int b, int h, int64_t c0, int ce,
                                          const __nv_bfloat16* ostage,
                                          __nv_bfloat16* __restrict__ o, bool vec) {
  const int64_t row0 = TokenRow(d, b, c0, h), step = d.H;
  if (vec && ce == kC) {
    const int m = threadIdx.x >> 3, q = threadIdx.x & 7;
#pragma unroll
    for (int u = 0; u < kC / 32; ++u) {
      const int t = m + 32 * u;
      *reinterpret_cast<uint4*>(o + (row0 + t * step) * kW + 8 * q) =
          *reinterpret_cast<const uint4*>(ostage + t * kOutLd + 8 * q);
    }
    return;
  }
  for (int e = threadIdx.x; e < ce * kW; e += kThreads) {
    const int t = e / kW, n = e - t * kW;
    o[(row0 + t * step) * kW + n] = ostage[t * kOutLd + n];
  }
}

// grid (batch * H, segments), kThreads threads, kSmemBytes of shared memory
// (two blocks per SM).
template <int kP>
__global__ void __launch_bounds__(kThreads, 2)
    ChunkWalkWgmmaKernel(SmatCudaDims d, SmatChunkRuns ws, const __nv_bfloat16* __restrict__ phi,
                         const __nv_bfloat16* __restrict__ psi, const __nv_bfloat16* __restrict__ v,
                         const float* __restrict__ starts, float* __restrict__ S_in, Outputs out,
                         int seg0) {
  char* sm;
  uint32_t sa;
  wgmma::DynamicSmem1024(&sm, &sa);
  const int tid = threadIdx.x, w = tid >> 5, wg = w >> 2, wi = w & 3;
  const int lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int bh = blockIdx.x, s = seg0 + static_cast<int>(blockIdx.y);
  const int b = bh / d.H, h = bh - b * d.H;
  int k0, k1;
  cuda_detail::RunChunks(ws, d.Lc, s, &k0, &k1);
  constexpr int64_t kState = int64_t{kW} * kP1;
  StagePlanes<3, kThreads>(starts + (static_cast<int64_t>(bh) * (ws.seg_d + ws.seg_r) + s) * kState,
                           nullptr, 1.f, reinterpret_cast<__nv_bfloat16*>(sm + kOffPlanes),
                           reinterpret_cast<float*>(sm + kOffZ));
  __nv_bfloat16* const planes = reinterpret_cast<__nv_bfloat16*>(sm + kOffPlanes);
  const float* const z = reinterpret_cast<const float*>(sm + kOffZ);
  __nv_bfloat16* const ostage = reinterpret_cast<__nv_bfloat16*>(sm + kOffOut);
  const int64_t stride = static_cast<int64_t>(d.H) * kW;
  const bool vec_out = (reinterpret_cast<uintptr_t>(out.o) & 15) == 0;
  const int tdv = 0;  // the lane of the quad that writes den
  // The planes and z staged: the first chunk's S_in reads them in another
  // thread order than StagePlanes writes them.
  __syncthreads();
  int ce = 0;
  for (int k = k0; k < k1; ++k) {
    const int64_t c0 = static_cast<int64_t>(k) * d.chunk;
    const int prev_ce = ce;
    ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));
    const bool read = out.reads != nullptr && c0 >= out.recent_begin;  // chunks never cross n
    const int64_t tok0 = TokenRow(d, b, c0, h);
    if (read) {
      // The reads rows in L2 before the rows are finished.
      for (int e = tid; e < 3 * ce; e += kThreads) {
        const int m = e / 3, piece = e - 3 * m;
        const char* row =
            reinterpret_cast<const char*>(out.reads + (tok0 + int64_t{m} * d.H) * kP1);
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(row + 128 * piece));
      }
    }
    StageTileRows<kC, kThreads>(phi + tok0 * kW, stride, ce, sa + kOffPhi, sm + kOffPhi);
    StageTileRows<kC, kThreads>(psi + tok0 * kW, stride, ce, sa + kOffPsi, sm + kOffPsi);
    StageTileRows<kC, kThreads>(v + tok0 * kW, stride, ce, sa + kOffV, sm + kOffV);
    mma_tiles::CpAsyncCommit();
    // While the rows come in: S_in[k] out, and the previous chunk's o rows.
    if (S_in != nullptr) WriteStateTo<kThreads>(planes, z, S_in + ChunkRow(d, b, k, h) * kState);
    if (k > k0) StoreRows(d, b, h, c0 - d.chunk, prev_ce, ostage, out.o, vec_out);
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    wgmma::FenceProxyAsync();  // the tiles, and the planes the update wrote
    __syncthreads();           // the tiles are in, the planes (and ostage) free

    const wgmma::DescBase db(sa);      // descriptors of the tiles, per chunk
    const bool active = 64 * wg < ce;  // the warpgroup's rows hold tokens
    float acc[8][4];
    float yd[2] = {0.f, 0.f};  // column dv of rows g, g + 8 of the warp
    if (active) {
      // The state term (acc's old values unread). Written out here rather
      // than through StateTermProducts and CausalProducts, with which the
      // compiler lays out this kernel's kP = 3 code (it spills) differently.
      wgmma::Fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const uint64_t da = db.At(kOffPhi + wg * (kTileBytes / 2) + 32 * ks);
#pragma unroll
        for (int q = kP - 1; q >= 0; --q) {
          wgmma::MmaSS<0, 1>(acc, da, db.At(kOffPlanes + q * kPlaneBytes + 2048 * ks),
                             ks > 0 || q < kP - 1);
        }
      }
      wgmma::Commit();
      // Column dv of the state term: phi_m . S[:, dv], this lane's 16 r.
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int m = 64 * wg + 16 * wi + g + 8 * hr;
        float x = 0.f;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const uint4 u = *reinterpret_cast<const uint4*>(sm + kOffPhi + Swz(m, 2 * tq + c));
          const uint32_t y[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int n = 16 * tq + 8 * c + 2 * e;
            x = fmaf(LowBf16(y[e]), z[n], x);
            x = fmaf(HighBf16(y[e]), z[n + 1], x);
          }
        }
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        yd[hr] = x;
      }
      wgmma::Wait<0>();
      wgmma::FenceOperands(acc);
    }
    __syncthreads();  // the planes and z are read

    if (active) {
      float ones[2] = {0.f, 0.f};
      for (int kb = 0; kb <= wg; ++kb) {
        // Key block kb: the scores, masked on the diagonal, summed into
        // column dv, split; their products with vbar.
        float sc[8][4];
        wgmma::Fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          wgmma::MmaSS<0, 0>(sc, db.At(kOffPhi + wg * (kTileBytes / 2) + 32 * ks),
                             db.At(kOffPsi + kb * (kTileBytes / 2) + 32 * ks), ks > 0);
        }
        wgmma::Commit();
        wgmma::Wait<0>();
        wgmma::FenceOperands(sc);
        if (kb == wg) {
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (8 * j + 2 * tq + (e & 1) > 16 * wi + g + 8 * (e >> 1)) sc[j][e] = 0.f;
            }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) ones[e >> 1] += sc[j][e];
        uint32_t xa[4][kP][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          mma_tiles::SplitTileParts<kP>(*reinterpret_cast<const float(*)[2][4]>(&sc[2 * kk]),
                                        xa[kk]);
        }
        wgmma::Fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t dv_desc = db.At(kOffV + (64 * kb + 16 * kk) * wgmma::kRowBytes);
#pragma unroll
          for (int q = kP - 1; q >= 0; --q) wgmma::MmaRS<1>(acc, xa[kk][q], dv_desc);
        }
        wgmma::Commit();
        wgmma::Wait<0>();
        wgmma::FenceOperands(acc);
      }
      // The rows: column dv (the state's part, then the scores' row sums),
      // the reads of recent rows, den and o.
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float x = ones[hr];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        yd[hr] += x;
        const int m = 64 * wg + 16 * wi + g + 8 * hr;
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
        if (here && tq == tdv) out.den[row] = dn;
        __nv_bfloat16* srow = ostage + m * kOutLd;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          *reinterpret_cast<__nv_bfloat162*>(srow + 8 * j + 2 * tq) = __floats2bfloat162_rn(
              __fmul_rn(acc[j][2 * hr], inv), __fmul_rn(acc[j][2 * hr + 1], inv));
        }
      }
    }
    if (wg == 0) {
      // S += psi^T vbar: rows 16 wi + g (+ 8) of the state, read exactly from
      // the planes, the products added, split back.
      float su[8][4];
      ReadStateRows(planes, wi, g, tq, su);
      wgmma::Fence();
#pragma unroll
      for (int kk = 0; kk < kC / 16; ++kk) {  // rows past ce are zeros
        wgmma::MmaSS<1, 1>(su, db.At(kOffPsi + 16 * kk * wgmma::kRowBytes),
                           db.At(kOffV + 16 * kk * wgmma::kRowBytes));
      }
      wgmma::Commit();
      AddPsiColumnSums<kC, false>(sm + kOffPsi, reinterpret_cast<float*>(sm + kOffZPart),
                                  reinterpret_cast<float*>(sm + kOffZ));
      wgmma::Wait<0>();
      wgmma::FenceOperands(su);
      WriteStateRows(planes, wi, g, tq, su);
    }
    wgmma::FenceProxyAsync();  // the planes' stores, before the next chunk's products
    __syncthreads();           // the tiles and the planes are free again, the o rows staged
  }
  if (k1 > k0) StoreRows(d, b, h, int64_t{k1 - 1} * d.chunk, ce, ostage, out.o, vec_out);
}

}  // namespace

cudaError_t LaunchChunkWalkWgmma(const SmatCudaDims& d, const SmatChunkRuns& ws, int s0, int s1,
                                 const void* phi, const void* psi, const void* v,
                                 const float* starts, float* S_in,
                                 const chunk_fwd_mma::Outputs& out, int parts,
                                 cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(d.batch * d.H), static_cast<unsigned>(s1 - s0));
  auto bf = [](const void* x) { return static_cast<const __nv_bfloat16*>(x); };
  return mma_tiles::WithSplitParts(parts, [&](auto kp) {
    auto kernel = ChunkWalkWgmmaKernel<decltype(kp)::value>;
    cudaError_t err = mma_tiles::AllowSharedMemory(kernel, kSmemBytes);
    if (err != cudaSuccess) return err;
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(d, ws, bf(phi), bf(psi), bf(v), starts, S_in,
                                                   out, s0);
    return cudaGetLastError();
  });
}

SmatWalk SmatWalkChoice(bool prefer64) {
  const char* env = std::getenv("SMAT_CUDA_CHUNK_TILES");
  const std::string tiles = env != nullptr ? env : "";
  if (tiles == "mma") return SmatWalk::kMma;
  SmatWalk want = prefer64 ? SmatWalk::kWgmma64 : SmatWalk::kMma;
  if (tiles == "wgmma") want = SmatWalk::kWgmma;
  if (tiles == "wgmma64") want = SmatWalk::kWgmma64;
  if (want == SmatWalk::kMma) return want;
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    return SmatWalk::kMma;
  }
  return major == 9 && minor == 0 ? want : SmatWalk::kMma;
}

}  // namespace smat
