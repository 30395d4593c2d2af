// AdamW (Loshchilov and Hutter, "Decoupled Weight Decay Regularization", 2019)
// with the learning-rate schedule and global-norm gradient clipping of a smat
// run (optimizer { ... } in core/config.proto).
//
// The update is PyTorch's torch.optim.AdamW (the reference users compare with):
//   p <- p * (1 - lr * wd)                        decoupled decay, matrices only
//   m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2
//   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// Weight decay applies to tensors of rank >= 2 (embeddings, projections), not to
// gains and biases (rank 1), as in GPT-2 / nanoGPT, and not to a parameter whose
// owner opts it out (OptimizerParam::decay). Weights and moments are
// fp32 (the model keeps fp32 master weights even with bf16 kernels) and live
// where the parameter lives: the update is ModelKernels::AdamWUpdate of the
// backend, run in place on the device (no host round trip per step), with
// the same operations on every backend, so a CPU and a GPU run take the same
// step from the same gradients.
//
// Gradients reach the optimizer already summed over the whole dp x sp grid
// (every rank holds the same bits), so the global norm needs no collective:
// each rank computes it in the same fixed order and gets the same clip factor.
//
//   const float lr = ScheduledLearningRate(cfg.optimizer(), step);
//   SMAT_ASSIGN_OR_RETURN(double norm, GlobalGradNorm(opt.params()));
//   SMAT_RETURN_IF_ERROR(opt.Step(lr, ClipScale(norm, cfg.optimizer().grad_clip())));
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/config.pb.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/model_kernels.h"

namespace smat {

// One tensor the optimizer updates; `value` and `grad` share their buffers with
// the model's (Tensor copies are views).
struct OptimizerParam {
  std::string name;
  Tensor value;  // fp32, any shape
  Tensor grad;   // fp32, shape of value, same device
  // False exempts the parameter from weight decay even when it is a matrix;
  // rank-1 tensors are never decayed.
  bool decay = true;
};

// Learning rate for optimizer step `step` (0-based: the update about to be
// made), with lr, min_lr, warmup_steps and total_steps of `config` (defaults
// applied). Linear warm-up lr * (step + 1) / warmup over the first warmup_steps
// steps, then a cosine from lr at step warmup_steps down to min_lr at step
// total_steps, and min_lr after it.
//   warmup 10, lr 1e-3: step 0 -> 1e-4, step 9 -> 1e-3.
float ScheduledLearningRate(const OptimizerConfig& config, int64_t step);

// sqrt(sum of g^2) over every element of every grad: parameters in the given
// order, elements in memory order, accumulated in double, so every rank holding
// the same gradients gets the same bits. With a backend the sum is its
// ModelKernels::SumOfSquares (on the device: only the scalar comes back);
// without one the gradients must be host tensors (InvalidArgument otherwise).
absl::StatusOr<double> GlobalGradNorm(absl::Span<const OptimizerParam> params,
                                      Backend* backend = nullptr);

// The factor gradients are scaled by: max_norm / norm when max_norm > 0 and the
// norm exceeds it, else 1 (max_norm = 0 disables clipping).
float ClipScale(double norm, double max_norm);

class AdamW {
 public:
  // Moments start at zero, on the parameters' device. Every param needs an
  // fp32 value and a grad of the same shape on the backend's device; names must
  // be unique (they name checkpoint tensors). `backend` runs the update and must
  // outlive the optimizer; null: a CPU backend of the optimizer's own (host
  // parameters only). InvalidArgument names the offending parameter.
  static absl::StatusOr<std::unique_ptr<AdamW>> Create(const OptimizerConfig& config,
                                                       std::vector<OptimizerParam> params,
                                                       Backend* backend = nullptr);

  // One update of every parameter with learning rate `lr`, gradients multiplied
  // by `grad_scale` first (ClipScale). Increments step_count().
  absl::Status Step(float lr, float grad_scale = 1.f);

  // Updates made so far: t - 1 of the next update's bias correction.
  int64_t step_count() const { return step_count_; }
  // For a resume: the moments are restored through moments(), the count here.
  void set_step_count(int64_t t) { step_count_ = t; }

  const std::vector<OptimizerParam>& params() const { return params_; }
  bool decays(int i) const { return decay_[i]; }

  // The state a checkpoint must hold, as fp32 tensors sharing this
  // optimizer's buffers (so restoring = copying into them; on the parameters'
  // device, so a GPU run's moments are copied out to be saved): first moments
  // "adam_m/<name>", second moments "adam_v/<name>", in parameter order.
  std::vector<std::pair<std::string, Tensor>> moments() const;

 private:
  AdamW() = default;

  OptimizerConfig config_;
  std::unique_ptr<Backend> own_backend_;  // the CPU backend when none was given
  Backend* backend_ = nullptr;
  ModelKernels* kernels_ = nullptr;  // backend_->model()
  std::vector<OptimizerParam> params_;
  std::vector<bool> decay_;
  std::vector<Tensor> m_, v_;  // fp32 on the parameters' device, shape of each param
  int64_t step_count_ = 0;
};

}  // namespace smat
