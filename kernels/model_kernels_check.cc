// The operand checks of the CPU and CUDA ModelKernels: see
// kernels/model_kernels_check.h.
#include "kernels/model_kernels_check.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/model_kernels.h"

namespace smat {
namespace {

// InvalidArgument unless t lives on `device`, worded for the implementation
// that runs there (see the header).
absl::Status ExpectDevice(const Tensor& t, Device device, const char* op, const char* operand) {
  if (device.is_cpu()) {
    if (t.device().is_cpu()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " is on ",
                                                   t.device().ToString(),
                                                   "; the CPU model kernels need host tensors"));
  }
  if (t.device() == device) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      op, ": ", operand, " is on ", t.device().ToString(), "; the CUDA model kernels of ",
      device.ToString(), " need tensors there (Backend::Copy)"));
}

// InvalidArgument unless t is a defined tensor of `dtype` and `shape` on `device`.
absl::Status Expect(const Tensor& t, DType dtype, absl::Span<const int64_t> shape, const char* op,
                    const char* operand, Device device) {
  if (!t.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " is undefined"));
  }
  SMAT_RETURN_IF_ERROR(ExpectDevice(t, device, op, operand));
  if (t.dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " is ", DTypeName(t.dtype()),
                                                   "; expected ", DTypeName(dtype)));
  }
  if (t.shape() != Shape(shape.begin(), shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " has shape ",
                                                   ShapeToString(t.shape()), "; expected ",
                                                   ShapeToString(shape)));
  }
  return absl::OkStatus();
}

// InvalidArgument unless t is a defined fp32 or bf16 tensor of `shape` on
// `device` (an output the caller may keep in bf16, or an input so stored).
absl::Status ExpectFloat(const Tensor& t, absl::Span<const int64_t> shape, const char* op,
                         const char* operand, Device device) {
  if (t.defined() && t.dtype() == DType::kBF16) {
    return Expect(t, DType::kBF16, shape, op, operand, device);
  }
  if (t.defined() && t.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " is ", DTypeName(t.dtype()),
                                                   "; expected fp32 or bf16"));
  }
  return Expect(t, DType::kF32, shape, op, operand, device);
}

// InvalidArgument when `out` starts where `in` does but has another dtype: an
// output may overwrite its input in place only element for element.
absl::Status ExpectNoMixedAlias(const Tensor& in, const Tensor& out, const char* op,
                                const char* in_name, const char* out_name) {
  if (in.numel() > 0 && in.raw() == out.raw() && in.dtype() != out.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", out_name, " (",
                                                   DTypeName(out.dtype()), ") may not alias ",
                                                   in_name, " (", DTypeName(in.dtype()), ")"));
  }
  return absl::OkStatus();
}

// t is a defined rank-2 tensor (checked before its shape is used).
absl::Status ExpectRank2(const Tensor& t, const char* op, const char* operand) {
  if (t.defined() && t.rank() == 2) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " must be a rank-2 tensor",
                                                 t.defined() ? "; got " + t.DebugString() : ""));
}

// Rank-2 fp32 tensor on `device`: returns {rows, cols}.
absl::StatusOr<RowsCols> Matrix(const Tensor& t, const char* op, const char* operand,
                                Device device) {
  SMAT_RETURN_IF_ERROR(ExpectRank2(t, op, operand));
  SMAT_RETURN_IF_ERROR(Expect(t, DType::kF32, t.shape(), op, operand, device));
  return RowsCols{t.dim(0), t.dim(1)};
}

// The operands SigmoidScale's forward and backward share: x fp32 [N, H, r]
// (its rank checked first, with its own message), g fp32 [N, H].
absl::StatusOr<Dims3> CheckSigmoidScaleInputs(const Tensor& x, const Tensor& g, const char* op,
                                              Device device) {
  if (!x.defined() || x.rank() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": x must be fp32 [N, H, r]"));
  }
  const int64_t N = x.dim(0), H = x.dim(1), r = x.dim(2);
  SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, {N, H, r}, op, "x", device));
  SMAT_RETURN_IF_ERROR(Expect(g, DType::kF32, {N, H}, op, "g", device));
  return Dims3{N, H, r};
}

