// AdamW, the learning-rate schedule and global-norm clipping (optimizer.h).
#include "trainer/optimizer.h"

#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace smat {
namespace {

constexpr double kPi = 3.14159265358979323846;

absl::Status CheckParam(const OptimizerParam& p) {
  if (!p.value.defined() || !p.grad.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer: parameter '", p.name, "' has no value or no gradient tensor"));
  }
  if (p.value.dtype() != DType::kF32 || p.grad.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "optimizer: parameter '", p.name, "' must be fp32 (value ", DTypeName(p.value.dtype()),
        ", grad ", DTypeName(p.grad.dtype()), "); keep fp32 master weights"));
  }
  if (p.value.shape() != p.grad.shape()) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer: parameter '", p.name, "' value ",
                                                   ShapeToString(p.value.shape()), " vs grad ",
                                                   ShapeToString(p.grad.shape())));
  }
  if (!(p.value.device() == p.grad.device())) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer: parameter '", p.name, "' value on ",
                                                   p.value.device().ToString(), ", grad on ",
                                                   p.grad.device().ToString()));
  }
  return absl::OkStatus();
}

}  // namespace

float ScheduledLearningRate(const OptimizerConfig& config, int64_t step) {
  const double lr = config.lr();
  const double min_lr = config.min_lr();
  const int64_t warmup = config.warmup_steps();
  const int64_t total = config.total_steps();
  if (step < warmup) return static_cast<float>(lr * static_cast<double>(step + 1) / warmup);
  if (step >= total || total <= warmup) return static_cast<float>(min_lr);
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
  return static_cast<float>(min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(kPi * progress)));
}

absl::StatusOr<double> GlobalGradNorm(absl::Span<const OptimizerParam> params, Backend* backend) {
  if (backend != nullptr) {
    SMAT_ASSIGN_OR_RETURN(ModelKernels * kernels, backend->model());
    std::vector<Tensor> grads;
    grads.reserve(params.size());
    for (const OptimizerParam& p : params) grads.push_back(p.grad);
    SMAT_ASSIGN_OR_RETURN(double sum, kernels->SumOfSquares(grads));
    return std::sqrt(sum);
  }
  double sum = 0.0;
  for (const OptimizerParam& p : params) {
    if (!p.grad.device().is_cpu()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "GlobalGradNorm: gradient of '", p.name, "' is on ", p.grad.device().ToString(),
          " and no backend was given to reduce it"));
    }
    const float* g = p.grad.data<float>();
    const int64_t n = p.grad.numel();
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(g[i]) * g[i];
  }
  return std::sqrt(sum);
}

float ClipScale(double norm, double max_norm) {
  if (max_norm <= 0.0 || !(norm > max_norm)) return 1.f;
  return static_cast<float>(max_norm / norm);
}

absl::StatusOr<std::unique_ptr<AdamW>> AdamW::Create(const OptimizerConfig& config,
                                                     std::vector<OptimizerParam> params,
                                                     Backend* backend) {
  std::unique_ptr<AdamW> opt(new AdamW());
  opt->config_ = config;
  if (backend == nullptr) {
    SMAT_ASSIGN_OR_RETURN(opt->own_backend_, CreateBackend(Device::Cpu()));
    backend = opt->own_backend_.get();
  }
  opt->backend_ = backend;
  SMAT_ASSIGN_OR_RETURN(opt->kernels_, backend->model());
  std::set<std::string> names;
  for (const OptimizerParam& p : params) {
    SMAT_RETURN_IF_ERROR(CheckParam(p));
    if (!names.insert(p.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer: two parameters are named '", p.name, "'"));
    }
    if (!(p.value.device() == backend->device())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer: parameter '", p.name, "' is on ", p.value.device().ToString(),
          " but the optimizer's backend runs on ", backend->device().ToString()));
    }
    SMAT_ASSIGN_OR_RETURN(Tensor m,
                          Tensor::Empty(p.value.shape(), DType::kF32, backend->allocator()));
    SMAT_ASSIGN_OR_RETURN(Tensor v,
                          Tensor::Empty(p.value.shape(), DType::kF32, backend->allocator()));
    SMAT_RETURN_IF_ERROR(backend->Fill(m, 0.0));
    SMAT_RETURN_IF_ERROR(backend->Fill(v, 0.0));
    opt->m_.push_back(std::move(m));
    opt->v_.push_back(std::move(v));
    opt->decay_.push_back(p.decay && p.value.rank() >= 2);
  }
  opt->params_ = std::move(params);
  return opt;
}

absl::Status AdamW::Step(float lr, float grad_scale) {
  const int64_t t = step_count_ + 1;
  const double b1 = config_.beta1(), b2 = config_.beta2();
  // Bias corrections in double: b2^t for b2 = 0.95..0.999 loses digits in fp32
  // long before t is large.
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(t));
  ModelKernels::AdamWScalars s;
  s.grad_scale = grad_scale;
  s.beta1 = static_cast<float>(b1);
  s.one_minus_beta1 = static_cast<float>(1.0 - b1);
  s.beta2 = static_cast<float>(b2);
  s.one_minus_beta2 = static_cast<float>(1.0 - b2);
  s.eps = config_.eps();
  s.step_size = static_cast<float>(lr / bc1);
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float decay =
      static_cast<float>(1.0 - static_cast<double>(lr) * config_.weight_decay());
  for (size_t i = 0; i < params_.size(); ++i) {
    OptimizerParam& p = params_[i];
    s.decay = decay_[i] ? decay : 1.f;
    SMAT_RETURN_IF_ERROR(Annotate(kernels_->AdamWUpdate(p.value, p.grad, m_[i], v_[i], s),
                                  "optimizer: parameter '", p.name, "'"));
  }
  // Asynchronous on a device: the next step's kernels queue behind these; a
  // host reader of the values (checkpoint, test) copies through the backend,
  // which orders after them.
  step_count_ = t;
  return absl::OkStatus();
}

std::vector<std::pair<std::string, Tensor>> AdamW::moments() const {
  std::vector<std::pair<std::string, Tensor>> out;
  out.reserve(2 * params_.size());
  for (size_t i = 0; i < params_.size(); ++i) out.emplace_back("adam_m/" + params_[i].name, m_[i]);
  for (size_t i = 0; i < params_.size(); ++i) out.emplace_back("adam_v/" + params_[i].name, v_[i]);
  return out;
}

}  // namespace smat
