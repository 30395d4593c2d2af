// Tests of the CPU model ops (kernels/model_kernels.h): every forward against a
// naive double-precision reference written here, every backward against
// central finite differences of that reference in double, at odd sizes with
// random inputs and random upstream gradients (so a wrong transpose or a
// missing term cannot hide), plus the determinism the trainer relies on. The
// bf16, narrow linear and fused cases are in model_kernels_bf16_test.cc.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/model_kernels.h"
#include "tests/trainer/model_kernels_test_util.h"

namespace smat {
namespace model_kernels_test {
namespace {

using Fn = std::function<double(const std::vector<Vec>&)>;  // scalar of double inputs

double MaxAbs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(double{t.data<float>()[i]}));
  return m;
}

// Central differences of f with respect to every element of inputs[k]
// (h = 1e-6 in double: truncation O(h^2) and rounding O(1e-16 / h) are both
// far below the fp32 tolerance used against them).
Vec FiniteDifferences(const Fn& f, std::vector<Vec> inputs, size_t k) {
  constexpr double h = 1e-6;
  Vec g(inputs[k].size());
  for (size_t i = 0; i < g.size(); ++i) {
    const double x = inputs[k][i];
    inputs[k][i] = x + h;
    const double fp = f(inputs);
    inputs[k][i] = x - h;
    const double fm = f(inputs);
    inputs[k][i] = x;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

TEST_F(ModelKernelsTest, EmbeddingGathersAndScatterAddsInFixedOrder) {
  const int64_t V = 7, W = 5, N = 13;
  Tensor table = Randn({V, W}, 1);
  Tensor ids = *Tensor::Empty({N}, DType::kI32);
  SMAT_CHECK(FillUniformInt(ids, 3, 0, 0, V).ok());
  ids.data<int32_t>()[3] = ids.data<int32_t>()[9] = 2;  // a repeated id, summed twice
  Tensor out = Zeros({N, W});
  ASSERT_TRUE(mk_->EmbeddingForward(table, ids, out).ok());
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < W; ++j) {
      EXPECT_EQ(out.data<float>()[i * W + j], table.data<float>()[ids.data<int32_t>()[i] * W + j]);
    }
  }
  Tensor dy = Randn({N, W}, 2);
  Vec want(V * W, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < W; ++j) want[ids.data<int32_t>()[i] * W + j] += dy.data<float>()[i * W + j];
  }
  Tensor d1 = Zeros({V, W}), d2 = Zeros({V, W});
  ASSERT_TRUE(mk_->EmbeddingBackward(ids, dy, d1).ok());
  ASSERT_TRUE(mk_->EmbeddingBackward(ids, dy, d2).ok());
  ExpectClose(d1, want, "d_table");
  EXPECT_EQ(0, std::memcmp(d1.raw(), d2.raw(), d1.nbytes())) << "scatter-add is not deterministic";
  // Accumulates: a second call doubles it.
  ASSERT_TRUE(mk_->EmbeddingBackward(ids, dy, d1).ok());
  for (double& w : want) w *= 2;
  ExpectClose(d1, want, "d_table accumulated");
  ids.data<int32_t>()[4] = V;  // data error, not a crash
  EXPECT_EQ(mk_->EmbeddingForward(table, ids, out).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelKernelsTest, RmsNormMatchesReferenceAndFiniteDifferences) {
  const int64_t N = 9, W = 11;
  const float eps = 1e-6f;
  Tensor x = Randn({N, W}, 3), w = Randn({W}, 4), dy = Randn({N, W}, 5);
  auto ref = [&](const Vec& xv, const Vec& wv, int64_t i, int64_t j) {
    double ss = 0;
    for (int64_t k = 0; k < W; ++k) ss += xv[i * W + k] * xv[i * W + k];
    return xv[i * W + j] / std::sqrt(ss / W + eps) * wv[j];
  };
  Fn f = [&](const std::vector<Vec>& in) {
    double s = 0;
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < W; ++j) s += in[2][i * W + j] * ref(in[0], in[1], i, j);
    return s;
  };
  Tensor y = Zeros({N, W}), rstd = Zeros({N});
  ASSERT_TRUE(mk_->RmsNormForward(x, w, eps, y, rstd).ok());
  Vec want_y(N * W);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < W; ++j) want_y[i * W + j] = ref(ToVec(x), ToVec(w), i, j);
  ExpectClose(y, want_y, "y");
  Tensor dx = Zeros({N, W}), dw = Zeros({W});
  ASSERT_TRUE(mk_->RmsNormBackward(x, w, rstd, dy, dx, dw).ok());
  const std::vector<Vec> in = {ToVec(x), ToVec(w), ToVec(dy)};
  ExpectClose(dx, FiniteDifferences(f, in, 0), "dx");
  ExpectClose(dw, FiniteDifferences(f, in, 1), "dw");
}

