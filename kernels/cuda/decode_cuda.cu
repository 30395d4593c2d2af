// Kernels of the CUDA decoders (decode_cuda.h). Plain CUDA, no Abseil.
//
// The step kernel runs one block per (sequence, head): warps over the rows of
// the r x p state, lanes over its columns, so every state element is owned by
// one thread (read, updated and written once, no atomics) and each warp's
// accesses to a row are contiguous. Readout sums go through per-warp-row double
// partials in shared memory, combined in a fixed order: the same inputs give
// the same bits. State updates use __fmul_rn / __fadd_rn so that nvcc cannot
// contract them into fused multiply-adds: the host computes fl(fl(a s) + fl(k v)).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/decode_cuda.h"

namespace smat {
namespace {

constexpr int kWarp = 32;
constexpr int kMaxRowsPerBlock = 32;                 // warps per block at most
constexpr int kElemBatch = 6;  // state elements loaded at once per thread (r = 64, p = 65: all)
constexpr int64_t kStepSharedBudget = 40 * 1024;     // bytes of double partials aimed for

template <bool kBf16>
__device__ __forceinline__ float Load(const void* p, int64_t i) {
  if constexpr (kBf16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  } else {
    return static_cast<const float*>(p)[i];
  }
}

// s <- fl(fl(s * a) + kv), never fused.
__device__ __forceinline__ float DecayAdd(float s, float a, float kv) {
  return __fadd_rn(__fmul_rn(s, a), kv);
}

// Shared memory: acc [ny][p] doubles, ybar [p] doubles, then phi [r], psi [r],
// vbar [p] floats.
template <bool kBf16>
__global__ void __launch_bounds__(kWarp * kMaxRowsPerBlock) DecodeStepKernel(DecodeStepArgs A) {
  extern __shared__ double smem[];
  const int r = A.r, dv = A.dv, p = dv + 1;
  const int ny = blockDim.y;
  const int lane = threadIdx.x, row0 = threadIdx.y;
  const int tid = row0 * kWarp + lane, nthreads = ny * kWarp;
  const int64_t i = blockIdx.x;
  const int64_t rp = static_cast<int64_t>(r) * p;
  double* acc = smem;                 // [ny][p]
  double* ybar = acc + ny * p;        // [p]
  float* phi = reinterpret_cast<float*>(ybar + p);  // [r]
  float* psi = phi + r;               // [r]
  float* vbar = psi + r;              // [p]

  // Token features first: their loads overlap the scalar chain below.
  for (int k = tid; k < r; k += nthreads) {
    phi[k] = Load<kBf16>(A.phi, i * r + k);
    psi[k] = Load<kBf16>(A.psi, i * r + k);
  }
  for (int j = tid; j < p; j += nthreads) vbar[j] = j < dv ? Load<kBf16>(A.v, i * dv + j) : 1.f;

  // Scalars, read by every thread before anyone writes them (after the second barrier).
  const int64_t x = A.prof ? static_cast<int64_t>(A.prof[i]) : A.pos_profile;
  const int64_t h = A.type ? static_cast<int64_t>(A.type[i]) : A.pos_type;
  const bool bad = (A.prof != nullptr && (x < 0 || x >= A.P)) ||
                   (A.type != nullptr && (h < 0 || h >= A.B));
  if (bad) {
    // An id outside the geometry: this (sequence, head) gets NaN and its cache
    // is left as it was (the host decoders return InvalidArgument instead).
    for (int j = tid; j < dv; j += nthreads) A.o[i * dv + j] = __int_as_float(0x7fc00000);
    return;
  }
  const double lg = A.logg ? static_cast<double>(A.logg[i]) : 0.0;
  const float a = A.logg ? static_cast<float>(exp(lg)) : 1.f;
  const double lam = A.lam[i] + lg;
  float fdec = 1.f;
  if (A.table != nullptr) fdec = static_cast<float>(exp(lam - A.table_lam[i * A.P + x]));
  double wU = 0.0;
  if (A.U != nullptr) wU = exp((A.lam_offset ? A.lam_offset[i] : 0.0) + lam);

  for (int j = lane; j < p; j += kWarp) acc[row0 * p + j] = 0.0;  // this thread's slots
  __syncthreads();

  float* __restrict__ S = A.S + i * rp;
  float* __restrict__ S2 = A.S2 ? A.S2 + i * rp : nullptr;
  float* __restrict__ Fx = A.table ? A.table + (i * A.P + x) * rp : nullptr;
  const float* __restrict__ U = A.U ? A.U + (i * A.B + h) * rp : nullptr;
  // This thread's elements: columns j = lane + 32 c (c < nc) by rows
  // k = row0 + ny m (m < nm), column-major, in batches whose loads are all
  // issued before any of them is used (one memory latency per batch, not per
  // element). Each column's partial sums rows in increasing order.
  const int nc = lane < p ? (p - lane + kWarp - 1) / kWarp : 0;
  const int nm = row0 < r ? (r - row0 + ny - 1) / ny : 0;
  const int count = nc * nm;
  for (int q0 = 0; q0 < count; q0 += kElemBatch) {
    float sv[kElemBatch], s2v[kElemBatch], fv[kElemBatch], uv[kElemBatch];
#pragma unroll
    for (int u = 0; u < kElemBatch; ++u) {
      const int q = q0 + u;
      if (q < count) {
        const int64_t e = static_cast<int64_t>(row0 + ny * (q % nm)) * p + lane + kWarp * (q / nm);
        sv[u] = S[e];
        if (S2 != nullptr) s2v[u] = S2[e];
        if (Fx != nullptr) fv[u] = Fx[e];
        if (U != nullptr) uv[u] = U[e];
      }
    }
#pragma unroll
    for (int u = 0; u < kElemBatch; ++u) {
      const int q = q0 + u;
      if (q < count) {
        const int k = row0 + ny * (q % nm), j = lane + kWarp * (q / nm);
        const int64_t e = static_cast<int64_t>(k) * p + j;
        const float kv = __fmul_rn(psi[k], vbar[j]);  // = psi[k] exactly in column dv
        const float s = DecayAdd(sv[u], a, kv);
        S[e] = s;
        if (S2 != nullptr) S2[e] = DecayAdd(s2v[u], a, kv);
        if (Fx != nullptr) Fx[e] = DecayAdd(fv[u], fdec, kv);
        const double f = static_cast<double>(phi[k]);
        double sum = acc[row0 * p + j];
        sum += f * static_cast<double>(s);
        if (U != nullptr) sum += (wU * f) * static_cast<double>(uv[u]);
        acc[row0 * p + j] = sum;
      }
    }
  }
  __syncthreads();
  if (tid == 0) {
    A.lam[i] = lam;
    if (A.table != nullptr) A.table_lam[i * A.P + x] = lam;
  }
  for (int j = tid; j < p; j += nthreads) {
    double y = 0.0;
    for (int w = 0; w < ny; ++w) y += acc[w * p + j];
    ybar[j] = y;
  }
  __syncthreads();
  const double den = ybar[dv] + static_cast<double>(A.eps);
  for (int j = tid; j < dv; j += nthreads) A.o[i * dv + j] = static_cast<float>(ybar[j] / den);
}

// One block per (i, x) table entry; the factor is computed once per block.
__global__ void ReferTableKernel(int64_t G, int64_t state, float* __restrict__ table,
                                 const double* __restrict__ table_lam,
                                 const double* __restrict__ lam) {
  const int64_t entry = blockIdx.x;  // i * G + x
  const int64_t i = entry / G;
  const float f = static_cast<float>(exp(lam[i] - table_lam[entry]));
  float* t = table + entry * state;
  for (int64_t e = threadIdx.x; e < state; e += blockDim.x) t[e] = __fmul_rn(t[e], f);
}

// grid (tiles, bh): one factor per (sequence, head).
__global__ void DecayAddKernel(int64_t count, float* __restrict__ U, const float* __restrict__ add,
                               const double* __restrict__ decay) {
  const int64_t i = blockIdx.y;
  const float f = static_cast<float>(exp(decay[i]));
  float* u = U + i * count;
  const float* s = add + i * count;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    u[e] = __fadd_rn(__fmul_rn(f, u[e]), s[e]);
  }
}

__global__ void MoveScalarsKernel(int64_t bh, double* dst, double* src) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < bh) {
    dst[i] = src[i];
    src[i] = 0.0;
  }
}

}  // namespace

