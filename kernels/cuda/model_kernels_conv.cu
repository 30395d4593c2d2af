// CUDA model kernels of the width-K short causal depthwise convolution
// (model_kernels_kernels.h): forward (also with softplus of its output as a
// second output, SoftplusForward's operations) and backward (also with
// SoftplusBackward applied as it reads the gradient), dx, d_prefix and d_w in
// one pass.
#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/model_kernels_device.cuh"

namespace smat {
namespace {

using namespace model_cuda;  // NOLINT: the shared launch shape and reductions

// ------------------------------------------------------------------ short conv
// A thread walks a run of kConvRun consecutive rows t of one sequence for V
// consecutive channels (V = 4: float4 loads and stores, when C % 4 == 0 and
// every pointer is 16-byte aligned; else V = 1), keeping the last K-1 input
// rows in registers, so each input element is loaded about once. A block is
// kConvGroups warps: warp g takes run number blockIdx.x * kConvGroups + g (runs
// numbered over (b, run) in order, ConvRuns(L) per sequence), lane l the
// channel vector blockIdx.y * 32 + l, so a warp's loads are contiguous.
// Loads are issued kConvForwardBatch (kConvBackwardBatch) rows at a time.
constexpr int kConvRun = 16, kConvGroups = 8, kConvForwardBatch = 8, kConvBackwardBatch = 4;
static_assert(kConvRun % kConvForwardBatch == 0 && kConvRun % kConvBackwardBatch == 0 &&
                  kConvRun >= K - 1,
              "conv run layout");

// Runs per sequence; at least one, so that the backward kernel writes d_prefix
// (zeros) when L == 0.
__host__ __device__ __forceinline__ int64_t ConvRuns(int64_t L) {
  return std::max<int64_t>(1, (L + kConvRun - 1) / kConvRun);
}

template <int V>
struct Vec {
  float v[V];
};

template <int V>
__device__ __forceinline__ Vec<V> LoadVec(const float* p) {
  Vec<V> r;
  if constexpr (V == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    r.v[0] = f.x;
    r.v[1] = f.y;
    r.v[2] = f.z;
    r.v[3] = f.w;
  } else {
#pragma unroll
    for (int q = 0; q < V; ++q) r.v[q] = p[q];
  }
  return r;
}

template <int V>
__device__ __forceinline__ void StoreVec(float* p, const Vec<V>& r) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
  } else {
#pragma unroll
    for (int q = 0; q < V; ++q) p[q] = r.v[q];
  }
}

// bf16 bits of the V values (rounded as Cast): uint2 for V = 4.
template <int V>
__device__ __forceinline__ void StoreVec(uint16_t* p, const Vec<V>& r) {
  if constexpr (V == 4) {
    uint2 b;
    b.x = static_cast<uint32_t>(ToBf16Bits(r.v[0])) |
          (static_cast<uint32_t>(ToBf16Bits(r.v[1])) << 16);
    b.y = static_cast<uint32_t>(ToBf16Bits(r.v[2])) |
          (static_cast<uint32_t>(ToBf16Bits(r.v[3])) << 16);
    *reinterpret_cast<uint2*>(p) = b;
  } else {
#pragma unroll
    for (int q = 0; q < V; ++q) p[q] = ToBf16Bits(r.v[q]);
  }
}

template <int V>
__device__ __forceinline__ Vec<V> ZeroVec() {
  Vec<V> r;
#pragma unroll
  for (int q = 0; q < V; ++q) r.v[q] = 0.f;
  return r;
}

// Start of input row s (negative: from the prefix) of sequence b.
__device__ __forceinline__ const float* ConvRow(const float* x, const float* prefix, int64_t b,
                                                int64_t s, int64_t L, int64_t C) {
  return s >= 0 ? x + (b * L + s) * C : prefix + (b * (K - 1) + (K - 1) + s) * C;
}

// y rows t0 .. t0 + kConvRun - 1 (those below L unless kFull: all of them).
// win[k] holds input row t0 - (K-1) + k for k < K-1 on entry. As the CPU:
// y = 0, then y += w[j] * in[t - (K-1) + j] for j = 0, 1, ..., K-1.
// TF: the type of a second output softplus(y) (SoftplusForward's operations),
// or NoFeatures (none).
struct NoFeatures {};