TEST_F(ModelKernelsTest, SwiGluMatchesReferenceAndFiniteDifferences) {
  const int64_t N = 7, F = 13;
  Tensor a = Randn({N, F}, 6, 2.f), b = Randn({N, F}, 7), dy = Randn({N, F}, 8);
  auto silu = [](double v) { return v / (1 + std::exp(-v)); };
  Fn f = [&](const std::vector<Vec>& in) {
    double s = 0;
    for (int64_t i = 0; i < N * F; ++i) s += in[2][i] * silu(in[0][i]) * in[1][i];
    return s;
  };
  Tensor y = Zeros({N, F});
  ASSERT_TRUE(mk_->SwiGluForward(a, b, y).ok());
  Vec want(N * F);
  for (int64_t i = 0; i < N * F; ++i) want[i] = silu(a.data<float>()[i]) * b.data<float>()[i];
  ExpectClose(y, want, "y");
  Tensor da = Zeros({N, F}), db = Zeros({N, F});
  ASSERT_TRUE(mk_->SwiGluBackward(a, b, dy, da, db).ok());
  const std::vector<Vec> in = {ToVec(a), ToVec(b), ToVec(dy)};
  ExpectClose(da, FiniteDifferences(f, in, 0), "d_gate");
  ExpectClose(db, FiniteDifferences(f, in, 1), "d_up");
}

TEST_F(ModelKernelsTest, GatesMatchFiniteDifferences) {
  const int64_t N = 5, H = 3, r = 7;
  // -softplus, including large |x| where a naive log(1 + exp(x)) overflows.
  Tensor z = Randn({N, H}, 9, 4.f), dz = Randn({N, H}, 10);
  z.data<float>()[0] = 100.f;
  z.data<float>()[1] = -100.f;
  Tensor y = Zeros({N, H}), dx = Zeros({N, H});
  ASSERT_TRUE(mk_->NegSoftplusForward(z, y).ok());
  ASSERT_TRUE(mk_->NegSoftplusBackward(z, dz, dx).ok());
  auto nsp = [](double v) { return -std::log1p(std::exp(v)); };
  Vec want(N * H);
  for (int64_t i = 0; i < N * H; ++i) want[i] = nsp(z.data<float>()[i]);  // double: exp(100) is finite
  ExpectClose(y, want, "-softplus");
  Fn f1 = [&](const std::vector<Vec>& in) {
    double s = 0;
    for (int64_t i = 0; i < N * H; ++i) s += in[1][i] * nsp(in[0][i]);
    return s;
  };
  ExpectClose(dx, FiniteDifferences(f1, {ToVec(z), ToVec(dz)}, 0), "d -softplus");

  Tensor x = Randn({N, H, r}, 11), g = Randn({N, H}, 12, 2.f), dy = Randn({N, H, r}, 13);
  Tensor out = Zeros({N, H, r}), gx = Zeros({N, H, r}), gg = Zeros({N, H});
  ASSERT_TRUE(mk_->SigmoidScaleForward(x, g, out).ok());
  ASSERT_TRUE(mk_->SigmoidScaleBackward(x, g, dy, gx, gg).ok());
  Fn f2 = [&](const std::vector<Vec>& in) {
    double s = 0;
    for (int64_t i = 0; i < N * H; ++i)
      for (int64_t j = 0; j < r; ++j)
        s += in[2][i * r + j] * in[0][i * r + j] / (1 + std::exp(-in[1][i]));
    return s;
  };
  const std::vector<Vec> in = {ToVec(x), ToVec(g), ToVec(dy)};
  ExpectClose(gx, FiniteDifferences(f2, in, 0), "key gate dx");
  ExpectClose(gg, FiniteDifferences(f2, in, 1), "key gate dg");
}

