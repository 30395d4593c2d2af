// The Backend interface: memory, streams, events and dense operations for one
// device. Two implementations: CpuBackend (compiled into every binary; CBLAS for
// dense products) and CudaBackend (libsmat_cuda.so, loaded with dlopen when a
// GPU is asked for, so no binary links cuBLAS at start-up: see PLATFORM.md on
// cuBLAS TLS and prometheus-cpp's civetweb threads).
//
//   SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Backend> gpu, CreateBackend(Device::Cuda(0)));
//   SMAT_ASSIGN_OR_RETURN(Tensor a, Tensor::Empty({m, k}, DType::kBF16, gpu->allocator()));
//   SMAT_RETURN_IF_ERROR(gpu->Gemm(Transpose::kNo, Transpose::kYes, 1.f, a, b, 0.f, c));
//
// Every operation is asynchronous on its stream (nullptr: the backend's default
// stream); the CPU backend runs it at once. Operations validate dtypes, shapes
// and devices and return InvalidArgument naming the operand that is wrong.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace smat {

class SmatKernels;   // kernels/smat_kernels.h: the SMat-Attention phases.
class ModelKernels;  // kernels/model_kernels.h: embedding, norms, MLP, loss.
class Decoder;       // kernels/decode.h: token-by-token decoding.
struct DecoderSpec;  // kernels/decode.h

// Opaque per-backend handles.
class Stream {
 public:
  virtual ~Stream() = default;
};
class Event {
 public:
  virtual ~Event() = default;
};

enum class Transpose : int { kNo = 0, kYes = 1 };

class Backend {
 public:
  virtual ~Backend() = default;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual Device device() const = 0;
  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H200)"
  virtual Allocator& allocator() = 0;

  // --- streams and events ------------------------------------------------------
  virtual absl::StatusOr<std::unique_ptr<Stream>> CreateStream() = 0;
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;
  virtual absl::Status Record(Event& event, Stream* stream) = 0;
  virtual absl::Status Wait(Stream* stream, Event& event) = 0;    // stream waits for event
  virtual absl::Status Synchronize(Stream* stream) = 0;            // host waits for stream
  virtual absl::StatusOr<float> ElapsedMs(Event& start, Event& stop) = 0;

  // --- memory --------------------------------------------------------------------
  // Copies src into dst (same dtype and element count). Either side may be host
  // memory or this backend's device memory.
  virtual absl::Status Copy(const Tensor& src, Tensor& dst, Stream* stream = nullptr) = 0;
  // Sets every element of t to value (converted to t's dtype).
  virtual absl::Status Fill(Tensor& t, double value, Stream* stream = nullptr) = 0;

  // --- dense operations ------------------------------------------------------------
  // y += alpha * x, fp32 (x may be bf16).
  virtual absl::Status Axpy(float alpha, const Tensor& x, Tensor& y, Stream* stream = nullptr) = 0;
  // c = alpha * op(a) @ op(b) + beta * c. a and b fp32 or bf16 (the same), c fp32,
  // fp32 accumulation. Rank 2, or rank 3 with a leading batch dimension shared by
  // all three (strided batched product). c may also be bf16 when a and b are
  // bf16 and beta = 0: the fp32-accumulated product rounded to nearest even
  // once on the way out (the CPU: exactly Cast of its fp32 product; cuBLAS may
  // sum in another order, so within a bf16 rounding of that), for a product
  // whose output only bf16 readers use.
  virtual absl::Status Gemm(Transpose ta, Transpose tb, float alpha, const Tensor& a,
                            const Tensor& b, float beta, Tensor& c, Stream* stream = nullptr) = 0;

  // --- SMat-Attention ----------------------------------------------------------------
  // The SMat phase kernels of this device (kernels/smat_kernels.h). A backend
  // library built without them returns FailedPrecondition saying so.
  virtual absl::StatusOr<SmatKernels*> smat() = 0;

  // --- model layers ----------------------------------------------------------------
  // The model ops of this device (kernels/model_kernels.h). A backend built
  // without them returns FailedPrecondition saying so.
  virtual absl::StatusOr<ModelKernels*> model() = 0;

  // --- decoding ------------------------------------------------------------------------
  // A decoder (kernels/decode.h) whose cache lives in this device's memory:
  // fixed horizon for spec.window == 0, else stepped window. Include
  // kernels/decode.h to call it.
  virtual absl::StatusOr<std::unique_ptr<Decoder>> CreateDecoder(const DecoderSpec& spec) = 0;
};

// The backend for `device`. CPU: always available. CUDA: loads libsmat_cuda.so
// from the directory of the running executable, else $SMAT_CUDA_LIBRARY, else the
// loader's search path; no GPU, no driver or no library is a FailedPrecondition
// error saying which, never a crash.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(Device device);

// Parses "cpu", "cuda", "cuda:N".
absl::StatusOr<Device> ParseDevice(const std::string& name);

}  // namespace smat