// The operands the short convolution's forward and backward share:
// x fp32 [batch, L, C] (its rank checked first), prefix [batch, K-1, C], w [K, C].
absl::StatusOr<Dims3> CheckShortConvInputs(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                           const char* op, Device device) {
  constexpr int64_t K = kShortConvWidth;
  if (!x.defined() || x.rank() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": x must be fp32 [batch, L, C]"));
  }
  const int64_t nb = x.dim(0), L = x.dim(1), C = x.dim(2);
  SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, {nb, L, C}, op, "x", device));
  SMAT_RETURN_IF_ERROR(Expect(prefix, DType::kF32, {nb, K - 1, C}, op, "prefix", device));
  SMAT_RETURN_IF_ERROR(Expect(w, DType::kF32, {K, C}, op, "w", device));
  return Dims3{nb, L, C};
}

// The operands the cross-entropy's forward and backward share: h [N, W],
// w_head [V, W], targets int32 [N], weights and lse fp32 [N].
absl::StatusOr<VocabDims> CheckCrossEntropyInputs(const Tensor& h, const Tensor& w_head,
                                                  const Tensor& targets, const Tensor& weights,
                                                  const Tensor& lse, const char* op,
                                                  Device device) {
  SMAT_ASSIGN_OR_RETURN(RowsCols nw, Matrix(h, op, "h", device));
  const auto [N, W] = nw;
  SMAT_ASSIGN_OR_RETURN(RowsCols vw, Matrix(w_head, op, "w_head", device));
  const int64_t V = vw.rows;
  SMAT_RETURN_IF_ERROR(Expect(w_head, DType::kF32, {V, W}, op, "w_head", device));
  SMAT_RETURN_IF_ERROR(Expect(targets, DType::kI32, {N}, op, "targets", device));
  SMAT_RETURN_IF_ERROR(Expect(weights, DType::kF32, {N}, op, "weights", device));
  SMAT_RETURN_IF_ERROR(Expect(lse, DType::kF32, {N}, op, "lse", device));
  return VocabDims{N, V, W};
}

}  // namespace

absl::Status CheckElementwise(const char* op, std::initializer_list<NamedTensor> operands,
                              Device device) {
  const Tensor& first = operands.begin()->tensor;
  for (const NamedTensor& o : operands) {
    SMAT_RETURN_IF_ERROR(Expect(o.tensor, DType::kF32, first.shape(), op, o.name, device));
  }
  return absl::OkStatus();
}

absl::StatusOr<RowsCols> CheckMatrices(const char* op, std::initializer_list<NamedTensor> operands,
                                       Device device) {
  const NamedTensor& first = *operands.begin();
  SMAT_ASSIGN_OR_RETURN(RowsCols dims, Matrix(first.tensor, op, first.name, device));
  SMAT_RETURN_IF_ERROR(CheckElementwise(op, operands, device));
  return dims;
}

absl::Status CheckFeatureMap(const char* op, FeatureMap f,
                             std::initializer_list<NamedTensor> operands, Device device) {
  // A value cast from elsewhere would reach the CPU's host loops (SMAT_CHECK)
  // or select no CUDA kernel.
  if (f != FeatureMap::kEluPlusOne && f != FeatureMap::kReluEps) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": unknown feature map ", static_cast<int>(f), "; expected kEluPlusOne or kReluEps"));
  }
  return CheckElementwise(op, operands, device);
}

