// Argument validation shared by the CPU and CUDA backends (backend_checks.h).
#include "kernels/backend_checks.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace smat {
namespace {

bool IsGemmInputType(DType t) { return t == DType::kF32 || t == DType::kBF16; }

}  // namespace

absl::Status CheckOnDevice(const Tensor& t, Device device, const char* op, const char* operand) {
  if (!t.defined() && t.numel() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", operand, " is an empty Tensor with no buffer; allocate it first"));
  }
  if (!(t.device() == device)) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", operand, " is ", t.DebugString(), " but this backend runs on ",
        device.ToString(), "; move it there with Backend::Copy first"));
  }
  return absl::OkStatus();
}

absl::Status CheckCopy(const Tensor& src, const Tensor& dst) {
  if (src.dtype() != dst.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("Copy: src is ", src.DebugString(), " and dst is ",
                                                   dst.DebugString(),
                                                   "; Copy does not convert dtypes"));
  }
  if (src.numel() != dst.numel()) {
    return absl::InvalidArgumentError(absl::StrCat("Copy: src is ", src.DebugString(), " (",
                                                   src.numel(), " elements) but dst is ",
                                                   dst.DebugString(), " (", dst.numel(),
                                                   " elements); element counts must match"));
  }
  if (src.numel() > 0 && (!src.defined() || !dst.defined())) {
    return absl::InvalidArgumentError(
        absl::StrCat("Copy: ", src.defined() ? "dst" : "src", " has no buffer; allocate it first"));
  }
  return absl::OkStatus();
}

absl::Status CheckAxpy(const Tensor& x, const Tensor& y, Device device) {
  if (y.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("Axpy: y must be fp32, got ", y.DebugString()));
  }
  if (x.dtype() != DType::kF32 && x.dtype() != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("Axpy: x must be fp32 or bf16, got ", x.DebugString()));
  }
  if (x.shape() != y.shape()) {
    return absl::InvalidArgumentError(absl::StrCat("Axpy: x has shape ", ShapeToString(x.shape()),
                                                   " but y has shape ", ShapeToString(y.shape()),
                                                   "; they must be equal"));
  }
  SMAT_RETURN_IF_ERROR(CheckOnDevice(x, device, "Axpy", "x"));
  SMAT_RETURN_IF_ERROR(CheckOnDevice(y, device, "Axpy", "y"));
  return absl::OkStatus();
}

absl::StatusOr<GemmDims> CheckGemm(Transpose ta, Transpose tb, const Tensor& a, const Tensor& b,
                                   const Tensor& c, Device device) {
  if (!IsGemmInputType(a.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: a must be fp32 or bf16, got ", a.DebugString()));
  }
  if (b.dtype() != a.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: b must have a's dtype (",
                                                   DTypeName(a.dtype()), "), got ",
                                                   b.DebugString()));
  }
  if (c.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: c must be fp32 (fp32 accumulation and output), got ", c.DebugString()));
  }
  const int rank = a.rank();
  if (rank != 2 && rank != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gemm: a must have rank 2 (rows, cols) or 3 (batch, rows, cols), got ", a.DebugString()));
  }
  if (b.rank() != rank || c.rank() != rank) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: a, b and c must have the same rank; got a ",
                                                   a.DebugString(), ", b ", b.DebugString(), ", c ",
                                                   c.DebugString()));
  }
  GemmDims d;
  if (rank == 3) {
    d.batch = a.dim(0);
    if (b.dim(0) != d.batch || c.dim(0) != d.batch) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Gemm: batched operands must share the leading batch dimension; got a ",
          ShapeToString(a.shape()), ", b ", ShapeToString(b.shape()), ", c ",
          ShapeToString(c.shape())));
    }
  }
  const int64_t a0 = a.dim(-2), a1 = a.dim(-1);
  const int64_t b0 = b.dim(-2), b1 = b.dim(-1);
  d.m = ta == Transpose::kNo ? a0 : a1;
  d.k = ta == Transpose::kNo ? a1 : a0;
  const int64_t kb = tb == Transpose::kNo ? b0 : b1;
  d.n = tb == Transpose::kNo ? b1 : b0;
  if (kb != d.k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Gemm: inner dimensions differ: op(a) is ", d.m, " x ", d.k, " (a ",
        ShapeToString(a.shape()), ta == Transpose::kYes ? ", transposed" : "", ") but op(b) is ",
        kb, " x ", d.n, " (b ", ShapeToString(b.shape()), tb == Transpose::kYes ? ", transposed" : "",
        ")"));
  }
  if (c.dim(-2) != d.m || c.dim(-1) != d.n) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: c must be ", d.m, " x ", d.n,
                                                   " (rows of op(a) x columns of op(b)), got ",
                                                   ShapeToString(c.shape())));
  }
  SMAT_RETURN_IF_ERROR(CheckOnDevice(a, device, "Gemm", "a"));
  SMAT_RETURN_IF_ERROR(CheckOnDevice(b, device, "Gemm", "b"));
  SMAT_RETURN_IF_ERROR(CheckOnDevice(c, device, "Gemm", "c"));
  d.lda = a1;
  d.ldb = b1;
  d.ldc = d.n;
  return d;
}

absl::StatusOr<uint64_t> FillPattern(DType dtype, double value) {
  auto integral = [&](double lo, double hi) -> absl::Status {
    if (!std::isfinite(value) || value != std::trunc(value) || value < lo || value > hi) {
      return absl::InvalidArgumentError(absl::StrCat("Fill: value ", value, " cannot be stored in ",
                                                     DTypeName(dtype), " (needs an integer in [",
                                                     lo, ", ", hi, "])"));
    }
    return absl::OkStatus();
  };
  switch (dtype) {
    case DType::kF32: {
      const float f = static_cast<float>(value);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      return u;
    }
    case DType::kF64: {
      uint64_t u;
      std::memcpy(&u, &value, 8);
      return u;
    }
    case DType::kBF16:
      return FloatToBf16(static_cast<float>(value));
    case DType::kI32: {
      SMAT_RETURN_IF_ERROR(integral(std::numeric_limits<int32_t>::min(),
                                    std::numeric_limits<int32_t>::max()));
      return static_cast<uint32_t>(static_cast<int32_t>(value));
    }
    case DType::kI64: {
      // 2^63 is the first double above the int64 range; -2^63 is exact.
      if (value >= 9223372036854775808.0) {
        return absl::InvalidArgumentError(
            absl::StrCat("Fill: value ", value, " cannot be stored in int64 (too large)"));
      }
      SMAT_RETURN_IF_ERROR(integral(-9223372036854775808.0, 9223372036854775807.0));
      return static_cast<uint64_t>(static_cast<int64_t>(value));
    }
    case DType::kU16: {
      SMAT_RETURN_IF_ERROR(integral(0, 65535));
      return static_cast<uint16_t>(value);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Fill: unknown dtype ", static_cast<int>(dtype)));
}

}  // namespace smat