TEST_F(ModelKernelsTest, SoftplusAndExpFeaturesMatchFiniteDifferences) {
  const int64_t M = 6, r = 7;
  Tensor x = Randn({M, r}, 25, 2.f), dy = Randn({M, r}, 26);
  auto sp = [](double v) { return std::log1p(std::exp(v)); };
  Tensor y = Zeros({M, r}), dx = Zeros({M, r});
  ASSERT_TRUE(mk_->SoftplusForward(x, y).ok());
  ASSERT_TRUE(mk_->SoftplusBackward(x, dy, dx).ok());
  Vec want(M * r);
  for (int64_t i = 0; i < M * r; ++i) want[i] = sp(x.data<float>()[i]);
  ExpectClose(y, want, "softplus");
  Fn f1 = [&](const std::vector<Vec>& in) {
    double s = 0;
    for (int64_t i = 0; i < M * r; ++i) s += in[1][i] * sp(in[0][i]);
    return s;
  };
  ExpectClose(dx, FiniteDifferences(f1, {ToVec(x), ToVec(dy)}, 0), "d softplus");

  // exp(x - rowmax): random rows have no ties, so the max is differentiable.
  auto ex = [&](const Vec& xv, int64_t i, int64_t j) {
    double mx = xv[i * r];
    for (int64_t k = 1; k < r; ++k) mx = std::max(mx, xv[i * r + k]);
    return std::exp(xv[i * r + j] - mx);
  };
  ASSERT_TRUE(mk_->ExpRowMaxForward(x, y).ok());
  ASSERT_TRUE(mk_->ExpRowMaxBackward(x, y, dy, dx).ok());
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < r; ++j) want[i * r + j] = ex(ToVec(x), i, j);
  ExpectClose(y, want, "exp features");
  Fn f2 = [&](const std::vector<Vec>& in) {
    double s = 0;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < r; ++j) s += in[1][i * r + j] * ex(in[0], i, j);
    return s;
  };
  ExpectClose(dx, FiniteDifferences(f2, {ToVec(x), ToVec(dy)}, 0), "d exp features");
}

