// The walk of ChunkStatesAndOutputs (smat_chunk_walk.cu) at r = dv = 64 on
// warpgroup MMAs with one warpgroup per block: built for sm_90a alone
// (kernels/cuda/CMakeLists.txt) and launched on devices of compute
// capability 9.0 where WalkKind in smat_chunk_walk.cu says so (by default
// where the walk writes no S_in, the forward for inference, and where it
// writes S_in but adds no reads, d = 1), its rows brought in by the bulk
// copy engine where SmatWalk64Tma says so (smat_chunk_walk_wgmma.h). The
// walk with two warpgroups per block: smat_chunk_walk_wgmma.sm90a.cu; their
// shared pieces: smat_chunk_walk_wgmma.cuh.
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "kernels/cuda/smat_chunk_fwd_mma.cuh"
#include "kernels/cuda/smat_chunk_walk_wgmma.cuh"
#include "kernels/cuda/smat_chunk_walk_wgmma.h"
#include "kernels/cuda/smat_cuda_kernels.h"
#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_mma.cuh"
#include "kernels/cuda/smat_tma.cuh"
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
//
// With kTma (SmatWalk64Tma: c % 64 == 0, so that no piece runs into the next
// chunk's rows) the pieces' rows come in by the bulk copy engine one piece
// ahead: two sets of tiles (phi, psi, v), each with an mbarrier; thread 0
// issues the next piece's three copies (tma::LoadRows) as a piece begins, so
// they come in while its products run, and no thread issues a copy or waits
// on a block barrier for them. The rows past the sequence's end come in as
// zeros (the tensor maps' bounds). 74 KB of shared memory: three blocks per
// SM. H100, same binary, 2026-12-07 (SMAT_CUDA_WALK_TMA=0 against 1):
// SmatForward for inference d = 1 1.459-1.502 -> 1.330-1.383 ms, d = 2
// 2.346 -> 2.333-2.365 ms (not its copies: see below), d = 3 4.250-4.266
// -> 4.248-4.251 ms; writing S_in at d = 1 (ChunkStatesAndOutputs) 1.656 ->
// 1.557-1.561 ms, against 1.613-1.662 ms for ChunkWalkKernel, but at d = 2
// 1.915-1.917 against 1.869-1.874. So WalkKind takes it at d = 1 for the
// forward that keeps the states too. H200, one host, 2026-12-07: SmatForward
// for inference d = 1 1.323-1.327 -> 1.196-1.221 ms, d = 2 1.992-1.993 ->
// 1.913-1.944, d = 3 3.764-3.769 -> 3.657-3.688; keeping the states at d = 1
// 1.513-1.555 -> 1.472-1.500 ms.
//
// Not kept (H100, 2026-12-07): each thread's reads loaded into registers
// just after the state term's and the scores' MMAs are issued (the rows
// asked of L2 one piece ahead) and added to the state term before the causal
// products. SmatForward for inference d = 2 2.291-2.305 -> 2.280-2.306 ms,
// d = 3 4.203-4.209 -> 4.183-4.188: the walk does not wait on those loads.
// Not kept either (H100, 2026-12-07, docs/PERFORMANCE.md, thirty-eighth
// pass): with kTma, S_in[k] written while the chunk's first products run,
// by 16-byte stores (ChunkStatesAndOutputs at d = 1 1.552-1.558 ->
// 1.566-1.582 ms; at d = 2 1.885 -> 1.870, still behind ChunkWalkKernel's
// 1.835, so WalkKind keeps that there); and S_in[k + 1]'s columns < kW
// stored from the update's registers (su) instead of read back from the
// planes: stores in the fragments' order, eight rows of 4 bytes at 8-byte
// steps a warp store, took d = 1 from 1.561-1.566 to 1.784-1.792 ms; and
// WriteStateTo's stores with the streaming cache hint (__stcs) gained
// nothing (1.552-1.555 -> 1.542-1.556 ms). WriteStateTo's consecutive
// floats stay as they are. Nor (H100, 2026-12-07, thirty-ninth pass): the
// update issued with the causal products as one group (the state rows read
// once the state term is done, psi's column sums beside it: two groups
// waited for a piece, not three) and the o rows out by one bulk tensor
// store: SmatForward for inference d = 1 1.309-1.324 -> 1.288-1.310 ms,
// d = 2 2.302-2.356 -> 2.314-2.349, d = 3 4.216-4.273 -> 4.210-4.276 (two
// hosts). With three blocks an SM the others' work fills a block's waits.
constexpr int kThreads64 = 128;
constexpr int kRows64 = 64;
constexpr int kTile64 = kRows64 * wgmma::kRowBytes;  // a piece's token tile, [64][kW] swizzled

