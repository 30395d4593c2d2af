// B7 (eq. 19 of Appendix E) on warpgroup MMAs: ChunkBackward's phi_bar,
// psi_bar and v_bar of a chunk for ungated bf16 inputs at r = dv = 64, from
// gbar's factors (gbar_t[0:dv] = d_o_t / den_t, SmatGbarFactors), written.
// Per chunk k and (b, h), t and s tokens of the chunk, G[t, s] = gbar_t . vbar_s
// and A[t, s] = phi_t . psi_s:
//   phi_bar_t = S_in gbar_t        + sum_{s <= t} G[t, s] psi_s
//   psi_bar_s = D_bar vbar_s       + sum_{t >= s} G[t, s] phi_t
//   v_bar_s   = (D_bar^T psi_s)[:dv] + sum_{t >= s} A[t, s] gbar_t[:dv]
// The same sums as ChunkBackwardFusedKernel (smat_chunk_bwd_mma.cu), which
// serves every other case (gated, other widths, gbar in full, adding to the
// outputs) and SMAT_CUDA_CHUNK_TILES=mma.
//
// Block: two warpgroups (256 threads), two blocks per SM (109 KB of shared
// memory each with three parts). The chunk's phi, psi, v and d_o rows are
// staged once by cp.async as 128-row swizzled tiles (smat_wgmma.cuh), S_in's
// rows as they are (a cp.async group of its own, waited for only before the
// query tiles), D_bar (with its carry) as kP bf16 planes and its column dv in
// fp32, 1 / den and gbar's column dv per token. Each output is taken in 64-row
// tiles, m64n64 products a warpgroup at a time (TileChain): the side term
// from the planes, then per block of 64 tokens on the other side the score
// tile (4 products of exact bf16 operands from shared memory), in registers
// its fp32 scaling, the causal mask on the diagonal and the split into kP
// bf16 parts, and the kP x 4 products of the parts (A from registers) with
// the other side's rows. Warpgroup 0 takes psi_bar's first tile and v_bar's
// second, warpgroup 1 the other two; then S_in's planes replace D_bar's (two
// block barriers) and each warpgroup takes one query tile (0 the first, 1 the
// second). Each output element is written once, by one thread, summed in a
// fixed order: the same inputs give the same bits.
//
// Exactness: as the walks on warpgroup MMAs and B7 on mma.sync, bf16 inputs
// and d_o enter as one exact part, every fp32 operand (the score tiles, S_in,
// D_bar) as kP bf16 parts, the smallest first, into fp32 accumulators;
// 1 / den_t applies in fp32 where each product is formed.
//
// Speed (H200, bf16, batch 1, 8 heads, r = dv = 64, c = 128, T = 524288,
// d = 2, 2026-12-03): ChunkBackward 4.065 ms with B7 on mma.sync, 3.642 with
// each group waited for, 3.573-3.576 as one chain of groups per tile, and
// 3.436-3.469 with S_in copied in while the key rows run. Nsight Compute:
// DRAM 42%, L1 71%, 0.74 eligible warps per scheduler at 24% occupancy. So
// B7 is bound by latency, each block staging, computing and storing in turn.
// The tile's own rows as A fragments in registers (a quarter less of the
// products' shared-memory reads) measured no faster (3.470-3.546 ms).
// ptxas -v reports these MMAs serialized (C7520: TileChain issues the next
// scores under `if (u < last)`). Peeling the last block off the loop (the
// products beside the next scores, in two halves, or before the scores)
// avoids that, with three parts only in halves, and spills 12-68 bytes at
// 128 registers: ChunkBackward 3.59-3.63 ms against 3.49-3.54, and 2.95
// against 2.88 with one part (2026-12-05). Asking L2 for the rows of the
// block 264 or 528 places on was slower too (3.62-3.81 ms). So was a
// persistent form, 2 x SMs blocks each looping over chunks and copying the
// next one's tiles and D_bar's rows in beside this one's products (128
// registers, spills at three parts, two more block barriers a chunk):
// ChunkBackward 4.03-4.04 ms against 3.91-3.92 on an H100 (2026-12-07).
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "kernels/cuda/smat_chunk_bwd_wgmma.h"
#include "kernels/cuda/smat_chunk_walk_wgmma.cuh"
#include "kernels/cuda/smat_cuda_kernels.h"
#include "kernels/cuda/smat_device.cuh"
#include "kernels/cuda/smat_mma.cuh"
#include "kernels/cuda/smat_wgmma.cuh"