// ELU_PLUS_ONE and RELU through ModelKernels: the same bits as the host loops
// of kernels/feature_map.h (which the trainer ran before, and which
// tests/kernels/feature_map_test.cc checks value by value), on random inputs
// with zeros, large magnitudes and exp underflow planted; in place; and the
// derivative against finite differences of the definition in double.
TEST_F(ModelKernelsTest, EluAndReluFeatureMapsEqualTheHostLoops) {
  const int64_t M = 7, r = 13, n = M * r;
  Tensor x = Randn({M, r}, 40, 3.f), dy = Randn({M, r}, 41);
  const float planted[] = {0.f, -0.f, 1e-30f, -1e-30f, 50.f, -50.f, -95.f, -110.f, 1e30f, -1e30f};
  std::memcpy(x.data<float>(), planted, sizeof(planted));
  auto clone = [](const Tensor& t) {
    Tensor c = *Tensor::Empty(t.shape(), t.dtype());
    std::memcpy(c.raw(), t.raw(), t.nbytes());
    return c;
  };
  for (FeatureMap f : {FeatureMap::kEluPlusOne, FeatureMap::kReluEps}) {
    SCOPED_TRACE(FeatureMapName(f));
    std::vector<float> want_y(n), want_dx(n);
    FeatureMapForward(f, x.data<float>(), want_y.data(), n);
    FeatureMapBackward(f, x.data<float>(), dy.data<float>(), want_dx.data(), n);
    Tensor y = Zeros({M, r}), dx = Zeros({M, r});
    ASSERT_TRUE(mk_->FeatureMapForward(f, x, y).ok());
    ASSERT_TRUE(mk_->FeatureMapBackward(f, x, dy, dx).ok());
    ASSERT_GT(MaxAbs(y), 0);
    ASSERT_GT(MaxAbs(dx), 0);
    EXPECT_EQ(std::memcmp(y.raw(), want_y.data(), y.nbytes()), 0) << "y";
    EXPECT_EQ(std::memcmp(dx.raw(), want_dx.data(), dx.nbytes()), 0) << "dx";
    // y may alias x, dx may alias dy.
    Tensor in_place = clone(x);
    ASSERT_TRUE(mk_->FeatureMapForward(f, in_place, in_place).ok());
    EXPECT_EQ(std::memcmp(in_place.raw(), want_y.data(), y.nbytes()), 0) << "y aliasing x";
    Tensor g = clone(dy);
    ASSERT_TRUE(mk_->FeatureMapBackward(f, x, g, g).ok());
    EXPECT_EQ(std::memcmp(g.raw(), want_dx.data(), dx.nbytes()), 0) << "dx aliasing dy";
  }
  // The definition, in double: values, and the derivative by finite
  // differences on random x (none within h of relu's kink at 0).
  const Tensor xr = Randn({M, r}, 42, 3.f);
  for (FeatureMap f : {FeatureMap::kEluPlusOne, FeatureMap::kReluEps}) {
    SCOPED_TRACE(FeatureMapName(f));
    const bool elu = f == FeatureMap::kEluPlusOne;
    auto phi = [elu](double v) {
      return elu ? (v > 0 ? v + 1 : std::exp(v)) : std::max(v, 0.0) + kReluFeatureFloor;
    };
    Tensor y = Zeros({M, r}), dx = Zeros({M, r});
    ASSERT_TRUE(mk_->FeatureMapForward(f, xr, y).ok());
    ASSERT_TRUE(mk_->FeatureMapBackward(f, xr, dy, dx).ok());
    Vec want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = phi(xr.data<float>()[i]);
    ExpectClose(y, want, "y");
    Fn fn = [&](const std::vector<Vec>& in) {
      double s = 0;
      for (int64_t i = 0; i < n; ++i) s += in[1][i] * phi(in[0][i]);
      return s;
    };
    ExpectClose(dx, FiniteDifferences(fn, {ToVec(xr), ToVec(dy)}, 0), "dx");
  }
  // Shapes, dtypes and the map are checked, naming the operand.
  Tensor y = Zeros({M, r}), dx = Zeros({M, r});
  Tensor wide = Zeros({M, r + 1}), ints = *Tensor::Zeros({M, r}, DType::kI32);
  auto expect_invalid = [](const absl::Status& s, const char* names) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find(names), std::string::npos) << s;
  };
  const FeatureMap elu = FeatureMap::kEluPlusOne, relu = FeatureMap::kReluEps;
  expect_invalid(mk_->FeatureMapForward(elu, x, wide), "FeatureMapForward: y");
  expect_invalid(mk_->FeatureMapForward(relu, ints, y), "FeatureMapForward: x");
  expect_invalid(mk_->FeatureMapBackward(elu, x, wide, dx), "FeatureMapBackward: dy");
  expect_invalid(mk_->FeatureMapBackward(relu, x, ints, dx), "FeatureMapBackward: dy");
  expect_invalid(mk_->FeatureMapBackward(relu, x, dy, wide), "FeatureMapBackward: dx");
  expect_invalid(mk_->FeatureMapBackward(elu, ints, dy, dx), "FeatureMapBackward: x");
  expect_invalid(mk_->FeatureMapForward(static_cast<FeatureMap>(2), x, y),
                 "FeatureMapForward: unknown feature map 2");
  expect_invalid(mk_->FeatureMapBackward(static_cast<FeatureMap>(-1), x, dy, dx),
                 "FeatureMapBackward: unknown feature map -1");
}

