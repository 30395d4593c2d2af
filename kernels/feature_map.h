// Feature maps of SMat-Attention: the nonnegative maps that turn projected
// queries and keys into phi and psi (paper Section 2, "Finite-feature
// attention": the kernel must factor through finite nonnegative features).
// Applied elementwise to already-projected inputs, forward and backward, fp32:
//   kEluPlusOne ("elu1"): f(x) = elu(x) + 1 = x + 1 (x > 0), exp(x) (x <= 0);
//                         f'(x) = 1 (x > 0), exp(x) (x <= 0).
//   kReluEps    ("relu"): f(x) = max(x, 0) + 1e-3; f'(x) = 1 (x > 0), 0 (x <= 0).
// Both are strictly positive, so every normaliser ybar[dv] is positive (the
// hypothesis of Theorem 3.2).
//
//   SMAT_ASSIGN_OR_RETURN(FeatureMap f, ParseFeatureMap("elu1"));
//   SMAT_RETURN_IF_ERROR(FeatureMapForward(f, q_proj, &phi));       // fp32 host, same shape
//   SMAT_RETURN_IF_ERROR(FeatureMapBackward(f, q_proj, dphi, &dq));  // dx from dy and x
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace smat {

enum class FeatureMap : int { kEluPlusOne = 0, kReluEps = 1 };

// The floor added by kReluEps, so that features stay strictly positive.
inline constexpr float kReluFeatureFloor = 1e-3f;

// "elu1" -> kEluPlusOne, "relu" -> kReluEps; anything else is InvalidArgument.
absl::StatusOr<FeatureMap> ParseFeatureMap(const std::string& name);
const char* FeatureMapName(FeatureMap f);  // "elu1", "relu"

// Raw host loops: y[i] = f(x[i]); dx[i] = f'(x[i]) dy[i]. y may alias x, dx may
// alias dy.
void FeatureMapForward(FeatureMap f, const float* x, float* y, int64_t n);
void FeatureMapBackward(FeatureMap f, const float* x, const float* dy, float* dx, int64_t n);

// Tensor forms: fp32 host tensors of one shape; *y / *dx are allocated when
// undefined, else must already have that shape. InvalidArgument naming the
// operand otherwise.
absl::Status FeatureMapForward(FeatureMap f, const Tensor& x, Tensor* y);
absl::Status FeatureMapBackward(FeatureMap f, const Tensor& x, const Tensor& dy, Tensor* dx);

}  // namespace smat
