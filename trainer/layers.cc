// Linear layers and activation allocation: see trainer/layers.h.
#include "trainer/layers.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace smat {

absl::StatusOr<Tensor> NewActivation(Backend& backend, Shape shape) {
  return Tensor::Empty(std::move(shape), DType::kF32, backend.allocator());
}

absl::StatusOr<Tensor> NewZeros(Backend& backend, Shape shape) {
  SMAT_ASSIGN_OR_RETURN(Tensor t, NewActivation(backend, std::move(shape)));
  SMAT_RETURN_IF_ERROR(backend.Fill(t, 0.0));
  return t;
}

absl::Status LinearForward(Backend& backend, const Tensor& x, const Parameter& w,
                           const Parameter* bias, Tensor& y) {
  if (bias == nullptr) {
    return Annotate(backend.Gemm(Transpose::kNo, Transpose::kYes, 1.f, x, w.value, 0.f, y),
                    "linear ", w.name);
  }
  // y = ones [N, 1] @ bias [1, out], then y += x w^T: the bias broadcast is a
  // product too, so no extra kernel is needed.
  const int64_t N = x.dim(0);
  SMAT_ASSIGN_OR_RETURN(Tensor ones, NewActivation(backend, {N, 1}));  // [N, 1]
  SMAT_RETURN_IF_ERROR(backend.Fill(ones, 1.0));
  Tensor b_row = bias->value.View(0, {1, bias->value.numel()});  // [1, out]
  SMAT_RETURN_IF_ERROR(Annotate(
      backend.Gemm(Transpose::kNo, Transpose::kNo, 1.f, ones, b_row, 0.f, y), "bias ", bias->name));
  return Annotate(backend.Gemm(Transpose::kNo, Transpose::kYes, 1.f, x, w.value, 1.f, y),
                  "linear ", w.name);
}

absl::Status LinearBackward(Backend& backend, const Tensor& x, const Tensor& dy, Parameter& w,
                            Parameter* bias, Tensor* dx, bool accumulate_dx) {
  SMAT_RETURN_IF_ERROR(
      Annotate(backend.Gemm(Transpose::kYes, Transpose::kNo, 1.f, dy, x, 1.f, w.grad),
               "linear backward ", w.name));
  if (bias != nullptr) {
    const int64_t N = dy.dim(0);
    SMAT_ASSIGN_OR_RETURN(Tensor ones, NewActivation(backend, {1, N}));  // [1, N]
    SMAT_RETURN_IF_ERROR(backend.Fill(ones, 1.0));
    Tensor gb = bias->grad.View(0, {1, bias->grad.numel()});  // [1, out]
    SMAT_RETURN_IF_ERROR(
        Annotate(backend.Gemm(Transpose::kNo, Transpose::kNo, 1.f, ones, dy, 1.f, gb),
                 "bias backward ", bias->name));
  }
  if (dx != nullptr) {
    SMAT_RETURN_IF_ERROR(Annotate(backend.Gemm(Transpose::kNo, Transpose::kNo, 1.f, dy, w.value,
                                               accumulate_dx ? 1.f : 0.f, *dx),
                                  "linear backward ", w.name));
  }
  return absl::OkStatus();
}

}  // namespace smat
