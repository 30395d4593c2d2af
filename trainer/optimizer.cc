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
  double sum = 0.0;
  for (const OptimizerParam& p : params) {
    Tensor host = p.grad;
    if (!p.grad.device().is_cpu()) {
      if (backend == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "GlobalGradNorm: gradient of '", p.name, "' is on ", p.grad.device().ToString(),
            " and no backend was given to copy it"));
      }
      SMAT_ASSIGN_OR_RETURN(host, Tensor::Empty(p.grad.shape(), DType::kF32));
      SMAT_RETURN_IF_ERROR(backend->Copy(p.grad, host));
      SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
    }
    const float* g = host.data<float>();
    const int64_t n = host.numel();
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
  opt->backend_ = backend;
  std::set<std::string> names;
  for (const OptimizerParam& p : params) {
    SMAT_RETURN_IF_ERROR(CheckParam(p));
    if (!names.insert(p.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer: two parameters are named '", p.name, "'"));
    }
    const bool on_device = !p.value.device().is_cpu();
    if (on_device && backend == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer: parameter '", p.name, "' is on ",
                                                     p.value.device().ToString(),
                                                     " and no backend was given"));
    }
    SMAT_ASSIGN_OR_RETURN(Tensor m, Tensor::Zeros(p.value.shape(), DType::kF32));
    SMAT_ASSIGN_OR_RETURN(Tensor v, Tensor::Zeros(p.value.shape(), DType::kF32));
    opt->m_.push_back(std::move(m));
    opt->v_.push_back(std::move(v));
    opt->decay_.push_back(p.decay && p.value.rank() >= 2);
    Tensor value_host, grad_host;
    if (on_device) {
      SMAT_ASSIGN_OR_RETURN(value_host, Tensor::Empty(p.value.shape(), DType::kF32));
      SMAT_ASSIGN_OR_RETURN(grad_host, Tensor::Empty(p.value.shape(), DType::kF32));
    }
    opt->value_host_.push_back(std::move(value_host));
    opt->grad_host_.push_back(std::move(grad_host));
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
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float eps = config_.eps();
  const float fb1 = static_cast<float>(b1), fb2 = static_cast<float>(b2);
  const float one_minus_b1 = static_cast<float>(1.0 - b1), one_minus_b2 = static_cast<float>(1.0 - b2);

  for (size_t i = 0; i < params_.size(); ++i) {
    const OptimizerParam& p = params_[i];
    const bool on_device = value_host_[i].defined();
    Tensor value = p.value, grad = p.grad;
    if (on_device) {
      SMAT_RETURN_IF_ERROR(backend_->Copy(p.value, value_host_[i]));
      SMAT_RETURN_IF_ERROR(backend_->Copy(p.grad, grad_host_[i]));
      SMAT_RETURN_IF_ERROR(backend_->Synchronize(nullptr));
      value = value_host_[i];
      grad = grad_host_[i];
    }
    float* w = value.data<float>();
    const float* g = grad.data<float>();
    float* m = m_[i].data<float>();
    float* v = v_[i].data<float>();
    const float decay = decay_[i] ? static_cast<float>(1.0 - static_cast<double>(lr) *
                                                                  config_.weight_decay())
                                  : 1.f;
    const int64_t n = value.numel();
    for (int64_t k = 0; k < n; ++k) {
      const float gk = g[k] * grad_scale;
      m[k] = fb1 * m[k] + one_minus_b1 * gk;
      v[k] = fb2 * v[k] + one_minus_b2 * gk * gk;
      const float denom = std::sqrt(v[k]) * inv_sqrt_bc2 + eps;
      w[k] = w[k] * decay - step_size * m[k] / denom;
    }
    if (on_device) {
      Tensor dst = p.value;
      SMAT_RETURN_IF_ERROR(backend_->Copy(value_host_[i], dst));
    }
  }
  if (backend_ != nullptr) SMAT_RETURN_IF_ERROR(backend_->Synchronize(nullptr));
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
