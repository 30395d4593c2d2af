// Helpers shared by the SMat kernel tests: random problems at odd sizes (as
// double references and as fp32 Tensors), and error measures.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "gtest/gtest.h"
#include "kernels/cpu/smat_reference.h"

namespace smat {
namespace testing_util {

struct ProblemSpec {
  int64_t batch = 1, T = 63, H = 2, r = 5, dv = 3;
  int d = 2;
  int64_t chunk = 16;
  bool gated = false;
  bool content = false;  // content prof/type maps instead of positional
  double eps = 0.0;
  uint64_t seed = 1;
  std::string Name() const {
    return absl::StrCat("b", batch, "_T", T, "_H", H, "_r", r, "_dv", dv, "_d", d, "_c", chunk,
                        gated ? "_gated" : "", content ? "_content" : "", "_eps", eps);
  }
};

// Features in (0.05, 1] keep every normaliser well away from 0 (Theorem 3.2
// assumes positive normalisers); values in [-1, 1]; log-gates in [-0.15, 0] so
// gating matters inside a chunk yet long ranges still carry signal.
inline SmatReferenceProblem RandomProblem(const SmatPlan& plan, const ProblemSpec& s) {
  std::mt19937_64 rng(s.seed);
  std::uniform_real_distribution<double> feat(0.05, 1.0), val(-1.0, 1.0), gate(-0.15, 0.0);
  SmatReferenceProblem pr;
  pr.batch = s.batch;
  pr.T = s.T;
  pr.H = s.H;
  pr.r = s.r;
  pr.dv = s.dv;
  pr.eps = s.eps;
  const int64_t rows = s.batch * s.T * s.H;
  pr.phi.resize(rows * s.r);
  pr.psi.resize(rows * s.r);
  pr.v.resize(rows * s.dv);
  for (double& x : pr.phi) x = feat(rng);
  for (double& x : pr.psi) x = feat(rng);
  for (double& x : pr.v) x = val(rng);
  if (s.gated) {
    pr.logg.resize(rows);
    for (double& x : pr.logg) x = gate(rng);
  }
  if (s.content) {
    std::uniform_int_distribution<int32_t> pd(0, static_cast<int32_t>(plan.geo.P - 1));
    std::uniform_int_distribution<int32_t> td(0, static_cast<int32_t>(plan.geo.B - 1));
    pr.prof.resize(rows);
    pr.type.resize(rows);
    for (int32_t& x : pr.prof) x = pd(rng);
    for (int32_t& x : pr.type) x = td(rng);
  }
  return pr;
}

inline std::vector<double> RandomVector(int64_t size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> val(-1.0, 1.0);
  std::vector<double> out(size);
  for (double& x : out) x = val(rng);
  return out;
}

// fp32 host tensor of the given shape from doubles (rounded once).
inline Tensor ToF32(const std::vector<double>& x, Shape shape) {
  auto t = Tensor::Empty(shape, DType::kF32);
  SMAT_CHECK(t.ok() && t->numel() == static_cast<int64_t>(x.size()));
  float* p = t->data<float>();
  for (size_t i = 0; i < x.size(); ++i) p[i] = static_cast<float>(x[i]);
  return *t;
}
inline Tensor ToI32(const std::vector<int32_t>& x, Shape shape) {
  auto t = Tensor::Empty(shape, DType::kI32);
  SMAT_CHECK(t.ok() && t->numel() == static_cast<int64_t>(x.size()));
  std::copy(x.begin(), x.end(), t->data<int32_t>());
  return *t;
}
inline std::vector<double> ToDouble(const Tensor& t) {
  std::vector<double> out(t.numel());
  const float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = p[i];
  return out;
}
// The problem rounded to fp32 and back, so references and fp32 kernels see the
// same inputs and only the arithmetic differs.
inline void RoundToF32(SmatReferenceProblem* pr) {
  for (auto* v : {&pr->phi, &pr->psi, &pr->v, &pr->logg}) {
    for (double& x : *v) x = static_cast<float>(x);
  }
}

inline double MaxAbs(const std::vector<double>& x) {
  double m = 0.0;
  for (double v : x) m = std::max(m, std::abs(v));
  return m;
}

// max_i |a_i - b_i| / max_i |b_i|: the error relative to the size of the
// reference, meaningful for entries near zero (values have random signs).
inline double MaxRelError(const std::vector<double>& a, const std::vector<double>& b) {
  SMAT_CHECK(a.size() == b.size());
  double err = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    err = std::max(err, std::abs(a[i] - b[i]));
  }
  const double scale = MaxAbs(b);
  return scale > 0 ? err / scale : (err > 0 ? INFINITY : 0.0);
}

}  // namespace testing_util
}  // namespace smat
