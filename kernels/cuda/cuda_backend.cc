// CudaBackend (cuda_backend.h): memory, streams, events, copies and element-wise
// kernels through the CUDA runtime, dense products through cuBLAS.
#include "kernels/cuda/cuda_backend.h"

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/backend_checks.h"
#include "kernels/cuda/cuda_allocator.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_cuda.h"
#include "kernels/cuda/elementwise_kernels.h"
#include "kernels/cuda/model_kernels_cuda.h"
#include "kernels/cuda/smat_cuda.h"

namespace smat {
namespace {

// cuBLAS's recommended workspace on Hopper. A workspace we own (instead of
// cuBLAS's per-stream pool) keeps kernel choice, and so results, the same on
// every stream.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// Makes `device` current on the calling thread for one scope and restores the
// previous device afterwards, so a backend never changes its caller's device.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    status_ = CudaStatus(cudaGetDevice(&previous_), "cudaGetDevice");
    if (status_.ok() && previous_ != device) {
      status_ = CudaStatus(cudaSetDevice(device), "cudaSetDevice");
      restore_ = status_.ok();
    }
  }
  ~ScopedDevice() {
    if (restore_) cudaSetDevice(previous_);
  }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
  int previous_ = 0;
  bool restore_ = false;
};

class CudaStream final : public Stream {
 public:
  CudaStream(int device, cudaStream_t s) : device(device), stream(s) {
    DeviceAllocator(device).RegisterStream(s);
  }
  ~CudaStream() override {
    DeviceAllocator(device).UnregisterStream(stream);  // waits for the stream's work
    cudaStreamDestroy(stream);
  }
  const int device;
  const cudaStream_t stream;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(int device, cudaEvent_t e) : device(device), event(e) {}
  ~CudaEvent() override { cudaEventDestroy(event); }
  const int device;
  const cudaEvent_t event;
  bool recorded = false;
};

absl::StatusOr<CudaEvent*> AsCudaEvent(Event& event, int device, const char* op) {
  auto* e = dynamic_cast<CudaEvent*>(&event);
  if (e == nullptr || e->device != device) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": the event was not created by the cuda:", device, " backend"));
  }
  return e;
}

bool FitsInt(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

}  // namespace

CudaBackend::CudaBackend(int device) : device_(device) {}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda:", device, ": no usable CUDA driver or device (cudaGetDeviceCount: ",
        cudaGetErrorString(err), ", ", cudaGetErrorName(err),
        "). Check that this machine has an NVIDIA GPU and a driver for CUDA ", CUDART_VERSION / 1000,
        " (nvidia-smi)", visible != nullptr ? absl::StrCat(" and CUDA_VISIBLE_DEVICES=", visible) : "",
        ", or run on the CPU backend"));
  }
  if (count == 0 || device >= count) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda:", device, " requested but ", count, " CUDA device(s) are visible",
        visible != nullptr ? absl::StrCat(" (CUDA_VISIBLE_DEVICES=", visible, ")") : "",
        "; pick an index below ", count, " or run on the CPU backend"));
  }
  std::unique_ptr<CudaBackend> backend(new CudaBackend(device));
  SMAT_RETURN_IF_ERROR(Annotate(backend->Init(), "initialising cuda:", device));
  return backend;
}

absl::Status CudaBackend::Init() {
  ScopedDevice scope(device_);
  SMAT_RETURN_IF_ERROR(scope.status());
  cudaDeviceProp prop;
  SMAT_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device_));
  name_ = absl::StrCat("cuda:", device_, " (", prop.name, ")");
  max_blocks_ = prop.multiProcessorCount * 8;
  allocator_ = &DeviceAllocator(device_);
  SMAT_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  DeviceAllocator(device_).RegisterStream(stream_);
  SMAT_CUBLAS_RETURN_IF_ERROR(cublasCreate(&cublas_));
  // Default math with CUBLAS_COMPUTE_32F means true fp32 products: TF32 only
  // happens with CUBLAS_TF32_TENSOR_OP_MATH or a *_FAST_TF32 compute type.
  SMAT_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  SMAT_CUBLAS_RETURN_IF_ERROR(cublasSetAtomicsMode(cublas_, CUBLAS_ATOMICS_NOT_ALLOWED));
  SMAT_CUDA_RETURN_IF_ERROR(cudaMalloc(&cublas_workspace_, kCublasWorkspaceBytes));
  return absl::OkStatus();
}

