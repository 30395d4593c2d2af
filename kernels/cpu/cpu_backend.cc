// CpuBackend (cpu_backend.h): synchronous host implementation of Backend.
#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/backend_checks.h"
#include "kernels/cpu/model_kernels_cpu.h"
#include "kernels/cpu/smat_cpu.h"
#include "kernels/decode.h"

namespace smat {
namespace {

// Work is done before a call returns, so a stream has nothing to hold.
class CpuStream final : public Stream {};

// The host time at the last Record.
class CpuEvent final : public Event {
 public:
  std::chrono::steady_clock::time_point time;
  bool recorded = false;
};

absl::Status CheckStream(Stream* stream, const char* op) {
  if (stream != nullptr && dynamic_cast<CpuStream*>(stream) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": the stream was not created by the cpu backend"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CpuEvent*> AsCpuEvent(Event& event, const char* op) {
  auto* e = dynamic_cast<CpuEvent*>(&event);
  if (e == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": the event was not created by the cpu backend"));
  }
  return e;
}

// cblas_sgemm takes int sizes; larger products must be split by the caller.
absl::Status CheckBlasInt(const GemmDims& d) {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (d.m > kMax || d.n > kMax || d.k > kMax || d.lda > kMax || d.ldb > kMax) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: sizes m=", d.m, " n=", d.n, " k=", d.k,
                                                   " exceed the 32-bit range of CBLAS; split the "
                                                   "product"));
  }
  return absl::OkStatus();
}

// CheckGemm, which knows fp32 outputs, plus the bf16 one (beta = 0), checked
// as the fp32 product it rounds.
absl::StatusOr<GemmDims> CheckGemmAnyOutput(Transpose ta, Transpose tb, const Tensor& a,
                                            const Tensor& b, float beta, const Tensor& c) {
  if (!c.defined() || c.dtype() != DType::kBF16) return CheckGemm(ta, tb, a, b, c, Device::Cpu());
  if (beta != 0.f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gemm: a bf16 c is overwritten, not accumulated into: beta must be 0, got ", beta));
  }
  if (a.dtype() != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: a bf16 c needs bf16 a and b, got a ", a.DebugString()));
  }
  const Tensor as_f32 = Tensor::Wrap(c.raw(), c.shape(), DType::kF32, c.device());
  return CheckGemm(ta, tb, a, b, as_f32, Device::Cpu());
}

// The fp32 view of a Gemm operand: the data itself, or (bf16) a widened copy
// kept in `scratch`.
const float* AsFloat(const Tensor& t, std::vector<float>& scratch) {
  if (t.dtype() == DType::kF32) return t.data<float>();
  const uint16_t* p = t.data<uint16_t>();
  scratch.resize(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < scratch.size(); ++i) scratch[i] = Bf16ToFloat(p[i]);
  return scratch.data();
}

}  // namespace

int CpuBlasThreads() { return openblas_get_num_threads(); }

void SetCpuBlasThreads(int threads) { openblas_set_num_threads(std::max(threads, 1)); }

CpuBackend::CpuBackend() : smat_(MakeCpuSmatKernels()), model_(MakeCpuModelKernels()) {}
CpuBackend::~CpuBackend() = default;

absl::StatusOr<std::unique_ptr<Stream>> CpuBackend::CreateStream() {
  return std::unique_ptr<Stream>(new CpuStream());
}

absl::StatusOr<std::unique_ptr<Event>> CpuBackend::CreateEvent() {
  return std::unique_ptr<Event>(new CpuEvent());
}

absl::Status CpuBackend::Record(Event& event, Stream* stream) {
  SMAT_RETURN_IF_ERROR(CheckStream(stream, "Record"));
  SMAT_ASSIGN_OR_RETURN(CpuEvent * e, AsCpuEvent(event, "Record"));
  e->time = std::chrono::steady_clock::now();
  e->recorded = true;
  return absl::OkStatus();
}

absl::Status CpuBackend::Wait(Stream* stream, Event& event) {
  SMAT_RETURN_IF_ERROR(CheckStream(stream, "Wait"));
  SMAT_ASSIGN_OR_RETURN(CpuEvent * e, AsCpuEvent(event, "Wait"));
  (void)e;  // everything recorded has already happened
  return absl::OkStatus();
}

absl::Status CpuBackend::Synchronize(Stream* stream) { return CheckStream(stream, "Synchronize"); }

absl::StatusOr<float> CpuBackend::ElapsedMs(Event& start, Event& stop) {
  SMAT_ASSIGN_OR_RETURN(CpuEvent * a, AsCpuEvent(start, "ElapsedMs"));
  SMAT_ASSIGN_OR_RETURN(CpuEvent * b, AsCpuEvent(stop, "ElapsedMs"));
  if (!a->recorded || !b->recorded) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ElapsedMs: the ", a->recorded ? "stop" : "start", " event was never recorded; call Record first"));
  }
  return std::chrono::duration<float, std::milli>(b->time - a->time).count();
}

absl::Status CpuBackend::Copy(const Tensor& src, Tensor& dst, Stream* stream) {
  SMAT_RETURN_IF_ERROR(CheckStream(stream, "Copy"));
  SMAT_RETURN_IF_ERROR(CheckCopy(src, dst));
  SMAT_RETURN_IF_ERROR(CheckOnDevice(src, Device::Cpu(), "Copy", "src"));
  SMAT_RETURN_IF_ERROR(CheckOnDevice(dst, Device::Cpu(), "Copy", "dst"));
  if (src.nbytes() > 0 && src.raw() != dst.raw()) std::memmove(dst.raw(), src.raw(), src.nbytes());
  return absl::OkStatus();
}

