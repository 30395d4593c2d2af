// CudaScratch: stream-ordered scratch memory for one call of a CUDA phase
// (cudaMallocAsync on the call's stream, cudaFreeAsync on it when the object
// goes out of scope), so that calls on different streams never share a
// buffer. Used by the SMat phases (smat_cuda.cc) and the model kernels
// (model_kernels_cuda.cc).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_check.h"

namespace smat {

class CudaScratch {
 public:
  explicit CudaScratch(cudaStream_t s) : stream_(s) {}
  ~CudaScratch() {
    for (void* p : ptrs_) cudaFreeAsync(p, stream_);
  }
  CudaScratch(const CudaScratch&) = delete;
  CudaScratch& operator=(const CudaScratch&) = delete;

  // count elements of T (at least one), valid on the stream until destruction.
  template <typename T>
  absl::StatusOr<T*> Get(int64_t count) {
    void* p = nullptr;
    SMAT_CUDA_RETURN_IF_ERROR(
        cudaMallocAsync(&p, std::max<int64_t>(1, count) * sizeof(T), stream_));
    ptrs_.push_back(p);
    return static_cast<T*>(p);
  }

 private:
  cudaStream_t stream_;
  std::vector<void*> ptrs_;
};

}  // namespace smat