namespace smat {
namespace {

using cuda_detail::ChunkRow;
using cuda_detail::TokenRow;
using walk_wgmma::kP1;
using walk_wgmma::kPlaneBytes;
using walk_wgmma::kW;
using wgmma::SwzElem;

constexpr int kThreads = 256;
constexpr int kC = 128;                       // chunk tokens held
constexpr int kTile = kC * wgmma::kRowBytes;  // [128][64] bf16, swizzled
constexpr int kHalf = 64 * wgmma::kRowBytes;  // a 64-row tile within it
constexpr int kOffPhi = 0, kOffPsi = kTile, kOffV = 2 * kTile, kOffDo = 3 * kTile;
constexpr int kOffPlanes = 4 * kTile;
// fp32 after the planes: gs = 1 / den [kC], gcol = gbar[:, dv] [kC],
// scol = S_in[:, dv] [kW], dcol = D_bar[:, dv] [kW].
template <int kP>
constexpr int kOffFloats = kOffPlanes + kP* kPlaneBytes;
// Then S_in's rows as they are (kW x kP1 fp32), copied in while the key rows
// run, for the query tiles' planes.
template <int kP>
constexpr int kOffSin = kOffFloats<kP> + (2 * kC + 2 * kW) * 4;
constexpr int kSinBytes = kW * kP1 * 4;
static_assert(kSinBytes % 16 == 0, "S_in's rows in 16-byte pieces");
template <int kP>
constexpr int kSmemBytes = kOffSin<kP> + kSinBytes + 1024;  // + room to align
static_assert(2 * (kSmemBytes<3> + 1024) <= 228 * 1024, "two blocks per SM");

// What a warpgroup's threads share: the tiles' descriptors and the thread's
// place in the m64n64 accumulator (rows 16 wi + g and 16 wi + g + 8 of a
// 64-row tile, columns 8 j + 2 tq and 8 j + 2 tq + 1).
struct Ctx {
  wgmma::DescBase db;
  const float* gs;
  const float* gcol;
  const float* scol;
  const float* dcol;
  int wi, g, tq, nb;
};

// Issues sc = (rows at a_off) (rows at b_off)^T, both K-major 64-row tiles:
// the exact bf16 scores (the caller fences and commits).
__device__ __forceinline__ void IssueScores(const Ctx& cx, uint32_t a_off, uint32_t b_off,
                                            float (&sc)[8][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    wgmma::MmaSS<0, 0>(sc, cx.db.At(a_off + 32 * ks), cx.db.At(b_off + 32 * ks), ks > 0);
  }
}

__device__ __forceinline__ void WaitAll(float (&acc)[8][4], float (&sc)[8][4]) {
  wgmma::Commit();
  wgmma::Wait<0>();
  wgmma::FenceOperands(acc);
  wgmma::FenceOperands(sc);
}

// One 64-row output tile as a chain of asynchronous groups, each waited for
// once. `own`: the tile's own 64 rows (K-major), the A operand of its side
// term and of its scores. First acc = the side term, the own rows times the
// kP planes, K-major (kMn = 0: B(k, n) = M[n][k]) or MN-major (kMn = 1:
// B(k, n) = M[k][n]), the smallest part first, issued with the first block's
// scores; init(acc) once they are in; then for each block u of the other
// side, from `first` to `last`: fix(u, sc) (scaling and mask, in fp32), the
// split into kP bf16 parts and their products (A from registers) with the 64
// rows at prod_b + u kHalf (MN-major), issued with the next block's scores
// (the split parts hold what the products read, so sc takes the next scores
// at once). Scores: the own rows times those at score_b + u kHalf.
template <int kP, int kMn, class Init, class Fix>
__device__ __forceinline__ void TileChain(const Ctx& cx, uint32_t own, uint32_t score_b,
                                          uint32_t prod_b, int first, int last, float (&acc)[8][4],
                                          Init init, Fix fix) {
  float sc[8][4];
  wgmma::Fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    const uint64_t da = cx.db.At(own + 32 * ks);
#pragma unroll
    for (int q = kP - 1; q >= 0; --q) {
      wgmma::MmaSS<0, kMn>(acc, da,
                           cx.db.At(kOffPlanes + q * kPlaneBytes + (kMn ? 2048 * ks : 32 * ks)),
                           ks > 0 || q < kP - 1);
    }
  }
  IssueScores(cx, own, score_b + first * kHalf, sc);
  WaitAll(acc, sc);
  init(acc);
  for (int u = first; u <= last; ++u) {
    fix(u, sc);
    walk_wgmma::IssueSplitProducts<kP>(sc, cx.db, prod_b + u * kHalf, acc);
    if (u < last) IssueScores(cx, own, score_b + (u + 1) * kHalf, sc);
    WaitAll(acc, sc);
  }
}

// Rows m0 + (the thread's two rows) of out (token rows of kW floats), those
// below ce, from acc: written, or added to where the row's token c0 + m is in
// [add_lo, add_hi).
__device__ __forceinline__ void StoreTile(const Ctx& cx, const SmatCudaDims& d, int b, int h,
                                          int64_t c0, int ce, int m0, const float (&acc)[8][4],
                                          int64_t add_lo, int64_t add_hi, float* __restrict__ out) {
  float* o[2];
  bool add[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int m = m0 + 16 * cx.wi + cx.g + 8 * hr;
    o[hr] = out + TokenRow(d, b, c0 + (m < ce ? m : 0), h) * kW + 2 * cx.tq;
    add[hr] = m < ce && c0 + m >= add_lo && c0 + m < add_hi;
  }
  float2 old[2][8];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      old[hr][j] =
          add[hr] ? *reinterpret_cast<const float2*>(o[hr] + 8 * j) : make_float2(0.f, 0.f);
    }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int m = m0 + 16 * cx.wi + cx.g + 8 * hr;
    if (m >= ce) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      *reinterpret_cast<float2*>(o[hr] + 8 * j) =
          add[hr] ? make_float2(old[hr][j].x + acc[j][2 * hr], old[hr][j].y + acc[j][2 * hr + 1])
                  : make_float2(acc[j][2 * hr], acc[j][2 * hr + 1]);
    }
  }
}

