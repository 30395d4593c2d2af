// Tests of the CPU model ops (kernels/model_kernels.h): every forward against a
// naive double-precision reference written here, every backward against
// central finite differences of that reference in double, at odd sizes with
// random inputs and random upstream gradients (so a wrong transpose or a
// missing term cannot hide), plus the determinism the trainer relies on.
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "core/rng.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/model_kernels.h"

namespace smat {
namespace {

using Vec = std::vector<double>;
using Fn = std::function<double(const std::vector<Vec>&)>;  // scalar of double inputs

Tensor Randn(Shape shape, uint64_t stream, float stddev = 1.f) {
  Tensor t = *Tensor::Empty(std::move(shape), DType::kF32);
  SMAT_CHECK(FillNormal(t, /*seed=*/11, 0, 0.f, stddev, stream).ok());
  return t;
}
Tensor Zeros(Shape shape) { return *Tensor::Zeros(std::move(shape), DType::kF32); }
Vec ToVec(const Tensor& t) {
  const float* p = t.data<float>();
  return Vec(p, p + t.numel());
}
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

// fp32 kernel output vs a double value: the kernels sum at most ~20 fp32
// products per element here (relative error <~ 20 * 6e-8 = 1.2e-6 of the
// largest term), so 1e-4 of the largest magnitude is a safe margin that still
// catches any wrong or missing term (an O(1) relative error).
void ExpectClose(const Tensor& got, const Vec& want, const char* what) {
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

}  // namespace
}  // namespace smat
