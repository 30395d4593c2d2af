// CPU implementation of the feature maps of kernels/feature_map.h (elementwise,
// fp32). The CUDA backend has its own kernels and is tested against these.
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/feature_map.h"

namespace smat {
namespace {

absl::Status CheckHostF32(const Tensor& t, const char* what) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat("feature map: ", what, " is undefined"));
  if (t.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("feature map: ", what, " must be fp32; got ",
                                                   DTypeName(t.dtype())));
  }
  if (!t.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "feature map: ", what, " is on ", t.device().ToString(), "; this is the CPU implementation"));
  }
  return absl::OkStatus();
}

// Allocates *out like `like` when undefined, else checks it matches.
absl::Status PrepareOutput(const Tensor& like, Tensor* out, const char* what) {
  if (!out->defined()) {
    SMAT_ASSIGN_OR_RETURN(*out, Tensor::Empty(like.shape(), DType::kF32));
    return absl::OkStatus();
  }
  SMAT_RETURN_IF_ERROR(CheckHostF32(*out, what));
  return CheckShape(*out, like.shape(), what);
}

}  // namespace

absl::StatusOr<FeatureMap> ParseFeatureMap(const std::string& name) {
  if (name == "elu1") return FeatureMap::kEluPlusOne;
  if (name == "relu") return FeatureMap::kReluEps;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown feature map \"", name, "\"; use \"elu1\" (elu(x) + 1) or \"relu\" (relu(x) + 1e-3)"));
}

const char* FeatureMapName(FeatureMap f) {
  switch (f) {
    case FeatureMap::kEluPlusOne:
      return "elu1";
    case FeatureMap::kReluEps:
      return "relu";
  }
  return "?";
}

void FeatureMapForward(FeatureMap f, const float* x, float* y, int64_t n) {
  switch (f) {
    case FeatureMap::kEluPlusOne:
      for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0.f ? x[i] + 1.f : std::exp(x[i]);
      return;
    case FeatureMap::kReluEps:
      for (int64_t i = 0; i < n; ++i) y[i] = (x[i] > 0.f ? x[i] : 0.f) + kReluFeatureFloor;
      return;
  }
  SMAT_CHECK(false);
}

void FeatureMapBackward(FeatureMap f, const float* x, const float* dy, float* dx, int64_t n) {
  switch (f) {
    case FeatureMap::kEluPlusOne:
      for (int64_t i = 0; i < n; ++i) dx[i] = x[i] > 0.f ? dy[i] : dy[i] * std::exp(x[i]);
      return;
    case FeatureMap::kReluEps:
      for (int64_t i = 0; i < n; ++i) dx[i] = x[i] > 0.f ? dy[i] : 0.f;
      return;
  }
  SMAT_CHECK(false);
}

absl::Status FeatureMapForward(FeatureMap f, const Tensor& x, Tensor* y) {
  SMAT_RETURN_IF_ERROR(CheckHostF32(x, "x"));
  SMAT_RETURN_IF_ERROR(PrepareOutput(x, y, "y"));
  FeatureMapForward(f, x.data<float>(), y->data<float>(), x.numel());
  return absl::OkStatus();
}

absl::Status FeatureMapBackward(FeatureMap f, const Tensor& x, const Tensor& dy, Tensor* dx) {
  SMAT_RETURN_IF_ERROR(CheckHostF32(x, "x"));
  SMAT_RETURN_IF_ERROR(CheckHostF32(dy, "dy"));
  SMAT_RETURN_IF_ERROR(CheckShape(dy, x.shape(), "dy"));
  SMAT_RETURN_IF_ERROR(PrepareOutput(x, dx, "dx"));
  FeatureMapBackward(f, x.data<float>(), dy.data<float>(), dx->data<float>(), x.numel());
  return absl::OkStatus();
}

}  // namespace smat
