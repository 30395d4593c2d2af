// The CUDA model kernels (kernels/cuda/model_kernels_cuda.h) against the CPU
// implementation, the reference (kernels/cpu/model_kernels_cpu.cc), on random
// inputs at odd sizes (rows 1031, widths 389 and 1037, r = 61, V = 259 and
// 50257, chunks that do not divide the rows, rows with weight 0), outputs
// poisoned with NaN first so an unwritten element fails, parameter gradients
// that start non-zero (accumulation), the aliasing the interface allows, bad
// ids and targets, two runs bitwise equal. The caching allocator's test is in
// cuda_allocator_test.cc, the timing printout in model_kernels_timing_gpu_test.cc,
// the bf16 outputs and inputs, the narrow linear layer and the fused ops in
// model_kernels_bf16_gpu_test.cc.
//
// Comparisons. "Bitwise" where the kernel performs the CPU's fp32 operations
// in the CPU's order (embedding, residual add, short convolution outputs and
// input gradients, Cast, AdamW). "Close" elsewhere: within 1e-5 of the CPU
// value relative to the element, plus 1e-6 of the tensor's largest magnitude
// for elements that are differences of larger terms (the GPU sums in another
// fixed order, and its expf / log1pf differ from glibc's by an ulp); the
// parameter gradients summed over 1031 rows get 1e-5 of the largest magnitude.
// The ELU and ReLU feature maps are bitwise but for exp(x), compared in ulps
// (the reasoning is above their test).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/model_kernels.h"
#include "model_kernels_gpu_util.h"