absl::StatusOr<VocabDims> CheckEmbedding(const char* op, NamedTensor matrix, const Tensor& ids,
                                         NamedTensor rows, Device device) {
  SMAT_ASSIGN_OR_RETURN(RowsCols vw, Matrix(matrix.tensor, op, matrix.name, device));
  if (!ids.defined() || ids.rank() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ids must be int32 [N]"));
  }
  const int64_t N = ids.dim(0);
  SMAT_RETURN_IF_ERROR(Expect(ids, DType::kI32, {N}, op, "ids", device));
  SMAT_RETURN_IF_ERROR(Expect(rows.tensor, DType::kF32, {N, vw.cols}, op, rows.name, device));
  return VocabDims{N, vw.rows, vw.cols};
}

namespace {

absl::StatusOr<RowsCols> CheckRmsNormForwardOf(const char* kOp, const Tensor& x,
                                               const Tensor& weight, const Tensor& y,
                                               const Tensor& rstd, Device device) {
  SMAT_ASSIGN_OR_RETURN(RowsCols nw, Matrix(x, kOp, "x", device));
  const auto [N, W] = nw;
  SMAT_RETURN_IF_ERROR(Expect(weight, DType::kF32, {W}, kOp, "weight", device));
  SMAT_RETURN_IF_ERROR(ExpectFloat(y, {N, W}, kOp, "y", device));
  SMAT_RETURN_IF_ERROR(Expect(rstd, DType::kF32, {N}, kOp, "rstd", device));
  return nw;
}

absl::StatusOr<RowsCols> CheckRmsNormBackwardOf(const char* kOp, const Tensor& x,
                                                const Tensor& weight, const Tensor& rstd,
                                                const Tensor& dy, const Tensor& dx,
                                                const Tensor& d_weight, Device device) {
  SMAT_ASSIGN_OR_RETURN(RowsCols nw, Matrix(x, kOp, "x", device));
  const auto [N, W] = nw;
  SMAT_RETURN_IF_ERROR(Expect(weight, DType::kF32, {W}, kOp, "weight", device));
  SMAT_RETURN_IF_ERROR(Expect(rstd, DType::kF32, {N}, kOp, "rstd", device));
  SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {N, W}, kOp, "dy", device));
  SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, {N, W}, kOp, "dx", device));
  SMAT_RETURN_IF_ERROR(Expect(d_weight, DType::kF32, {W}, kOp, "d_weight", device));
  return nw;
}

