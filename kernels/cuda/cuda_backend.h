// CudaBackend: the Backend for one CUDA device, built into libsmat_cuda.so and
// reached only through CreateBackend(Device::Cuda(i)) (kernels/backend.cc loads
// the library with dlopen, so cuBLAS is never linked into an executable).
//
// Memory: device memory (never managed memory) from a caching allocator that
// lives as long as the process, so tensors may outlive the backend that made
// them (kernels/cuda/cuda_allocator.h). Freeing a tensor never synchronises:
// its block is reused once the work queued before the free on the backend's
// streams (the default one and those of CreateStream) has finished.
// Streams are non-blocking (they never serialise with the legacy default
// stream); nullptr means the backend's own default stream. Copy accepts every
// host/device pair (pageable host memory is fine; a copy into host memory has
// finished when the call returns, as CUDA does for pageable destinations).
// Dense products go to cuBLAS with CUBLAS_COMPUTE_32F: full fp32 arithmetic,
// no TF32 (fp32 inputs) and fp32 accumulation (bf16 inputs), atomics disabled
// and a fixed per-backend workspace, so equal calls give equal bits.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"

namespace smat {

class CudaBackend final : public Backend {
 public:
  // Fails with FailedPrecondition when there is no driver, no device, or fewer
  // than device + 1 devices.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device);
  ~CudaBackend() override;

  Device device() const override { return Device::Cuda(device_); }
  std::string name() const override { return name_; }
  Allocator& allocator() override { return *allocator_; }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override;
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override;
  absl::Status Record(Event& event, Stream* stream) override;
  absl::Status Wait(Stream* stream, Event& event) override;
  absl::Status Synchronize(Stream* stream) override;
  absl::StatusOr<float> ElapsedMs(Event& start, Event& stop) override;

  absl::Status Copy(const Tensor& src, Tensor& dst, Stream* stream = nullptr) override;
  absl::Status Fill(Tensor& t, double value, Stream* stream = nullptr) override;
  absl::Status Axpy(float alpha, const Tensor& x, Tensor& y, Stream* stream = nullptr) override;
  absl::Status Gemm(Transpose ta, Transpose tb, float alpha, const Tensor& a, const Tensor& b,
                    float beta, Tensor& c, Stream* stream = nullptr) override;

  // The CUDA SMat phase kernels (kernels/cuda/smat_cuda.h), created on first use.
  absl::StatusOr<SmatKernels*> smat() override;
  // The CUDA model kernels (kernels/cuda/model_kernels_cuda.h), created on first use.
  absl::StatusOr<ModelKernels*> model() override;
  // The CUDA decoders (kernels/cuda/decode_cuda.h): cache on this device.
  absl::StatusOr<std::unique_ptr<Decoder>> CreateDecoder(const DecoderSpec& spec) override;

 private:
  explicit CudaBackend(int device);
  absl::Status Init();
  // The CUDA stream behind `stream` (nullptr: the default stream); `op` names
  // the calling operation for the message when the stream is foreign.
  absl::StatusOr<cudaStream_t> StreamOf(Stream* stream, const char* op) const;

  const int device_;
  std::string name_;             // "cuda:0 (NVIDIA H200)"
  Allocator* allocator_ = nullptr;  // process lifetime (DeviceAllocator)
  int max_blocks_ = 1;           // grid size cap for element-wise kernels (SMs x 8)
  cudaStream_t stream_ = nullptr;   // default stream, non-blocking

  // cuBLAS state; a handle must not be used by two threads at once.
  absl::Mutex cublas_mu_;
  cublasHandle_t cublas_ = nullptr;
  void* cublas_workspace_ = nullptr;  // (kCublasWorkspaceBytes) bytes on the device

  absl::Mutex smat_mu_;
  std::unique_ptr<SmatKernels> smat_;  // guarded by smat_mu_

  absl::Mutex model_mu_;
  std::unique_ptr<ModelKernels> model_;  // guarded by model_mu_
};

}  // namespace smat
