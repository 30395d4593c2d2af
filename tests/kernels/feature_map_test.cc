// Tests of the feature maps (kernels/feature_map.h): exact values at chosen
// points, positivity, the backward pass against central finite differences in
// double, and the Tensor forms' argument checks.
#include "kernels/feature_map.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace smat {
namespace {

TEST(FeatureMapTest, ParseAndName) {
  auto e = ParseFeatureMap("elu1");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(*e, FeatureMap::kEluPlusOne);
  auto r = ParseFeatureMap("relu");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, FeatureMap::kReluEps);
  EXPECT_STREQ(FeatureMapName(*e), "elu1");
  EXPECT_STREQ(FeatureMapName(*r), "relu");
  auto bad = ParseFeatureMap("gelu");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("elu1"), std::string::npos);
}

TEST(FeatureMapTest, ExactValues) {
  const float x[5] = {-2.f, -0.5f, 0.f, 0.25f, 3.f};
  float y[5], dx[5];
  const float dy[5] = {1.f, 2.f, 3.f, 4.f, 5.f};
  FeatureMapForward(FeatureMap::kEluPlusOne, x, y, 5);
  EXPECT_EQ(y[0], std::exp(-2.f));
  EXPECT_EQ(y[1], std::exp(-0.5f));
  EXPECT_EQ(y[2], 1.f);
  EXPECT_EQ(y[3], 1.25f);
  EXPECT_EQ(y[4], 4.f);
  FeatureMapBackward(FeatureMap::kEluPlusOne, x, dy, dx, 5);
  EXPECT_EQ(dx[0], std::exp(-2.f));
  EXPECT_EQ(dx[1], 2.f * std::exp(-0.5f));
  EXPECT_EQ(dx[2], 3.f);  // elu'(0) = exp(0) from the left branch
  EXPECT_EQ(dx[3], 4.f);
  EXPECT_EQ(dx[4], 5.f);
  FeatureMapForward(FeatureMap::kReluEps, x, y, 5);
  EXPECT_EQ(y[0], 1e-3f);
  EXPECT_EQ(y[2], 1e-3f);
  EXPECT_EQ(y[3], 0.25f + 1e-3f);
  EXPECT_EQ(y[4], 3.f + 1e-3f);
  FeatureMapBackward(FeatureMap::kReluEps, x, dy, dx, 5);
  EXPECT_EQ(dx[0], 0.f);
  EXPECT_EQ(dx[1], 0.f);
  EXPECT_EQ(dx[2], 0.f);
  EXPECT_EQ(dx[3], 4.f);
  EXPECT_EQ(dx[4], 5.f);
}

// Finite differences in double of the fp32 forward would measure fp32 rounding,
// so the reference derivative is taken of the same formula evaluated in double.
double ForwardDouble(FeatureMap f, double x) {
  if (f == FeatureMap::kEluPlusOne) return x > 0 ? x + 1 : std::exp(x);
  return (x > 0 ? x : 0) + 1e-3;
}

TEST(FeatureMapTest, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-4.f, 4.f);
  const int64_t n = 1031;  // odd size
  std::vector<float> x(n), dy(n), dx(n), y(n);
  for (int64_t i = 0; i < n; ++i) {
    x[i] = u(rng);
    if (std::fabs(x[i]) < 1e-3f) x[i] = 0.5f;  // keep the kink out of the stencil
    dy[i] = u(rng);
  }
  for (FeatureMap f : {FeatureMap::kEluPlusOne, FeatureMap::kReluEps}) {
    FeatureMapForward(f, x.data(), y.data(), n);
    FeatureMapBackward(f, x.data(), dy.data(), dx.data(), n);
    double norm = 0;
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_GT(y[i], 0.f);  // strictly positive features
      const double h = 1e-6;
      const double fd = (ForwardDouble(f, x[i] + h) - ForwardDouble(f, x[i] - h)) / (2 * h);
      // Central differences of a smooth function, h = 1e-6: truncation error
      // ~ h^2 |f'''| < 1e-10 and cancellation ~ 1e-16 / 1e-6 = 1e-10; the fp32
      // product f'(x) dy carries ~6e-8 relative rounding. 1e-6 relative covers both.
      EXPECT_NEAR(dx[i], fd * dy[i], 1e-6 * (1.0 + std::fabs(fd * dy[i]))) << "x=" << x[i];
      norm += dx[i] * dx[i];
    }
    EXPECT_GT(norm, 1.0);  // not all zero
  }
}

TEST(FeatureMapTest, TensorForms) {
  auto x = Tensor::Empty({3, 5}, DType::kF32);
  ASSERT_TRUE(x.ok());
  for (int i = 0; i < 15; ++i) x->data<float>()[i] = static_cast<float>(i - 7) / 3.f;
  Tensor y;
  ASSERT_TRUE(FeatureMapForward(FeatureMap::kEluPlusOne, *x, &y).ok());
  ASSERT_EQ(y.shape(), Shape({3, 5}));
  EXPECT_FLOAT_EQ(y.data<float>()[14], 7.f / 3.f + 1.f);
  Tensor dx;
  ASSERT_TRUE(FeatureMapBackward(FeatureMap::kReluEps, *x, y, &dx).ok());
  EXPECT_EQ(dx.data<float>()[0], 0.f);
  EXPECT_EQ(dx.data<float>()[14], y.data<float>()[14]);

  auto wrong = Tensor::Empty({5, 3}, DType::kF32);
  ASSERT_TRUE(wrong.ok());
  EXPECT_FALSE(FeatureMapBackward(FeatureMap::kReluEps, *x, *wrong, &dx).ok());
  Tensor small_out = *wrong;
  EXPECT_FALSE(FeatureMapForward(FeatureMap::kReluEps, *x, &small_out).ok());
  auto ints = Tensor::Empty({3, 5}, DType::kI32);
  ASSERT_TRUE(ints.ok());
  Tensor out;
  auto s = FeatureMapForward(FeatureMap::kReluEps, *ints, &out);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("fp32"), std::string::npos);
}

}  // namespace
}  // namespace smat