template <int V, bool kFull, typename TY, typename TF>
__device__ __forceinline__ void ConvForwardRun(const float* __restrict__ xb,
                                               TY* __restrict__ yb, TF* __restrict__ fb,
                                               int64_t rows_left, int64_t C,
                                               const Vec<V> (&wt)[K], Vec<V> (&win)[K]) {
#pragma unroll
  for (int k0 = 0; k0 < kConvRun; k0 += kConvForwardBatch) {
    Vec<V> in[kConvForwardBatch];  // the batch's loads first, then its outputs
#pragma unroll
    for (int k = 0; k < kConvForwardBatch; ++k) {
      in[k] = kFull || k0 + k < rows_left ? LoadVec<V>(xb + (k0 + k) * C) : ZeroVec<V>();
    }
#pragma unroll
    for (int k = 0; k < kConvForwardBatch; ++k) {
      if (kFull || k0 + k < rows_left) {
        win[K - 1] = in[k];
        Vec<V> out;
#pragma unroll
        for (int q = 0; q < V; ++q) {
          float o = 0.f;
#pragma unroll
          for (int j = 0; j < K; ++j) o = __fadd_rn(o, __fmul_rn(wt[j].v[q], win[j].v[q]));
          out.v[q] = o;
        }
        StoreVec<V>(yb + (k0 + k) * C, out);
        if constexpr (!std::is_same_v<TF, NoFeatures>) {
          Vec<V> f;
#pragma unroll
          for (int q = 0; q < V; ++q) f.v[q] = 1.f * Softplus(out.v[q]);
          StoreVec<V>(fb + (k0 + k) * C, f);
        }
#pragma unroll
        for (int j = 0; j < K - 1; ++j) win[j] = win[j + 1];
      }
    }
  }
}

template <int V, typename TY, typename TF>
__global__ void __launch_bounds__(kWarp * kConvGroups)
    ShortConvForwardKernel(const float* __restrict__ x, const float* __restrict__ prefix,
                           const float* __restrict__ w, TY* __restrict__ y,
                           TF* __restrict__ f, int64_t nb, int64_t L, int64_t C) {
  const int lane = threadIdx.x % kWarp, g = threadIdx.x / kWarp;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kWarp + lane) * V;
  const int64_t runs = ConvRuns(L);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kConvGroups + g;
  if (c >= C || r >= nb * runs) return;
  const int64_t b = r / runs, t0 = (r - b * runs) * kConvRun;
  Vec<V> wt[K], win[K];
#pragma unroll
  for (int j = 0; j < K; ++j) wt[j] = LoadVec<V>(w + j * C + c);
#pragma unroll
  for (int k = 0; k < K - 1; ++k) {
    win[k] = LoadVec<V>(ConvRow(x, prefix, b, t0 - (K - 1) + k, L, C) + c);
  }
  const float* xb = x + (b * L + t0) * C + c;
  TY* yb = y + (b * L + t0) * C + c;
  TF* fb = f != nullptr ? f + (b * L + t0) * C + c : nullptr;
  if (t0 + kConvRun <= L) {
    ConvForwardRun<V, true, TY, TF>(xb, yb, fb, L - t0, C, wt, win);
  } else {
    ConvForwardRun<V, false, TY, TF>(xb, yb, fb, L - t0, C, wt, win);
  }
}

// The input gradient of row s as the CPU: 0, then += w[j] * dy[s + (K-1) - j]
// for j = 0, 1, ..., K-1 where that row is in [0, L) (the others skipped).
// dyw[k] holds dy row s + k (k <= K-1); t_ok(k) says whether row s + k < L
// (and >= 0).
template <int V, class Ok>
__device__ __forceinline__ Vec<V> ConvInputGrad(const Vec<V> (&wt)[K], const Vec<V> (&dyw)[K],
                                                Ok t_ok) {
  Vec<V> out;
#pragma unroll
  for (int q = 0; q < V; ++q) {
    float o = 0.f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      if (t_ok(K - 1 - j)) o = __fadd_rn(o, __fmul_rn(wt[j].v[q], dyw[K - 1 - j].v[q]));
    }
    out.v[q] = o;
  }
  return out;
}

