// Element-wise CUDA kernels of the CUDA backend (Fill, Axpy, scaling of an
// output by beta), behind plain launch functions so that cuda_backend.cc is
// ordinary C++ and nvcc never has to parse Abseil.
//
// Each launcher enqueues one grid-stride kernel on `stream` and returns the
// launch's cudaError_t (cudaGetLastError right after the launch). Every thread
// writes its own elements only: no atomics, so results are bitwise repeatable.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace smat {

// Sets n elements of `elem_size` bytes (2, 4 or 8) at p to the low elem_size
// bytes of `bits`. p is aligned to elem_size.
cudaError_t LaunchFill(void* p, int64_t n, int elem_size, uint64_t bits, int max_blocks,
                       cudaStream_t stream);

// y[i] = fmaf(alpha, x[i], y[i]) for i < n; x fp32 (x_is_bf16 false) or bf16.
cudaError_t LaunchAxpy(float alpha, const void* x, bool x_is_bf16, float* y, int64_t n,
                       int max_blocks, cudaStream_t stream);

// c[i] = beta == 0 ? 0 : beta * c[i] (an empty inner product: c = beta c, where
// beta = 0 overwrites NaNs rather than multiplying them).
cudaError_t LaunchScale(float beta, float* c, int64_t n, int max_blocks, cudaStream_t stream);

}  // namespace smat
