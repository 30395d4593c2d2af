// Argument validation shared by every Backend implementation.
//
// The CPU backend (compiled in) and the CUDA backend (libsmat_cuda.so) must
// reject exactly the same calls with the same messages, so the checks live
// here once. Each returns InvalidArgument naming the operation and the operand
// that is wrong, with the shape/dtype/device it got and what was expected.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor.h"
#include "kernels/backend.h"

namespace smat {

// Sizes of one (possibly batched) product c = op(a) @ op(b).
struct GemmDims {
  int64_t batch = 1;  // 1 for rank-2 operands
  int64_t m = 0;      // rows of op(a) and c
  int64_t n = 0;      // columns of op(b) and c
  int64_t k = 0;      // columns of op(a), rows of op(b)
  int64_t lda = 0;    // row-major leading dimensions: last dim of each operand
  int64_t ldb = 0;
  int64_t ldc = 0;
};

// Checks that `t` is defined and lives on `device` (host tensors are only
// accepted when `device` is the CPU). `op` and `operand` name the call for the
// message, e.g. ("Gemm", "a").
absl::Status CheckOnDevice(const Tensor& t, Device device, const char* op, const char* operand);

// Copy: same dtype and element count. Devices are checked by the backend,
// since the set of memory a backend can copy between is its own business.
absl::Status CheckCopy(const Tensor& src, const Tensor& dst);

// Axpy: y fp32, x fp32 or bf16, identical shapes, both on `device`.
absl::Status CheckAxpy(const Tensor& x, const Tensor& y, Device device);

// Gemm: a, b fp32 or bf16 (the same), c fp32; rank 2 (m, k) x (k, n) -> (m, n)
// up to transposes, or rank 3 with a shared leading batch dimension; all three
// on `device`. Returns the sizes.
absl::StatusOr<GemmDims> CheckGemm(Transpose ta, Transpose tb, const Tensor& a, const Tensor& b,
                                   const Tensor& c, Device device);

// The bit pattern of `value` converted to `dtype`, in the low DTypeSize(dtype)
// bytes. Integer dtypes need an integral value within their range; a NaN or
// infinity is only accepted by the floating-point dtypes.
absl::StatusOr<uint64_t> FillPattern(DType dtype, double value);

}  // namespace smat
