// CUDA model kernels at the two ends of the model (model_kernels_kernels.h):
// id and target range checks, the embedding (forward gather; backward as a
// stable radix sort of the ids and ordered adds, the CPU's order) and the
// per-row softmax parts of the chunked cross-entropy.
#include <cub/device/device_radix_sort.cuh>

#include <climits>
#include <cstdint>

#include "kernels/cuda/model_kernels_device.cuh"

namespace smat {
namespace {

using namespace model_cuda;  // NOLINT: the shared launch shape and reductions

// ------------------------------------------------------------------ index checks
__global__ void FirstBadIndexKernel(const int32_t* __restrict__ ids,
                                    const float* __restrict__ weights, int64_t n, int64_t V,
                                    unsigned long long* first_bad) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const int32_t id = ids[i];
    if ((id < 0 || id >= V) && (weights == nullptr || weights[i] != 0.f)) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));  // integer: order-free
    }
  }
}

__global__ void SetKernel(unsigned long long* p, unsigned long long v) { *p = v; }

// ------------------------------------------------------------------ embedding
__global__ void EmbeddingForwardKernel(const float* __restrict__ table,
                                       const int32_t* __restrict__ ids, float* __restrict__ out,
                                       int64_t N, int64_t W, int64_t V, bool vectorized) {
  if (vectorized) {  // W % 4 == 0 and both pointers 16-byte aligned
    const int64_t w4 = W / 4, n = N * w4;
    for (int64_t e = GlobalThread(); e < n; e += GridThreads()) {
      const int64_t i = e / w4, j = e - i * w4;
      const int32_t id = ids[i];
      if (id < 0 || id >= V) continue;
      reinterpret_cast<float4*>(out)[e] = reinterpret_cast<const float4*>(table)[id * w4 + j];
    }
    return;
  }
  const int64_t n = N * W;
  for (int64_t e = GlobalThread(); e < n; e += GridThreads()) {
    const int64_t i = e / W, j = e - i * W;
    const int32_t id = ids[i];
    if (id < 0 || id >= V) continue;
    out[e] = table[id * W + j];
  }
}

__global__ void IotaKernel(int32_t* p, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) p[i] = static_cast<int32_t>(i);
}

// run_end[id] = one past the last sorted position holding id (written only
// for ids present).
__global__ void RunEndsKernel(const int32_t* __restrict__ sorted_ids, int64_t N,
                              int32_t* __restrict__ run_end) {
  for (int64_t p = GlobalThread(); p < N; p += GridThreads()) {
    if (p + 1 == N || sorted_ids[p + 1] != sorted_ids[p]) {
      run_end[sorted_ids[p]] = static_cast<int32_t>(p + 1);
    }
  }
}

// Block (p, column tile): when sorted position p starts a run of equal ids,
// adds the run's d_out rows (increasing row order, from the stable sort) to
// the table row, one column per thread: d = ((d + g_0) + g_1) + ..., as the CPU.
constexpr int kEmbedRows = 32;  // run rows staged in shared memory at a time
__global__ void EmbeddingAccumulateKernel(const int32_t* __restrict__ sorted_ids,
                                          const int32_t* __restrict__ sorted_rows,
                                          const int32_t* __restrict__ run_end,
                                          const float* __restrict__ d_out,
                                          float* __restrict__ d_table, int64_t W) {
  const int64_t p = blockIdx.x;
  const int32_t id = sorted_ids[p];
  if (p > 0 && sorted_ids[p - 1] == id) return;  // not the start of a run
  const int64_t end = run_end[id];
  const int64_t j = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  __shared__ int32_t rows[kEmbedRows];
  float acc = j < W ? d_table[id * W + j] : 0.f;
  for (int64_t q0 = p; q0 < end; q0 += kEmbedRows) {
    const int count = static_cast<int>(std::min<int64_t>(kEmbedRows, end - q0));
    __syncthreads();
    if (threadIdx.x < count) rows[threadIdx.x] = sorted_rows[q0 + threadIdx.x];
    __syncthreads();
    if (j < W) {
      float g[kEmbedRows];
#pragma unroll
      for (int k = 0; k < kEmbedRows; ++k) g[k] = k < count ? d_out[rows[k] * W + j] : 0.f;
#pragma unroll
      for (int k = 0; k < kEmbedRows; ++k) {
        if (k < count) acc = __fadd_rn(acc, g[k]);
      }
    }
  }
  if (j < W) d_table[id * W + j] = acc;
}

int SortBits(int64_t V) {
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) < V) ++bits;
  return bits;
}

size_t AlignUp(size_t v) { return (v + 255) & ~size_t{255}; }

// ------------------------------------------------------------------ cross-entropy
constexpr int kRowThreads = 256;

__global__ void CrossEntropyRowsKernel(const float* __restrict__ logits, int64_t V,
                                       const int32_t* __restrict__ targets,
                                       const float* __restrict__ weights, float* __restrict__ lse,
                                       double* __restrict__ terms) {
  __shared__ float fshared[kWarp];
  __shared__ double dshared[kWarp];
  const int64_t i = blockIdx.x;
  const float* row = logits + i * V;
  float mx = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, row[v]);
  mx = BlockMax(mx, fshared);
  double s = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += exp(double{row[v]} - mx);
  s = BlockSum(s, dshared);
  if (threadIdx.x == 0) {
    const double l = mx + log(s);
    lse[i] = static_cast<float>(l);
    const float wt = weights[i];
    terms[i] = wt != 0.f ? double{wt} * (l - row[targets[i]]) : 0.0;
  }
}