TEST_F(ModelKernelsTest, ShortConvIsCausalWithPrefixAndMatchesFiniteDifferences) {
  const int64_t nb = 2, L = 6, C = 5, K = kShortConvWidth;
  Tensor x = Randn({nb, L, C}, 14), pre = Randn({nb, K - 1, C}, 15), w = Randn({K, C}, 16);
  Tensor dy = Randn({nb, L, C}, 17);
  // Reference over the concatenation [prefix; x].
  auto ref = [&](const std::vector<Vec>& in, int64_t b, int64_t t, int64_t c) {
    double s = 0;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t src = t + j;  // index into [prefix (K-1 rows); x]
      const double v = src < K - 1 ? in[1][(b * (K - 1) + src) * C + c]
                                   : in[0][(b * L + src - (K - 1)) * C + c];
      s += in[2][j * C + c] * v;
    }
    return s;
  };
  Fn f = [&](const std::vector<Vec>& in) {
    double s = 0;
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t t = 0; t < L; ++t)
        for (int64_t c = 0; c < C; ++c) s += in[3][(b * L + t) * C + c] * ref(in, b, t, c);
    return s;
  };
  const std::vector<Vec> in = {ToVec(x), ToVec(pre), ToVec(w), ToVec(dy)};
  Tensor y = Zeros({nb, L, C});
  ASSERT_TRUE(mk_->ShortConvForward(x, pre, w, y).ok());
  Vec want(nb * L * C);
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t t = 0; t < L; ++t)
      for (int64_t c = 0; c < C; ++c) want[(b * L + t) * C + c] = ref(in, b, t, c);
  ExpectClose(y, want, "conv y");
  Tensor dx = Zeros({nb, L, C}), dp = Zeros({nb, K - 1, C}), dw = Zeros({K, C});
  ASSERT_TRUE(mk_->ShortConvBackward(x, pre, w, dy, dx, dp, dw).ok());
  ExpectClose(dx, FiniteDifferences(f, in, 0), "conv dx");
  ExpectClose(dp, FiniteDifferences(f, in, 1), "conv d_prefix");
  ExpectClose(dw, FiniteDifferences(f, in, 2), "conv dw");
  // Causality: changing the last row changes no earlier output.
  Tensor y2 = Zeros({nb, L, C});
  x.data<float>()[(L - 1) * C] += 1.f;
  ASSERT_TRUE(mk_->ShortConvForward(x, pre, w, y2).ok());
  for (int64_t i = 0; i < (L - 1) * C; ++i) EXPECT_EQ(y.data<float>()[i], y2.data<float>()[i]);
}