absl::Status CpuBackend::Fill(Tensor& t, double value, Stream* stream) {
  SMAT_RETURN_IF_ERROR(CheckStream(stream, "Fill"));
  SMAT_RETURN_IF_ERROR(CheckOnDevice(t, Device::Cpu(), "Fill", "t"));
  SMAT_ASSIGN_OR_RETURN(uint64_t bits, FillPattern(t.dtype(), value));
  const int64_t n = t.numel();
  switch (DTypeSize(t.dtype())) {
    case 2: {
      const uint16_t v = static_cast<uint16_t>(bits);
      uint16_t* p = static_cast<uint16_t*>(t.raw());
      for (int64_t i = 0; i < n; ++i) p[i] = v;
      break;
    }
    case 4: {
      const uint32_t v = static_cast<uint32_t>(bits);
      uint32_t* p = static_cast<uint32_t*>(t.raw());
      for (int64_t i = 0; i < n; ++i) p[i] = v;
      break;
    }
    case 8: {
      uint64_t* p = static_cast<uint64_t*>(t.raw());
      for (int64_t i = 0; i < n; ++i) p[i] = bits;
      break;
    }
    default:
      SMAT_CHECK(false && "every dtype is 2, 4 or 8 bytes");
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Axpy(float alpha, const Tensor& x, Tensor& y, Stream* stream) {
  SMAT_RETURN_IF_ERROR(CheckStream(stream, "Axpy"));
  SMAT_RETURN_IF_ERROR(CheckAxpy(x, y, Device::Cpu()));
  const int64_t n = y.numel();
  float* yp = y.data<float>();
  // A plain loop rather than cblas_saxpy: one rounding per element (the same
  // as the CUDA kernel's fmaf), whatever OpenBLAS's vector path does.
  if (x.dtype() == DType::kF32) {
    const float* xp = x.data<float>();
    for (int64_t i = 0; i < n; ++i) yp[i] = std::fma(alpha, xp[i], yp[i]);
  } else {
    const uint16_t* xp = x.data<uint16_t>();
    for (int64_t i = 0; i < n; ++i) yp[i] = std::fma(alpha, Bf16ToFloat(xp[i]), yp[i]);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Gemm(Transpose ta, Transpose tb, float alpha, const Tensor& a,
                              const Tensor& b, float beta, Tensor& c, Stream* stream) {
  SMAT_RETURN_IF_ERROR(CheckStream(stream, "Gemm"));
  SMAT_ASSIGN_OR_RETURN(GemmDims d, CheckGemmAnyOutput(ta, tb, a, b, beta, c));
  SMAT_RETURN_IF_ERROR(CheckBlasInt(d));
  if (c.numel() == 0) return absl::OkStatus();
  std::vector<float> a_scratch, b_scratch, c_scratch;
  const float* ap = AsFloat(a, a_scratch);  // (batch, a0, a1)
  const float* bp = AsFloat(b, b_scratch);  // (batch, b0, b1)
  const bool bf16_out = c.dtype() == DType::kBF16;
  if (bf16_out) c_scratch.resize(static_cast<size_t>(c.numel()));  // the fp32 product first
  float* cp = bf16_out ? c_scratch.data() : c.data<float>();  // (batch, m, n)
  const int64_t a_stride = a.dim(-2) * a.dim(-1);
  const int64_t b_stride = b.dim(-2) * b.dim(-1);
  const int64_t c_stride = d.m * d.n;
  const CBLAS_TRANSPOSE cta = ta == Transpose::kYes ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE ctb = tb == Transpose::kYes ? CblasTrans : CblasNoTrans;
  // BLAS leading dimensions must be >= 1 even when a dimension is empty.
  const int lda = static_cast<int>(std::max<int64_t>(d.lda, 1));
  const int ldb = static_cast<int>(std::max<int64_t>(d.ldb, 1));
  const int ldc = static_cast<int>(std::max<int64_t>(d.ldc, 1));
  for (int64_t i = 0; i < d.batch; ++i) {
    if (d.k == 0) {
      // An empty inner product: BLAS would still scale c by beta, but with
      // beta = 0 it must overwrite (not multiply) whatever c held.
      float* ci = cp + i * c_stride;
      for (int64_t j = 0; j < c_stride; ++j) ci[j] = beta == 0.f ? 0.f : beta * ci[j];
      continue;
    }
    cblas_sgemm(CblasRowMajor, cta, ctb, static_cast<int>(d.m), static_cast<int>(d.n),
                static_cast<int>(d.k), alpha, ap + i * a_stride, lda, bp + i * b_stride, ldb, beta,
                cp + i * c_stride, ldc);
  }
  if (bf16_out) {
    uint16_t* out = c.data<uint16_t>();
    for (size_t j = 0; j < c_scratch.size(); ++j) out[j] = FloatToBf16(c_scratch[j]);
  }
  return absl::OkStatus();
}

absl::StatusOr<SmatKernels*> CpuBackend::smat() { return smat_.get(); }

absl::StatusOr<ModelKernels*> CpuBackend::model() { return model_.get(); }

absl::StatusOr<std::unique_ptr<Decoder>> CpuBackend::CreateDecoder(const DecoderSpec& spec) {
  return CreateHostDecoder(spec);
}

}  // namespace smat