// out must not start where `in` does (the kernels read `in` while writing out).
absl::Status ExpectDistinct(const Tensor& in, const Tensor& out, const char* op,
                            const char* in_name, const char* out_name) {
  if (in.numel() > 0 && out.numel() > 0 && in.raw() == out.raw()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", out_name, " may not alias ", in_name));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<RowsCols> CheckRmsNormForward(const Tensor& x, const Tensor& weight, const Tensor& y,
                                             const Tensor& rstd, Device device) {
  return CheckRmsNormForwardOf("RmsNormForward", x, weight, y, rstd, device);
}

absl::StatusOr<RowsCols> CheckRmsNormBackward(const Tensor& x, const Tensor& weight,
                                              const Tensor& rstd, const Tensor& dy,
                                              const Tensor& dx, const Tensor& d_weight,
                                              Device device) {
  return CheckRmsNormBackwardOf("RmsNormBackward", x, weight, rstd, dy, dx, d_weight, device);
}

absl::StatusOr<RowsCols> CheckAddRmsNormForward(const Tensor& a, const Tensor& b,
                                                const Tensor& weight, const Tensor& sum,
                                                const Tensor& y, const Tensor& rstd,
                                                Device device) {
  constexpr const char* kOp = "AddRmsNormForward";
  SMAT_RETURN_IF_ERROR(CheckElementwise(kOp, {{a, "a"}, {b, "b"}, {sum, "sum"}}, device));
  SMAT_ASSIGN_OR_RETURN(RowsCols nw, CheckRmsNormForwardOf(kOp, sum, weight, y, rstd, device));
  for (const NamedTensor& t : {NamedTensor{a, "a"}, NamedTensor{b, "b"}, NamedTensor{sum, "sum"}}) {
    SMAT_RETURN_IF_ERROR(ExpectDistinct(t.tensor, y, kOp, t.name, "y"));
  }
  return nw;
}

absl::StatusOr<RowsCols> CheckRmsNormBackwardAdd(const Tensor& x, const Tensor& weight,
                                                 const Tensor& rstd, const Tensor& dy,
                                                 const Tensor& d_residual, const Tensor& dx,
                                                 const Tensor& d_weight, Device device) {
  constexpr const char* kOp = "RmsNormBackwardAdd";
  SMAT_ASSIGN_OR_RETURN(RowsCols nw,
                        CheckRmsNormBackwardOf(kOp, x, weight, rstd, dy, dx, d_weight, device));
  SMAT_RETURN_IF_ERROR(
      Expect(d_residual, DType::kF32, {nw.rows, nw.cols}, kOp, "d_residual", device));
  SMAT_RETURN_IF_ERROR(ExpectDistinct(dy, dx, kOp, "dy", "dx"));
  SMAT_RETURN_IF_ERROR(ExpectDistinct(d_residual, dx, kOp, "d_residual", "dx"));
  return nw;
}

absl::StatusOr<Dims3> CheckSigmoidScaleForward(const Tensor& x, const Tensor& g, const Tensor& y,
                                               Device device) {
  constexpr const char* kOp = "SigmoidScaleForward";
  SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckSigmoidScaleInputs(x, g, kOp, device));
  SMAT_RETURN_IF_ERROR(ExpectFloat(y, {d.d0, d.d1, d.d2}, kOp, "y", device));
  SMAT_RETURN_IF_ERROR(ExpectNoMixedAlias(x, y, kOp, "x", "y"));
  return d;
}

absl::StatusOr<Dims3> CheckSigmoidScaleBackward(const Tensor& x, const Tensor& g, const Tensor& dy,
                                                const Tensor& dx, const Tensor& dg, Device device) {
  constexpr const char* kOp = "SigmoidScaleBackward";
  SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckSigmoidScaleInputs(x, g, kOp, device));
  const auto [N, H, r] = d;
  SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {N, H, r}, kOp, "dy", device));
  SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, {N, H, r}, kOp, "dx", device));
  SMAT_RETURN_IF_ERROR(Expect(dg, DType::kF32, {N, H}, kOp, "dg", device));
  return d;
}

absl::StatusOr<Dims3> CheckShortConvForward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                            const Tensor& y, Device device) {
  constexpr const char* kOp = "ShortConvForward";
  SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckShortConvInputs(x, prefix, w, kOp, device));
  SMAT_RETURN_IF_ERROR(ExpectFloat(y, {d.d0, d.d1, d.d2}, kOp, "y", device));
  return d;
}

absl::StatusOr<Dims3> CheckShortConvSoftplusForward(const Tensor& x, const Tensor& prefix,
                                                    const Tensor& w, const Tensor& y,
                                                    const Tensor& f, Device device) {
  constexpr const char* kOp = "ShortConvSoftplusForward";
  SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckShortConvInputs(x, prefix, w, kOp, device));
  SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {d.d0, d.d1, d.d2}, kOp, "y", device));
  SMAT_RETURN_IF_ERROR(ExpectFloat(f, {d.d0, d.d1, d.d2}, kOp, "f", device));
  for (const NamedTensor& t : {NamedTensor{x, "x"}, NamedTensor{y, "y"}}) {
    SMAT_RETURN_IF_ERROR(ExpectDistinct(t.tensor, f, kOp, t.name, "f"));
  }
  SMAT_RETURN_IF_ERROR(ExpectDistinct(x, y, kOp, "x", "y"));
  return d;
}

