// The fast path of the CUDA SMat-Attention chunk tiles (c <= 128 tokens, r
// and dv <= 64): the chunk-local tiles F6 (eq. 10 gated by Lemma 4) and their
// adjoint B7 (eq. 19 of Appendix E) with one block of 256 threads per
// (chunk, b * H) and the whole chunk staged once in shared memory (staging and
// products: smat_fast_tiles.cuh; the grouped outer sums and per-token reads
// built from the same pieces: smat_grouped_fast.cu). smat_chunk.cu and
// smat_grouped.cu hold the
// general kernels (any c, r, dv) and pick this path when the sizes fit; the
// chunk tiles run on tensor cores (smat_chunk_mma.cu) where
// SmatUseMmaChunkTiles says so (SMAT_CUDA_CHUNK_TILES=ffma: the FFMA tiles
// below, "mma": tensor cores for every chunk tile; B7 of bf16 inputs then runs
// as one kernel for all three outputs, smat_chunk_bwd_mma.cu).
//
// Every tile here has the same shape, so one kernel template serves all four:
//   X[row][col] = gate * (P[:, row] . Q[:, col]), masked to s <= t   (score)
//   side[m][n]  = sum_i Q[i][m] F[i][n]                              (chunk state)
//   main[m][n]  = sum_k X[k][m] R[k][n]                              (tile product)
//   out[m][n]  (+)= main[m][n] + w[m] side[m][n]
// with (t = query token, s = key token, K1 = r or p):
//   kind      P [K1][c]  Q [K1][c]  X       F [K1][64]  R [c][64]   out
//   forward   psi^T      phi^T      A^T     S_in        v           ybar (= ; col dv = den)
//   query     vbar^T     gbar^T     G^T     S_in^T      psi         phi_bar (+=)
//   key psi   gbar^T     vbar^T     G       D_bar^T     phi         psi_bar (+=)
//   key v     phi^T      psi^T      A       D_bar       gbar[:dv]   v_bar (+=)
// so the score tile is computed directly in the k-major orientation the tile
// product reads, and the only transposes happen once, while staging.
//
// Speed: tiles are staged with 16-byte loads where rows allow it and with no
// division per element; every product is a register-blocked fp32 FFMA loop
// whose operands are 16-byte shared-memory loads (a thread owns 8 rows x 4 or
// 8 columns; the row operand is a broadcast), the causal half of the score
// tile and of the tile product is skipped per warp, and the score tile reuses
// the staging buffers of P and Q. Exactness: fp32 FFMA throughout (no TF32, no
// bf16 rounding of fp32 operands), each output element summed in a fixed
// order, no atomics: fp32 inputs stay within 1e-5 of the CPU phases and every
// run gives the same bits.
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/smat_chunk_launch.cuh"
#include "kernels/cuda/smat_fast_tiles.cuh"

