// CUDA runtime and cuBLAS error handling for libsmat_cuda.so: every call's
// result becomes an absl::Status carrying the CUDA error string, so a failing
// call is reported where it happened instead of surfacing later as garbage.
//
//   SMAT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, n, kind, stream));
//   SMAT_CUDA_RETURN_IF_ERROR(LaunchFill(...));  // launchers return cudaGetLastError()
#pragma once

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "core/status.h"

namespace smat {

// OK for cudaSuccess; otherwise a status whose code says what the caller can
// do: ResourceExhausted (out of memory), FailedPrecondition (no driver or no
// device), Aborted (the context is broken, e.g. an illegal address: restart the
// process), Internal (anything else). `what` names the call.
absl::Status CudaStatus(cudaError_t err, const char* what);

// The same for cuBLAS results.
absl::Status CublasStatus(cublasStatus_t status, const char* what);

// Makes `device` current for this thread. The first call for a device also
// tells its default stream-ordered memory pool (where the kernels' scratch
// comes from) to keep what it has reserved across synchronisations, so
// steady-state calls do not go back to the driver for memory.
absl::Status UseDevice(int device);

}  // namespace smat

#define SMAT_CUDA_RETURN_IF_ERROR(call) SMAT_RETURN_IF_ERROR(::smat::CudaStatus((call), #call))
#define SMAT_CUBLAS_RETURN_IF_ERROR(call) SMAT_RETURN_IF_ERROR(::smat::CublasStatus((call), #call))