TEST_F(ModelKernelsTest, ChunkedCrossEntropyMatchesReferenceAndFiniteDifferences) {
  const int64_t N = 13, W = 6, V = 17;
  Tensor h = Randn({N, W}, 18), wh = Randn({V, W}, 19);
  Tensor tg = *Tensor::Empty({N}, DType::kI32);
  SMAT_CHECK(FillUniformInt(tg, 20, 0, 0, V).ok());
  Tensor wt = *Tensor::Empty({N}, DType::kF32);
  SMAT_CHECK(FillUniform(wt, 21, 0, 0.5f, 1.5f).ok());
  wt.data<float>()[4] = 0.f;
  tg.data<int32_t>()[4] = -5;  // masked rows may hold any target
  const float scale = 0.37f;
  Fn f = [&](const std::vector<Vec>& in) {
    double loss = 0;
    for (int64_t i = 0; i < N; ++i) {
      if (wt.data<float>()[i] == 0.f) continue;
      std::vector<double> lg(V);
      double mx = -1e300;
      for (int64_t v = 0; v < V; ++v) {
        lg[v] = 0;
        for (int64_t k = 0; k < W; ++k) lg[v] += in[0][i * W + k] * in[1][v * W + k];
        mx = std::max(mx, lg[v]);
      }
      double s = 0;
      for (double l : lg) s += std::exp(l - mx);
      loss += wt.data<float>()[i] * (mx + std::log(s) - lg[tg.data<int32_t>()[i]]);
    }
    return loss;
  };
  const std::vector<Vec> in = {ToVec(h), ToVec(wh)};
  const double want = f(in);
  for (int64_t chunk : {int64_t{1}, int64_t{5}, N, int64_t{100}}) {
    SCOPED_TRACE(chunk);
    Tensor lse = Zeros({N});
    double loss = 0;
    ASSERT_TRUE(mk_->CrossEntropyForward(cpu_, h, wh, tg, wt, chunk, lse, &loss).ok());
    // fp32 logits of W = 6 products each: relative error ~1e-6 per token.
    EXPECT_NEAR(loss, want, 1e-5 * std::fabs(want));
    Tensor dh = Zeros({N, W}), dw = Zeros({V, W});
    ASSERT_TRUE(mk_->CrossEntropyBackward(cpu_, h, wh, tg, wt, lse, scale, chunk, dh, dw).ok());
    Vec gh = FiniteDifferences(f, in, 0), gw = FiniteDifferences(f, in, 1);
    for (double& g : gh) g *= scale;
    for (double& g : gw) g *= scale;
    ExpectClose(dh, gh, "dh");
    ExpectClose(dw, gw, "d_w_head");
    for (int64_t k = 0; k < W; ++k) EXPECT_EQ(dh.data<float>()[4 * W + k], 0.f) << "masked row";
  }
  tg.data<int32_t>()[2] = V;  // a counted target outside the vocabulary is a data error
  Tensor lse = Zeros({N});
  double loss = 0;
  EXPECT_EQ(mk_->CrossEntropyForward(cpu_, h, wh, tg, wt, 4, lse, &loss).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelKernelsTest, ResidualAddAndSumOfSquares) {
  Tensor a = Randn({3, 7}, 22), b = Randn({3, 7}, 23), out = Zeros({3, 7});
  ASSERT_TRUE(mk_->ResidualAdd(a, b, out).ok());
  for (int i = 0; i < 21; ++i) {
    EXPECT_EQ(out.data<float>()[i], a.data<float>()[i] + b.data<float>()[i]);
  }
  Tensor c = Randn({5}, 24);
  double want = 0;
  for (const Tensor* t : {&a, &c}) {
    for (int64_t i = 0; i < t->numel(); ++i) want += double{t->data<float>()[i]} * t->data<float>()[i];
  }
  auto got = mk_->SumOfSquares({a, c});
  ASSERT_TRUE(got.ok());
  EXPECT_NEAR(*got, want, 1e-12 * want);  // double accumulation of exact fp32 squares
  EXPECT_GT(MaxAbs(a), 0);
}

// bf16 bits of f by the definition: the nearer of the two bf16 neighbours of
// f (truncation and the next value up in magnitude), the even one on a tie;
// compared in double, where both differences are exact.
uint16_t Bf16Reference(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t lo = static_cast<uint16_t>(u >> 16), hi = static_cast<uint16_t>(lo + 1);
  auto value = [](uint16_t b) {
    const uint32_t v = static_cast<uint32_t>(b) << 16;
    float x;
    std::memcpy(&x, &v, 4);
    return double{x};
  };
  // hi of the largest finite magnitude is infinity: value() handles it.
  const double dlo = std::fabs(double{f} - value(lo)), dhi = std::fabs(value(hi) - double{f});
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1u) == 0 ? lo : hi;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST_F(ModelKernelsTest, CastRoundsToNearestEvenAndKeepsNaN) {
  // Hand-picked cases: exact, just below / above / at the halfway point (ties
  // go to the even mantissa, both directions), overflow to infinity, signed
  // zero, infinities, and NaNs whose payload sits only in the low 16 bits
  // (plain truncation or rounding would turn them into infinity).
  const std::vector<std::pair<uint32_t, uint16_t>> cases = {
      {0x3f800000u, 0x3f80u},  // 1
      {0x3f807fffu, 0x3f80u},  // below half: down
      {0x3f808000u, 0x3f80u},  // tie, 0x3f80 even: down
      {0x3f808001u, 0x3f81u},  // above half: up
      {0x3f818000u, 0x3f82u},  // tie, 0x3f81 odd: up to even
      {0xbf818000u, 0xbf82u},  // the same, negative
      {0x7f7fffffu, 0x7f80u},  // largest float rounds to infinity
      {0x80000000u, 0x8000u},  // -0
      {0x7f800000u, 0x7f80u},  // +inf
      {0xff800000u, 0xff80u},  // -inf
      {0x00000001u, 0x0000u},  // smallest subnormal: rounds to +0
      {0x7fc00000u, 0x7fc0u},  // quiet NaN
      {0x7f800001u, 0x7fc0u},  // signalling NaN, payload in the low bits only
      {0xff800001u, 0xffc0u},  // negative NaN
  };
  const int64_t n = static_cast<int64_t>(cases.size()) + 1000;
  Tensor src = *Tensor::Empty({n}, DType::kF32);
  for (size_t i = 0; i < cases.size(); ++i) src.data<float>()[i] = FromBits(cases[i].first);
  // Random values over many binades, normal and subnormal.
  Tensor noise = Randn({1000}, 30);
  for (int64_t i = 0; i < 1000; ++i) {
    src.data<float>()[cases.size() + i] =
        std::ldexp(noise.data<float>()[i], static_cast<int>(i % 300) - 150);
  }
  Tensor dst = *Tensor::Empty({n}, DType::kBF16);
  ASSERT_TRUE(mk_->Cast(src, dst).ok());
  const uint16_t* b = static_cast<const uint16_t*>(dst.raw());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(b[i], cases[i].second) << "case " << i << " input 0x" << std::hex << cases[i].first;
  }
  int nonzero = 0;
  for (int64_t i = static_cast<int64_t>(cases.size()); i < n; ++i) {
    EXPECT_EQ(b[i], Bf16Reference(src.data<float>()[i])) << "element " << i;
    nonzero += (b[i] & 0x7fffu) != 0;
  }
  EXPECT_GT(nonzero, 500) << "the random inputs should mostly stay nonzero in bf16";

  // bf16 -> fp32 is exact (the bits shifted up), into a reshaped destination.
  Tensor back = *Tensor::Empty({n / 2, 2}, DType::kF32);
  ASSERT_EQ(n % 2, 0);
  ASSERT_TRUE(mk_->Cast(dst, back).ok());
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &back.data<float>()[i], 4);
    EXPECT_EQ(u, static_cast<uint32_t>(b[i]) << 16) << "element " << i;
  }
  // Same dtype: a copy.
  Tensor copy = *Tensor::Empty({n}, DType::kF32);
  ASSERT_TRUE(mk_->Cast(src, copy).ok());
  EXPECT_EQ(std::memcmp(copy.raw(), src.raw(), src.nbytes()), 0);
  // Element counts must match.
  Tensor short_dst = *Tensor::Empty({n - 1}, DType::kBF16);
  EXPECT_EQ(mk_->Cast(src, short_dst).code(), absl::StatusCode::kInvalidArgument);
}