absl::StatusOr<Dims3> CheckShortConvBackward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                             const Tensor& dy, const Tensor& dx,
                                             const Tensor& d_prefix, const Tensor& d_w,
                                             Device device) {
  constexpr const char* kOp = "ShortConvBackward";
  constexpr int64_t K = kShortConvWidth;
  SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckShortConvInputs(x, prefix, w, kOp, device));
  const auto [nb, L, C] = d;
  SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {nb, L, C}, kOp, "dy", device));
  SMAT_RETURN_IF_ERROR(ExpectFloat(dx, {nb, L, C}, kOp, "dx", device));
  SMAT_RETURN_IF_ERROR(Expect(d_prefix, DType::kF32, {nb, K - 1, C}, kOp, "d_prefix", device));
  SMAT_RETURN_IF_ERROR(Expect(d_w, DType::kF32, {K, C}, kOp, "d_w", device));
  return d;
}

absl::StatusOr<Dims3> CheckShortConvSoftplusBackward(const Tensor& x, const Tensor& prefix,
                                                     const Tensor& w, const Tensor& z,
                                                     const Tensor& dy, const Tensor& dx,
                                                     const Tensor& d_prefix, const Tensor& d_w,
                                                     Device device) {
  constexpr const char* kOp = "ShortConvSoftplusBackward";
  constexpr int64_t K = kShortConvWidth;
  SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckShortConvInputs(x, prefix, w, kOp, device));
  const auto [nb, L, C] = d;
  SMAT_RETURN_IF_ERROR(Expect(z, DType::kF32, {nb, L, C}, kOp, "z", device));
  SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {nb, L, C}, kOp, "dy", device));
  SMAT_RETURN_IF_ERROR(ExpectFloat(dx, {nb, L, C}, kOp, "dx", device));
  SMAT_RETURN_IF_ERROR(Expect(d_prefix, DType::kF32, {nb, K - 1, C}, kOp, "d_prefix", device));
  SMAT_RETURN_IF_ERROR(Expect(d_w, DType::kF32, {K, C}, kOp, "d_w", device));
  for (const NamedTensor& t : {NamedTensor{x, "x"}, NamedTensor{z, "z"}, NamedTensor{dy, "dy"}}) {
    SMAT_RETURN_IF_ERROR(ExpectDistinct(t.tensor, dx, kOp, t.name, "dx"));
  }
  return d;
}

absl::StatusOr<VocabDims> CheckCrossEntropyForward(const Tensor& h, const Tensor& w_head,
                                                   const Tensor& targets, const Tensor& weights,
                                                   int64_t chunk_tokens, const Tensor& lse,
                                                   const double* loss_sum, Device device) {
  SMAT_ASSIGN_OR_RETURN(VocabDims d, CheckCrossEntropyInputs(h, w_head, targets, weights, lse,
                                                             "CrossEntropyForward", device));
  if (chunk_tokens < 1 || loss_sum == nullptr) {
    return absl::InvalidArgumentError("CrossEntropyForward: chunk_tokens must be >= 1");
  }
  return d;
}

absl::StatusOr<VocabDims> CheckCrossEntropyBackward(const Tensor& h, const Tensor& w_head,
                                                    const Tensor& targets, const Tensor& weights,
                                                    const Tensor& lse, int64_t chunk_tokens,
                                                    const Tensor& dh, const Tensor& d_w_head,
                                                    Device device) {
  constexpr const char* kOp = "CrossEntropyBackward";
  SMAT_ASSIGN_OR_RETURN(VocabDims d,
                        CheckCrossEntropyInputs(h, w_head, targets, weights, lse, kOp, device));
  SMAT_RETURN_IF_ERROR(Expect(dh, DType::kF32, {d.n, d.w}, kOp, "dh", device));
  SMAT_RETURN_IF_ERROR(Expect(d_w_head, DType::kF32, {d.v, d.w}, kOp, "d_w_head", device));
  if (chunk_tokens < 1) {
    return absl::InvalidArgumentError("CrossEntropyBackward: chunk_tokens must be >= 1");
  }
  return d;
}