__global__ void CrossEntropyRowGradsKernel(float* __restrict__ logits, int64_t V,
                                           const int32_t* __restrict__ targets,
                                           const float* __restrict__ weights,
                                           const float* __restrict__ lse, float scale) {
  const int64_t i = blockIdx.x;
  float* row = logits + i * V;
  const float a = __fmul_rn(scale, weights[i]);
  if (a == 0.f) {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) row[v] = 0.f;
    return;
  }
  const float l = lse[i];
  const int64_t tg = targets[i];
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float p = __fmul_rn(a, expf(__fsub_rn(row[v], l)));
    row[v] = v == tg ? __fsub_rn(p, a) : p;
  }
}

}  // namespace

cudaError_t LaunchFirstBadIndex(const int32_t* ids, const float* weights, int64_t n, int64_t V,
                                unsigned long long* first_bad, int max_blocks,
                                cudaStream_t stream) {
  SetKernel<<<1, 1, 0, stream>>>(first_bad, ULLONG_MAX);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || n == 0) return err;
  FirstBadIndexKernel<<<Blocks(n, max_blocks), kThreads, 0, stream>>>(ids, weights, n, V,
                                                                      first_bad);
  return cudaGetLastError();
}

cudaError_t LaunchEmbeddingForward(const float* table, const int32_t* ids, float* out, int64_t N,
                                   int64_t W, int64_t V, int max_blocks, cudaStream_t stream) {
  if (N == 0 || W == 0) return cudaSuccess;
  const bool vectorized = W % 4 == 0 && Aligned16(table) && Aligned16(out);
  EmbeddingForwardKernel<<<Blocks(vectorized ? N * W / 4 : N * W, max_blocks), kThreads, 0,
                           stream>>>(table, ids, out, N, W, V, vectorized);
  return cudaGetLastError();
}

cudaError_t EmbeddingBackwardScratchBytes(int64_t N, int64_t V, size_t* bytes) {
  size_t sort_bytes = 0;
  cudaError_t err = cub::DeviceRadixSort::SortPairs(
      nullptr, sort_bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<int>(std::max<int64_t>(N, 1)), 0, SortBits(V));
  if (err != cudaSuccess) return err;
  *bytes = 3 * AlignUp(static_cast<size_t>(std::max<int64_t>(N, 1)) * sizeof(int32_t)) +
           AlignUp(static_cast<size_t>(std::max<int64_t>(V, 1)) * sizeof(int32_t)) +
           AlignUp(sort_bytes);
  return cudaSuccess;
}

cudaError_t LaunchEmbeddingBackward(const int32_t* ids, const float* d_out, float* d_table,
                                    int64_t N, int64_t W, int64_t V, void* scratch,
                                    size_t scratch_bytes, cudaStream_t stream) {
  if (N == 0 || W == 0) return cudaSuccess;
  char* p = static_cast<char*>(scratch);
  const size_t ints = AlignUp(static_cast<size_t>(N) * sizeof(int32_t));
  int32_t* rows_in = reinterpret_cast<int32_t*>(p);               // [N] 0, 1, ..., N-1
  int32_t* sorted_ids = reinterpret_cast<int32_t*>(p + ints);     // [N]
  int32_t* sorted_rows = reinterpret_cast<int32_t*>(p + 2 * ints);  // [N]
  int32_t* run_end = reinterpret_cast<int32_t*>(p + 3 * ints);    // [V]
  const size_t ends = AlignUp(static_cast<size_t>(V) * sizeof(int32_t));
  void* temp = p + 3 * ints + ends;
  size_t temp_bytes = scratch_bytes - 3 * ints - ends;
  IotaKernel<<<Blocks(N, 1024), kThreads, 0, stream>>>(rows_in, N);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  // LSD radix sort is stable: equal ids keep their rows in increasing order.
  err = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, ids, sorted_ids, rows_in, sorted_rows,
                                        static_cast<int>(N), 0, SortBits(V), stream);
  if (err != cudaSuccess) return err;
  RunEndsKernel<<<Blocks(N, 1024), kThreads, 0, stream>>>(sorted_ids, N, run_end);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>((W + 127) / 128));
  EmbeddingAccumulateKernel<<<grid, 128, 0, stream>>>(sorted_ids, sorted_rows, run_end, d_out,
                                                      d_table, W);
  return cudaGetLastError();
}

cudaError_t LaunchCrossEntropyRows(const float* logits, int64_t m, int64_t V,
                                   const int32_t* targets, const float* weights, float* lse,
                                   double* terms, cudaStream_t stream) {
  if (m == 0) return cudaSuccess;
  CrossEntropyRowsKernel<<<static_cast<unsigned>(m), kRowThreads, 0, stream>>>(
      logits, V, targets, weights, lse, terms);
  return cudaGetLastError();
}

cudaError_t LaunchCrossEntropyRowGrads(float* logits, int64_t m, int64_t V,
                                       const int32_t* targets, const float* weights,
                                       const float* lse, float scale, cudaStream_t stream) {
  if (m == 0) return cudaSuccess;
  CrossEntropyRowGradsKernel<<<static_cast<unsigned>(m), kRowThreads, 0, stream>>>(
      logits, V, targets, weights, lse, scale);
  return cudaGetLastError();
}

}  // namespace smat