namespace smat {
namespace gpu_test {
namespace {

// ------------------------------------------------------------------ element-wise

TEST_F(ModelKernelsGpuTest, ElementwiseOpsMatchCpu) {
  const int64_t N = 1031, F = 1037;
  const Tensor a = Random({N, F}, 1, 4.f), b = Random({N, F}, 2, 2.f), dy = Random({N, F}, 3);
  const Tensor da = Dev(a), db = Dev(b), ddy = Dev(dy);
  // SwiGLU forward / backward: close (expf).
  {
    Tensor y = *Tensor::Empty({N, F}, DType::kF32), dg = Clone(y), du = Clone(y);
    ASSERT_TRUE(cmk_->SwiGluForward(a, b, y).ok());
    ASSERT_TRUE(cmk_->SwiGluBackward(a, b, dy, dg, du).ok());
    Tensor gy = Poisoned({N, F}), gdg = Poisoned({N, F}), gdu = Poisoned({N, F});
    SMAT_ASSERT_OK(gmk_->SwiGluForward(da, db, gy));
    SMAT_ASSERT_OK(gmk_->SwiGluBackward(da, db, ddy, gdg, gdu));
    ExpectClose(Host(gy), y, 1e-5, 1e-6, "SwiGluForward y");
    ExpectClose(Host(gdg), dg, 1e-5, 1e-6, "SwiGluBackward d_gate");
    ExpectClose(Host(gdu), du, 1e-5, 1e-6, "SwiGluBackward d_up");
    // d_gate may alias dy (the CPU reads dy first; so does the kernel).
    Tensor alias = Dev(dy);
    Tensor gdu2 = Poisoned({N, F});
    SMAT_ASSERT_OK(gmk_->SwiGluBackward(da, db, alias, alias, gdu2));
    ExpectSameBits(Host(alias), Host(gdg), "SwiGluBackward with d_gate aliasing dy");
    // Repeatable.
    Tensor gy2 = Poisoned({N, F});
    SMAT_ASSERT_OK(gmk_->SwiGluForward(da, db, gy2));
    ExpectSameBits(Host(gy2), Host(gy), "SwiGluForward");
  }
  // Residual add: bitwise, also in place (out aliases a) and on views that
  // are not 16-byte aligned (the scalar path).
  {
    Tensor out = *Tensor::Empty({N, F}, DType::kF32);
    ASSERT_TRUE(cmk_->ResidualAdd(a, b, out).ok());
    Tensor gout = Poisoned({N, F});
    SMAT_ASSERT_OK(gmk_->ResidualAdd(da, db, gout));
    ExpectBitwise(Host(gout), out, "ResidualAdd");
    Tensor inplace = Dev(a);
    SMAT_ASSERT_OK(gmk_->ResidualAdd(inplace, db, inplace));
    ExpectBitwise(Host(inplace), out, "ResidualAdd in place");
    const int64_t m = N * F - 3;
    Tensor va = da.View(1, {m}), vb = db.View(3, {m}), vout = Poisoned({m + 2}).View(2, {m});
    SMAT_ASSERT_OK(gmk_->ResidualAdd(va, vb, vout));
    Tensor hva = Host(va), hvb = Host(vb), want = *Tensor::Empty({m}, DType::kF32);
    ASSERT_TRUE(cmk_->ResidualAdd(hva, hvb, want).ok());
    ExpectBitwise(Host(vout), want, "ResidualAdd on unaligned views");
  }
  // Softplus and its negation, forward in place (y aliases x) and backward.
  for (bool negate : {true, false}) {
    SCOPED_TRACE(negate ? "NegSoftplus" : "Softplus");
    Tensor y = *Tensor::Empty({N, F}, DType::kF32), dx = Clone(y);
    Tensor gy = Dev(a), gdx = Poisoned({N, F});
    if (negate) {
      ASSERT_TRUE(cmk_->NegSoftplusForward(a, y).ok());
      ASSERT_TRUE(cmk_->NegSoftplusBackward(a, dy, dx).ok());
      SMAT_ASSERT_OK(gmk_->NegSoftplusForward(gy, gy));
      SMAT_ASSERT_OK(gmk_->NegSoftplusBackward(da, ddy, gdx));
    } else {
      ASSERT_TRUE(cmk_->SoftplusForward(a, y).ok());
      ASSERT_TRUE(cmk_->SoftplusBackward(a, dy, dx).ok());
      SMAT_ASSERT_OK(gmk_->SoftplusForward(gy, gy));
      SMAT_ASSERT_OK(gmk_->SoftplusBackward(da, ddy, gdx));
    }
    ExpectClose(Host(gy), y, 1e-5, 0, "softplus y (in place)");
    ExpectClose(Host(gdx), dx, 1e-5, 0, "softplus dx");
    // dx may alias dy.
    Tensor alias = Dev(dy);
    if (negate) {
      SMAT_ASSERT_OK(gmk_->NegSoftplusBackward(da, alias, alias));
    } else {
      SMAT_ASSERT_OK(gmk_->SoftplusBackward(da, alias, alias));
    }
    ExpectSameBits(Host(alias), Host(gdx), "softplus backward with dx aliasing dy");
  }
  // Shapes are checked and name the operand.
  Tensor wrong = Poisoned({N, F - 1});
  const absl::Status s = gmk_->SwiGluForward(da, db, wrong);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("SwiGluForward: y"), std::string::npos) << s;
  const absl::Status host_input = gmk_->ResidualAdd(a, db, wrong);
  EXPECT_EQ(host_input.code(), absl::StatusCode::kInvalidArgument) << host_input;
}

TEST_F(ModelKernelsGpuTest, GatesAndExpFeatureMapMatchCpu) {
  const int64_t N = 1031, H = 3, r = 61;
  const Tensor x = Random({N, H, r}, 4, 3.f), g = Random({N, H}, 5, 4.f), dy = Random({N, H, r}, 6);
  const Tensor dx_ = Dev(x), dg_ = Dev(g), ddy = Dev(dy);
  {
    Tensor y = *Tensor::Empty({N, H, r}, DType::kF32), dx = Clone(y);
    Tensor dg = *Tensor::Empty({N, H}, DType::kF32);
    ASSERT_TRUE(cmk_->SigmoidScaleForward(x, g, y).ok());
    ASSERT_TRUE(cmk_->SigmoidScaleBackward(x, g, dy, dx, dg).ok());
    Tensor gy = Dev(x);  // y aliases x
    SMAT_ASSERT_OK(gmk_->SigmoidScaleForward(gy, dg_, gy));
    ExpectClose(Host(gy), y, 1e-5, 0, "SigmoidScaleForward y (in place)");
    Tensor gdx = Poisoned({N, H, r}), gdg = Poisoned({N, H});
    SMAT_ASSERT_OK(gmk_->SigmoidScaleBackward(dx_, dg_, ddy, gdx, gdg));
    ExpectClose(Host(gdx), dx, 1e-5, 0, "SigmoidScaleBackward dx");
    ExpectClose(Host(gdg), dg, 1e-5, 1e-6, "SigmoidScaleBackward dg");
  }
  {
    const Tensor x2 = x.View(0, {N * H, r}), dy2 = dy.View(0, {N * H, r});
    const Tensor gx2 = dx_.View(0, {N * H, r}), gdy2 = ddy.View(0, {N * H, r});
    Tensor y = *Tensor::Empty({N * H, r}, DType::kF32), dx = Clone(y);
    ASSERT_TRUE(cmk_->ExpRowMaxForward(x2, y).ok());
    ASSERT_TRUE(cmk_->ExpRowMaxBackward(x2, y, dy2, dx).ok());
    Tensor gy = Poisoned({N * H, r}), gdx = Poisoned({N * H, r});
    SMAT_ASSERT_OK(gmk_->ExpRowMaxForward(gx2, gy));
    ExpectClose(Host(gy), y, 1e-5, 0, "ExpRowMaxForward y");
    // Backward from the CPU's y, so only the backward's own rounding differs.
    SMAT_ASSERT_OK(gmk_->ExpRowMaxBackward(gx2, Dev(y), gdy2, gdx));
    ExpectClose(Host(gdx), dx, 1e-5, 1e-6, "ExpRowMaxBackward dx");
    Tensor gdx2 = Poisoned({N * H, r});
    SMAT_ASSERT_OK(gmk_->ExpRowMaxBackward(gx2, Dev(y), gdy2, gdx2));
    ExpectSameBits(Host(gdx2), Host(gdx), "ExpRowMaxBackward");
  }
}

// ------------------------------------------------------------------ ELU / ReLU feature maps

// Distance between two floats in representable values: the number of fp32
// values from one to the other (+0 and -0 count as one value); NaN is as far as
// can be from everything, so an unwritten (NaN-poisoned) element fails.
int64_t UlpDistance(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<int64_t>::max();
  auto ordered = [](float v) {
    int32_t i;
    std::memcpy(&i, &v, sizeof(i));
    return i < 0 ? -int64_t{i & 0x7fffffff} : int64_t{i};
  };
  const int64_t d = ordered(a) - ordered(b);
  return d < 0 ? -d : d;
}

uint32_t Bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
}

// x over every regime of the two maps: [-8, 8] (projected queries and keys),
// [-110, 0] (exp's gradual underflow, y subnormal for x in [-103.9, -87.4],
// and y = 0 below), magnitudes 1e-30 .. 1e30 of both signs, and planted zeros
// of both signs, subnormals, the ends of exp's normal range and infinities.
std::vector<float> FeatureMapInputs(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.f, 1.f), deep(-110.f, 0.f), decade(-30.f, 30.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (i % 4 == 2) {
      v[i] = deep(rng);
    } else if (i % 4 == 3) {
      v[i] = std::copysign(std::pow(10.f, decade(rng)), unit(rng));
    } else {
      v[i] = 8.f * unit(rng);
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  const float tiny = std::numeric_limits<float>::denorm_min();
  const float least_normal = std::numeric_limits<float>::min();
  const float planted[] = {0.f,     -0.f,    tiny,   -tiny,   least_normal, -least_normal,
                           1e-8f,   -1e-8f,  1.f,    -1.f,    88.f,         -87.3f,
                           -87.4f,  -100.f,  -103.9f, -104.f, -150.f,       1e30f,
                           -1e30f,  inf,     -inf};
  SMAT_CHECK(n >= static_cast<int64_t>(std::size(planted)));
  std::copy(std::begin(planted), std::end(planted), v.begin());
  return v;
}

// +-2^k, k in [-8, 8]: a product with such a factor is exact (or, where it
// underflows, rounded monotonically), so it keeps the ulp distance of the
// other factor.
std::vector<float> SignedPowersOfTwo(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> exponent(-8, 8), sign(0, 1);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& d : v) d = std::ldexp(sign(rng) ? 1.f : -1.f, exponent(rng));
  return v;
}

// ELU_PLUS_ONE and RELU against the CPU method (the host loops of
// kernels/feature_map.h). Tolerances: every fp32 operation of the host loops
// is repeated unfused on the GPU, so all is bitwise except where kEluPlusOne
// takes exp(x) (x <= 0). There CUDA's expf is within 2 ulp of exp(x)
// (CUDA Math API, no fast math) and glibc's expf within 0.502 ulp, so within
// a binade the two floats are at most 2 values apart: y within 2 ulp, and dx
// within 2 ulp for power-of-two dy where y is normal. For any dy, dx = dy *
// expf(x) rounded once, so it equals (bitwise) dy times the GPU's own forward
// y, rounded here.
TEST_F(ModelKernelsGpuTest, EluAndReluFeatureMapsMatchCpu) {
  const int64_t N = 1031, r = 61, n = N * r;  // n % 4 = 3: the vector path has a tail
  const Tensor x = HostTensor({N, r}, DType::kF32, FeatureMapInputs(n, 20));
  const Tensor dy = Random({N, r}, 21, 2.f);
  const Tensor dy2 = HostTensor({N, r}, DType::kF32, SignedPowersOfTwo(n, 22));
  const Tensor gx = Dev(x), gdy = Dev(dy), gdy2 = Dev(dy2);
  const float* xv = x.data<float>();
  for (FeatureMap f : {FeatureMap::kEluPlusOne, FeatureMap::kReluEps}) {
    SCOPED_TRACE(FeatureMapName(f));
    Tensor y = *Tensor::Empty({N, r}, DType::kF32), dx = Clone(y), dx2 = Clone(y);
    ASSERT_TRUE(cmk_->FeatureMapForward(f, x, y).ok());
    ASSERT_TRUE(cmk_->FeatureMapBackward(f, x, dy, dx).ok());
    ASSERT_TRUE(cmk_->FeatureMapBackward(f, x, dy2, dx2).ok());
    Tensor gy = Poisoned({N, r}), gdx = Poisoned({N, r}), gdx2 = Poisoned({N, r});
    SMAT_ASSERT_OK(gmk_->FeatureMapForward(f, gx, gy));
    SMAT_ASSERT_OK(gmk_->FeatureMapBackward(f, gx, gdy, gdx));
    SMAT_ASSERT_OK(gmk_->FeatureMapBackward(f, gx, gdy2, gdx2));
    const Tensor hy = Host(gy), hdx = Host(gdx), hdx2 = Host(gdx2);
    if (f == FeatureMap::kReluEps) {
      ExpectBitwise(hy, y, "relu y");
      ExpectBitwise(hdx, dx, "relu dx");
      ExpectBitwise(hdx2, dx2, "relu dx (power-of-two dy)");
    } else {
      const float* cy = y.data<float>();
      const float* cdx = dx.data<float>();
      const float* cdx2 = dx2.data<float>();
      const float* gyv = hy.data<float>();
      const float* gdxv = hdx.data<float>();
      const float* gdx2v = hdx2.data<float>();
      const float* dyv = dy.data<float>();
      const float* dy2v = dy2.data<float>();
      int64_t linear = 0, exponential = 0, subnormal = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (xv[i] > 0.f) {  // x + 1 and dy: the CPU's bits
          ++linear;
          ASSERT_EQ(Bits(gyv[i]), Bits(cy[i])) << "y at x = " << xv[i] << ": " << gyv[i];
          ASSERT_EQ(Bits(gdxv[i]), Bits(cdx[i])) << "dx at x = " << xv[i] << ": " << gdxv[i];
          ASSERT_EQ(Bits(gdx2v[i]), Bits(cdx2[i])) << "dx at x = " << xv[i];
          continue;
        }
        ++exponential;
        if (cy[i] > 0.f && cy[i] < std::numeric_limits<float>::min()) ++subnormal;
        ASSERT_LE(UlpDistance(gyv[i], cy[i]), 2)
            << "y = exp(" << xv[i] << "): GPU " << gyv[i] << ", CPU " << cy[i];
        // Scaling a subnormal y up by dy = 2^k multiplies its ulp distance
        // (the subnormal's ulp is coarser than the product's), so the
        // distance to the CPU holds only for normal y; the GPU's own
        // forward value times dy is exact everywhere.
        if (std::fabs(cy[i]) >= std::numeric_limits<float>::min()) {
          ASSERT_LE(UlpDistance(gdx2v[i], cdx2[i]), 2)
              << "dx at x = " << xv[i] << ": GPU " << gdx2v[i] << ", CPU " << cdx2[i];
        }
        const float want2 = dy2v[i] * gyv[i];
        ASSERT_EQ(Bits(gdx2v[i]), Bits(want2))
            << "dx at x = " << xv[i] << ": " << gdx2v[i] << ", dy * y = " << want2;
        const float want = dyv[i] * gyv[i];  // one fp32 product, as the kernel
        ASSERT_EQ(Bits(gdxv[i]), Bits(want))
            << "dx at x = " << xv[i] << ": " << gdxv[i] << ", dy * y = " << want;
      }
      // Both branches and exp's gradual underflow were exercised.
      ASSERT_GT(linear, n / 4);
      ASSERT_GT(exponential, n / 4);
      ASSERT_GT(subnormal, 100);
      ASSERT_GT(MaxAbs(hy), 0);
      ASSERT_GT(MaxAbs(hdx), 0);
    }
    // Repeatable.
    Tensor gy_again = Poisoned({N, r}), gdx_again = Poisoned({N, r});
    SMAT_ASSERT_OK(gmk_->FeatureMapForward(f, gx, gy_again));
    SMAT_ASSERT_OK(gmk_->FeatureMapBackward(f, gx, gdy, gdx_again));
    ExpectSameBits(Host(gy_again), hy, "FeatureMapForward y");
    ExpectSameBits(Host(gdx_again), hdx, "FeatureMapBackward dx");
    // y may alias x, dx may alias dy.
    Tensor in_place = Dev(x);
    SMAT_ASSERT_OK(gmk_->FeatureMapForward(f, in_place, in_place));
    ExpectSameBits(Host(in_place), hy, "FeatureMapForward with y aliasing x");
    Tensor alias = Dev(dy);
    SMAT_ASSERT_OK(gmk_->FeatureMapBackward(f, gx, alias, alias));
    ExpectSameBits(Host(alias), hdx, "FeatureMapBackward with dx aliasing dy");
    // Views that are not 16-byte aligned take the scalar path: the same
    // function, so the same bits as the matching elements above.
    const int64_t m = n - 3;
    Tensor vy = Poisoned({m + 2}).View(2, {m}), vdx = Poisoned({m + 2}).View(2, {m});
    SMAT_ASSERT_OK(gmk_->FeatureMapForward(f, gx.View(1, {m}), vy));
    SMAT_ASSERT_OK(gmk_->FeatureMapBackward(f, gx.View(1, {m}), gdy.View(1, {m}), vdx));
    EXPECT_EQ(std::memcmp(Host(vy).raw(), hy.data<float>() + 1, m * sizeof(float)), 0)
        << "FeatureMapForward on unaligned views";
    EXPECT_EQ(std::memcmp(Host(vdx).raw(), hdx.data<float>() + 1, m * sizeof(float)), 0)
        << "FeatureMapBackward on unaligned views";
  }
  // Operands are checked and named; so is the map.
  Tensor wrong = Poisoned({N, r - 1}), gy = Poisoned({N, r});
  const FeatureMap elu = FeatureMap::kEluPlusOne;
  const absl::Status s = gmk_->FeatureMapForward(elu, gx, wrong);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("FeatureMapForward: y"), std::string::npos) << s;
  const absl::Status host_x = gmk_->FeatureMapForward(elu, x, gy);
  EXPECT_EQ(host_x.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(host_x.message()).find("FeatureMapForward: x"), std::string::npos)
      << host_x;
  const absl::Status bad_dy = gmk_->FeatureMapBackward(elu, gx, wrong, gy);
  EXPECT_EQ(bad_dy.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad_dy.message()).find("FeatureMapBackward: dy"), std::string::npos)
      << bad_dy;
  const absl::Status bad_map = gmk_->FeatureMapForward(static_cast<FeatureMap>(2), gx, gy);
  EXPECT_EQ(bad_map.code(), absl::StatusCode::kInvalidArgument) << bad_map;
}

