// Shared by the CPU model-kernel tests (model_kernels_test.cc; the bf16 and
// fused cases in model_kernels_bf16_test.cc): the fixture, random and zero
// fp32 tensors and the comparison against a double reference. The fixture
// lives in a named namespace so that both files' tests share one type.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/model_kernels.h"

namespace smat {
namespace model_kernels_test {

using Vec = std::vector<double>;

inline Tensor Randn(Shape shape, uint64_t stream, float stddev = 1.f) {
  Tensor t = *Tensor::Empty(std::move(shape), DType::kF32);
  SMAT_CHECK(FillNormal(t, /*seed=*/11, 0, 0.f, stddev, stream).ok());
  return t;
}
inline Tensor Zeros(Shape shape) { return *Tensor::Zeros(std::move(shape), DType::kF32); }
inline Vec ToVec(const Tensor& t) {
  const float* p = t.data<float>();
  return Vec(p, p + t.numel());
}

// fp32 kernel output vs a double value: the kernels sum at most ~20 fp32
// products per element here (relative error <~ 20 * 6e-8 = 1.2e-6 of the
// largest term), so 1e-4 of the largest magnitude is a safe margin that still
// catches any wrong or missing term (an O(1) relative error).
inline void ExpectClose(const Tensor& got, const Vec& want, const char* what) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size())) << what;
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  ASSERT_GT(scale, 0) << what << ": the reference is all zero, the test proves nothing";
  const float* g = got.data<float>();
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(g[i], want[i], 1e-4 * scale) << what << " element " << i;
  }
}

class ModelKernelsTest : public ::testing::Test {
 protected:
  void SetUp() override { mk_ = *cpu_.model(); }
  CpuBackend cpu_;
  ModelKernels* mk_ = nullptr;
};

}  // namespace model_kernels_test
}  // namespace smat