// Rows s = t0 .. t0 + kConvRun - 1 (those below L unless kFull, which also
// means s + K-1 < L for all of them): dx[s], and the d_w terms of output row
// s added to acc[j] (acc[j] += dy[s] * in[s - (K-1) + j], as the CPU's term).
// On entry xw[k] = input row t0 - (K-1) + k and dyw[k] = dy row t0 + k for
// k < K-1 (rows >= L: unused).
// The gradient at the conv's output: dy, or (z not null: the conv output that
// a softplus read) sigmoid(z) * dy, the operations of SoftplusBackward.
template <int V>
__device__ __forceinline__ Vec<V> LoadConvGrad(const float* __restrict__ dy,
                                               const float* __restrict__ z) {
  Vec<V> g = LoadVec<V>(dy);
  if (z != nullptr) {
    const Vec<V> zv = LoadVec<V>(z);
#pragma unroll
    for (int q = 0; q < V; ++q) g.v[q] = 1.f * Sigmoid(zv.v[q]) * g.v[q];
  }
  return g;
}

template <int V, bool kFull, typename TX>
__device__ __forceinline__ void ConvBackwardRun(const float* __restrict__ xb,
                                                const float* __restrict__ dyb,
                                                const float* __restrict__ zb,
                                                TX* __restrict__ dxb, int64_t rows_left,
                                                int64_t C, const Vec<V> (&wt)[K], Vec<V> (&xw)[K],
                                                Vec<V> (&dyw)[K], Vec<V> (&acc)[K]) {
#pragma unroll
  for (int k0 = 0; k0 < kConvRun; k0 += kConvBackwardBatch) {
    Vec<V> xin[kConvBackwardBatch], gin[kConvBackwardBatch];  // the batch's loads first
#pragma unroll
    for (int k = 0; k < kConvBackwardBatch; ++k) {
      const int s = k0 + k;  // row t0 + s
      xin[k] = kFull || s < rows_left ? LoadVec<V>(xb + s * C) : ZeroVec<V>();
      gin[k] = kFull || s + (K - 1) < rows_left
                   ? LoadConvGrad<V>(dyb + (s + (K - 1)) * C,
                                     zb != nullptr ? zb + (s + (K - 1)) * C : nullptr)
                   : ZeroVec<V>();
    }
#pragma unroll
    for (int k = 0; k < kConvBackwardBatch; ++k) {
      const int s = k0 + k;
      if (kFull || s < rows_left) {
        xw[K - 1] = xin[k];
        dyw[K - 1] = gin[k];
        StoreVec<V>(dxb + s * C, ConvInputGrad<V>(wt, dyw, [&](int d) {
                      return kFull || s + d < rows_left;
                    }));
#pragma unroll
        for (int j = 0; j < K; ++j) {
#pragma unroll
          for (int q = 0; q < V; ++q) {
            acc[j].v[q] = __fadd_rn(acc[j].v[q], __fmul_rn(dyw[0].v[q], xw[j].v[q]));
          }
        }
#pragma unroll
        for (int j = 0; j < K - 1; ++j) {
          xw[j] = xw[j + 1];
          dyw[j] = dyw[j + 1];
        }
      }
    }
  }
}

// dx, d_prefix and the d_w partials [gridDim.x, K, C] in one pass: each
// warp's run as above (the d_w terms of its rows summed in row order), then
// the block's kConvGroups run sums added in warp order. The thread of run 0
// of sequence b also writes d_prefix[b] for its channels.
template <int V, typename TX>
__global__ void __launch_bounds__(kWarp * kConvGroups, 2)
    ShortConvBackwardKernel(const float* __restrict__ x, const float* __restrict__ prefix,
                            const float* __restrict__ w, const float* __restrict__ dy,
                            const float* __restrict__ z, TX* __restrict__ dx,
                            float* __restrict__ d_prefix,
                            float* __restrict__ partials, int64_t nb, int64_t L, int64_t C) {
  const int lane = threadIdx.x % kWarp, g = threadIdx.x / kWarp;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * kWarp + lane) * V;
  const int64_t runs = ConvRuns(L);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kConvGroups + g;
  Vec<V> acc[K];