// The shared memory of a block (byte offsets from its 1024-byte aligned
// base): kSets sets of a piece's phi, psi and v tiles, the planes, z (the
// state's column dv), the column sums' scratch and (kTma) the sets'
// mbarriers.
template <bool kTma>
struct Walk64Smem {
  static constexpr int kSets = kTma ? 2 : 1;
  static constexpr int kSet = 3 * kTile64;
  static constexpr int kPlanes = kSets * kSet;
  static constexpr int kZ = kPlanes + 3 * kPlaneBytes;
  static constexpr int kZPart = kZ + kW * 4;
  static constexpr int kBar = kZPart + 4 * kW * 4;
  static constexpr int kBytes = kBar + (kTma ? 16 : 0) + 1024;  // + room to align the base
  static constexpr int kBlocksPerSm = kTma ? kWalk64TmaBlocksPerSm : 4;
  static_assert(kSet % 1024 == 0 && kPlanes % 1024 == 0, "atoms on 1024-byte lines");
  static_assert(kBar % 8 == 0, "mbarriers on 8-byte lines");
  static_assert(kBlocksPerSm * (kBytes + 1024) <= 228 * 1024, "the blocks fit an SM");
};

// The rows a walk reads: the token tensors, or (kTma) their tensor maps
// (tma::TokenRowsMap, kRows64-token boxes).
struct TokenPtrs {
  const __nv_bfloat16* phi;
  const __nv_bfloat16* psi;
  const __nv_bfloat16* v;
};
struct TokenMaps {
  CUtensorMap phi, psi, v;
};
template <bool kTma>
using WalkRows = std::conditional_t<kTma, TokenMaps, TokenPtrs>;

