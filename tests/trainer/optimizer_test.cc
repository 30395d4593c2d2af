// AdamW against a hand-written double-precision reference, schedule values at
// the points where the formula changes, and global-norm clipping.
#include "trainer/optimizer.h"

#include <cmath>
#include <vector>

#include "core/config.h"
#include "core/rng.h"
#include "gtest/gtest.h"

namespace smat {
namespace {

OptimizerConfig DefaultedOptimizer(const std::string& text) {
  absl::StatusOr<TrainConfig> cfg = ParseConfigText(text, "<test>");
  EXPECT_TRUE(cfg.ok()) << cfg.status();
  ApplyDefaults(*cfg);
  return cfg->optimizer();
}

Tensor Random(Shape shape, uint64_t stream, float stddev = 1.f) {
  Tensor t = Tensor::Empty(std::move(shape), DType::kF32).value();
  EXPECT_TRUE(FillNormal(t, /*seed=*/11, /*offset=*/0, 0.f, stddev, stream).ok());
  return t;
}

// One AdamW update in double, written from the paper / PyTorch's formula.
void ReferenceStep(std::vector<double>& w, std::vector<double>& m, std::vector<double>& v,
                   const std::vector<double>& g, int t, double lr, double wd, double b1, double b2,
                   double eps) {
  for (size_t k = 0; k < w.size(); ++k) {
    w[k] *= 1.0 - lr * wd;
    m[k] = b1 * m[k] + (1 - b1) * g[k];
    v[k] = b2 * v[k] + (1 - b2) * g[k] * g[k];
    const double mhat = m[k] / (1 - std::pow(b1, t));
    const double vhat = v[k] / (1 - std::pow(b2, t));
    w[k] -= lr * mhat / (std::sqrt(vhat) + eps);
  }
}

TEST(AdamWTest, MatchesDoubleReferenceOverSeveralSteps) {
  OptimizerConfig oc = DefaultedOptimizer(
      "optimizer { lr: 0.01 weight_decay: 0.1 beta1: 0.9 beta2: 0.95 eps: 1e-8 }");
  Tensor w_mat = Random({7, 5}, 1), g_mat = Random({7, 5}, 2);
  Tensor w_vec = Random({13}, 3), g_vec = Random({13}, 4);
  std::vector<double> rw_mat(w_mat.data<float>(), w_mat.data<float>() + 35);
  std::vector<double> rw_vec(w_vec.data<float>(), w_vec.data<float>() + 13);
  std::vector<double> rm_mat(35), rv_mat(35), rm_vec(13), rv_vec(13);

  auto opt = AdamW::Create(oc, {{"mat", w_mat, g_mat}, {"vec", w_vec, g_vec}});
  ASSERT_TRUE(opt.ok()) << opt.status();
  EXPECT_TRUE((*opt)->decays(0));   // rank 2: decayed
  EXPECT_FALSE((*opt)->decays(1));  // rank 1: gains and biases are not

  const float scale = 0.5f;  // a clip factor, applied to the gradient before the moments
  for (int t = 1; t <= 5; ++t) {
    // New gradients every step, so the moments mix several of them.
    ASSERT_TRUE(FillNormal(g_mat, 100 + t, 0).ok());
    ASSERT_TRUE(FillNormal(g_vec, 200 + t, 0).ok());
    std::vector<double> gm(35), gv(13);
    for (int k = 0; k < 35; ++k) gm[k] = static_cast<double>(g_mat.data<float>()[k]) * scale;
    for (int k = 0; k < 13; ++k) gv[k] = static_cast<double>(g_vec.data<float>()[k]) * scale;
    const double lr = 0.01 * t / 5.0;
    ReferenceStep(rw_mat, rm_mat, rv_mat, gm, t, lr, 0.1, 0.9, 0.95, 1e-8);
    ReferenceStep(rw_vec, rm_vec, rv_vec, gv, t, lr, 0.0, 0.9, 0.95, 1e-8);
    ASSERT_TRUE((*opt)->Step(static_cast<float>(lr), scale).ok());
    EXPECT_EQ((*opt)->step_count(), t);
  }
  // Tolerance: weights are O(1) and move by ~lr per step; the fp32 update
  // rounds each of ~6 operations to 2^-24 relative, over 5 steps: ~1e-6 of the
  // weight. 1e-5 absolute leaves room and is still far below one step (~1e-3).
  double moved = 0.0;
  for (int k = 0; k < 35; ++k) {
    EXPECT_NEAR(w_mat.data<float>()[k], rw_mat[k], 1e-5) << "mat " << k;
  }
  for (int k = 0; k < 13; ++k) {
    EXPECT_NEAR(w_vec.data<float>()[k], rw_vec[k], 1e-5) << "vec " << k;
  }
  // The update did something (a test of an optimizer that never moves proves nothing).
  Tensor w0 = Random({7, 5}, 1);
  for (int k = 0; k < 35; ++k) moved += std::fabs(w_mat.data<float>()[k] - w0.data<float>()[k]);
  EXPECT_GT(moved / 35, 1e-3);

  // The moments a checkpoint saves are the ones the reference carries.
  auto moments = (*opt)->moments();
  ASSERT_EQ(moments.size(), 4u);
  EXPECT_EQ(moments[0].first, "adam_m/mat");
  EXPECT_EQ(moments[3].first, "adam_v/vec");
  for (int k = 0; k < 13; ++k) {
    // Moments are sums of O(1) squared gradients: relative fp32 error ~1e-6.
    EXPECT_NEAR(moments[3].second.data<float>()[k], rv_vec[k], 1e-5 * (1 + rv_vec[k]));
  }
}

TEST(AdamWTest, FirstStepMovesEachWeightByLearningRate) {
  // With zero decay, step 1 is lr * g / (|g| + eps'): every weight moves by lr
  // against the sign of its gradient, whatever the gradient's size.
  OptimizerConfig oc = DefaultedOptimizer("optimizer { lr: 0.1 weight_decay: 0 }");
  Tensor w = Tensor::Zeros({4}, DType::kF32).value();
  Tensor g = Tensor::Empty({4}, DType::kF32).value();
  const float gs[4] = {3.f, -1e-3f, 50.f, -2.f};
  for (int k = 0; k < 4; ++k) g.data<float>()[k] = gs[k];
  auto opt = AdamW::Create(oc, {{"w", w, g}});
  ASSERT_TRUE(opt.ok());
  ASSERT_TRUE((*opt)->Step(0.1f).ok());
  for (int k = 0; k < 4; ++k) {
    // eps = 1e-8 against |g| >= 1e-3 shrinks the step by at most 1e-5 relative,
    // 1e-6 of lr = 0.1; fp32 rounding adds ~1e-8: 2e-6 absolute.
    EXPECT_NEAR(w.data<float>()[k], gs[k] > 0 ? -0.1f : 0.1f, 2e-6) << k;
  }
}

TEST(AdamWTest, DecayOnlyOnMatricesNotOptedOut) {
  // Zero gradients: the only change is the decay p * (1 - lr * wd).
  OptimizerConfig oc = DefaultedOptimizer("optimizer { lr: 0.5 weight_decay: 0.2 }");
  Tensor a = Tensor::Empty({2, 2}, DType::kF32).value();
  Tensor b = Tensor::Empty({2, 2}, DType::kF32).value();
  Tensor c = Tensor::Empty({4}, DType::kF32).value();
  Tensor zero = Tensor::Zeros({2, 2}, DType::kF32).value();
  Tensor zero4 = Tensor::Zeros({4}, DType::kF32).value();
  for (Tensor* t : {&a, &b, &c}) {
    for (int k = 0; k < 4; ++k) t->data<float>()[k] = 2.f;
  }
  auto opt = AdamW::Create(oc, {{"a", a, zero}, {"b", b, zero, /*decay=*/false}, {"c", c, zero4}});
  ASSERT_TRUE(opt.ok());
  ASSERT_TRUE((*opt)->Step(0.5f).ok());
  EXPECT_FLOAT_EQ(a.data<float>()[3], 2.f * (1.f - 0.5f * 0.2f));
  EXPECT_EQ(b.data<float>()[3], 2.f);
  EXPECT_EQ(c.data<float>()[3], 2.f);
}

TEST(AdamWTest, RejectsMismatchedOrDuplicateParameters) {
  OptimizerConfig oc = DefaultedOptimizer("");
  Tensor a = Tensor::Zeros({2, 3}, DType::kF32).value();
  Tensor b = Tensor::Zeros({3, 2}, DType::kF32).value();
  auto bad_shape = AdamW::Create(oc, {{"a", a, b}});
  EXPECT_EQ(bad_shape.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_shape.status().message().find("'a'"), std::string::npos);
  auto dup = AdamW::Create(oc, {{"a", a, a}, {"a", b, b}});
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  Tensor i = Tensor::Zeros({2, 3}, DType::kI32).value();
  EXPECT_FALSE(AdamW::Create(oc, {{"i", i, i}}).ok());
}

TEST(ScheduleTest, WarmupThenCosineToMinimum) {
  OptimizerConfig oc = DefaultedOptimizer(
      "optimizer { lr: 1e-3 min_lr: 1e-4 warmup_steps: 10 total_steps: 110 }");
  // Warm-up is linear and reaches the peak on its last step.
  EXPECT_FLOAT_EQ(ScheduledLearningRate(oc, 0), 1e-4f);
  EXPECT_FLOAT_EQ(ScheduledLearningRate(oc, 4), 5e-4f);
  EXPECT_FLOAT_EQ(ScheduledLearningRate(oc, 9), 1e-3f);
  // Cosine: peak at its start, midpoint half-way at step 60, minimum at the end.
  EXPECT_FLOAT_EQ(ScheduledLearningRate(oc, 10), 1e-3f);
  EXPECT_FLOAT_EQ(ScheduledLearningRate(oc, 60), 5.5e-4f);
  EXPECT_FLOAT_EQ(ScheduledLearningRate(oc, 35),
                  static_cast<float>(1e-4 + 0.45e-3 * (1 + std::cos(M_PI * 0.25))));
  EXPECT_FLOAT_EQ(ScheduledLearningRate(oc, 110), 1e-4f);
  EXPECT_FLOAT_EQ(ScheduledLearningRate(oc, 5000), 1e-4f);
  // Monotone after the warm-up.
  for (int s = 10; s < 110; ++s) {
    EXPECT_GE(ScheduledLearningRate(oc, s), ScheduledLearningRate(oc, s + 1)) << s;
  }
}

TEST(ScheduleTest, DefaultsFollowRunLength) {
  // min_lr defaults to lr / 10 and total_steps to run.steps.
  OptimizerConfig oc = DefaultedOptimizer("run { steps: 50 } optimizer { lr: 2e-3 }");
  EXPECT_FLOAT_EQ(ScheduledLearningRate(oc, 0), 2e-3f);  // no warm-up
  EXPECT_FLOAT_EQ(ScheduledLearningRate(oc, 50), 2e-4f);
}

TEST(ClipTest, GlobalNormAndScale) {
  Tensor a = Tensor::Empty({2, 2}, DType::kF32).value();
  Tensor b = Tensor::Empty({1}, DType::kF32).value();
  const float av[4] = {1.f, 2.f, 2.f, 0.f};  // sum of squares 9
  for (int k = 0; k < 4; ++k) a.data<float>()[k] = av[k];
  b.data<float>()[0] = 4.f;  // + 16 = 25
  std::vector<OptimizerParam> ps = {{"a", a, a}, {"b", b, b}};
  absl::StatusOr<double> norm = GlobalGradNorm(ps);
  ASSERT_TRUE(norm.ok());
  EXPECT_EQ(*norm, 5.0);  // exact: small integers
  EXPECT_FLOAT_EQ(ClipScale(*norm, 1.0), 0.2f);
  EXPECT_EQ(ClipScale(*norm, 5.0), 1.f);   // at the limit: untouched
  EXPECT_EQ(ClipScale(*norm, 10.0), 1.f);  // below: untouched
  EXPECT_EQ(ClipScale(*norm, 0.0), 1.f);   // 0 disables clipping
  // A non-finite norm is not clipped away (the caller must see it).
  EXPECT_EQ(ClipScale(std::nan(""), 1.0), 1.f);

  // Clipped step: the clipped gradient has norm max_norm, so the moments see
  // g * 0.2 and the second step differs from an unclipped one.
  OptimizerConfig oc = DefaultedOptimizer("optimizer { lr: 0.1 weight_decay: 0 }");
  Tensor w1 = Tensor::Zeros({2}, DType::kF32).value();
  Tensor g1 = Tensor::Empty({2}, DType::kF32).value();
  g1.data<float>()[0] = 3.f;
  g1.data<float>()[1] = 4.f;
  auto opt = AdamW::Create(oc, {{"w", w1, g1}});
  ASSERT_TRUE(opt.ok());
  ASSERT_TRUE((*opt)->Step(0.1f, ClipScale(5.0, 1.0)).ok());
  const float* m = (*opt)->moments()[0].second.data<float>();
  EXPECT_FLOAT_EQ(m[0], 0.1f * 3.f * 0.2f);
  EXPECT_FLOAT_EQ(m[1], 0.1f * 4.f * 0.2f);
}

}  // namespace
}  // namespace smat