#pragma unroll
  for (int j = 0; j < K; ++j) acc[j] = ZeroVec<V>();
  if (c < C && r < nb * runs) {
    const int64_t b = r / runs, t0 = (r - b * runs) * kConvRun;
    Vec<V> wt[K], xw[K], dyw[K];
#pragma unroll
    for (int j = 0; j < K; ++j) wt[j] = LoadVec<V>(w + j * C + c);
#pragma unroll
    for (int k = 0; k < K - 1; ++k) {
      xw[k] = LoadVec<V>(ConvRow(x, prefix, b, t0 - (K - 1) + k, L, C) + c);
      const int64_t off = (b * L + t0 + k) * C + c;
      dyw[k] = t0 + k < L ? LoadConvGrad<V>(dy + off, z != nullptr ? z + off : nullptr)
                          : ZeroVec<V>();
    }
    xw[K - 1] = ZeroVec<V>();
    dyw[K - 1] = ZeroVec<V>();
    if (t0 == 0) {
      // d_prefix rows s = -(K-1) .. -1 as the CPU: the dy rows t = s + (K-1) - j
      // in [0, L) for j = 0, 1, ..., K-1; t < K-1, so dy row t is dyw[t].
#pragma unroll
      for (int i = 0; i < K - 1; ++i) {
        const int s = i - (K - 1);
        Vec<V> out;
#pragma unroll
        for (int q = 0; q < V; ++q) {
          float o = 0.f;
#pragma unroll
          for (int j = 0; j < K; ++j) {
            const int t = s + (K - 1) - j;
            if (t >= 0 && t < L) o = __fadd_rn(o, __fmul_rn(wt[j].v[q], dyw[t].v[q]));
          }
          out.v[q] = o;
        }
        StoreVec<V>(d_prefix + (b * (K - 1) + i) * C + c, out);
      }
    }
    const float* xb = x + (b * L + t0) * C + c;
    const float* dyb = dy + (b * L + t0) * C + c;
    const float* zb = z != nullptr ? z + (b * L + t0) * C + c : nullptr;
    TX* dxb = dx + (b * L + t0) * C + c;
    if (t0 + kConvRun + (K - 1) <= L) {
      ConvBackwardRun<V, true, TX>(xb, dyb, zb, dxb, L - t0, C, wt, xw, dyw, acc);
    } else {
      ConvBackwardRun<V, false, TX>(xb, dyb, zb, dxb, L - t0, C, wt, xw, dyw, acc);
    }
  }
  __shared__ float sums[K][kConvGroups][kWarp * V];
#pragma unroll
  for (int j = 0; j < K; ++j) {
#pragma unroll
    for (int q = 0; q < V; ++q) sums[j][g][lane * V + q] = acc[j].v[q];
  }
  __syncthreads();
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kWarp * V;
  for (int e = threadIdx.x; e < K * kWarp * V; e += blockDim.x) {
    const int j = e / (kWarp * V), col = e % (kWarp * V);
    if (c0 + col >= C) continue;
    float total = sums[j][0][col];
    for (int k = 1; k < kConvGroups; ++k) total = __fadd_rn(total, sums[j][k][col]);
    partials[(static_cast<int64_t>(blockIdx.x) * K + j) * C + c0 + col] = total;
  }
}

}  // namespace

int64_t ShortConvBackwardPartials(int64_t nb, int64_t L) {
  return std::max<int64_t>(1, (nb * ConvRuns(L) + kConvGroups - 1) / kConvGroups);
}