CudaBackend::~CudaBackend() {
  ScopedDevice scope(device_);
  // Work still queued may use the workspace: let it finish before freeing.
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (cublas_workspace_ != nullptr) cudaFree(cublas_workspace_);
  if (stream_ != nullptr) {
    DeviceAllocator(device_).UnregisterStream(stream_);
    cudaStreamDestroy(stream_);
  }
}

absl::StatusOr<cudaStream_t> CudaBackend::StreamOf(Stream* stream, const char* op) const {
  if (stream == nullptr) return stream_;
  auto* s = dynamic_cast<CudaStream*>(stream);
  if (s == nullptr || s->device != device_) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": the stream was not created by the ", name_, " backend"));
  }
  return s->stream;
}

absl::StatusOr<std::unique_ptr<Stream>> CudaBackend::CreateStream() {
  ScopedDevice scope(device_);
  SMAT_RETURN_IF_ERROR(scope.status());
  cudaStream_t s = nullptr;
  SMAT_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return std::unique_ptr<Stream>(new CudaStream(device_, s));
}

absl::StatusOr<std::unique_ptr<Event>> CudaBackend::CreateEvent() {
  ScopedDevice scope(device_);
  SMAT_RETURN_IF_ERROR(scope.status());
  cudaEvent_t e = nullptr;
  SMAT_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));  // with timing
  return std::unique_ptr<Event>(new CudaEvent(device_, e));
}

absl::Status CudaBackend::Record(Event& event, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(cudaStream_t s, StreamOf(stream, "Record"));
  SMAT_ASSIGN_OR_RETURN(CudaEvent * e, AsCudaEvent(event, device_, "Record"));
  ScopedDevice scope(device_);
  SMAT_RETURN_IF_ERROR(scope.status());
  SMAT_CUDA_RETURN_IF_ERROR(cudaEventRecord(e->event, s));
  e->recorded = true;
  return absl::OkStatus();
}

absl::Status CudaBackend::Wait(Stream* stream, Event& event) {
  SMAT_ASSIGN_OR_RETURN(cudaStream_t s, StreamOf(stream, "Wait"));
  SMAT_ASSIGN_OR_RETURN(CudaEvent * e, AsCudaEvent(event, device_, "Wait"));
  ScopedDevice scope(device_);
  SMAT_RETURN_IF_ERROR(scope.status());
  SMAT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, e->event, 0));
  return absl::OkStatus();
}

absl::Status CudaBackend::Synchronize(Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(cudaStream_t s, StreamOf(stream, "Synchronize"));
  ScopedDevice scope(device_);
  SMAT_RETURN_IF_ERROR(scope.status());
  SMAT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return absl::OkStatus();
}

absl::StatusOr<float> CudaBackend::ElapsedMs(Event& start, Event& stop) {
  SMAT_ASSIGN_OR_RETURN(CudaEvent * a, AsCudaEvent(start, device_, "ElapsedMs"));
  SMAT_ASSIGN_OR_RETURN(CudaEvent * b, AsCudaEvent(stop, device_, "ElapsedMs"));
  if (!a->recorded || !b->recorded) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ElapsedMs: the ", a->recorded ? "stop" : "start", " event was never recorded; call Record first"));
  }
  ScopedDevice scope(device_);
  SMAT_RETURN_IF_ERROR(scope.status());
  // cudaEventElapsedTime fails with cudaErrorNotReady until stop has happened.
  SMAT_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(b->event));
  float ms = 0.f;
  SMAT_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, a->event, b->event));
  return ms;
}