// psi_bar rows of 64-token block J: D_bar vbar_s (+ D_bar[:, dv]), then over
// query blocks I >= J, X^T[s, t] = (vbar_s . gbar_t) times phi_t.
template <int kP>
__device__ __forceinline__ void KeyPsi(const Ctx& cx, const SmatCudaDims& d, int b, int h,
                                       int64_t c0, int ce, int J, int64_t add_before,
                                       float* __restrict__ psi_bar) {
  float acc[8][4];
  TileChain<kP, 0>(
      cx, kOffV + J * kHalf, kOffDo, kOffPhi, J, cx.nb - 1, acc,
      [&](float(&a)[8][4]) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) a[j][e] += cx.dcol[8 * j + 2 * cx.tq + (e & 1)];
      },
      [&](int I, float(&sc)[8][4]) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tl = 8 * j + 2 * cx.tq + (e & 1), t = 64 * I + tl;
            const float x = fmaf(cx.gs[t], sc[j][e], cx.gcol[t]);
            sc[j][e] = I == J && tl < 16 * cx.wi + cx.g + 8 * (e >> 1) ? 0.f : x;
          }
      });
  StoreTile(cx, d, b, h, c0, ce, 64 * J, acc, 0, add_before, psi_bar);
}

// v_bar rows of 64-token block J: D_bar^T psi_s, then over query blocks
// I >= J, X^T[s, t] = (psi_s . phi_t) / den_t times d_o_t.
template <int kP>
__device__ __forceinline__ void KeyV(const Ctx& cx, const SmatCudaDims& d, int b, int h, int64_t c0,
                                     int ce, int J, int64_t add_before, float* __restrict__ v_bar) {
  float acc[8][4];
  TileChain<kP, 1>(
      cx, kOffPsi + J * kHalf, kOffPhi, kOffDo, J, cx.nb - 1, acc, [](float(&)[8][4]) {},
      [&](int I, float(&sc)[8][4]) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int tl = 8 * j + 2 * cx.tq + (e & 1);
            const float x = sc[j][e] * cx.gs[64 * I + tl];
            sc[j][e] = I == J && tl < 16 * cx.wi + cx.g + 8 * (e >> 1) ? 0.f : x;
          }
      });
  StoreTile(cx, d, b, h, c0, ce, 64 * J, acc, 0, add_before, v_bar);
}