// grid (batch * H, s1 - s0), kThreads64 threads, Walk64Smem<kTma>::kBytes of
// shared memory.
template <int kP, bool kTma>
__global__ void __launch_bounds__(kThreads64, Walk64Smem<kTma>::kBlocksPerSm)
    ChunkWalkWgmma64Kernel(SmatCudaDims d, SmatChunkRuns ws,
                           const __grid_constant__ WalkRows<kTma> rows,
                           const float* __restrict__ starts, float* __restrict__ S_in, Outputs out,
                           int seg0) {
  using Smem = Walk64Smem<kTma>;
  char* sm;
  uint32_t sa;
  wgmma::DynamicSmem1024(&sm, &sa);
  const int tid = threadIdx.x, wi = tid >> 5;
  const int lane = tid & 31, g = lane >> 2, tq = lane & 3;
  const int bh = blockIdx.x, s = seg0 + static_cast<int>(blockIdx.y);
  const int b = bh / d.H, h = bh - b * d.H;
  int k0, k1;
  cuda_detail::RunChunks(ws, d.Lc, s, &k0, &k1);
  const int64_t t_end = cuda_detail::Min64(static_cast<int64_t>(k1) * d.chunk, d.L);
  const uint32_t bar0 = sa + Smem::kBar;
  // kTma: the rows of the piece at token t into set `set`, by thread 0.
  auto issue = [&](int64_t t, int set) {
    if constexpr (kTma) {
      const uint32_t to = sa + set * Smem::kSet, bar = bar0 + 8 * set;
      const int ti = static_cast<int>(t);
      tma::ArriveExpectBytes(bar, Smem::kSet);
      tma::LoadRows(to, &rows.phi, h, ti, b, bar);
      tma::LoadRows(to + kTile64, &rows.psi, h, ti, b, bar);
      tma::LoadRows(to + 2 * kTile64, &rows.v, h, ti, b, bar);
    }
  };
  if constexpr (kTma) {
    if (tid == 0) {
      tma::BarrierInit(bar0, 1);
      tma::BarrierInit(bar0 + 8, 1);
      tma::FenceBarrierInit();
      const int64_t t0 = static_cast<int64_t>(k0) * d.chunk;
      if (t0 < t_end) issue(t0, 0);
    }
  }
  constexpr int64_t kState = int64_t{kW} * kP1;
  StagePlanes<3, kThreads64>(
      starts + (static_cast<int64_t>(bh) * (ws.seg_d + ws.seg_r) + s) * kState, nullptr, 1.f,
      reinterpret_cast<__nv_bfloat16*>(sm + Smem::kPlanes),
      reinterpret_cast<float*>(sm + Smem::kZ));
  __nv_bfloat16* const planes = reinterpret_cast<__nv_bfloat16*>(sm + Smem::kPlanes);
  const float* const z = reinterpret_cast<const float*>(sm + Smem::kZ);
  const int64_t stride = static_cast<int64_t>(d.H) * kW;
  const bool vec_out = (reinterpret_cast<uintptr_t>(out.o) & 15) == 0;
  if constexpr (kTma) wgmma::FenceProxyAsync();  // the planes, before the first products
  __syncthreads();  // the planes and z staged (kTma: the mbarriers ready)
  int p = 0;        // the pieces walked so far
  for (int k = k0; k < k1; ++k) {
    const int64_t c0 = static_cast<int64_t>(k) * d.chunk;
    const int cl = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));
    const bool read = out.reads != nullptr && c0 >= out.recent_begin;  // chunks never cross n
    for (int u0 = 0; u0 < cl; u0 += kRows64, ++p) {
      const int ce = min(kRows64, cl - u0);
      const int64_t tok0 = TokenRow(d, b, c0 + u0, h);
      // The piece's tiles (kTma: set p % 2; set (p + 1) % 2 was last read by
      // piece p - 1, before the barrier that ended it, so the next piece's
      // rows may come into it).
      const uint32_t set = kTma ? (p & 1) * Smem::kSet : 0;
      const uint32_t off_phi = set, off_psi = set + kTile64, off_v = set + 2 * kTile64;
      // The o rows wait in phi's tile once its products are done.
      __nv_bfloat16* const ostage = reinterpret_cast<__nv_bfloat16*>(sm + off_phi);
      if constexpr (kTma) {
        if (tid == 0 && c0 + u0 + kRows64 < t_end) issue(c0 + u0 + kRows64, (p + 1) & 1);
      }
      if (read) {
        for (int e = tid; e < 3 * ce; e += kThreads64) {
          const int m = e / 3, piece = e - 3 * m;
          const char* row =
              reinterpret_cast<const char*>(out.reads + (tok0 + int64_t{m} * d.H) * kP1);
          asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(row + 128 * piece));
        }
      }
      if constexpr (!kTma) {
        StageTileRows<kRows64, kThreads64>(rows.phi + tok0 * kW, stride, ce, sa + off_phi,
                                           sm + off_phi);
        StageTileRows<kRows64, kThreads64>(rows.psi + tok0 * kW, stride, ce, sa + off_psi,
                                           sm + off_psi);
        StageTileRows<kRows64, kThreads64>(rows.v + tok0 * kW, stride, ce, sa + off_v, sm + off_v);
        mma_tiles::CpAsyncCommit();
      }
      if (S_in != nullptr && u0 == 0) {
        WriteStateTo<kThreads64>(planes, z, S_in + ChunkRow(d, b, k, h) * kState);
      }
      if constexpr (kTma) {
        tma::Wait(bar0 + 8 * (p & 1), (p >> 1) & 1);  // the piece's rows are in
      } else {
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        wgmma::FenceProxyAsync();
        __syncthreads();  // the piece's tiles are in
      }

      const wgmma::DescBase db(sa);
      // The state term and the scores, two groups in flight together.
      float acc[8][4], sc[8][4];
      wgmma::Fence();
      StateTermProducts<kP>(acc, db, off_phi, Smem::kPlanes);
      wgmma::Commit();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        wgmma::MmaSS<0, 0>(sc, db.At(off_phi + 32 * ks), db.At(off_psi + 32 * ks), ks > 0);
      }
      wgmma::Commit();
      float yd[2];
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        yd[hr] = StateColumnTerm(sm + off_phi, 16 * wi + g + 8 * hr, tq, z);
      }
      wgmma::Wait<0>();
      wgmma::FenceOperands(acc);
      wgmma::FenceOperands(sc);
      // The diagonal block: masked, summed into column dv, split, times vbar.
      float ones[2] = {0.f, 0.f};
      CausalProducts<kP>(sc, true, wi, g, tq, db, off_v, ones, acc);
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
        wgmma::MmaSS<1, 1>(su, db.At(off_psi + 16 * kk * wgmma::kRowBytes),
                           db.At(off_v + 16 * kk * wgmma::kRowBytes));
      }
      wgmma::Commit();
      // Past its barrier every o row is staged.
      AddPsiColumnSums<kRows64, true>(sm + off_psi, reinterpret_cast<float*>(sm + Smem::kZPart),
                                      reinterpret_cast<float*>(sm + Smem::kZ));
      // The piece's o rows out while the update's products run.
      {
        const int64_t row0 = tok0;
        for (int e = tid; e < ce * 8; e += kThreads64) {
          const int t = e >> 3, q = e & 7;
          const uint4 x = *reinterpret_cast<const uint4*>(sm + off_phi + Swz(t, q));
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
      // The planes' stores (and the o rows' reads of the set), before the
      // next piece's products (and copies).
      wgmma::FenceProxyAsync();
      __syncthreads();  // the tiles free again, the planes and z updated
    }
  }
}

}  // namespace