namespace {

template <typename TY, typename TF>
cudaError_t ShortConvForwardAs(const float* x, const float* prefix, const float* w, TY* y, TF* f,
                               bool vec, int64_t nb, int64_t L, int64_t C, cudaStream_t stream) {
  const int64_t tiles = (C / (vec ? 4 : 1) + kWarp - 1) / kWarp;
  const int64_t blocks = (nb * ConvRuns(L) + kConvGroups - 1) / kConvGroups;
  if (tiles > 65535 || blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
  const unsigned threads = kWarp * kConvGroups;
  if (vec) {
    ShortConvForwardKernel<4, TY, TF><<<grid, threads, 0, stream>>>(x, prefix, w, y, f, nb, L, C);
  } else {
    ShortConvForwardKernel<1, TY, TF><<<grid, threads, 0, stream>>>(x, prefix, w, y, f, nb, L, C);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchShortConvForward(const float* x, const float* prefix, const float* w, void* y,
                                   bool y_bf16, int64_t nb, int64_t L, int64_t C,
                                   cudaStream_t stream) {
  if (nb * L * C == 0) return cudaSuccess;
  const bool y_aligned = (reinterpret_cast<uintptr_t>(y) & (y_bf16 ? 7u : 15u)) == 0;
  const bool vec = C % 4 == 0 && Aligned16(x) && Aligned16(prefix) && Aligned16(w) && y_aligned;
  NoFeatures* none = nullptr;
  if (y_bf16) {
    return ShortConvForwardAs(x, prefix, w, static_cast<uint16_t*>(y), none, vec, nb, L, C, stream);
  }
  return ShortConvForwardAs(x, prefix, w, static_cast<float*>(y), none, vec, nb, L, C, stream);
}

cudaError_t LaunchShortConvSoftplusForward(const float* x, const float* prefix, const float* w,
                                           float* y, void* f, bool f_bf16, int64_t nb, int64_t L,
                                           int64_t C, cudaStream_t stream) {
  if (nb * L * C == 0) return cudaSuccess;
  const bool f_aligned = (reinterpret_cast<uintptr_t>(f) & (f_bf16 ? 7u : 15u)) == 0;
  const bool vec = C % 4 == 0 && Aligned16(x) && Aligned16(prefix) && Aligned16(w) &&
                   Aligned16(y) && f_aligned;
  if (f_bf16) {
    return ShortConvForwardAs(x, prefix, w, y, static_cast<uint16_t*>(f), vec, nb, L, C, stream);
  }
  return ShortConvForwardAs(x, prefix, w, y, static_cast<float*>(f), vec, nb, L, C, stream);
}

cudaError_t LaunchShortConvBackward(const float* x, const float* prefix, const float* w,
                                    const float* dy, const float* z, void* dx, bool dx_bf16,
                                    float* d_prefix, float* d_w, float* partials, int64_t nb,
                                    int64_t L, int64_t C, cudaStream_t stream) {
  if (nb * C == 0) return cudaSuccess;
  const bool dx_aligned = (reinterpret_cast<uintptr_t>(dx) & (dx_bf16 ? 7u : 15u)) == 0;
  const bool vec = C % 4 == 0 && Aligned16(x) && Aligned16(prefix) && Aligned16(w) &&
                   Aligned16(dy) && (z == nullptr || Aligned16(z)) && dx_aligned &&
                   Aligned16(d_prefix);
  const int64_t tiles = (C / (vec ? 4 : 1) + kWarp - 1) / kWarp;
  const int64_t blocks = ShortConvBackwardPartials(nb, L);
  if (tiles > 65535 || blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
  uint16_t* dxh = static_cast<uint16_t*>(dx);
  float* dxf = static_cast<float*>(dx);
  const unsigned threads = kWarp * kConvGroups;
  if (vec && dx_bf16) {
    ShortConvBackwardKernel<4><<<grid, threads, 0, stream>>>(x, prefix, w, dy, z, dxh,
                                                             d_prefix, partials, nb, L, C);
  } else if (vec) {
    ShortConvBackwardKernel<4><<<grid, threads, 0, stream>>>(x, prefix, w, dy, z, dxf,
                                                             d_prefix, partials, nb, L, C);
  } else if (dx_bf16) {
    ShortConvBackwardKernel<1><<<grid, threads, 0, stream>>>(x, prefix, w, dy, z, dxh,
                                                             d_prefix, partials, nb, L, C);
  } else {
    ShortConvBackwardKernel<1><<<grid, threads, 0, stream>>>(x, prefix, w, dy, z, dxf,
                                                             d_prefix, partials, nb, L, C);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || L == 0) return err;  // no rows: d_w unchanged
  return LaunchAddPartialsGrouped(partials, blocks, K * C, d_w, stream);
}

}  // namespace smat