absl::Status CheckUnaryForward(const char* op, const Tensor& x, const Tensor& y, Device device) {
  SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, x.defined() ? x.shape() : Shape{}, op, "x", device));
  SMAT_RETURN_IF_ERROR(ExpectFloat(y, x.shape(), op, "y", device));
  return ExpectNoMixedAlias(x, y, op, "x", "y");
}

absl::Status CheckFeatureMapForward(FeatureMap f, const Tensor& x, const Tensor& y,
                                    Device device) {
  SMAT_RETURN_IF_ERROR(CheckFeatureMap("FeatureMapForward", f, {{x, "x"}}, device));
  return CheckUnaryForward("FeatureMapForward", x, y, device);
}

absl::StatusOr<RowsCols> CheckSwiGluForward(const Tensor& gate, const Tensor& up, const Tensor& y,
                                            Device device) {
  constexpr const char* kOp = "SwiGluForward";
  SMAT_RETURN_IF_ERROR(ExpectRank2(gate, kOp, "gate"));
  const RowsCols nf{gate.dim(0), gate.dim(1)};
  SMAT_RETURN_IF_ERROR(ExpectFloat(gate, gate.shape(), kOp, "gate", device));
  SMAT_RETURN_IF_ERROR(Expect(up, gate.dtype(), gate.shape(), kOp, "up", device));
  SMAT_RETURN_IF_ERROR(ExpectFloat(y, gate.shape(), kOp, "y", device));
  SMAT_RETURN_IF_ERROR(ExpectNoMixedAlias(gate, y, kOp, "gate", "y"));
  SMAT_RETURN_IF_ERROR(ExpectNoMixedAlias(up, y, kOp, "up", "y"));
  return nf;
}

absl::StatusOr<RowsCols> CheckSwiGluBackward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                                             const Tensor& d_gate, const Tensor& d_up,
                                             Device device) {
  constexpr const char* kOp = "SwiGluBackward";
  SMAT_RETURN_IF_ERROR(ExpectRank2(gate, kOp, "gate"));
  const RowsCols nf{gate.dim(0), gate.dim(1)};
  SMAT_RETURN_IF_ERROR(ExpectFloat(gate, gate.shape(), kOp, "gate", device));
  SMAT_RETURN_IF_ERROR(Expect(up, gate.dtype(), gate.shape(), kOp, "up", device));
  SMAT_RETURN_IF_ERROR(ExpectFloat(dy, gate.shape(), kOp, "dy", device));
  SMAT_RETURN_IF_ERROR(ExpectFloat(d_gate, gate.shape(), kOp, "d_gate", device));
  SMAT_RETURN_IF_ERROR(Expect(d_up, d_gate.dtype(), gate.shape(), kOp, "d_up", device));
  for (const NamedTensor& o : {NamedTensor{gate, "gate"}, NamedTensor{up, "up"},
                               NamedTensor{dy, "dy"}}) {
    SMAT_RETURN_IF_ERROR(ExpectNoMixedAlias(o.tensor, d_gate, kOp, o.name, "d_gate"));
    SMAT_RETURN_IF_ERROR(ExpectNoMixedAlias(o.tensor, d_up, kOp, o.name, "d_up"));
  }
  return nf;
}

namespace {

// The operands NarrowLinearForward and NarrowLinearBackward share: x [N, in]
// and w [out, in] (fp32 or bf16), 1 <= out <= kNarrowLinearMaxOut.
absl::StatusOr<Dims3> CheckNarrowOperands(const char* op, const Tensor& x, const Tensor& w,
                                          Device device) {
  SMAT_RETURN_IF_ERROR(ExpectRank2(x, op, "x"));
  SMAT_RETURN_IF_ERROR(ExpectRank2(w, op, "w"));
  const Dims3 d{x.dim(0), x.dim(1), w.dim(0)};
  SMAT_RETURN_IF_ERROR(ExpectFloat(x, x.shape(), op, "x", device));
  if (d.d2 < 1 || d.d2 > kNarrowLinearMaxOut) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": w has ", d.d2,
                                                   " outputs; a narrow linear layer has 1 to ",
                                                   kNarrowLinearMaxOut));
  }
  SMAT_RETURN_IF_ERROR(ExpectFloat(w, {d.d2, d.d1}, op, "w", device));
  return d;
}

}  // namespace

