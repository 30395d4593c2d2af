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

absl::StatusOr<Tensor> Dense::Operand(const Tensor& t, Slot slot) {
  if (!bf16_ || t.dtype() == DType::kBF16) return t;
  Tensor& buf = scratch_[slot];
  if (!buf.defined() || buf.numel() < t.numel()) {
    // Grown, never shrunk: after the first step every cast reuses its slot.
    buf = Tensor();
    SMAT_ASSIGN_OR_RETURN(buf, Tensor::Empty({t.numel()}, DType::kBF16, backend_->allocator()));
  }
  Tensor out = buf.View(0, t.shape());
  SMAT_RETURN_IF_ERROR(kernels_->Cast(t, out));
  return out;
}

absl::StatusOr<Tensor> Dense::NewOperand(Shape shape) {
  return Tensor::Empty(std::move(shape), bf16_ ? DType::kBF16 : DType::kF32,
                       backend_->allocator());
}

absl::StatusOr<Tensor> Dense::WeightOperand(const Parameter& w) {
  if (!bf16_ || generation_ == 0) return Operand(w.value, kWeight);
  CachedWeight& c = weights_[&w];
  if (c.generation == generation_) return c.value;
  if (!c.value.defined() || c.value.shape() != w.value.shape()) {
    c.value = Tensor();
    SMAT_ASSIGN_OR_RETURN(c.value,
                          Tensor::Empty(w.value.shape(), DType::kBF16, backend_->allocator()));
  }
  SMAT_RETURN_IF_ERROR(kernels_->Cast(w.value, c.value));
  c.generation = generation_;
  return c.value;
}

absl::StatusOr<Tensor> Dense::Ones(int64_t n) {
  if (!ones_.defined() || ones_.numel() < n) {
    ones_ = Tensor();
    SMAT_ASSIGN_OR_RETURN(ones_, NewActivation(*backend_, {n}));
    SMAT_RETURN_IF_ERROR(backend_->Fill(ones_, 1.0));
  }
  return ones_;
}

absl::Status Dense::Forward(const Tensor& x, const Parameter& w, const Parameter* bias,
                            Tensor& y) {
  Backend& be = *backend_;
  SMAT_ASSIGN_OR_RETURN(Tensor xs, Operand(x, kOperand));
  SMAT_ASSIGN_OR_RETURN(Tensor ws, WeightOperand(w));
  if (bias == nullptr) {
    return Annotate(be.Gemm(Transpose::kNo, Transpose::kYes, 1.f, xs, ws, 0.f, y), "linear ",
                    w.name);
  }
  // y = ones [N, 1] @ bias [1, out], then y += x w^T: the bias broadcast is a
  // product too, so no extra kernel is needed. It stays fp32 (a rank-1 term).
  const int64_t N = x.dim(0);
  SMAT_ASSIGN_OR_RETURN(Tensor ones, Ones(N));
  Tensor col = ones.View(0, {N, 1});
  Tensor b_row = bias->value.View(0, {1, bias->value.numel()});  // [1, out]
  SMAT_RETURN_IF_ERROR(Annotate(
      be.Gemm(Transpose::kNo, Transpose::kNo, 1.f, col, b_row, 0.f, y), "bias ", bias->name));
  return Annotate(be.Gemm(Transpose::kNo, Transpose::kYes, 1.f, xs, ws, 1.f, y), "linear ",
                  w.name);
}

absl::Status Dense::Backward(const Tensor& x, const Tensor& dy, Parameter& w, Parameter* bias,
                             Tensor* dx, bool accumulate_dx) {
  Backend& be = *backend_;
  SMAT_ASSIGN_OR_RETURN(Tensor dys, Operand(dy, kGrad));
  SMAT_ASSIGN_OR_RETURN(Tensor xs, Operand(x, kOperand));
  SMAT_RETURN_IF_ERROR(
      Annotate(be.Gemm(Transpose::kYes, Transpose::kNo, 1.f, dys, xs, 1.f, w.grad),
               "linear backward ", w.name));
  if (bias != nullptr) {
    const int64_t N = dy.dim(0);
    SMAT_ASSIGN_OR_RETURN(Tensor ones, Ones(N));
    Tensor row = ones.View(0, {1, N});
    Tensor gb = bias->grad.View(0, {1, bias->grad.numel()});  // [1, out]
    // fp32 dy: the bias gradient is a plain row sum, kept exact to fp32.
    SMAT_RETURN_IF_ERROR(Annotate(be.Gemm(Transpose::kNo, Transpose::kNo, 1.f, row, dy, 1.f, gb),
                                  "bias backward ", bias->name));
  }
  if (dx != nullptr) {
    SMAT_ASSIGN_OR_RETURN(Tensor ws, WeightOperand(w));
    SMAT_RETURN_IF_ERROR(Annotate(be.Gemm(Transpose::kNo, Transpose::kNo, 1.f, dys, ws,
                                          accumulate_dx ? 1.f : 0.f, *dx),
                                  "linear backward ", w.name));
  }
  return absl::OkStatus();
}

absl::Status Dense::NarrowForward(const Tensor& x, const Parameter& w, const Parameter* bias,
                                  Tensor& y) {
  if (!bf16_) return Forward(x, w, bias, y);
  SMAT_ASSIGN_OR_RETURN(Tensor xs, Operand(x, kOperand));
  SMAT_ASSIGN_OR_RETURN(Tensor ws, WeightOperand(w));
  return Annotate(
      kernels_->NarrowLinearForward(xs, ws, bias != nullptr ? bias->value : Tensor(), y),
      "linear ", w.name);
}

absl::Status Dense::NarrowBackward(const Tensor& x, const Tensor& dy, Parameter& w,
                                   Parameter* bias, Tensor* dx, bool accumulate_dx) {
  if (!bf16_ || dx == nullptr) return Backward(x, dy, w, bias, dx, accumulate_dx);
  SMAT_ASSIGN_OR_RETURN(Tensor xs, Operand(x, kOperand));
  SMAT_ASSIGN_OR_RETURN(Tensor ws, WeightOperand(w));
  Tensor no_bias;
  return Annotate(kernels_->NarrowLinearBackward(xs, ws, dy, *dx, accumulate_dx, w.grad,
                                                 bias != nullptr ? bias->grad : no_bias),
                  "linear backward ", w.name);
}

}  // namespace smat
