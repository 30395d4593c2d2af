// CUDA and cuBLAS status mapping (cuda_check.h).
#include "kernels/cuda/cuda_check.h"

#include <cstdint>
#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"

namespace smat {

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, " failed: ", cudaGetErrorString(err), " (",
                                       cudaGetErrorName(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorUnsupportedPtxVersion:
      return absl::FailedPreconditionError(msg);
    // Sticky errors: the context is unusable until the process restarts.
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
      return absl::AbortedError(absl::StrCat(msg, "; the CUDA context is lost, restart the process"));
    default:
      return absl::InternalError(msg);
  }
}

absl::Status CublasStatus(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, " failed: ", cublasGetStatusString(status),
                                       " (", cublasGetStatusName(status), ")");
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(msg);
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return absl::FailedPreconditionError(msg);
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return absl::AbortedError(absl::StrCat(msg, "; the CUDA context may be lost, restart the process"));
    default:
      return absl::InternalError(msg);
  }
}

absl::Status UseDevice(int device) {
  SMAT_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  static std::mutex mu;
  static std::set<int>* pools_kept = new std::set<int>();  // guarded by mu; never destroyed
  std::lock_guard<std::mutex> lock(mu);
  if (pools_kept->count(device) != 0) return absl::OkStatus();
  cudaMemPool_t pool;
  SMAT_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, device));
  uint64_t keep = UINT64_MAX;
  SMAT_CUDA_RETURN_IF_ERROR(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  pools_kept->insert(device);
  return absl::OkStatus();
}

}  // namespace smat