// The loop of trainer/optimizer.cc (AdamW::Step), expression for expression.
void OptimizerLoop(float* w, const float* g, float* m, float* v, int64_t n, float grad_scale,
                   float fb1, float one_minus_b1, float fb2, float one_minus_b2, float eps,
                   float step_size, float inv_sqrt_bc2, float decay) {
  for (int64_t k = 0; k < n; ++k) {
    const float gk = g[k] * grad_scale;
    m[k] = fb1 * m[k] + one_minus_b1 * gk;
    v[k] = fb2 * v[k] + one_minus_b2 * gk * gk;
    const float denom = std::sqrt(v[k]) * inv_sqrt_bc2 + eps;
    w[k] = w[k] * decay - step_size * m[k] / denom;
  }
}

TEST_F(ModelKernelsTest, AdamWUpdateMatchesDoubleReferenceAndOptimizerBits) {
  const int64_t n = 1031;
  Tensor w = Randn({n}, 40), m = Zeros({n}), v = Zeros({n});
  Tensor w_loop = Randn({n}, 40), m_loop = Zeros({n}), v_loop = Zeros({n});
  const double lr = 3e-3, b1 = 0.9, b2 = 0.95, wd = 0.1;
  for (int t = 1; t <= 3; ++t) {
    SCOPED_TRACE(t);
    Tensor g = Randn({n}, 40 + t, 0.5f);
    ModelKernels::AdamWScalars s;
    s.grad_scale = t == 2 ? 0.25f : 1.f;  // a clipped step
    s.beta1 = static_cast<float>(b1);
    s.one_minus_beta1 = static_cast<float>(1.0 - b1);
    s.beta2 = static_cast<float>(b2);
    s.one_minus_beta2 = static_cast<float>(1.0 - b2);
    s.eps = 1e-8f;
    s.step_size = static_cast<float>(lr / (1.0 - std::pow(b1, t)));
    s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(b2, t)));
    s.decay = static_cast<float>(1.0 - lr * wd);
    const Vec w0 = ToVec(w), m0 = ToVec(m), v0 = ToVec(v);
    ASSERT_TRUE(mk_->AdamWUpdate(w, g, m, v, s).ok());
    // Double reference from the same fp32 inputs and scalars. A few fp32
    // roundings (unit 6e-8 each) separate the kernel from it, relative to the
    // magnitudes of the terms (m's two terms may cancel): m within 3 units of
    // its terms, v (no cancellation) within 4 of itself, the step within 6
    // units of itself plus m's error carried through, w within 2 units of its
    // terms plus the step's error.
    constexpr double u = 6e-8;
    for (int64_t k = 0; k < n; ++k) {
      const double gk = double{g.data<float>()[k]} * s.grad_scale;
      const double m_terms = std::fabs(double{s.beta1} * m0[k]) +
                             std::fabs(double{s.one_minus_beta1} * gk);
      const double mk = double{s.beta1} * m0[k] + double{s.one_minus_beta1} * gk;
      const double vk = double{s.beta2} * v0[k] + double{s.one_minus_beta2} * gk * gk;
      const double denom = std::sqrt(vk) * s.inv_sqrt_bc2 + s.eps;
      const double step = double{s.step_size} * mk / denom;
      const double wk = w0[k] * s.decay - step;
      const double m_tol = 3 * u * m_terms;
      const double step_tol = 6 * u * std::fabs(step) + s.step_size * m_tol / denom;
      ASSERT_NEAR(m.data<float>()[k], mk, m_tol) << "m " << k;
      ASSERT_NEAR(v.data<float>()[k], vk, 4 * u * vk) << "v " << k;
      ASSERT_NEAR(w.data<float>()[k], wk,
                  2 * u * (std::fabs(w0[k] * s.decay) + std::fabs(step)) + step_tol)
          << "w " << k;
    }
    OptimizerLoop(w_loop.data<float>(), g.data<float>(), m_loop.data<float>(),
                  v_loop.data<float>(), n, s.grad_scale, s.beta1, s.one_minus_beta1, s.beta2,
                  s.one_minus_beta2, s.eps, s.step_size, s.inv_sqrt_bc2, s.decay);
    EXPECT_EQ(std::memcmp(w.raw(), w_loop.raw(), w.nbytes()), 0) << "value bits";
    EXPECT_EQ(std::memcmp(m.raw(), m_loop.raw(), m.nbytes()), 0) << "m bits";
    EXPECT_EQ(std::memcmp(v.raw(), v_loop.raw(), v.nbytes()), 0) << "v bits";
  }
  EXPECT_GT(MaxAbs(m), 0);
  Tensor bad = Zeros({n + 1});
  EXPECT_EQ(mk_->AdamWUpdate(w, bad, m, v, {}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace model_kernels_test
}  // namespace smat