bool SmatWalk64Tma(const SmatCudaDims& d) {
  const char* env = std::getenv("SMAT_CUDA_WALK_TMA");
  if (env != nullptr && std::string(env) == "0") return false;
  return d.chunk % kRows64 == 0 && d.L <= INT32_MAX && tma::EncodeTiled() != nullptr;
}

namespace {

template <bool kTma>
cudaError_t LaunchWalk64(const SmatCudaDims& d, const SmatChunkRuns& ws, int s0, int s1,
                         const WalkRows<kTma>& rows, const float* starts, float* S_in,
                         const chunk_fwd_mma::Outputs& out, int parts, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(d.batch * d.H), static_cast<unsigned>(s1 - s0));
  constexpr int kBytes = Walk64Smem<kTma>::kBytes;
  return mma_tiles::WithSplitParts(parts, [&](auto kp) {
    auto kernel = ChunkWalkWgmma64Kernel<decltype(kp)::value, kTma>;
    cudaError_t err = mma_tiles::AllowSharedMemory(kernel, kBytes);
    if (err != cudaSuccess) return err;
    kernel<<<grid, kThreads64, kBytes, stream>>>(d, ws, rows, starts, S_in, out, s0);
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t LaunchChunkWalkWgmma64(const SmatCudaDims& d, const SmatChunkRuns& ws, int s0, int s1,
                                   const void* phi, const void* psi, const void* v,
                                   const float* starts, float* S_in,
                                   const chunk_fwd_mma::Outputs& out, int parts,
                                   cudaStream_t stream) {
  const TokenPtrs rows{static_cast<const __nv_bfloat16*>(phi),
                       static_cast<const __nv_bfloat16*>(psi),
                       static_cast<const __nv_bfloat16*>(v)};
  return LaunchWalk64<false>(d, ws, s0, s1, rows, starts, S_in, out, parts, stream);
}

cudaError_t LaunchChunkWalkWgmma64Tma(const SmatCudaDims& d, const SmatChunkRuns& ws, int s0,
                                      int s1, const void* phi, const void* psi, const void* v,
                                      const float* starts, float* S_in,
                                      const chunk_fwd_mma::Outputs& out, int parts,
                                      cudaStream_t stream) {
  TokenMaps maps;
  if (!SmatWalk64Tma(d) || !tma::TokenRowsMap(phi, d.batch, d.L, d.H, kRows64, &maps.phi) ||
      !tma::TokenRowsMap(psi, d.batch, d.L, d.H, kRows64, &maps.psi) ||
      !tma::TokenRowsMap(v, d.batch, d.L, d.H, kRows64, &maps.v)) {
    return LaunchChunkWalkWgmma64(d, ws, s0, s1, phi, psi, v, starts, S_in, out, parts, stream);
  }
  return LaunchWalk64<true>(d, ws, s0, s1, maps, starts, S_in, out, parts, stream);
}

}  // namespace smat
