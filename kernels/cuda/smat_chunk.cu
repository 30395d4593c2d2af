// Chunk-local tiles of CUDA SMat-Attention: the outputs of eq. 10 (gated per
// Lemma 4) and their adjoint, eq. 19 of Appendix E. One block per (query or key
// tile, chunk, b * H), so a single head still spreads over every SM.
//
// Forward, per query tile of chunk k (rows t):
//   A[t, s]  = exp(lam[t] - lam[s]) (phi_t . psi_s) for s <= t     (tril tile)
//   ybar_t   = sum_s A[t, s] vbar_s + exp(lam[t]) phi_t^T S_in[k]
// Backward, per query tile:
//   G[t, s]  = exp(lam[t] - lam[s]) (gbar_t . vbar_s) for s <= t
//   phi_bar_t += sum_s G[t, s] psi_s + exp(lam[t]) S_in[k] gbar_t
// and per key tile (rows s, queries t >= s), w_s = exp(chunk_decay[k] - lam[s]):
//   psi_bar_s += sum_t G[t, s] phi_t + w_s D_bar[k] vbar_s
//   v_bar_s   += sum_t A[t, s] gbar_t + w_s (D_bar[k]^T psi_s)[0:dv]
// Every product is TileAccumulate (fp32 FFMA, k in increasing order), so the
// results are bitwise repeatable.
//
// These are the general kernels (any c, r, dv that fits shared memory). The
// launchers hand sizes that fit smat_chunk_fast.cu (c <= 128, r, dv <= 64) to
// its kernels instead, unless SMAT_CUDA_CHUNK_TILES says otherwise.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/smat_device.cuh"