namespace smat {
namespace {

using namespace fast_tiles;  // NOLINT: the tile pieces are this file's vocabulary

enum class Kind { kForward, kQuery, kKeyPsi, kKeyV };

// Shared memory (floats): P and Q [kK1][kC] each (X [kC][kC] overlays them
// once the score tile is in registers), R [kC][kW], F [kK1][kLdF], then lam,
// w, two [2][kC] partial-sum arrays and the state column of the forward den.
constexpr int kOffQ = kK1 * kC;
constexpr int kOffR = 2 * kK1 * kC;
constexpr int kOffF = kOffR + kC * kW;
constexpr int kOffLam = kOffF + kK1 * kLdF;
constexpr int kOffW = kOffLam + kC;
constexpr int kOffPart = kOffW + kC;
constexpr int kOffPart2 = kOffPart + 2 * kC;
constexpr int kOffScol = kOffPart2 + 2 * kC;
constexpr int kSmemFloats = kOffScol + kW;
static_assert(kC * kC <= 2 * kK1 * kC, "the score tile must fit over P and Q");

// grid ChunkGrid(d), 256 threads, kSmemFloats floats of shared memory.
// vec_in: phi, psi, v rows can be read 16 bytes at a time.
template <Kind kKind, typename In>
__global__ void __launch_bounds__(kThreads, 1)
    ChunkTileKernel(SmatCudaDims d, bool vec_in, const In* __restrict__ phi,
                    const In* __restrict__ psi, const In* __restrict__ v,
                    const float* __restrict__ gbar, const float* __restrict__ lam,
                    const float* __restrict__ cd, const float* __restrict__ M,
                    float* __restrict__ out) {
  constexpr bool kRowsAreKeys = kKind == Kind::kForward || kKind == Kind::kQuery;
  constexpr bool kScoresGv = kKind == Kind::kQuery || kKind == Kind::kKeyPsi;
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  float* P = sm;
  float* Q = sm + kOffQ;
  float* X = sm;  // over P and Q once they are no longer read
  float* R = sm + kOffR;
  float* F = sm + kOffF;
  float* lam_t = sm + kOffLam;
  float* w = sm + kOffW;
  float* part = sm + kOffPart;
  float* part2 = sm + kOffPart2;
  float* scol = sm + kOffScol;

  const int tid = threadIdx.x;
  const cuda_detail::ChunkBlock blk(d);
  const int64_t k = blk.k;
  const int b = blk.b, h = blk.h;
  const int64_t c0 = k * d.chunk;
  const int ce = static_cast<int>(cuda_detail::Min64(d.chunk, d.L - c0));  // tokens held
  const int r = d.r, dv = d.dv, p = d.p;
  const int K1 = kScoresGv ? p : r;
  const int64_t crow = ChunkRow(d, b, k, h);
  const float* Mk = M + crow * static_cast<int64_t>(r) * p;

  // ---- staging ----
  const TokenTile<In> tphi = Tile(d, phi, r, b, h, c0), tpsi = Tile(d, psi, r, b, h, c0),
                      tv = Tile(d, v, dv, b, h, c0);
  const TokenTile<float> tg = Tile(d, gbar, p, b, h, c0);
  if constexpr (kKind == Kind::kForward) {
    StageTransposed(tpsi, ce, K1, vec_in, P);
    StageTransposed(tphi, ce, K1, vec_in, Q);
    StageRows(tv, ce, dv, vec_in, R);
    StageChunkMatrix(Mk, r, p, dv, false, F);
    for (int j = tid; j < kW; j += kThreads) scol[j] = j < r ? __ldg(&Mk[j * p + dv]) : 0.f;
  } else if constexpr (kKind == Kind::kQuery) {
    StageTransposed(tv, ce, K1, vec_in, P);
    StageTransposed(tg, ce, K1, false, Q);
    StageRows(tpsi, ce, r, vec_in, R);
    StageChunkMatrix(Mk, r, p, r, true, F);
  } else if constexpr (kKind == Kind::kKeyPsi) {
    StageTransposed(tg, ce, K1, false, P);
    StageTransposed(tv, ce, K1, vec_in, Q);
    StageRows(tphi, ce, r, vec_in, R);
    StageChunkMatrix(Mk, r, p, r, true, F);
  } else {
    StageTransposed(tphi, ce, K1, vec_in, P);
    StageTransposed(tpsi, ce, K1, vec_in, Q);
    StageRows(tg, ce, dv, false, R);
    StageChunkMatrix(Mk, r, p, dv, false, F);
  }
  if (tid < kC) {
    const float l = lam != nullptr && tid < ce ? lam[TokenRow(d, b, c0 + tid, h)] : 0.f;
    lam_t[tid] = l;
    // Query side exp(lam_t), key side exp(chunk_decay - lam_s) (Lemma 4).
    w[tid] = lam == nullptr ? 1.f : (kRowsAreKeys ? expf(l) : expf(cd[crow] - l));
  }
  __syncthreads();

  // Warp w owns rows [16 rb, 16 rb + 16) with rb = w for w < 4 and 11 - w
  // otherwise: the causal loops below run longer for later rows, and warps w
  // and w + 4 share a scheduler, so each scheduler gets one short and one
  // long row block (rb and 7 - rb).
  const int warp = tid >> 5, rb = warp < 4 ? warp : 11 - warp;
  const int ty = 2 * rb + ((tid >> 4) & 1), tx = tid & 15;
  const int m0 = ty * 8, n0 = tx * 4;

  // ---- chunk-state product, before Q is overwritten ----
  float side[8][4];
  Zero(side);
  Gemm<true, false>(side, Q, kC, m0, F, kLdF, n0, 0, K1);
  if constexpr (kKind == Kind::kForward) {
    // den column: phi_t . S_in[:, dv], in two halves of r summed in order.
    const int t = tid & (kC - 1), half = tid >> 7;
    const int jh = (r + 1) / 2, j0 = half * jh, j1 = min(r, j0 + jh);
    float acc = 0.f;
    for (int j = j0; j < j1; ++j) acc = fmaf(Q[j * kC + t], scol[j], acc);
    part[half * kC + t] = acc;
  }

  // ---- score tile: rows [16 rb, 16 rb + 16), columns in two halves ----
  float x[8][8];
  Zero(x);
  const int wr0 = 16 * rb;
  // Rows are keys s (columns t >= s matter): the low column half is dead for
  // warps whose first row is >= 64. Rows are queries t (columns s <= t): the
  // high half is dead for warps whose last row is < 64.
  if (kRowsAreKeys && wr0 >= kC / 2) {
    Gemm<false, true>(x, P, kC, m0, Q, kC, n0, 0, K1);
  } else if (!kRowsAreKeys && wr0 + 15 < kC / 2) {
    Gemm<true, false>(x, P, kC, m0, Q, kC, n0, 0, K1);
  } else {
    Gemm<true, true>(x, P, kC, m0, Q, kC, n0, 0, K1);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int row = m0 + i, col = n0 + 64 * (j >> 2) + (j & 3);
      const int s = kRowsAreKeys ? row : col, t = kRowsAreKeys ? col : row;
      const float g = lam != nullptr ? expf(lam_t[t] - lam_t[s]) : 1.f;
      x[i][j] = s <= t ? x[i][j] * g : 0.f;
    }
  __syncthreads();  // every read of P and Q is done
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      *reinterpret_cast<float4*>(&X[(m0 + i) * kC + n0 + 64 * hh]) =
          make_float4(x[i][4 * hh], x[i][4 * hh + 1], x[i][4 * hh + 2], x[i][4 * hh + 3]);
  __syncthreads();

  if constexpr (kKind == Kind::kForward) {
    // den column: sum_s A[t, s], in two halves of s summed in order.
    const int t = tid & (kC - 1), half = tid >> 7;
    float acc = 0.f;
    for (int s = half * (kC / 2); s < (half + 1) * (kC / 2); ++s) acc += X[s * kC + t];
    part2[half * kC + t] = acc;
  }

  // ---- tile product: out rows m (X columns), k over the live X rows ----
  float acc[8][4];
  Zero(acc);
  int k0 = 0, k1 = ce;
  if (kRowsAreKeys) {
    k1 = min(ce, wr0 + 16);  // keys s <= t, t < wr0 + 16
  } else {
    k0 = wr0;  // queries t >= s
  }
  Gemm<true, false>(acc, X, kC, m0, R, kW, n0, k0, k1);

  // ---- outputs ----
  const int width = kKind == Kind::kForward || kKind == Kind::kKeyV ? dv : r;
  const int ld_out = kKind == Kind::kForward ? p : width;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int m = m0 + i;
    if (m >= ce) continue;
    float* o = out + TokenRow(d, b, c0 + m, h) * ld_out;
    const float wm = w[m];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + j;
      if (n >= width) continue;
      const float val = fmaf(wm, side[i][j], acc[i][j]);
      if constexpr (kKind == Kind::kForward) {
        o[n] = val;
      } else {
        o[n] += val;
      }
    }
  }
  if constexpr (kKind == Kind::kForward) {
    __syncthreads();
    for (int t = tid; t < ce; t += kThreads) {
      out[TokenRow(d, b, c0 + t, h) * p + dv] =
          fmaf(w[t], part[t] + part[kC + t], part2[t] + part2[kC + t]);
    }
  }
}

