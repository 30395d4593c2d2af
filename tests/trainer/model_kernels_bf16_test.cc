// Tests of the CPU model ops (kernels/model_kernels.h) with bf16 outputs and
// inputs, the narrow linear layer against double formulas, and the fused ops
// (residual add + RMSNorm, RMSNorm backward + residual gradient, softplus +
// short conv backward) against the separate ops, bit for bit. The fixture and
// helpers are in model_kernels_test_util.h.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/model_kernels.h"
#include "tests/trainer/model_kernels_test_util.h"

namespace smat {
namespace model_kernels_test {
namespace {

// --- bf16 outputs and inputs (run.bf16) ------------------------------------------------
// An op that writes bf16 gives exactly Cast of its fp32 result (so writing the
// bf16 operand directly changes no bit against the former cast pass), and an
// op that reads bf16 gives exactly its fp32 result on the widened values.
// Outputs start as bf16 NaN, so an element left unwritten fails.

class ModelKernelsBf16Test : public ModelKernelsTest {
 protected:
  Tensor To(const Tensor& t, DType dtype) {
    Tensor out = *Tensor::Empty(t.shape(), dtype);
    SMAT_CHECK(mk_->Cast(t, out).ok());
    return out;
  }
  static Tensor Bf16NaN(Shape shape) {
    Tensor t = *Tensor::Empty(std::move(shape), DType::kBF16);
    uint16_t* p = static_cast<uint16_t*>(t.raw());
    std::fill(p, p + t.numel(), uint16_t{0x7fc1});
    return t;
  }
  static void ExpectSameBits(const Tensor& got, const Tensor& want, const char* what) {
    ASSERT_EQ(got.dtype(), want.dtype()) << what;
    ASSERT_EQ(got.nbytes(), want.nbytes()) << what;
    ASSERT_GT(got.numel(), 0) << what;
    const uint8_t* g = static_cast<const uint8_t*>(got.raw());
    const uint8_t* w = static_cast<const uint8_t*>(want.raw());
    const size_t es = DTypeSize(got.dtype());
    for (size_t i = 0; i < got.nbytes(); i += es) {
      ASSERT_EQ(std::memcmp(g + i, w + i, es), 0) << what << ": element " << i / es << " differs";
    }
  }
};

TEST_F(ModelKernelsBf16Test, RmsNormWritesTheCastOfItsFp32Output) {
  const int64_t N = 37, W = 29;
  const Tensor x = Randn({N, W}, 1, 2.f), w = Randn({W}, 2);
  Tensor y = Zeros({N, W}), rstd = Zeros({N}), y16 = Bf16NaN({N, W}), rstd16 = Zeros({N});
  ASSERT_TRUE(mk_->RmsNormForward(x, w, 1e-6f, y, rstd).ok());
  ASSERT_TRUE(mk_->RmsNormForward(x, w, 1e-6f, y16, rstd16).ok());
  ExpectSameBits(y16, To(y, DType::kBF16), "RmsNormForward y bf16");
  ExpectSameBits(rstd16, rstd, "RmsNormForward rstd beside a bf16 y");
}

TEST_F(ModelKernelsBf16Test, SwiGluReadsAndWritesBf16) {
  const int64_t N = 31, F = 53;
  const Tensor gate = Randn({N, F}, 3, 3.f), up = Randn({N, F}, 4), dy = Randn({N, F}, 5);
  const Tensor gate16 = To(gate, DType::kBF16), up16 = To(up, DType::kBF16);
  // The fp32 inputs that the bf16 ones stand for.
  const Tensor gate_w = To(gate16, DType::kF32), up_w = To(up16, DType::kF32);
  for (bool in16 : {false, true}) {
    SCOPED_TRACE(in16 ? "bf16 gate and up" : "fp32 gate and up");
    const Tensor& g32 = in16 ? gate_w : gate;
    const Tensor& u32 = in16 ? up_w : up;
    const Tensor& gin = in16 ? gate16 : gate;
    const Tensor& uin = in16 ? up16 : up;
    Tensor y = Zeros({N, F}), dg = Zeros({N, F}), du = Zeros({N, F});
    ASSERT_TRUE(mk_->SwiGluForward(g32, u32, y).ok());
    ASSERT_TRUE(mk_->SwiGluBackward(g32, u32, dy, dg, du).ok());
    Tensor y32 = Zeros({N, F}), dg32 = Zeros({N, F}), du32 = Zeros({N, F});
    ASSERT_TRUE(mk_->SwiGluForward(gin, uin, y32).ok());
    ASSERT_TRUE(mk_->SwiGluBackward(gin, uin, dy, dg32, du32).ok());
    ExpectSameBits(y32, y, "SwiGluForward fp32 y");
    ExpectSameBits(dg32, dg, "SwiGluBackward fp32 d_gate");
    ExpectSameBits(du32, du, "SwiGluBackward fp32 d_up");
    Tensor y16 = Bf16NaN({N, F}), dg16 = Bf16NaN({N, F}), du16 = Bf16NaN({N, F});
    ASSERT_TRUE(mk_->SwiGluForward(gin, uin, y16).ok());
    ASSERT_TRUE(mk_->SwiGluBackward(gin, uin, dy, dg16, du16).ok());
    ExpectSameBits(y16, To(y, DType::kBF16), "SwiGluForward bf16 y");
    ExpectSameBits(dg16, To(dg, DType::kBF16), "SwiGluBackward bf16 d_gate");
    ExpectSameBits(du16, To(du, DType::kBF16), "SwiGluBackward bf16 d_up");
  }
  // gate and up share a dtype, and so do d_gate and d_up.
  Tensor y = Zeros({N, F}), dg16 = Bf16NaN({N, F}), du = Zeros({N, F});
  absl::Status s = mk_->SwiGluForward(gate16, up, y);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("SwiGluForward: up"), std::string::npos) << s;
  s = mk_->SwiGluBackward(gate, up, dy, dg16, du);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("SwiGluBackward: d_up"), std::string::npos) << s;
  // A bf16 dy is read exactly: the same bits as its widened fp32 values, for
  // fp32 and bf16 gradients.
  const Tensor dy16 = To(dy, DType::kBF16), dy_w = To(dy16, DType::kF32);
  for (DType out : {DType::kF32, DType::kBF16}) {
    Tensor dg_w = Zeros({N, F}), du_w = Zeros({N, F});
    ASSERT_TRUE(mk_->SwiGluBackward(gate, up, dy_w, dg_w, du_w).ok());
    Tensor dg2 = out == DType::kF32 ? Zeros({N, F}) : Bf16NaN({N, F});
    Tensor du2 = out == DType::kF32 ? Zeros({N, F}) : Bf16NaN({N, F});
    ASSERT_TRUE(mk_->SwiGluBackward(gate, up, dy16, dg2, du2).ok());
    ExpectSameBits(dg2, To(dg_w, out), "SwiGluBackward d_gate from a bf16 dy");
    ExpectSameBits(du2, To(du_w, out), "SwiGluBackward d_up from a bf16 dy");
  }
  // A fp32 d_gate may not overwrite a bf16 dy in place.
  Tensor dy16_as_f32 = Tensor::Wrap(const_cast<void*>(dy16.raw()), {N, F / 2}, DType::kF32,
                                    dy16.device());
  Tensor du3 = Zeros({N, F / 2});
  s = mk_->SwiGluBackward(gate.View(0, {N, F / 2}), up.View(0, {N, F / 2}),
                          dy16.View(0, {N, F / 2}), dy16_as_f32, du3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("may not alias"), std::string::npos) << s;
  // dy is fp32 or bf16.
  Tensor ints = *Tensor::Empty({N, F}, DType::kI32), du4 = Zeros({N, F});
  s = mk_->SwiGluBackward(gate, up, ints, du, du4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("SwiGluBackward: dy"), std::string::npos) << s;
}

TEST_F(ModelKernelsBf16Test, FeatureMapsWriteTheCastOfTheirFp32Output) {
  const int64_t N = 23, C = 41;
  const Tensor x = Randn({N, C}, 6, 3.f);
  using Op = std::function<absl::Status(const Tensor&, Tensor&)>;
  const std::vector<std::pair<const char*, Op>> ops = {
      {"SoftplusForward", [&](const Tensor& a, Tensor& b) { return mk_->SoftplusForward(a, b); }},
      {"NegSoftplusForward",
       [&](const Tensor& a, Tensor& b) { return mk_->NegSoftplusForward(a, b); }},
      {"FeatureMapForward elu+1",
       [&](const Tensor& a, Tensor& b) {
         return mk_->FeatureMapForward(FeatureMap::kEluPlusOne, a, b);
       }},
      {"FeatureMapForward relu",
       [&](const Tensor& a, Tensor& b) {
         return mk_->FeatureMapForward(FeatureMap::kReluEps, a, b);
       }},
  };
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    Tensor y = Zeros({N, C}), y16 = Bf16NaN({N, C});
    ASSERT_TRUE(op(x, y).ok());
    ASSERT_TRUE(op(x, y16).ok());
    ExpectSameBits(y16, To(y, DType::kBF16), name);
    // A bf16 y may not overwrite its fp32 x in place.
    Tensor x_as_bf16 = Tensor::Wrap(const_cast<void*>(x.raw()), {N, C}, DType::kBF16, x.device());
    const absl::Status s = op(x, x_as_bf16);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find("may not alias"), std::string::npos) << s;
    // Neither fp32 nor bf16.
    Tensor ints = *Tensor::Empty({N, C}, DType::kI32);
    const absl::Status bad = op(x, ints);
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(std::string(bad.message()).find("expected fp32 or bf16"), std::string::npos) << bad;
  }
}