namespace smat {
namespace {

using cuda_detail::ChunkRow;
using cuda_detail::kRegM;
using cuda_detail::kRegN;
using cuda_detail::kThreads;
using cuda_detail::kTileM;
using cuda_detail::kTileN;
using cuda_detail::LoadIn;
using cuda_detail::PadOdd;
using cuda_detail::TileAccumulate;
using cuda_detail::TileStore;
using cuda_detail::TokenRow;
using cuda_detail::ZeroAcc;

enum class ChunkKernel { kForward, kQueryBackward, kKeyBackward };

// Shared-memory floats of each kernel for a tile of `tile` rows.
int64_t SmemFloats(const SmatCudaDims& d, int tile, ChunkKernel which) {
  const int64_t ldr = PadOdd(d.r), ldp = PadOdd(d.p), ldc = PadOdd(d.chunk), c = d.chunk;
  switch (which) {
    case ChunkKernel::kForward:
      return tile * ldr + c * ldr + c * ldp + tile * ldc + 2 * tile + c;
    case ChunkKernel::kQueryBackward:
      return tile * ldp + c * ldp + c * ldr + tile * ldc + 2 * tile + c;
    case ChunkKernel::kKeyBackward:
      return c * ldr + c * ldp + tile * ldr + tile * ldp + 2 * tile * ldc + 2 * tile + c;
  }
  return 0;
}

// Copies rows [row0, row0 + rows) of a token tensor (width `width`, input
// dtype) into dst [rows][ld]; with `augment`, the rows are vbar = [v, 1].
__device__ void LoadRows(const SmatCudaDims& d, const void* src, bool bf16, int b, int h,
                         int64_t row0, int rows, int width, bool augment, float* dst, int ld) {
  const int cols = augment ? width + 1 : width;
  for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) {
    const int t = e / cols, k = e % cols;
    float val = 1.f;
    if (k < width) val = LoadIn(src, TokenRow(d, b, row0 + t, h) * width + k, bf16);
    dst[t * ld + k] = val;
  }
}

__device__ void LoadLam(const SmatCudaDims& d, const float* lam, int b, int h, int64_t row0,
                        int rows, float* dst) {
  for (int t = threadIdx.x; t < rows; t += blockDim.x)
    dst[t] = lam != nullptr ? lam[TokenRow(d, b, row0 + t, h)] : 0.f;
}

// ---- F6 ---------------------------------------------------------------------------
// grid (Lc * ceil(c / tile), batch * H).
__global__ void ChunkOutputsKernel(SmatCudaDims d, int tile, const void* __restrict__ phi,
                                   const void* __restrict__ psi, const void* __restrict__ v,
                                   const float* __restrict__ lam, const float* __restrict__ S_in,
                                   float* __restrict__ ybar) {
  extern __shared__ float smem[];
  const int r = d.r, p = d.p, c = d.chunk;
  const int ldr = PadOdd(r), ldp = PadOdd(p), ldc = PadOdd(c);
  const int nq = (c + tile - 1) / tile;
  const int64_t k = blockIdx.x / nq;
  const int q0 = (blockIdx.x % nq) * tile;
  const int b = blockIdx.y / d.H, h = blockIdx.y % d.H;
  const int64_t c0 = k * c;
  const int ce = static_cast<int>(cuda_detail::Min64(c, d.L - c0));  // tokens in the chunk
  if (q0 >= ce) return;
  const int qn = min(tile, ce - q0);  // query rows of this tile
  const int kn = q0 + qn;             // keys that can be seen: s <= t
  float* phi_q = smem;                // [tile][ldr]
  float* psi_s = phi_q + tile * ldr;  // [c][ldr]
  float* vb_s = psi_s + c * ldr;      // [c][ldp]
  float* A = vb_s + c * ldp;          // [tile][ldc]
  float* lam_q = A + tile * ldc;      // [tile]
  float* wq = lam_q + tile;           // [tile]
  float* lam_k = wq + tile;           // [c]
  LoadRows(d, phi, d.bf16, b, h, c0 + q0, qn, r, false, phi_q, ldr);
  LoadRows(d, psi, d.bf16, b, h, c0, kn, r, false, psi_s, ldr);
  LoadRows(d, v, d.bf16, b, h, c0, kn, d.dv, true, vb_s, ldp);
  LoadLam(d, lam, b, h, c0 + q0, qn, lam_q);
  LoadLam(d, lam, b, h, c0, kn, lam_k);
  __syncthreads();
  for (int t = threadIdx.x; t < qn; t += blockDim.x) wq[t] = lam != nullptr ? expf(lam_q[t]) : 1.f;

  for (int m0 = 0; m0 < qn; m0 += kTileM) {
    for (int n0 = 0; n0 < kn; n0 += kTileN) {
      float acc[kRegM][kRegN];
      ZeroAcc(acc);
      TileAccumulate(
          acc, m0, n0, qn, kn, r, [&](int m, int kk) { return phi_q[m * ldr + kk]; },
          [&](int n, int kk) { return psi_s[n * ldr + kk]; });
      TileStore(acc, m0, n0, qn, kn, [&](int m, int n, float val) {
        const bool seen = n <= q0 + m;
        A[m * ldc + n] = seen ? (lam != nullptr ? val * expf(lam_q[m] - lam_k[n]) : val) : 0.f;
      });
    }
  }
  __syncthreads();
  const float* S = S_in + ChunkRow(d, b, k, h) * static_cast<int64_t>(r) * p;
  for (int m0 = 0; m0 < qn; m0 += kTileM) {
    for (int n0 = 0; n0 < p; n0 += kTileN) {
      float acc[kRegM][kRegN];
      ZeroAcc(acc);
      TileAccumulate(
          acc, m0, n0, qn, p, kn + r,
          [&](int m, int kk) { return kk < kn ? A[m * ldc + kk] : phi_q[m * ldr + kk - kn] * wq[m]; },
          [&](int n, int kk) { return kk < kn ? vb_s[kk * ldp + n] : __ldg(&S[(kk - kn) * p + n]); });
      TileStore(acc, m0, n0, qn, p, [&](int m, int n, float val) {
        ybar[TokenRow(d, b, c0 + q0 + m, h) * p + n] = val;
      });
    }
  }
}

// ---- B7, query tiles: phi_bar ------------------------------------------------------
__global__ void ChunkQueryBackwardKernel(SmatCudaDims d, int tile, const void* __restrict__ psi,
                                         const void* __restrict__ v,
                                         const float* __restrict__ lam,
                                         const float* __restrict__ S_in,
                                         const float* __restrict__ gbar,
                                         float* __restrict__ phi_bar) {
  extern __shared__ float smem[];
  const int r = d.r, p = d.p, c = d.chunk;
  const int ldr = PadOdd(r), ldp = PadOdd(p), ldc = PadOdd(c);
  const int nq = (c + tile - 1) / tile;
  const int64_t k = blockIdx.x / nq;
  const int q0 = (blockIdx.x % nq) * tile;
  const int b = blockIdx.y / d.H, h = blockIdx.y % d.H;
  const int64_t c0 = k * c;
  const int ce = static_cast<int>(cuda_detail::Min64(c, d.L - c0));
  if (q0 >= ce) return;
  const int qn = min(tile, ce - q0);
  const int kn = q0 + qn;
  float* g_q = smem;                  // [tile][ldp]
  float* vb_s = g_q + tile * ldp;     // [c][ldp]
  float* psi_s = vb_s + c * ldp;      // [c][ldr]
  float* G = psi_s + c * ldr;         // [tile][ldc]
  float* lam_q = G + tile * ldc;      // [tile]
  float* wq = lam_q + tile;           // [tile]
  float* lam_k = wq + tile;           // [c]
  for (int e = threadIdx.x; e < qn * p; e += blockDim.x) {
    const int t = e / p, j = e % p;
    g_q[t * ldp + j] = gbar[TokenRow(d, b, c0 + q0 + t, h) * p + j];
  }
  LoadRows(d, v, d.bf16, b, h, c0, kn, d.dv, true, vb_s, ldp);
  LoadRows(d, psi, d.bf16, b, h, c0, kn, r, false, psi_s, ldr);
  LoadLam(d, lam, b, h, c0 + q0, qn, lam_q);
  LoadLam(d, lam, b, h, c0, kn, lam_k);
  __syncthreads();
  for (int t = threadIdx.x; t < qn; t += blockDim.x) wq[t] = lam != nullptr ? expf(lam_q[t]) : 1.f;

  for (int m0 = 0; m0 < qn; m0 += kTileM) {
    for (int n0 = 0; n0 < kn; n0 += kTileN) {
      float acc[kRegM][kRegN];
      ZeroAcc(acc);
      TileAccumulate(
          acc, m0, n0, qn, kn, p, [&](int m, int kk) { return g_q[m * ldp + kk]; },
          [&](int n, int kk) { return vb_s[n * ldp + kk]; });
      TileStore(acc, m0, n0, qn, kn, [&](int m, int n, float val) {
        const bool seen = n <= q0 + m;
        G[m * ldc + n] = seen ? (lam != nullptr ? val * expf(lam_q[m] - lam_k[n]) : val) : 0.f;
      });
    }
  }
  __syncthreads();
  const float* S = S_in + ChunkRow(d, b, k, h) * static_cast<int64_t>(r) * p;
  for (int m0 = 0; m0 < qn; m0 += kTileM) {
    for (int n0 = 0; n0 < r; n0 += kTileN) {
      float acc[kRegM][kRegN];
      ZeroAcc(acc);
      TileAccumulate(
          acc, m0, n0, qn, r, kn + p,
          [&](int m, int kk) { return kk < kn ? G[m * ldc + kk] : g_q[m * ldp + kk - kn] * wq[m]; },
          [&](int n, int kk) { return kk < kn ? psi_s[kk * ldr + n] : __ldg(&S[n * p + kk - kn]); });
      TileStore(acc, m0, n0, qn, r, [&](int m, int n, float val) {
        phi_bar[TokenRow(d, b, c0 + q0 + m, h) * r + n] += val;
      });
    }
  }
}

// ---- B7, key tiles: psi_bar, v_bar -------------------------------------------------
__global__ void ChunkKeyBackwardKernel(SmatCudaDims d, int tile, const void* __restrict__ phi,
                                       const void* __restrict__ psi, const void* __restrict__ v,
                                       const float* __restrict__ lam,
                                       const float* __restrict__ cd,
                                       const float* __restrict__ gbar,
                                       const float* __restrict__ D_bar,
                                       float* __restrict__ psi_bar, float* __restrict__ v_bar) {
  extern __shared__ float smem[];
  const int r = d.r, p = d.p, c = d.chunk;
  const int ldr = PadOdd(r), ldp = PadOdd(p), ldc = PadOdd(c);
  const int nk = (c + tile - 1) / tile;
  const int64_t k = blockIdx.x / nk;
  const int k0 = (blockIdx.x % nk) * tile;
  const int b = blockIdx.y / d.H, h = blockIdx.y % d.H;
  const int64_t c0 = k * c;
  const int ce = static_cast<int>(cuda_detail::Min64(c, d.L - c0));
  if (k0 >= ce) return;
  const int sn = min(tile, ce - k0);  // key rows of this tile
  const int tn = ce - k0;             // queries t in [k0, ce) can see them
  float* phi_s = smem;                // [c][ldr], query rows from k0
  float* g_s = phi_s + c * ldr;       // [c][ldp]
  float* psi_k = g_s + c * ldp;       // [tile][ldr]
  float* vb_k = psi_k + tile * ldr;   // [tile][ldp]
  float* At = vb_k + tile * ldp;      // [tile][ldc]
  float* Gt = At + tile * ldc;        // [tile][ldc]
  float* lam_k = Gt + tile * ldc;     // [tile]
  float* ws = lam_k + tile;           // [tile]
  float* lam_q = ws + tile;           // [c]
  LoadRows(d, phi, d.bf16, b, h, c0 + k0, tn, r, false, phi_s, ldr);
  for (int e = threadIdx.x; e < tn * p; e += blockDim.x) {
    const int t = e / p, j = e % p;
    g_s[t * ldp + j] = gbar[TokenRow(d, b, c0 + k0 + t, h) * p + j];
  }
  LoadRows(d, psi, d.bf16, b, h, c0 + k0, sn, r, false, psi_k, ldr);
  LoadRows(d, v, d.bf16, b, h, c0 + k0, sn, d.dv, true, vb_k, ldp);
  LoadLam(d, lam, b, h, c0 + k0, sn, lam_k);
  LoadLam(d, lam, b, h, c0 + k0, tn, lam_q);
  __syncthreads();
  const int64_t crow = ChunkRow(d, b, k, h);
  for (int s = threadIdx.x; s < sn; s += blockDim.x)
    ws[s] = lam != nullptr ? expf(cd[crow] - lam_k[s]) : 1.f;

  // At[s][t'] and Gt[s][t'] for t = k0 + t' >= s = k0 + m.
  for (int pass = 0; pass < 2; ++pass) {
    float* dst = pass == 0 ? At : Gt;
    for (int m0 = 0; m0 < sn; m0 += kTileM) {
      for (int n0 = 0; n0 < tn; n0 += kTileN) {
        float acc[kRegM][kRegN];
        ZeroAcc(acc);
        if (pass == 0) {
          TileAccumulate(
              acc, m0, n0, sn, tn, r, [&](int m, int kk) { return psi_k[m * ldr + kk]; },
              [&](int n, int kk) { return phi_s[n * ldr + kk]; });
        } else {
          TileAccumulate(
              acc, m0, n0, sn, tn, p, [&](int m, int kk) { return vb_k[m * ldp + kk]; },
              [&](int n, int kk) { return g_s[n * ldp + kk]; });
        }
        TileStore(acc, m0, n0, sn, tn, [&](int m, int n, float val) {
          const bool seen = n >= m;
          dst[m * ldc + n] = seen ? (lam != nullptr ? val * expf(lam_q[n] - lam_k[m]) : val) : 0.f;
        });
      }
    }
  }
  __syncthreads();
  const float* Db = D_bar + crow * static_cast<int64_t>(r) * p;
  for (int m0 = 0; m0 < sn; m0 += kTileM) {
    for (int n0 = 0; n0 < r; n0 += kTileN) {
      float acc[kRegM][kRegN];
      ZeroAcc(acc);
      TileAccumulate(
          acc, m0, n0, sn, r, tn + p,
          [&](int m, int kk) { return kk < tn ? Gt[m * ldc + kk] : vb_k[m * ldp + kk - tn] * ws[m]; },
          [&](int n, int kk) { return kk < tn ? phi_s[kk * ldr + n] : __ldg(&Db[n * p + kk - tn]); });
      TileStore(acc, m0, n0, sn, r, [&](int m, int n, float val) {
        psi_bar[TokenRow(d, b, c0 + k0 + m, h) * r + n] += val;
      });
    }
  }
  for (int m0 = 0; m0 < sn; m0 += kTileM) {
    for (int n0 = 0; n0 < d.dv; n0 += kTileN) {
      float acc[kRegM][kRegN];
      ZeroAcc(acc);
      TileAccumulate(
          acc, m0, n0, sn, d.dv, tn + r,
          [&](int m, int kk) { return kk < tn ? At[m * ldc + kk] : psi_k[m * ldr + kk - tn] * ws[m]; },
          [&](int n, int kk) { return kk < tn ? g_s[kk * ldp + n] : __ldg(&Db[(kk - tn) * p + n]); });
      TileStore(acc, m0, n0, sn, d.dv, [&](int m, int n, float val) {
        v_bar[TokenRow(d, b, c0 + k0 + m, h) * d.dv + n] += val;
      });
    }
  }
}

// Which kernels run the chunk tiles: SMAT_CUDA_CHUNK_TILES = "general" or
// "fast" overrides kFastTilesByDefault (read on every launch, so a test can
// compare the two in one process).
constexpr bool kFastTilesByDefault = true;

template <class Kernel>
cudaError_t Prepare(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(smem));
}

}  // namespace