// The tile kernels, for the launchers of smat_chunk_launch.cuh.
struct ChunkTiles : chunk_launch::TileBlock<Kind, kThreads, sizeof(float) * kSmemFloats> {
  template <Kind kKind, typename In>
  static auto Kernel() {
    return ChunkTileKernel<kKind, In>;
  }
};

}  // namespace

bool SmatChunkFastTilesFit(const SmatCudaDims& d) {
  return d.chunk <= kC && d.r <= kW && d.dv <= kW;
}

int64_t SmatChunkFastTilesSmemBytes() { return sizeof(float) * kSmemFloats; }

cudaError_t LaunchSmatChunkOutputsFast(const SmatCudaDims& d, const void* phi, const void* psi,
                                       const void* v, const float* lam, const float* S_in,
                                       float* ybar, cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatUseMmaChunkTiles(d, /*backward=*/false)) {
    return LaunchSmatChunkOutputsMma(d, phi, psi, v, lam, S_in, ybar, stream);
  }
  return chunk_launch::LaunchTile<ChunkTiles, Kind::kForward>(d, phi, psi, v, nullptr, lam, nullptr,
                                                              S_in, ybar, stream);
}

cudaError_t LaunchSmatChunkOutputsBackwardFast(const SmatCudaDims& d, const void* phi,
                                               const void* psi, const void* v, const float* lam,
                                               const float* chunk_decay, const float* S_in,
                                               const float* gbar, const float* D_bar,
                                               float* phi_bar, float* psi_bar, float* v_bar,
                                               bool assign, cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatUseMmaChunkTiles(d, /*backward=*/true)) {
    return LaunchSmatChunkOutputsBackwardMma(d, phi, psi, v, lam, chunk_decay, S_in, gbar, D_bar,
                                             phi_bar, psi_bar, v_bar, assign, stream);
  }
  return chunk_launch::LaunchBackwardTiles<ChunkTiles>(
      d, phi, psi, v, lam, chunk_decay, S_in, gbar, D_bar, phi_bar, psi_bar, v_bar, assign, stream);
}

}  // namespace smat
