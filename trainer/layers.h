// Small building blocks shared by trainer/model and trainer/smat_mixer: fp32
// activation allocation on the backend, and the linear layer y = x W^T (+ b)
// with its backward, both through Backend::Gemm so a device backend runs them
// unchanged. Weights follow the [out, in] convention, so the LM head and the
// tied embedding table are the same [vocab, width] matrix.
//
//   SMAT_ASSIGN_OR_RETURN(Tensor y, NewActivation(backend, {N, out}));
//   SMAT_RETURN_IF_ERROR(LinearForward(backend, x, wq, nullptr, y));
//   SMAT_RETURN_IF_ERROR(LinearBackward(backend, x, dy, wq, nullptr, &dx, /*accumulate_dx=*/true));
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "trainer/model.h"

namespace smat {

// An uninitialised fp32 tensor of `shape` in the backend's memory.
absl::StatusOr<Tensor> NewActivation(Backend& backend, Shape shape);
// The same, zero-filled.
absl::StatusOr<Tensor> NewZeros(Backend& backend, Shape shape);

// y [N, out] = x [N, in] @ w [out, in]^T + bias [out] (bias may be null).
absl::Status LinearForward(Backend& backend, const Tensor& x, const Parameter& w,
                           const Parameter* bias, Tensor& y);

// Backward of LinearForward for upstream gradient dy [N, out]:
// w.grad += dy^T x, bias.grad += sum over rows of dy (rows in order, through
// a ones-vector product), and, when dx is not null, dx [N, in] = dy w
// (accumulate_dx: dx += dy w).
absl::Status LinearBackward(Backend& backend, const Tensor& x, const Tensor& dy, Parameter& w,
                            Parameter* bias, Tensor* dx, bool accumulate_dx);

}  // namespace smat