cudaError_t LaunchDecodeStep(const DecodeStepArgs& args, cudaStream_t stream) {
  if (args.bh == 0) return cudaSuccess;
  const int p = args.dv + 1;
  // As many warps (row groups) as the rows need and the partials' budget allows.
  int ny = static_cast<int>(kStepSharedBudget / (static_cast<int64_t>(sizeof(double)) * p));
  ny = ny < 1 ? 1 : (ny > kMaxRowsPerBlock ? kMaxRowsPerBlock : ny);
  if (ny > args.r) ny = args.r;
  const size_t smem = sizeof(double) * static_cast<size_t>(ny * p + p) +
                      sizeof(float) * static_cast<size_t>(2 * args.r + p);
  const dim3 block(kWarp, ny);
  const dim3 grid(static_cast<unsigned>(args.bh));
  if (args.bf16) {
    if (smem > 48 * 1024) {
      const cudaError_t err = cudaFuncSetAttribute(
          DecodeStepKernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (err != cudaSuccess) return err;
    }
    DecodeStepKernel<true><<<grid, block, smem, stream>>>(args);
  } else {
    if (smem > 48 * 1024) {
      const cudaError_t err = cudaFuncSetAttribute(
          DecodeStepKernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (err != cudaSuccess) return err;
    }
    DecodeStepKernel<false><<<grid, block, smem, stream>>>(args);
  }
  return cudaGetLastError();
}

cudaError_t LaunchDecodeReferTable(int64_t bh, int64_t G, int64_t state, float* table,
                                   const double* table_lam, const double* lam,
                                   cudaStream_t stream) {
  if (bh == 0 || G == 0 || state == 0) return cudaSuccess;
  ReferTableKernel<<<static_cast<unsigned>(bh * G), 256, 0, stream>>>(G, state, table, table_lam,
                                                                       lam);
  return cudaGetLastError();
}

cudaError_t LaunchDecodeDecayAdd(int64_t bh, int64_t count, float* U, const float* add,
                                 const double* decay, cudaStream_t stream) {
  if (bh == 0 || count == 0) return cudaSuccess;
  int64_t tiles = (count + 255) / 256;
  if (tiles > 4096) tiles = 4096;
  DecayAddKernel<<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(bh)), 256, 0,
                   stream>>>(count, U, add, decay);
  return cudaGetLastError();
}

cudaError_t LaunchDecodeMoveScalars(int64_t bh, double* dst, double* src, cudaStream_t stream) {
  if (bh == 0) return cudaSuccess;
  MoveScalarsKernel<<<static_cast<unsigned>((bh + 255) / 256), 256, 0, stream>>>(bh, dst, src);
  return cudaGetLastError();
}

}  // namespace smat