// phi_bar rows of 64-token block I: S_in gbar_t ((S_in d_o_t) / den_t +
// gbar_t[dv] S_in[:, dv]), then over key blocks J <= I, X[t, s] =
// (gbar_t . vbar_s) times psi_s. S_in's planes are staged.
template <int kP>
__device__ __forceinline__ void QueryRows(const Ctx& cx, const SmatCudaDims& d, int b, int h,
                                          int64_t c0, int ce, int I, int64_t add_from,
                                          float* __restrict__ phi_bar) {
  float gm[2], gc[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int t = 64 * I + 16 * cx.wi + cx.g + 8 * hr;
    gm[hr] = cx.gs[t];
    gc[hr] = cx.gcol[t];
  }
  float acc[8][4];
  TileChain<kP, 0>(
      cx, kOffDo + I * kHalf, kOffV, kOffPsi, 0, I, acc,
      [&](float(&a)[8][4]) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            a[j][e] = fmaf(gc[e >> 1], cx.scol[8 * j + 2 * cx.tq + (e & 1)], gm[e >> 1] * a[j][e]);
          }
      },
      [&](int J, float(&sc)[8][4]) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int sl = 8 * j + 2 * cx.tq + (e & 1);
            const float x = fmaf(gm[e >> 1], sc[j][e], gc[e >> 1]);
            sc[j][e] = I == J && sl > 16 * cx.wi + cx.g + 8 * (e >> 1) ? 0.f : x;
          }
      });
  StoreTile(cx, d, b, h, c0, ce, 64 * I, acc, add_from, INT64_MAX, phi_bar);
}