absl::Status CudaBackend::Copy(const Tensor& src, Tensor& dst, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(cudaStream_t s, StreamOf(stream, "Copy"));
  SMAT_RETURN_IF_ERROR(CheckCopy(src, dst));
  const Device here = device();
  for (const auto& [t, operand] : {std::pair<const Tensor*, const char*>{&src, "src"},
                                   std::pair<const Tensor*, const char*>{&dst, "dst"}}) {
    if (!t->device().is_cpu() && !(t->device() == here)) {
      return absl::InvalidArgumentError(absl::StrCat("Copy: ", operand, " is ", t->DebugString(),
                                                     " but this backend is ", name_,
                                                     "; use that device's backend"));
    }
  }
  if (src.nbytes() == 0) return absl::OkStatus();
  const bool from_host = src.device().is_cpu(), to_host = dst.device().is_cpu();
  const cudaMemcpyKind kind = from_host ? (to_host ? cudaMemcpyHostToHost : cudaMemcpyHostToDevice)
                                        : (to_host ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice);
  ScopedDevice scope(device_);
  SMAT_RETURN_IF_ERROR(scope.status());
  SMAT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(), kind, s));
  return absl::OkStatus();
}

absl::Status CudaBackend::Fill(Tensor& t, double value, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(cudaStream_t s, StreamOf(stream, "Fill"));
  SMAT_RETURN_IF_ERROR(CheckOnDevice(t, device(), "Fill", "t"));
  SMAT_ASSIGN_OR_RETURN(uint64_t bits, FillPattern(t.dtype(), value));
  ScopedDevice scope(device_);
  SMAT_RETURN_IF_ERROR(scope.status());
  SMAT_CUDA_RETURN_IF_ERROR(LaunchFill(t.raw(), t.numel(), static_cast<int>(DTypeSize(t.dtype())),
                                       bits, max_blocks_, s));
  return absl::OkStatus();
}

absl::Status CudaBackend::Axpy(float alpha, const Tensor& x, Tensor& y, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(cudaStream_t s, StreamOf(stream, "Axpy"));
  SMAT_RETURN_IF_ERROR(CheckAxpy(x, y, device()));
  ScopedDevice scope(device_);
  SMAT_RETURN_IF_ERROR(scope.status());
  SMAT_CUDA_RETURN_IF_ERROR(LaunchAxpy(alpha, x.raw(), x.dtype() == DType::kBF16, y.data<float>(),
                                       y.numel(), max_blocks_, s));
  return absl::OkStatus();
}