// ------------------------------------------------------------------ RMSNorm

TEST_F(ModelKernelsGpuTest, RmsNormMatchesCpuAndAccumulatesWeightGradient) {
  const int64_t N = 1031, W = 389;
  const Tensor x = Random({N, W}, 7, 2.f), w = Random({W}, 8), dy = Random({N, W}, 9);
  const Tensor dw0 = Random({W}, 10);  // a gradient that starts non-zero
  Tensor y = *Tensor::Empty({N, W}, DType::kF32), rstd = *Tensor::Empty({N}, DType::kF32);
  Tensor dx = Clone(y), dw = Clone(dw0);
  ASSERT_TRUE(cmk_->RmsNormForward(x, w, 1e-6f, y, rstd).ok());
  ASSERT_TRUE(cmk_->RmsNormBackward(x, w, rstd, dy, dx, dw).ok());
  const Tensor gx = Dev(x), gw = Dev(w), gdyv = Dev(dy);
  Tensor gy = Poisoned({N, W}), grstd = Poisoned({N});
  SMAT_ASSERT_OK(gmk_->RmsNormForward(gx, gw, 1e-6f, gy, grstd));
  // rstd: the same double formula, the sum of squares in another order: the
  // fp32 results agree to an ulp.
  ExpectClose(Host(grstd), rstd, 2.4e-7, 0, "RmsNormForward rstd");
  ExpectClose(Host(gy), y, 4e-7, 0, "RmsNormForward y");
  Tensor gdx = Poisoned({N, W}), gdw = Dev(dw0);
  SMAT_ASSERT_OK(gmk_->RmsNormBackward(gx, gw, Dev(rstd), gdyv, gdx, gdw));
  ExpectClose(Host(gdx), dx, 1e-5, 1e-6, "RmsNormBackward dx");
  ExpectClose(Host(gdw), dw, 1e-5, 1e-5, "RmsNormBackward d_weight (+=)");
  // Repeatable, and dx may not alias dy.
  Tensor gdx2 = Poisoned({N, W}), gdw2 = Dev(dw0);
  SMAT_ASSERT_OK(gmk_->RmsNormBackward(gx, gw, Dev(rstd), gdyv, gdx2, gdw2));
  ExpectSameBits(Host(gdx2), Host(gdx), "RmsNormBackward dx");
  ExpectSameBits(Host(gdw2), Host(gdw), "RmsNormBackward d_weight");
  Tensor alias = Dev(dy);
  EXPECT_EQ(gmk_->RmsNormBackward(gx, gw, Dev(rstd), alias, alias, gdw2).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor bad_w = Poisoned({W + 1});
  const absl::Status s = gmk_->RmsNormForward(gx, bad_w, 1e-6f, gy, grstd);
  EXPECT_NE(std::string(s.message()).find("RmsNormForward: weight"), std::string::npos) << s;
}

// ------------------------------------------------------------------ short convolution

TEST_F(ModelKernelsGpuTest, ShortConvMatchesCpu) {
  constexpr int64_t K = kShortConvWidth;
  const int64_t nb = 3, L = 347, C = 389;
  const Tensor x = Random({nb, L, C}, 11), prefix = Random({nb, K - 1, C}, 12);
  const Tensor w = Random({K, C}, 13), dy = Random({nb, L, C}, 14), dw0 = Random({K, C}, 15);
  Tensor y = *Tensor::Empty({nb, L, C}, DType::kF32), dx = Clone(y);
  Tensor dp = *Tensor::Empty({nb, K - 1, C}, DType::kF32), dw = Clone(dw0);
  ASSERT_TRUE(cmk_->ShortConvForward(x, prefix, w, y).ok());
  ASSERT_TRUE(cmk_->ShortConvBackward(x, prefix, w, dy, dx, dp, dw).ok());
  const Tensor gx = Dev(x), gp = Dev(prefix), gw = Dev(w), gdyv = Dev(dy);
  Tensor gy = Poisoned({nb, L, C});
  SMAT_ASSERT_OK(gmk_->ShortConvForward(gx, gp, gw, gy));
  ExpectBitwise(Host(gy), y, "ShortConvForward y");
  Tensor gdx = Poisoned({nb, L, C}), gdp = Poisoned({nb, K - 1, C}), gdw = Dev(dw0);
  SMAT_ASSERT_OK(gmk_->ShortConvBackward(gx, gp, gw, gdyv, gdx, gdp, gdw));
  ExpectBitwise(Host(gdx), dx, "ShortConvBackward dx");
  ExpectBitwise(Host(gdp), dp, "ShortConvBackward d_prefix");
  // d_w sums nb * L = 1041 rows in two stages instead of one running sum.
  ExpectClose(Host(gdw), dw, 1e-5, 1e-5, "ShortConvBackward d_w (+=)");
  Tensor gdw2 = Dev(dw0), gdx2 = Poisoned({nb, L, C}), gdp2 = Poisoned({nb, K - 1, C});
  SMAT_ASSERT_OK(gmk_->ShortConvBackward(gx, gp, gw, gdyv, gdx2, gdp2, gdw2));
  ExpectSameBits(Host(gdw2), Host(gdw), "ShortConvBackward d_w");
}

// The float4 path (C % 4 == 0, aligned), with runs that end inside a sequence,
// exactly at the lookahead boundary (L = 19) and sequences shorter than the
// halo (L = 1, 2: every tap reaches into the prefix); then the scalar path on
// an x that is not 16-byte aligned.
TEST_F(ModelKernelsGpuTest, ShortConvMatchesCpuVectorizedAndShortSequences) {
  constexpr int64_t K = kShortConvWidth;
  struct Case {
    int64_t nb, L, C;
    bool unaligned_x;
  };
  for (const Case& k : {Case{2, 37, 132, false}, Case{3, 19, 8, false}, Case{3, 2, 12, false},
                        Case{2, 1, 4, false}, Case{2, 37, 132, true}}) {
    SCOPED_TRACE("nb " + std::to_string(k.nb) + ", L " + std::to_string(k.L) + ", C " +
                 std::to_string(k.C) + (k.unaligned_x ? ", x unaligned" : ""));
    const int64_t nb = k.nb, L = k.L, C = k.C, n = nb * L * C;
    const Tensor xflat = Random({n + 1}, 16);
    Tensor x = *Tensor::Empty({nb, L, C}, DType::kF32);
    std::memcpy(x.raw(), xflat.data<float>() + 1, n * sizeof(float));
    const Tensor prefix = Random({nb, K - 1, C}, 17), w = Random({K, C}, 18);
    const Tensor dy = Random({nb, L, C}, 19), dw0 = Random({K, C}, 20);
    Tensor y = *Tensor::Empty({nb, L, C}, DType::kF32), dx = Clone(y);
    Tensor dp = *Tensor::Empty({nb, K - 1, C}, DType::kF32), dw = Clone(dw0);
    ASSERT_TRUE(cmk_->ShortConvForward(x, prefix, w, y).ok());
    ASSERT_TRUE(cmk_->ShortConvBackward(x, prefix, w, dy, dx, dp, dw).ok());
    const Tensor gxflat = Dev(xflat);
    const Tensor gx = k.unaligned_x ? gxflat.View(1, {nb, L, C}) : Dev(x);
    const Tensor gp = Dev(prefix), gw = Dev(w), gdyv = Dev(dy);
    Tensor gy = Poisoned({nb, L, C});
    SMAT_ASSERT_OK(gmk_->ShortConvForward(gx, gp, gw, gy));
    ExpectBitwise(Host(gy), y, "ShortConvForward y");
    Tensor gdx = Poisoned({nb, L, C}), gdp = Poisoned({nb, K - 1, C}), gdw = Dev(dw0);
    SMAT_ASSERT_OK(gmk_->ShortConvBackward(gx, gp, gw, gdyv, gdx, gdp, gdw));
    ExpectBitwise(Host(gdx), dx, "ShortConvBackward dx");
    ExpectBitwise(Host(gdp), dp, "ShortConvBackward d_prefix");
    ExpectClose(Host(gdw), dw, 1e-5, 1e-5, "ShortConvBackward d_w (+=)");
  }
}

// ------------------------------------------------------------------ embedding

TEST_F(ModelKernelsGpuTest, EmbeddingMatchesCpuBitwise) {
  const int64_t V = 259, N = 1031;
  for (int64_t W : {int64_t{389}, int64_t{384}}) {  // scalar and float4 gathers
    SCOPED_TRACE(W);
    const Tensor table = Random({V, W}, 16), ids = Ids(N, V, 17), d_out = Random({N, W}, 18);
    const Tensor d_table0 = Random({V, W}, 19);  // accumulates onto existing values
    Tensor out = *Tensor::Empty({N, W}, DType::kF32), d_table = Clone(d_table0);
    ASSERT_TRUE(cmk_->EmbeddingForward(table, ids, out).ok());
    ASSERT_TRUE(cmk_->EmbeddingBackward(ids, d_out, d_table).ok());
    const Tensor gtable = Dev(table), gids = Dev(ids), gd_out = Dev(d_out);
    Tensor gout = Poisoned({N, W});
    SMAT_ASSERT_OK(gmk_->EmbeddingForward(gtable, gids, gout));
    ExpectBitwise(Host(gout), out, "EmbeddingForward");
    // Every id's rows are added in increasing row order from the existing
    // value, as the CPU does: the same bits.
    Tensor gd_table = Dev(d_table0);
    SMAT_ASSERT_OK(gmk_->EmbeddingBackward(gids, gd_out, gd_table));
    ExpectBitwise(Host(gd_table), d_table, "EmbeddingBackward");
  }
  // Ids outside [0, V): InvalidArgument with the CPU's message, and the
  // gradient is left as it was.
  const int64_t W = 389;
  const Tensor table = Random({V, W}, 16), d_out = Random({N, W}, 18);
  for (int32_t bad : {int32_t{-1}, static_cast<int32_t>(V)}) {
    SCOPED_TRACE(bad);
    Tensor ids = Ids(N, V, 17);
    ids.data<int32_t>()[700] = bad;
    ids.data<int32_t>()[900] = bad;
    Tensor out = *Tensor::Empty({N, W}, DType::kF32), d_table = Random({V, W}, 19);
    const absl::Status cpu_f = cmk_->EmbeddingForward(table, ids, out);
    const absl::Status cpu_b = cmk_->EmbeddingBackward(ids, d_out, d_table);
    Tensor gout = Poisoned({N, W});
    const Tensor d_table0 = Random({V, W}, 19);
    Tensor gd_table = Dev(d_table0);
    const absl::Status gpu_f = gmk_->EmbeddingForward(Dev(table), Dev(ids), gout);
    const absl::Status gpu_b = gmk_->EmbeddingBackward(Dev(ids), Dev(d_out), gd_table);
    EXPECT_EQ(gpu_f.code(), absl::StatusCode::kInvalidArgument) << gpu_f;
    EXPECT_EQ(gpu_b.code(), absl::StatusCode::kInvalidArgument) << gpu_b;
    EXPECT_EQ(gpu_f.message(), cpu_f.message());
    EXPECT_EQ(gpu_b.message(), cpu_b.message());
    EXPECT_NE(std::string(gpu_f.message()).find("at row 700"), std::string::npos) << gpu_f;
    ExpectBitwise(Host(gd_table), d_table0, "d_table after a bad id");
  }
}

// ------------------------------------------------------------------ cross-entropy

void CrossEntropyCase(ModelKernelsGpuTest* t, Backend& cpu, Backend& gpu, ModelKernels& cmk,
                      ModelKernels& gmk, int64_t N, int64_t W, int64_t V, int64_t chunk) {
  SCOPED_TRACE(testing::Message() << "N " << N << " V " << V << " chunk " << chunk);
  std::vector<float> hv = RandomUniform(N * W, 20), wv = RandomUniform(V * W, 21);
  const Tensor h = HostTensor({N, W}, DType::kF32, hv);
  for (float& x : wv) x *= 0.2f;
  const Tensor wh = HostTensor({V, W}, DType::kF32, wv);
  Tensor tg = Tensor::Empty({N}, DType::kI32).value();
  std::vector<float> wt(N);
  std::mt19937 rng(22);
  std::uniform_int_distribution<int64_t> d(0, V - 1);
  for (int64_t i = 0; i < N; ++i) {
    tg.data<int32_t>()[i] = static_cast<int32_t>(d(rng));
    wt[i] = i % 7 == 3 ? 0.f : 0.5f + static_cast<float>(i % 5) * 0.25f;
  }
  tg.data<int32_t>()[3] = -5;  // weight 0: may hold any target
  const Tensor weights = HostTensor({N}, DType::kF32, wt);
  // d_w_head starts non-zero but small, so the accumulated gradient (O(1) for
  // the targets' rows) dominates what is compared.
  std::vector<float> dw0v = RandomUniform(V * W, 23);
  for (float& x : dw0v) x *= 0.01f;
  const Tensor dw0 = HostTensor({V, W}, DType::kF32, dw0v);
  const float scale = 0.5f;

  Tensor lse = Tensor::Empty({N}, DType::kF32).value();
  double loss = 0;
  ASSERT_TRUE(cmk.CrossEntropyForward(cpu, h, wh, tg, weights, chunk, lse, &loss).ok());
  Tensor dh = Tensor::Empty({N, W}, DType::kF32).value();
  Tensor dw = Tensor::Empty({V, W}, DType::kF32).value();
  std::memcpy(dw.raw(), dw0.raw(), dw.nbytes());
  ASSERT_TRUE(cmk.CrossEntropyBackward(cpu, h, wh, tg, weights, lse, scale, chunk, dh, dw).ok());

  const Tensor gh = ToDevice(gpu, h).value(), gwh = ToDevice(gpu, wh).value();
  const Tensor gtg = ToDevice(gpu, tg).value(), gwt = ToDevice(gpu, weights).value();
  auto poisoned = [&](const Shape& shape) {
    Tensor p = Tensor::Empty(shape, DType::kF32, gpu.allocator()).value();
    SMAT_CHECK(gpu.Fill(p, kNaN).ok());
    return p;
  };
  Tensor glse = poisoned({N});
  double gloss = kNaN;
  SMAT_ASSERT_OK(gmk.CrossEntropyForward(gpu, gh, gwh, gtg, gwt, chunk, glse, &gloss));
  // Logits from cuBLAS vs CBLAS (W-term fp32 dot products, relative ~1e-6),
  // lse and the loss terms in double: 1e-5 relative.
  EXPECT_NEAR(gloss, loss, 1e-5 * std::fabs(loss));
  ExpectClose(ToHost(gpu, glse).value(), lse, 1e-5, 1e-6, "lse");
  Tensor gdh = poisoned({N, W}), gdw = ToDevice(gpu, dw0).value();
  SMAT_ASSERT_OK(gmk.CrossEntropyBackward(gpu, gh, gwh, gtg, gwt, glse, scale, chunk, gdh, gdw));
  const Tensor hdh = ToHost(gpu, gdh).value(), hdw = ToHost(gpu, gdw).value();
  ExpectClose(hdh, dh, 1e-5, 1e-5, "dh");
  ExpectClose(hdw, dw, 1e-5, 1e-5, "d_w_head (+=)");
  for (int64_t k = 0; k < W; ++k) ASSERT_EQ(hdh.data<float>()[3 * W + k], 0.f) << "masked row";
  // Repeatable.
  Tensor glse2 = poisoned({N});
  double gloss2 = kNaN;
  SMAT_ASSERT_OK(gmk.CrossEntropyForward(gpu, gh, gwh, gtg, gwt, chunk, glse2, &gloss2));
  EXPECT_EQ(std::memcmp(&gloss, &gloss2, sizeof(double)), 0) << "loss differs between runs";
  Tensor gdh2 = poisoned({N, W}), gdw2 = ToDevice(gpu, dw0).value();
  SMAT_ASSERT_OK(
      gmk.CrossEntropyBackward(gpu, gh, gwh, gtg, gwt, glse, scale, chunk, gdh2, gdw2));
  ExpectSameBits(ToHost(gpu, gdh2).value(), hdh, "dh");
  ExpectSameBits(ToHost(gpu, gdw2).value(), hdw, "d_w_head");
  // A counted row with a target outside [0, V): the CPU's InvalidArgument.
  Tensor bad = Tensor::Empty({N}, DType::kI32).value();
  std::memcpy(bad.raw(), tg.raw(), tg.nbytes());
  bad.data<int32_t>()[N - 2] = static_cast<int32_t>(V);
  Tensor lse_c = Tensor::Empty({N}, DType::kF32).value();
  double l = 0;
  const absl::Status cs = cmk.CrossEntropyForward(cpu, h, wh, bad, weights, chunk, lse_c, &l);
  const absl::Status gs =
      gmk.CrossEntropyForward(gpu, gh, gwh, ToDevice(gpu, bad).value(), gwt, chunk, glse2, &l);
  EXPECT_EQ(gs.code(), absl::StatusCode::kInvalidArgument) << gs;
  EXPECT_EQ(gs.message(), cs.message());
  (void)t;
}

TEST_F(ModelKernelsGpuTest, CrossEntropyMatchesCpuByteVocabulary) {
  CrossEntropyCase(this, *cpu_, *gpu_, *cmk_, *gmk_, 1031, 389, 259, 300);
  CrossEntropyCase(this, *cpu_, *gpu_, *cmk_, *gmk_, 1031, 389, 259, 4096);
}

TEST_F(ModelKernelsGpuTest, CrossEntropyMatchesCpuLargeVocabulary) {
  CrossEntropyCase(this, *cpu_, *gpu_, *cmk_, *gmk_, 517, 389, 50257, 200);
}

// ------------------------------------------------------------------ Cast, AdamW, norms

TEST_F(ModelKernelsGpuTest, CastMatchesCpuBitwise) {
  const int64_t n = 1031 * 389;
  Tensor src = Random({n}, 24, 100.f);
  const uint32_t specials[] = {0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0x80000000u, 0x7f800000u,
                               0x7fc00000u, 0x7f800001u, 0xff800001u, 0x00000001u};
  for (size_t i = 0; i < sizeof(specials) / sizeof(specials[0]); ++i) {
    std::memcpy(&src.data<float>()[i * 101], &specials[i], 4);
  }
  Tensor bf = *Tensor::Empty({n}, DType::kBF16), back = *Tensor::Empty({n}, DType::kF32);
  ASSERT_TRUE(cmk_->Cast(src, bf).ok());
  ASSERT_TRUE(cmk_->Cast(bf, back).ok());
  const Tensor gsrc = Dev(src);
  Tensor gbf = Tensor::Empty({n}, DType::kBF16, gpu_->allocator()).value();
  SMAT_ASSERT_OK(gpu_->Fill(gbf, kNaN));
  SMAT_ASSERT_OK(gmk_->Cast(gsrc, gbf));
  ExpectBitwise(Host(gbf), bf, "Cast fp32 -> bf16");
  Tensor gback = Poisoned({n / 389, 389});  // a reshape
  SMAT_ASSERT_OK(gmk_->Cast(gbf, gback));
  ExpectBitwise(Host(gback), back, "Cast bf16 -> fp32");
  // Unaligned views (the scalar path).
  const int64_t m = n - 5;
  Tensor vbf = Tensor::Empty({m + 1}, DType::kBF16, gpu_->allocator()).value().View(1, {m});
  SMAT_ASSERT_OK(gmk_->Cast(gsrc.View(3, {m}), vbf));
  Tensor want = *Tensor::Empty({m}, DType::kBF16);
  ASSERT_TRUE(cmk_->Cast(src.View(3, {m}), want).ok());
  ExpectBitwise(Host(vbf), want, "Cast on unaligned views");
  Tensor gcopy = Poisoned({n});
  SMAT_ASSERT_OK(gmk_->Cast(gsrc, gcopy));
  ExpectBitwise(Host(gcopy), src, "Cast fp32 -> fp32 (a copy)");
  Tensor wrong = Poisoned({n - 1});
  EXPECT_EQ(gmk_->Cast(gsrc, wrong).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelKernelsGpuTest, AdamWUpdateMatchesCpuBitwise) {
  const int64_t n = 1031 * 389 + 3;
  Tensor w = Random({n}, 25), m = Random({n}, 26, 0.01f), v = Random({n}, 27, 0.01f);
  for (int64_t i = 0; i < n; ++i) v.data<float>()[i] = std::fabs(v.data<float>()[i]);
  Tensor gw = Dev(w), gm = Dev(m), gv = Dev(v);
  // Also on views that start one element in (the scalar path).
  const int64_t k = n - 1;
  Tensor vw = Dev(w).View(1, {k}), vm = Dev(m).View(1, {k}), vv = Dev(v).View(1, {k});
  Tensor cw = w.View(1, {k}), cm = m.View(1, {k}), cv = v.View(1, {k});
  Tensor cw_full = Clone(w), cm_full = Clone(m), cv_full = Clone(v);
  for (int t = 1; t <= 3; ++t) {
    SCOPED_TRACE(t);
    const Tensor g = Random({n}, 30 + t, 0.5f);
    ModelKernels::AdamWScalars s;
    s.grad_scale = t == 2 ? 0.3f : 1.f;
    s.step_size = static_cast<float>(1e-3 / (1.0 - std::pow(0.9, t)));
    s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(0.95, t)));
    s.decay = static_cast<float>(1.0 - 1e-3 * 0.1);
    ASSERT_TRUE(cmk_->AdamWUpdate(cw_full, g, cm_full, cv_full, s).ok());
    SMAT_ASSERT_OK(gmk_->AdamWUpdate(gw, Dev(g), gm, gv, s));
    ExpectBitwise(Host(gw), cw_full, "AdamW value");
    ExpectBitwise(Host(gm), cm_full, "AdamW m");
    ExpectBitwise(Host(gv), cv_full, "AdamW v");
    const Tensor gk = g.View(1, {k});
    ASSERT_TRUE(cmk_->AdamWUpdate(cw, gk, cm, cv, s).ok());
    SMAT_ASSERT_OK(gmk_->AdamWUpdate(vw, Dev(g).View(1, {k}), vm, vv, s));
    ExpectBitwise(Host(vw), Clone(cw), "AdamW value on an unaligned view");
  }
}

TEST_F(ModelKernelsGpuTest, SumOfSquaresMatchesCpu) {
  const std::vector<Tensor> host = {Random({1031, 389}, 40), Random({7}, 41),
                                    Random({5000003}, 42, 0.1f), Random({389}, 43)};
  std::vector<Tensor> dev;
  for (const Tensor& t : host) dev.push_back(Dev(t));
  auto want = cmk_->SumOfSquares(host);
  ASSERT_TRUE(want.ok());
  auto got = gmk_->SumOfSquares(dev);
  ASSERT_TRUE(got.ok()) << got.status();
  // Exact fp32 squares summed in double in two different fixed orders.
  EXPECT_NEAR(*got, *want, 1e-12 * *want);
  EXPECT_GT(*want, 1000.0);
  auto again = gmk_->SumOfSquares(dev);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(std::memcmp(&*got, &*again, sizeof(double)), 0);
  auto empty = gmk_->SumOfSquares({});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, 0.0);
  const absl::Status bad = gmk_->SumOfSquares({dev[0], host[1]}).status();
  EXPECT_NE(std::string(bad.message()).find("tensor 1"), std::string::npos) << bad;
}

}  // namespace
}  // namespace gpu_test
}  // namespace smat