TEST_F(ModelKernelsBf16Test, ShortConvWritesTheCastOfItsFp32Outputs) {
  const int64_t nb = 2, L = 19, C = 13, K = kShortConvWidth;
  const Tensor x = Randn({nb, L, C}, 7), prefix = Randn({nb, K - 1, C}, 8),
               w = Randn({K, C}, 9), dy = Randn({nb, L, C}, 10);
  Tensor y = Zeros({nb, L, C}), y16 = Bf16NaN({nb, L, C});
  ASSERT_TRUE(mk_->ShortConvForward(x, prefix, w, y).ok());
  ASSERT_TRUE(mk_->ShortConvForward(x, prefix, w, y16).ok());
  ExpectSameBits(y16, To(y, DType::kBF16), "ShortConvForward bf16 y");
  const Tensor dw0 = Randn({K, C}, 11);  // d_w accumulates
  Tensor dx = Zeros({nb, L, C}), dp = Zeros({nb, K - 1, C}), dw = To(dw0, DType::kF32);
  Tensor dx16 = Bf16NaN({nb, L, C}), dp16 = Zeros({nb, K - 1, C}), dw16 = To(dw0, DType::kF32);
  ASSERT_TRUE(mk_->ShortConvBackward(x, prefix, w, dy, dx, dp, dw).ok());
  ASSERT_TRUE(mk_->ShortConvBackward(x, prefix, w, dy, dx16, dp16, dw16).ok());
  ExpectSameBits(dx16, To(dx, DType::kBF16), "ShortConvBackward bf16 dx");
  ExpectSameBits(dp16, dp, "ShortConvBackward d_prefix beside a bf16 dx");
  ExpectSameBits(dw16, dw, "ShortConvBackward d_w beside a bf16 dx");
  // The inputs stay fp32.
  const absl::Status s = mk_->ShortConvForward(To(x, DType::kBF16), prefix, w, y);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// --- narrow linear layer -----------------------------------------------------------------
// Forward and backward against double formulas (the layer is linear, so the
// gradients are exact sums), with fp32 and bf16 x and w (bf16 read exactly:
// the results equal those on the widened values), gradients that start
// non-zero, dx written and accumulated, and no bias.
TEST_F(ModelKernelsBf16Test, NarrowLinearMatchesDoubleFormulas) {
  const int64_t N = 37, in = 29, out = 7;
  const Tensor x32 = Randn({N, in}, 61), w32 = Randn({out, in}, 62), b = Randn({out}, 63);
  const Tensor dy = Randn({N, out}, 64), dx0 = Randn({N, in}, 65);
  const Tensor dw0 = Randn({out, in}, 66), db0 = Randn({out}, 67);
  for (bool in16 : {false, true}) {
    SCOPED_TRACE(in16 ? "bf16 x and w" : "fp32 x and w");
    const Tensor x = in16 ? To(x32, DType::kBF16) : x32;
    const Tensor w = in16 ? To(w32, DType::kBF16) : w32;
    const Vec xv = ToVec(in16 ? To(x, DType::kF32) : x), wv = ToVec(in16 ? To(w, DType::kF32) : w);
    const Vec bv = ToVec(b), g = ToVec(dy), dxv = ToVec(dx0), dwv = ToVec(dw0), dbv = ToVec(db0);
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(with_bias ? "bias" : "no bias");
      Vec y_want(N * out), dx_want(N * in), dw_want(dwv), db_want(dbv);
      for (int64_t i = 0; i < N; ++i) {
        for (int64_t o = 0; o < out; ++o) {
          double s = with_bias ? bv[o] : 0;
          for (int64_t j = 0; j < in; ++j) s += xv[i * in + j] * wv[o * in + j];
          y_want[i * out + o] = s;
          if (with_bias) db_want[o] += g[i * out + o];
          for (int64_t j = 0; j < in; ++j) dw_want[o * in + j] += g[i * out + o] * xv[i * in + j];
        }
        for (int64_t j = 0; j < in; ++j) {
          double s = 0;
          for (int64_t o = 0; o < out; ++o) s += g[i * out + o] * wv[o * in + j];
          dx_want[i * in + j] = s;
        }
      }
      Tensor y = Zeros({N, out});
      ASSERT_TRUE(mk_->NarrowLinearForward(x, w, with_bias ? b : Tensor(), y).ok());
      ExpectClose(y, y_want, "NarrowLinearForward y");
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(accumulate ? "dx +=" : "dx =");
        Tensor dx = *Tensor::Empty({N, in}, DType::kF32), dw = Zeros({out, in});
        Tensor db = Zeros({out}), no_bias;
        std::memcpy(dx.raw(), dx0.raw(), dx0.nbytes());
        std::memcpy(dw.raw(), dw0.raw(), dw0.nbytes());
        std::memcpy(db.raw(), db0.raw(), db0.nbytes());
        if (!accumulate) std::fill(dx.data<float>(), dx.data<float>() + dx.numel(), NAN);
        ASSERT_TRUE(
            mk_->NarrowLinearBackward(x, w, dy, dx, accumulate, dw, with_bias ? db : no_bias)
                .ok());
        Vec want = dx_want;
        if (accumulate) {
          for (size_t k = 0; k < want.size(); ++k) want[k] += dxv[k];
        }
        ExpectClose(dx, want, "NarrowLinearBackward dx");
        ExpectClose(dw, dw_want, "NarrowLinearBackward d_w");
        ExpectClose(db, with_bias ? db_want : dbv, "NarrowLinearBackward d_bias");
      }
    }
  }
}