bool SmatDeviceRunsMma(int64_t smem_bytes) {
  int dev = 0, major = 0, smem = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
          cudaSuccess) {
    return false;
  }
  return major >= 8 && static_cast<int64_t>(smem) >= smem_bytes;
}

bool SmatUseFastChunkTiles(const SmatCudaDims& d) {
  if (!SmatChunkFastTilesFit(d)) return false;
  const char* env = std::getenv("SMAT_CUDA_CHUNK_TILES");
  if (env != nullptr && std::strcmp(env, "general") == 0) return false;
  if (env != nullptr && std::strcmp(env, "fast") == 0) return true;
  return kFastTilesByDefault;
}

bool SmatChunkBackwardRunsFused(const SmatCudaDims& d) {
  // LaunchSmatChunkOutputsBackward's way down to the fused kernel.
  return SmatUseFastChunkTiles(d) && SmatUseMmaChunkTiles(d, /*backward=*/true) &&
         SmatChunkBackwardFusedFits(d);
}

int SmatChunkTileRows(const SmatCudaDims& d, int64_t smem_limit, bool backward_keys) {
  for (int tile : {64, 32, 16}) {
    int64_t need = 0;
    if (backward_keys) {
      need = SmemFloats(d, tile, ChunkKernel::kKeyBackward);
    } else {
      need = std::max(SmemFloats(d, tile, ChunkKernel::kForward),
                      SmemFloats(d, tile, ChunkKernel::kQueryBackward));
    }
    if (need * static_cast<int64_t>(sizeof(float)) <= smem_limit) return tile;
  }
  return 0;
}