// grid ChunkGrid(d), kThreads threads, kSmemBytes<kP> of shared memory.
template <int kP>
__global__ void __launch_bounds__(kThreads, 2)
    ChunkBackwardWgmmaKernel(SmatCudaDims d, const __nv_bfloat16* __restrict__ phi,
                             const __nv_bfloat16* __restrict__ psi,
                             const __nv_bfloat16* __restrict__ v,
                             const __nv_bfloat16* __restrict__ d_o, const float* __restrict__ den,
                             const float* __restrict__ gbar, const float* __restrict__ gden,
                             const float* __restrict__ S_in, const float* __restrict__ D_bar,
                             SmatDBarCarry dc, SmatChunkBackwardAdds adds,
                             float* __restrict__ phi_bar, float* __restrict__ psi_bar,
                             float* __restrict__ v_bar) {
  char* sm;
  uint32_t sa;
  wgmma::DynamicSmem1024(&sm, &sa);
  const int tid = threadIdx.x, wg = tid >> 7;
  const cuda_detail::ChunkBlock blk(d);
  const int64_t k = blk.k;
  const int b = blk.b, h = blk.h;
  const int64_t c0 = k * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));  // tokens held
  const int64_t crow = ChunkRow(d, b, k, h);
  constexpr int64_t kMat = int64_t{kW} * kP1;

  // ---- staging ----
  const int64_t tok = TokenRow(d, b, c0, h), stride = static_cast<int64_t>(d.H) * kW;
  walk_wgmma::StageTileRows<kC, kThreads>(phi + tok * kW, stride, ce, sa + kOffPhi, sm + kOffPhi);
  walk_wgmma::StageTileRows<kC, kThreads>(psi + tok * kW, stride, ce, sa + kOffPsi, sm + kOffPsi);
  walk_wgmma::StageTileRows<kC, kThreads>(v + tok * kW, stride, ce, sa + kOffV, sm + kOffV);
  walk_wgmma::StageTileRows<kC, kThreads>(d_o + tok * kW, stride, ce, sa + kOffDo, sm + kOffDo);
  mma_tiles::CpAsyncCommit();
  {
    // S_in's rows, a group of their own: waited for before the query tiles.
    const char* src = reinterpret_cast<const char*>(S_in + crow * kMat);
    for (int e = tid; e < kSinBytes / 16; e += kThreads) {
      mma_tiles::CpAsync16(sa + kOffSin<kP> + 16 * e, src + 16 * e);
    }
    mma_tiles::CpAsyncCommit();
  }
  float* const fl = reinterpret_cast<float*>(sm + kOffFloats<kP>);
  float* const gs = fl;
  float* const gcol = fl + kC;
  float* const scol = fl + 2 * kC;
  float* const dcol = fl + 2 * kC + kW;
  if (tid < kC) {
    const int64_t row = tok + static_cast<int64_t>(tid) * d.H;
    const bool in = tid < ce;
    gs[tid] = in ? 1.f / __ldg(&den[row]) : 0.f;
    gcol[tid] = in ? __ldg(gden != nullptr ? &gden[row] : &gbar[row * kP1 + kW]) : 0.f;
  } else if (tid < kC + kW) {
    scol[tid - kC] = __ldg(&S_in[crow * kMat + (tid - kC) * kP1 + kW]);
  }
  __nv_bfloat16* const planes = reinterpret_cast<__nv_bfloat16*>(sm + kOffPlanes);
  {
    // D_bar = Dk + dscale Dc where it comes in two pieces (SmatDBarCarry).
    const float* Dc = nullptr;
    float dscale = 1.f;
    if (dc.carry != nullptr) {
      const int runs = dc.runs.seg_d + dc.runs.seg_r;
      Dc = dc.carry +
           (static_cast<int64_t>(b * d.H + h) * runs + cuda_detail::RunOf(dc.runs, k)) * kMat;
      if (dc.scale != nullptr) dscale = __ldg(&dc.scale[crow]);
    }
    walk_wgmma::StagePlanes<kP, kThreads>(D_bar + crow * kMat, Dc, dscale, planes, dcol);
  }
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // the tiles, not S_in
  wgmma::FenceProxyAsync();
  __syncthreads();

  const int lane = tid & 31;
  const Ctx cx{wgmma::DescBase(sa), gs,        gcol,     scol,          dcol,
               (tid >> 5) & 3,      lane >> 2, lane & 3, (ce + 63) >> 6};
  // The key rows: warpgroup 0 psi_bar's first tile and v_bar's second,
  // warpgroup 1 v_bar's first and psi_bar's second.
  if (wg == 0) {
    KeyPsi<kP>(cx, d, b, h, c0, ce, 0, adds.key_before, psi_bar);
    if (cx.nb > 1) KeyV<kP>(cx, d, b, h, c0, ce, 1, adds.key_before, v_bar);
  } else {
    KeyV<kP>(cx, d, b, h, c0, ce, 0, adds.key_before, v_bar);
    if (cx.nb > 1) KeyPsi<kP>(cx, d, b, h, c0, ce, 1, adds.key_before, psi_bar);
  }
  // The query tiles after S_in's planes replace D_bar's.
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();  // S_in in; every warpgroup done with D_bar's planes
  walk_wgmma::StagePlanes<kP, kThreads, true>(reinterpret_cast<const float*>(sm + kOffSin<kP>),
                                              nullptr, 1.f, planes, nullptr);
  wgmma::FenceProxyAsync();
  __syncthreads();
  if (wg < cx.nb) QueryRows<kP>(cx, d, b, h, c0, ce, wg, adds.query_from, phi_bar);
}

}  // namespace

bool SmatChunkBackwardOnWgmma() {
  const char* env = std::getenv("SMAT_CUDA_CHUNK_TILES");
  if (env != nullptr && std::string(env) == "mma") return false;
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0;
}

cudaError_t LaunchChunkBackwardWgmma(const SmatCudaDims& d, const void* phi, const void* psi,
                                     const void* v, const float* S_in, const float* gbar,
                                     const float* D_bar, float* phi_bar, float* psi_bar,
                                     float* v_bar, const SmatDBarCarry& carry,
                                     const SmatGbarFactors& factors,
                                     const SmatChunkBackwardAdds& adds, int parts,
                                     cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  auto bf = [](const void* x) { return static_cast<const __nv_bfloat16*>(x); };
  return mma_tiles::WithSplitParts(parts, [&](auto kp) {
    constexpr int kP = decltype(kp)::value;
    auto kernel = ChunkBackwardWgmmaKernel<kP>;
    cudaError_t err = mma_tiles::AllowSharedMemory(kernel, kSmemBytes<kP>);
    if (err != cudaSuccess) return err;
    kernel<<<cuda_detail::ChunkGrid(d), kThreads, kSmemBytes<kP>, stream>>>(
        d, bf(phi), bf(psi), bf(v), bf(factors.d_o), factors.den, gbar, factors.gden, S_in, D_bar,
        carry, adds, phi_bar, psi_bar, v_bar);
    return cudaGetLastError();
  });
}

}  // namespace smat