TEST_F(ModelKernelsBf16Test, NarrowLinearRejectsBadOperands) {
  const int64_t N = 5, in = 3;
  const Tensor x = Randn({N, in}, 71), b17 = Randn({17}, 72), w17 = Randn({17, in}, 73);
  const Tensor w = Randn({4, in}, 74), b = Randn({4}, 75);
  Tensor y17 = Zeros({N, 17}), y = Zeros({N, 4});
  absl::Status s = mk_->NarrowLinearForward(x, w17, b17, y17);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("17 outputs"), std::string::npos) << s;
  s = mk_->NarrowLinearForward(x, w, Randn({3}, 76), y);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("NarrowLinearForward: bias"), std::string::npos) << s;
  s = mk_->NarrowLinearForward(x, Randn({4, in + 1}, 77), b, y);
  EXPECT_NE(std::string(s.message()).find("NarrowLinearForward: w"), std::string::npos) << s;
  Tensor y16 = Bf16NaN({N, 4});
  s = mk_->NarrowLinearForward(x, w, b, y16);
  EXPECT_NE(std::string(s.message()).find("NarrowLinearForward: y"), std::string::npos) << s;
  Tensor dy = Randn({N, 4}, 78), dx = Zeros({N, in}), dw = Zeros({4, in}), db = Zeros({4});
  s = mk_->NarrowLinearBackward(x, w, To(dy, DType::kBF16), dx, false, dw, db);
  EXPECT_NE(std::string(s.message()).find("NarrowLinearBackward: dy"), std::string::npos) << s;
  Tensor x_alias = x;
  s = mk_->NarrowLinearBackward(x, w, dy, x_alias, false, dw, db);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("dx may not alias x"), std::string::npos) << s;
  Tensor dw_bad = Zeros({in, 4});
  s = mk_->NarrowLinearBackward(x, w, dy, dx, false, dw_bad, db);
  EXPECT_NE(std::string(s.message()).find("NarrowLinearBackward: d_w"), std::string::npos) << s;
}