absl::StatusOr<Dims3> CheckNarrowLinearForward(const Tensor& x, const Tensor& w,
                                               const Tensor& bias, const Tensor& y,
                                               Device device) {
  constexpr const char* kOp = "NarrowLinearForward";
  SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckNarrowOperands(kOp, x, w, device));
  if (bias.defined()) SMAT_RETURN_IF_ERROR(Expect(bias, DType::kF32, {d.d2}, kOp, "bias", device));
  SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {d.d0, d.d2}, kOp, "y", device));
  SMAT_RETURN_IF_ERROR(ExpectDistinct(x, y, kOp, "x", "y"));
  return d;
}

absl::StatusOr<Dims3> CheckNarrowLinearBackward(const Tensor& x, const Tensor& w,
                                                const Tensor& dy, const Tensor& dx,
                                                const Tensor& d_w, const Tensor& d_bias,
                                                Device device) {
  constexpr const char* kOp = "NarrowLinearBackward";
  SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckNarrowOperands(kOp, x, w, device));
  SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {d.d0, d.d2}, kOp, "dy", device));
  SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, {d.d0, d.d1}, kOp, "dx", device));
  SMAT_RETURN_IF_ERROR(Expect(d_w, DType::kF32, {d.d2, d.d1}, kOp, "d_w", device));
  if (d_bias.defined()) {
    SMAT_RETURN_IF_ERROR(Expect(d_bias, DType::kF32, {d.d2}, kOp, "d_bias", device));
  }
  SMAT_RETURN_IF_ERROR(ExpectDistinct(x, dx, kOp, "x", "dx"));
  SMAT_RETURN_IF_ERROR(ExpectDistinct(dy, dx, kOp, "dy", "dx"));
  return d;
}

absl::Status CheckCast(const Tensor& src, const Tensor& dst, Device device) {
  auto floating = [](DType t) { return t == DType::kF32 || t == DType::kBF16; };
  if (!src.defined() || !dst.defined() || !floating(src.dtype()) || !floating(dst.dtype())) {
    return absl::InvalidArgumentError("Cast: src and dst must be defined fp32 or bf16 tensors");
  }
  // Cast words a wrong device on its own: one message for both operands on the
  // CPU, the operand and the expected device on CUDA.
  if (device.is_cpu()) {
    if (!src.device().is_cpu() || !dst.device().is_cpu()) {
      return absl::InvalidArgumentError("Cast: the CPU model kernels need host tensors");
    }
  } else {
    for (const NamedTensor& o : {NamedTensor{src, "src"}, NamedTensor{dst, "dst"}}) {
      if (!(o.tensor.device() == device)) {
        return absl::InvalidArgumentError(absl::StrCat("Cast: ", o.name, " is on ",
                                                       o.tensor.device().ToString(), "; expected ",
                                                       device.ToString()));
      }
    }
  }
  if (src.numel() != dst.numel()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Cast: src has ", src.numel(), " elements, dst ", dst.numel()));
  }
  return absl::OkStatus();
}

absl::Status CheckSumOfSquares(absl::Span<const Tensor> tensors, Device device) {
  for (size_t k = 0; k < tensors.size(); ++k) {
    const Tensor& t = tensors[k];
    SMAT_RETURN_IF_ERROR(Expect(t, DType::kF32, t.shape(), "SumOfSquares",
                                absl::StrCat("tensor ", k).c_str(), device));
  }
  return absl::OkStatus();
}

}  // namespace smat