bool SmatNormalizedOutputsFused(const SmatCudaDims& d) {
  return SmatUseFastChunkTiles(d) && SmatChunkMmaForwardFused(d) &&
         SmatNormalizedOutputsFusedFits(d);
}

cudaError_t LaunchSmatChunkOutputs(const SmatCudaDims& d, int tile, const void* phi,
                                   const void* psi, const void* v, const float* lam,
                                   const float* S_in, float* ybar, cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatUseFastChunkTiles(d)) {
    return LaunchSmatChunkOutputsFast(d, phi, psi, v, lam, S_in, ybar, stream);
  }
  const size_t smem = sizeof(float) * SmemFloats(d, tile, ChunkKernel::kForward);
  cudaError_t err = Prepare(ChunkOutputsKernel, smem);
  if (err != cudaSuccess) return err;
  const int nq = (d.chunk + tile - 1) / tile;
  const dim3 grid(static_cast<unsigned>(d.Lc) * nq, d.batch * d.H);
  ChunkOutputsKernel<<<grid, kThreads, smem, stream>>>(d, tile, phi, psi, v, lam, S_in, ybar);
  return cudaGetLastError();
}

cudaError_t LaunchSmatChunkOutputsBackward(const SmatCudaDims& d, int query_tile, int key_tile,
                                           const void* phi, const void* psi, const void* v,
                                           const float* lam, const float* chunk_decay,
                                           const float* S_in, const float* gbar,
                                           const float* D_bar, float* phi_bar, float* psi_bar,
                                           float* v_bar, bool assign, cudaStream_t stream) {
  if (d.Lc == 0 || d.batch * d.H == 0) return cudaSuccess;
  if (SmatUseFastChunkTiles(d)) {
    return LaunchSmatChunkOutputsBackwardFast(d, phi, psi, v, lam, chunk_decay, S_in, gbar, D_bar,
                                              phi_bar, psi_bar, v_bar, assign, stream);
  }
  if (assign) {
    cudaError_t err = ZeroSmatChunkOutputsBackward(d, phi_bar, psi_bar, v_bar, stream);
    if (err != cudaSuccess) return err;
  }
  const size_t smem_q = sizeof(float) * SmemFloats(d, query_tile, ChunkKernel::kQueryBackward);
  cudaError_t err = Prepare(ChunkQueryBackwardKernel, smem_q);
  if (err != cudaSuccess) return err;
  const int nq = (d.chunk + query_tile - 1) / query_tile;
  ChunkQueryBackwardKernel<<<dim3(static_cast<unsigned>(d.Lc) * nq, d.batch * d.H), kThreads,
                             smem_q, stream>>>(d, query_tile, psi, v, lam, S_in, gbar, phi_bar);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const size_t smem_k = sizeof(float) * SmemFloats(d, key_tile, ChunkKernel::kKeyBackward);
  err = Prepare(ChunkKeyBackwardKernel, smem_k);
  if (err != cudaSuccess) return err;
  const int nk = (d.chunk + key_tile - 1) / key_tile;
  ChunkKeyBackwardKernel<<<dim3(static_cast<unsigned>(d.Lc) * nk, d.batch * d.H), kThreads,
                           smem_k, stream>>>(d, key_tile, phi, psi, v, lam, chunk_decay, gbar,
                                             D_bar, psi_bar, v_bar);
  return cudaGetLastError();
}

cudaError_t ZeroSmatChunkOutputsBackward(const SmatCudaDims& d, float* phi_bar, float* psi_bar,
                                         float* v_bar, cudaStream_t stream) {
  const size_t rows = static_cast<size_t>(d.batch) * static_cast<size_t>(d.L) * d.H;
  cudaError_t err = cudaMemsetAsync(phi_bar, 0, rows * d.r * sizeof(float), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(psi_bar, 0, rows * d.r * sizeof(float), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(v_bar, 0, rows * d.dv * sizeof(float), stream);
  return err;
}

}  // namespace smat