// The fused residual add + norm and norm backward + residual gradient give the
// bits of the separate ops (fp32 and bf16 y; sum in place of b).
TEST_F(ModelKernelsBf16Test, FusedResidualNormsEqualTheSeparateOps) {
  const int64_t N = 33, W = 27;
  const Tensor a = Randn({N, W}, 101), b = Randn({N, W}, 102), w = Randn({W}, 103);
  const Tensor dy = Randn({N, W}, 104), dres = Randn({N, W}, 105), dw0 = Randn({W}, 106);
  auto copy = [](const Tensor& t) {
    Tensor c = *Tensor::Empty(t.shape(), t.dtype());
    std::memcpy(c.raw(), t.raw(), t.nbytes());
    return c;
  };
  for (DType yt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(yt == DType::kF32 ? "fp32 y" : "bf16 y");
    Tensor sum = Zeros({N, W}), y = yt == DType::kF32 ? Zeros({N, W}) : Bf16NaN({N, W});
    Tensor rstd = Zeros({N});
    ASSERT_TRUE(mk_->ResidualAdd(a, b, sum).ok());
    ASSERT_TRUE(mk_->RmsNormForward(sum, w, 1e-6f, y, rstd).ok());
    Tensor in_place = copy(b), y2 = yt == DType::kF32 ? Zeros({N, W}) : Bf16NaN({N, W});
    Tensor rstd2 = Zeros({N});
    ASSERT_TRUE(mk_->AddRmsNormForward(a, in_place, w, 1e-6f, in_place, y2, rstd2).ok());
    ExpectSameBits(in_place, sum, "AddRmsNormForward sum");
    ExpectSameBits(y2, y, "AddRmsNormForward y");
    ExpectSameBits(rstd2, rstd, "AddRmsNormForward rstd");
  }
  Tensor rstd = Zeros({N}), y = Zeros({N, W});
  ASSERT_TRUE(mk_->RmsNormForward(a, w, 1e-6f, y, rstd).ok());
  Tensor dx = Zeros({N, W}), dw = copy(dw0);
  ASSERT_TRUE(mk_->RmsNormBackward(a, w, rstd, dy, dx, dw).ok());
  ASSERT_TRUE(mk_->ResidualAdd(dx, dres, dx).ok());
  Tensor dx2 = Zeros({N, W}), dw2 = copy(dw0);
  ASSERT_TRUE(mk_->RmsNormBackwardAdd(a, w, rstd, dy, dres, dx2, dw2).ok());
  ExpectSameBits(dx2, dx, "RmsNormBackwardAdd dx");
  ExpectSameBits(dw2, dw, "RmsNormBackwardAdd d_weight");
  // dx may not alias d_residual; y may not alias the sum.
  Tensor dres_alias = copy(dres);
  absl::Status s = mk_->RmsNormBackwardAdd(a, w, rstd, dy, dres_alias, dres_alias, dw2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("dx may not alias d_residual"), std::string::npos) << s;
  Tensor sum = Zeros({N, W});
  s = mk_->AddRmsNormForward(a, b, w, 1e-6f, sum, sum, rstd);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("AddRmsNormForward: y may not alias sum"),
            std::string::npos)
      << s;
  s = mk_->AddRmsNormForward(a, Randn({N, W + 1}, 107), w, 1e-6f, sum, y, rstd);
  EXPECT_NE(std::string(s.message()).find("AddRmsNormForward: b"), std::string::npos) << s;
}