absl::Status CudaBackend::Gemm(Transpose ta, Transpose tb, float alpha, const Tensor& a,
                               const Tensor& b, float beta, Tensor& c, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(cudaStream_t s, StreamOf(stream, "Gemm"));
  const bool bf16_out = c.defined() && c.dtype() == DType::kBF16;
  if (bf16_out && beta != 0.f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gemm: a bf16 c is overwritten, not accumulated into: beta must be 0, got ", beta));
  }
  if (bf16_out && a.dtype() != DType::kBF16) {  // cuBLAS has no fp32 x fp32 -> bf16
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: a bf16 c needs bf16 a and b, got a ", a.DebugString()));
  }
  // CheckGemm knows fp32 outputs: a bf16 c is checked as the fp32 product it rounds.
  SMAT_ASSIGN_OR_RETURN(
      GemmDims d,
      CheckGemm(ta, tb, a, b,
                bf16_out ? Tensor::Wrap(c.raw(), c.shape(), DType::kF32, c.device()) : c,
                device()));
  if (!FitsInt(d.m) || !FitsInt(d.n) || !FitsInt(d.k) || !FitsInt(d.lda) || !FitsInt(d.ldb) ||
      !FitsInt(d.batch)) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: sizes batch=", d.batch, " m=", d.m,
                                                   " n=", d.n, " k=", d.k,
                                                   " exceed cuBLAS's 32-bit range; split the product"));
  }
  if (c.numel() == 0) return absl::OkStatus();
  ScopedDevice scope(device_);
  SMAT_RETURN_IF_ERROR(scope.status());
  if (d.k == 0) {
    // No products to sum: c = beta c. Done here rather than trusting every
    // cuBLAS version's handling of k = 0.
    if (bf16_out) return Fill(c, 0.0, stream);  // beta = 0
    SMAT_CUDA_RETURN_IF_ERROR(LaunchScale(beta, c.data<float>(), c.numel(), max_blocks_, s));
    return absl::OkStatus();
  }
  const cudaDataType_t ab_type = a.dtype() == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
  const cudaDataType_t c_type = bf16_out ? CUDA_R_16BF : CUDA_R_32F;
  // cuBLAS is column-major; a row-major (r, c) matrix is its column-major
  // transpose. So the row-major c = op(a) op(b) is computed as the column-major
  // c^T = op(b)^T op(a)^T: operands swapped, each keeping its own transpose
  // flag, m and n swapped.
  const cublasOperation_t op_a = ta == Transpose::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = tb == Transpose::kYes ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int m = static_cast<int>(d.n), n = static_cast<int>(d.m), k = static_cast<int>(d.k);
  const int ld_first = static_cast<int>(d.ldb), ld_second = static_cast<int>(d.lda);
  const int ldc = static_cast<int>(d.ldc);

  absl::MutexLock lock(&cublas_mu_);
  // cublasSetStream resets the workspace to cuBLAS's own pool, so the
  // workspace is set again after it on every call.
  SMAT_CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas_, s));
  SMAT_CUBLAS_RETURN_IF_ERROR(cublasSetWorkspace(cublas_, cublas_workspace_, kCublasWorkspaceBytes));
  if (d.batch == 1) {
    SMAT_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(cublas_, op_b, op_a, m, n, k, &alpha, b.raw(), ab_type,
                                             ld_first, a.raw(), ab_type, ld_second, &beta, c.raw(),
                                             c_type, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  } else {
    const long long stride_a = a.dim(-2) * a.dim(-1);
    const long long stride_b = b.dim(-2) * b.dim(-1);
    const long long stride_c = d.m * d.n;
    SMAT_CUBLAS_RETURN_IF_ERROR(cublasGemmStridedBatchedEx(
        cublas_, op_b, op_a, m, n, k, &alpha, b.raw(), ab_type, ld_first, stride_b, a.raw(), ab_type,
        ld_second, stride_a, &beta, c.raw(), c_type, ldc, stride_c, static_cast<int>(d.batch),
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  return absl::OkStatus();
}

absl::StatusOr<SmatKernels*> CudaBackend::smat() {
  absl::MutexLock lock(&smat_mu_);
  if (smat_ == nullptr) {
    // ForkSide's stream at the device's highest priority: the forward's
    // long-range phases take the SMs as they free up and the causal states
    // fill the rest.
    smat_ = MakeCudaSmatKernels(
        device_, [this](Stream* s) { return StreamOf(s, "smat"); },
        [this]() -> absl::StatusOr<std::unique_ptr<Stream>> {
          ScopedDevice scope(device_);
          SMAT_RETURN_IF_ERROR(scope.status());
          int least = 0, greatest = 0;
          SMAT_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
          cudaStream_t s = nullptr;
          SMAT_CUDA_RETURN_IF_ERROR(
              cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
          return std::unique_ptr<Stream>(new CudaStream(device_, s));
        });
  }
  return smat_.get();
}

absl::StatusOr<std::unique_ptr<Decoder>> CudaBackend::CreateDecoder(const DecoderSpec& spec) {
  SMAT_ASSIGN_OR_RETURN(SmatKernels* kernels, smat());
  return MakeCudaDecoder(
      device_, [this](Stream* s) { return StreamOf(s, "decode"); }, *allocator_, kernels, spec);
}

absl::StatusOr<ModelKernels*> CudaBackend::model() {
  absl::MutexLock lock(&model_mu_);
  if (model_ == nullptr) {
    model_ = MakeCudaModelKernels(
        device_, [this](Stream* s) { return StreamOf(s, "model"); }, max_blocks_);
  }
  return model_.get();
}

}  // namespace smat
