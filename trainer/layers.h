// Small building blocks shared by trainer/model and trainer/smat_mixer: fp32
// activation allocation on the backend, and the linear layer y = x W^T (+ b)
// with its backward, both through Backend::Gemm so a device backend runs them
// unchanged. Weights follow the [out, in] convention, so the LM head and the
// tied embedding table are the same [vocab, width] matrix.
//
// Precision (run.bf16): with bf16 on, every product casts its operands to bf16
// (ModelKernels::Cast, round to nearest even) and multiplies them with fp32
// accumulation into an fp32 output (Backend::Gemm's bf16 path), forward and
// backward (dy is cast too); weights, gradients and outputs stay fp32. An
// operand that already is bf16 (the SMat output with bf16 features, an input
// the caller cast once for several products, an activation a model kernel
// wrote in bf16 because only products read it: NewOperand) is used as it is.
// A weight is cast once per model forward (BeginForward), not once per
// product: its bf16 copy serves the forward's products and the backward's.
//
//   Dense dense(backend, kernels, /*bf16=*/cfg.run().bf16());
//   SMAT_ASSIGN_OR_RETURN(Tensor y, NewActivation(backend, {N, out}));
//   SMAT_RETURN_IF_ERROR(dense.Forward(x, wq, nullptr, y));
//   SMAT_RETURN_IF_ERROR(dense.Backward(x, dy, wq, nullptr, &dx, /*accumulate_dx=*/true));
#pragma once

#include <array>
#include <cstdint>
#include <map>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/model_kernels.h"
#include "trainer/model.h"

namespace smat {

// An uninitialised fp32 tensor of `shape` in the backend's memory.
absl::StatusOr<Tensor> NewActivation(Backend& backend, Shape shape);
// The same, zero-filled.
absl::StatusOr<Tensor> NewZeros(Backend& backend, Shape shape);

class Dense {
 public:
  // Scratch slots of the bf16 casts: kInput is the caller's (Cast below: one
  // cast of a block input shared by the products that read it); the others
  // are Forward's and Backward's own.
  enum Slot : int { kInput = 0, kWeight = 1, kGrad = 2, kOperand = 3, kNumSlots = 4 };

  Dense(Backend& backend, ModelKernels& kernels, bool bf16)
      : backend_(&backend), kernels_(&kernels), bf16_(bf16) {}

  bool bf16() const { return bf16_; }

  // An uninitialised [shape] tensor for an activation that only products
  // read: bf16 with bf16 on (the model kernel that produces it writes bf16,
  // which is what Operand would have cast it to), else fp32.
  absl::StatusOr<Tensor> NewOperand(Shape shape);

  // Starts a model forward: the weights may have changed since the last one
  // (an optimizer step), so their bf16 copies are cast again on first use.
  // Until the next call, the weights must not change.
  void BeginForward() { ++generation_; }

  // y [N, out] = x [N, in] @ w [out, in]^T + bias [out] (bias may be null).
  // y fp32, or with bf16 on and no bias bf16 (NewOperand: the product rounded
  // once on the way out, for an output only bf16 readers use).
  absl::Status Forward(const Tensor& x, const Parameter& w, const Parameter* bias, Tensor& y);

  // Backward of Forward for upstream gradient dy [N, out]: w.grad += dy^T x,
  // bias.grad += sum over rows of dy (rows in order, through a ones-vector
  // product), and, when dx is not null, dx [N, in] = dy w (accumulate_dx:
  // dx += dy w).
  absl::Status Backward(const Tensor& x, const Tensor& dy, Parameter& w, Parameter* bias,
                        Tensor* dx, bool accumulate_dx);

  // The same layer for out <= kNarrowLinearMaxOut outputs (the mixer's decay
  // and key-gate projections). With bf16 on: ModelKernels::NarrowLinear*, x
  // and w read in bf16 as by the products, dy kept fp32, and NarrowBackward's
  // dx written (not accumulated) when accumulate_dx is false; in fp32 mode,
  // exactly Forward and Backward.
  absl::Status NarrowForward(const Tensor& x, const Parameter& w, const Parameter* bias,
                             Tensor& y);
  absl::Status NarrowBackward(const Tensor& x, const Tensor& dy, Parameter& w, Parameter* bias,
                              Tensor* dx, bool accumulate_dx);

  // The operand the products read for t: t itself in fp32 mode (or when it is
  // bf16 already), else its bf16 cast in scratch slot `slot`, valid until the
  // slot's next use.
  absl::StatusOr<Tensor> Operand(const Tensor& t, Slot slot);

 private:
  // A [n] ones vector (the bias broadcast and reduction), kept between calls.
  absl::StatusOr<Tensor> Ones(int64_t n);
  // The operand for the weight w: Operand(w.value, kWeight) before any
  // BeginForward, else w's bf16 copy, cast at its first use since the last
  // BeginForward.
  absl::StatusOr<Tensor> WeightOperand(const Parameter& w);

  struct CachedWeight {
    Tensor value;             // bf16, w.value's shape
    uint64_t generation = 0;  // the BeginForward it was cast in
  };

  Backend* backend_;
  ModelKernels* kernels_;
  bool bf16_;
  std::array<Tensor, kNumSlots> scratch_;  // bf16, grown on demand
  Tensor ones_;
  uint64_t generation_ = 0;  // BeginForward calls
  std::map<const Parameter*, CachedWeight> weights_;
};

}  // namespace smat