TEST_F(ModelKernelsBf16Test, SigmoidScaleWritesTheCastOfItsFp32Output) {
  const int64_t N = 13, H = 3, r = 7;
  const Tensor x = Randn({N, H, r}, 111, 2.f), g = Randn({N, H}, 112, 2.f);
  Tensor y = Zeros({N, H, r}), y16 = Bf16NaN({N, H, r});
  ASSERT_TRUE(mk_->SigmoidScaleForward(x, g, y).ok());
  ASSERT_TRUE(mk_->SigmoidScaleForward(x, g, y16).ok());
  ExpectSameBits(y16, To(y, DType::kBF16), "SigmoidScaleForward bf16 y");
  Tensor x_as_bf16 = Tensor::Wrap(const_cast<void*>(x.raw()), {N, H, r}, DType::kBF16, x.device());
  const absl::Status s = mk_->SigmoidScaleForward(x, g, x_as_bf16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("may not alias"), std::string::npos) << s;
}

// The backward of softplus(conv(x)) equals SoftplusBackward then
// ShortConvBackward, bit for bit; dx may not overwrite z.
TEST_F(ModelKernelsBf16Test, ShortConvSoftplusBackwardEqualsTheSeparateOps) {
  const int64_t nb = 2, L = 9, C = 5, K = kShortConvWidth;
  const Tensor x = Randn({nb, L, C}, 151), prefix = Randn({nb, K - 1, C}, 152);
  const Tensor w = Randn({K, C}, 153), z = Randn({nb, L, C}, 154, 3.f), dy = Randn({nb, L, C}, 155);
  Tensor g = Zeros({nb, L, C}), dx = Zeros({nb, L, C}), dp = Zeros({nb, K - 1, C});
  Tensor dw = Randn({K, C}, 156);
  Tensor dx2 = Bf16NaN({nb, L, C}), dx2w = Zeros({nb, L, C}), dp2 = Zeros({nb, K - 1, C});
  Tensor dw2 = Randn({K, C}, 156);
  ASSERT_TRUE(mk_->SoftplusBackward(z, dy, g).ok());
  ASSERT_TRUE(mk_->ShortConvBackward(x, prefix, w, g, dx, dp, dw).ok());
  ASSERT_TRUE(mk_->ShortConvSoftplusBackward(x, prefix, w, z, dy, dx2w, dp2, dw2).ok());
  ExpectSameBits(dx2w, dx, "ShortConvSoftplusBackward dx");
  ExpectSameBits(dp2, dp, "ShortConvSoftplusBackward d_prefix");
  ExpectSameBits(dw2, dw, "ShortConvSoftplusBackward d_w");
  Tensor dw3 = Randn({K, C}, 156);
  ASSERT_TRUE(mk_->ShortConvSoftplusBackward(x, prefix, w, z, dy, dx2, dp2, dw3).ok());
  ExpectSameBits(dx2, To(dx, DType::kBF16), "ShortConvSoftplusBackward bf16 dx");
  Tensor z_alias = Randn({nb, L, C}, 157);
  absl::Status s = mk_->ShortConvSoftplusBackward(x, prefix, w, z_alias, dy, z_alias, dp2, dw3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("dx may not alias z"), std::string::npos) << s;
  s = mk_->ShortConvSoftplusBackward(x, prefix, w, Randn({nb, L, C + 1}, 158), dy, dx2w, dp2, dw3);
  EXPECT_NE(std::string(s.message()).find("ShortConvSoftplusBackward: z"), std::string::npos) << s;
  // The forward: the conv's output and its softplus (fp32 and bf16).
  Tensor y = Zeros({nb, L, C}), f = Zeros({nb, L, C});
  ASSERT_TRUE(mk_->ShortConvForward(x, prefix, w, y).ok());
  ASSERT_TRUE(mk_->SoftplusForward(y, f).ok());
  Tensor y2 = Zeros({nb, L, C}), f2 = Zeros({nb, L, C}), f16 = Bf16NaN({nb, L, C});
  ASSERT_TRUE(mk_->ShortConvSoftplusForward(x, prefix, w, y2, f2).ok());
  ExpectSameBits(y2, y, "ShortConvSoftplusForward y");
  ExpectSameBits(f2, f, "ShortConvSoftplusForward f");
  ASSERT_TRUE(mk_->ShortConvSoftplusForward(x, prefix, w, y2, f16).ok());
  ExpectSameBits(f16, To(f, DType::kBF16), "ShortConvSoftplusForward bf16 f");
  s = mk_->ShortConvSoftplusForward(x, prefix, w, y2, y2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("f may not alias y"), std::string::npos) << s;
  Tensor y16 = Bf16NaN({nb, L, C});
  s = mk_->ShortConvSoftplusForward(x, prefix, w, y16, f2);
  EXPECT_NE(std::string(s.message()).find("ShortConvSoftplusForward: y"), std::string::npos) << s;
}

}  // namespace
}  // namespace model_kernels_test
}  // namespace smat
