// The CUDA model kernels (kernels/cuda/model_kernels_cuda.h) with bf16 outputs
// and inputs, the narrow linear layer, and the fused ops (residual add +
// RMSNorm, RMSNorm backward + residual gradient, softplus + short conv
// backward): against the GPU's own fp32 and separate ops bit for bit, and
// against the CPU (kernels/cpu/model_kernels_cpu.cc). The fixture and
// comparisons are in model_kernels_gpu_util.h; the rules for "bitwise" and
// "close" are at the top of model_kernels_gpu_test.cc.
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/model_kernels.h"
#include "model_kernels_gpu_util.h"

namespace smat {
namespace gpu_test {
namespace {

// ------------------------------------------------------------------ bf16 outputs and inputs
// An op that writes bf16 (run.bf16: activations only products read) gives
// exactly the GPU Cast of its own fp32 result, and one that reads bf16 gate /
// up gives exactly its fp32 result on the widened values; bf16 outputs start
// as NaN, sizes are odd (the scalar tail), and unaligned views take the scalar
// path. The conv's bf16 outputs are also the CPU's bits.

class ModelKernelsBf16GpuTest : public ModelKernelsGpuTest {
 protected:
  // A device bf16 tensor of NaN.
  Tensor P16(const Shape& shape) { return To(Poisoned(shape), DType::kBF16); }
  // The GPU cast of a device tensor.
  Tensor To(const Tensor& dev, DType dtype) {
    Tensor out = Tensor::Empty(dev.shape(), dtype, gpu_->allocator()).value();
    SMAT_CHECK(gmk_->Cast(dev, out).ok());
    return out;
  }
};

TEST_F(ModelKernelsBf16GpuTest, ElementwiseBf16OutputsAreTheCastOfFp32) {
  const int64_t N = 1031, F = 1037;
  const Tensor da = Dev(Random({N, F}, 51, 4.f)), db = Dev(Random({N, F}, 52, 2.f));
  const Tensor ddy = Dev(Random({N, F}, 53));
  const Tensor a16 = To(da, DType::kBF16), b16 = To(db, DType::kBF16);
  const Tensor aw = To(a16, DType::kF32), bw = To(b16, DType::kF32);  // what a16, b16 hold
  for (bool in16 : {false, true}) {
    SCOPED_TRACE(in16 ? "bf16 gate and up" : "fp32 gate and up");
    const Tensor& g32 = in16 ? aw : da;
    const Tensor& u32 = in16 ? bw : db;
    const Tensor& gin = in16 ? a16 : da;
    const Tensor& uin = in16 ? b16 : db;
    Tensor y = Poisoned({N, F}), dg = Poisoned({N, F}), du = Poisoned({N, F});
    SMAT_ASSERT_OK(gmk_->SwiGluForward(g32, u32, y));
    SMAT_ASSERT_OK(gmk_->SwiGluBackward(g32, u32, ddy, dg, du));
    if (in16) {
      Tensor y2 = Poisoned({N, F}), dg2 = Poisoned({N, F}), du2 = Poisoned({N, F});
      SMAT_ASSERT_OK(gmk_->SwiGluForward(gin, uin, y2));
      SMAT_ASSERT_OK(gmk_->SwiGluBackward(gin, uin, ddy, dg2, du2));
      ExpectBitwise(Host(y2), Host(y), "SwiGluForward on bf16 inputs");
      ExpectBitwise(Host(dg2), Host(dg), "SwiGluBackward d_gate on bf16 inputs");
      ExpectBitwise(Host(du2), Host(du), "SwiGluBackward d_up on bf16 inputs");
    }
    Tensor y16 = P16({N, F}), dg16 = P16({N, F}), du16 = P16({N, F});
    SMAT_ASSERT_OK(gmk_->SwiGluForward(gin, uin, y16));
    SMAT_ASSERT_OK(gmk_->SwiGluBackward(gin, uin, ddy, dg16, du16));
    ExpectBitwise(Host(y16), Host(To(y, DType::kBF16)), "SwiGluForward bf16 y");
    ExpectBitwise(Host(dg16), Host(To(dg, DType::kBF16)), "SwiGluBackward bf16 d_gate");
    ExpectBitwise(Host(du16), Host(To(du, DType::kBF16)), "SwiGluBackward bf16 d_up");
    // A bf16 dy (the product's bf16 output) is read exactly.
    const Tensor dy16 = To(ddy, DType::kBF16), dyw = To(dy16, DType::kF32);
    Tensor dg3 = Poisoned({N, F}), du3 = Poisoned({N, F});
    SMAT_ASSERT_OK(gmk_->SwiGluBackward(g32, u32, dyw, dg3, du3));
    Tensor dg4 = P16({N, F}), du4 = P16({N, F});
    SMAT_ASSERT_OK(gmk_->SwiGluBackward(gin, uin, dy16, dg4, du4));
    ExpectBitwise(Host(dg4), Host(To(dg3, DType::kBF16)), "SwiGluBackward d_gate, bf16 dy");
    ExpectBitwise(Host(du4), Host(To(du3, DType::kBF16)), "SwiGluBackward d_up, bf16 dy");
    // And matches the CPU's.
    Tensor cdg = Tensor::Empty({N, F}, DType::kBF16).value(), cdu = Clone(cdg);
    SMAT_ASSERT_OK(cmk_->SwiGluBackward(Host(gin), Host(uin), Host(dy16), cdg, cdu));
    ExpectClose(Host(To(dg4, DType::kF32)), Host(To(Dev(cdg), DType::kF32)), 1e-2, 1e-6,
                "SwiGluBackward d_gate, bf16 dy, vs CPU");
  }
  // Unaligned bf16 views: the scalar path.
  {
    const int64_t m = N * F - 3;
    Tensor y = Poisoned({m}), y16 = P16({m + 1}).View(1, {m});
    const Tensor va = a16.View(1, {m}), vb = b16.View(3, {m});
    Tensor vaw = To(va, DType::kF32), vbw = To(vb, DType::kF32);
    Tensor ym = y.View(0, {1, m});
    SMAT_ASSERT_OK(gmk_->SwiGluForward(vaw.View(0, {1, m}), vbw.View(0, {1, m}), ym));
    Tensor y16m = y16.View(0, {1, m});
    SMAT_ASSERT_OK(gmk_->SwiGluForward(va.View(0, {1, m}), vb.View(0, {1, m}), y16m));
    ExpectBitwise(Host(y16), Host(To(y, DType::kBF16)), "SwiGluForward on unaligned bf16 views");
  }
  // The unary forward maps.
  using Op = std::function<absl::Status(const Tensor&, Tensor&)>;
  const std::vector<std::pair<const char*, Op>> ops = {
      {"SoftplusForward", [&](const Tensor& x, Tensor& y) { return gmk_->SoftplusForward(x, y); }},
      {"NegSoftplusForward",
       [&](const Tensor& x, Tensor& y) { return gmk_->NegSoftplusForward(x, y); }},
      {"FeatureMapForward elu+1",
       [&](const Tensor& x, Tensor& y) {
         return gmk_->FeatureMapForward(FeatureMap::kEluPlusOne, x, y);
       }},
      {"FeatureMapForward relu",
       [&](const Tensor& x, Tensor& y) {
         return gmk_->FeatureMapForward(FeatureMap::kReluEps, x, y);
       }},
  };
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    Tensor y = Poisoned({N, F}), y16 = P16({N, F});
    SMAT_ASSERT_OK(op(da, y));
    SMAT_ASSERT_OK(op(da, y16));
    ExpectBitwise(Host(y16), Host(To(y, DType::kBF16)), name);
    const int64_t m = N * F - 2;
    Tensor vy = Poisoned({m}), vy16 = P16({m + 1}).View(1, {m});
    SMAT_ASSERT_OK(op(da.View(1, {m}), vy));
    SMAT_ASSERT_OK(op(da.View(1, {m}), vy16));
    ExpectBitwise(Host(vy16), Host(To(vy, DType::kBF16)), name);
    // A bf16 y may not overwrite its fp32 x.
    Tensor x = Dev(Random({N, F}, 54));
    Tensor x_as_bf16 = Tensor::Wrap(x.raw(), {N, F}, DType::kBF16, x.device());
    const absl::Status s = op(x, x_as_bf16);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find("may not alias"), std::string::npos) << s;
  }
}

TEST_F(ModelKernelsBf16GpuTest, RmsNormBf16OutputIsTheCastOfFp32) {
  const int64_t N = 1031, W = 389;
  const Tensor gx = Dev(Random({N, W}, 55, 2.f)), gw = Dev(Random({W}, 56));
  Tensor y = Poisoned({N, W}), rstd = Poisoned({N}), y16 = P16({N, W}), rstd16 = Poisoned({N});
  SMAT_ASSERT_OK(gmk_->RmsNormForward(gx, gw, 1e-6f, y, rstd));
  SMAT_ASSERT_OK(gmk_->RmsNormForward(gx, gw, 1e-6f, y16, rstd16));
  ExpectBitwise(Host(y16), Host(To(y, DType::kBF16)), "RmsNormForward bf16 y");
  ExpectBitwise(Host(rstd16), Host(rstd), "RmsNormForward rstd beside a bf16 y");
}

// Both conv paths (float4 at C = 384 / 132, scalar at C = 389 and on an
// unaligned bf16 view), bitwise the CPU's bf16 outputs.
TEST_F(ModelKernelsBf16GpuTest, ShortConvBf16OutputsMatchCpu) {
  constexpr int64_t K = kShortConvWidth;
  struct Case {
    int64_t nb, L, C;
    bool unaligned_out;
  };
  for (const Case& k : {Case{2, 347, 384, false}, Case{3, 37, 389, false},
                        Case{2, 19, 132, false}, Case{2, 37, 132, true}}) {
    SCOPED_TRACE("nb " + std::to_string(k.nb) + ", L " + std::to_string(k.L) + ", C " +
                 std::to_string(k.C) + (k.unaligned_out ? ", outputs unaligned" : ""));
    const int64_t nb = k.nb, L = k.L, C = k.C;
    const Tensor x = Random({nb, L, C}, 57), prefix = Random({nb, K - 1, C}, 58);
    const Tensor w = Random({K, C}, 59), dy = Random({nb, L, C}, 60), dw0 = Random({K, C}, 61);
    Tensor y16 = *Tensor::Empty({nb, L, C}, DType::kBF16), dx16 = Clone(y16);
    Tensor dp = *Tensor::Empty({nb, K - 1, C}, DType::kF32), dw = Clone(dw0);
    ASSERT_TRUE(cmk_->ShortConvForward(x, prefix, w, y16).ok());
    ASSERT_TRUE(cmk_->ShortConvBackward(x, prefix, w, dy, dx16, dp, dw).ok());
    const int64_t off = k.unaligned_out ? 1 : 0, n = nb * L * C;
    Tensor gy16 = P16({n + off}).View(off, {nb, L, C});
    Tensor gdx16 = P16({n + off}).View(off, {nb, L, C});
    const Tensor gx = Dev(x), gp = Dev(prefix), gw = Dev(w), gdyv = Dev(dy);
    SMAT_ASSERT_OK(gmk_->ShortConvForward(gx, gp, gw, gy16));
    ExpectBitwise(Host(gy16), y16, "ShortConvForward bf16 y");
    Tensor gdp = Poisoned({nb, K - 1, C}), gdw = Dev(dw0);
    SMAT_ASSERT_OK(gmk_->ShortConvBackward(gx, gp, gw, gdyv, gdx16, gdp, gdw));
    ExpectBitwise(Host(gdx16), dx16, "ShortConvBackward bf16 dx");
    ExpectBitwise(Host(gdp), dp, "ShortConvBackward d_prefix beside a bf16 dx");
    ExpectClose(Host(gdw), dw, 1e-5, 1e-5, "ShortConvBackward d_w beside a bf16 dx");
  }
}

// Backend::Gemm with a bf16 c (the MLP's gate and up products with run.bf16):
// within a bf16 rounding of the fp32 product (cuBLAS may pick another
// summation order for the bf16 output), every transpose, odd sizes, batched,
// NaN in c overwritten; beta != 0 is an error.
TEST_F(ModelKernelsBf16GpuTest, GemmBf16OutputRoundsTheFp32Product) {
  struct Case {
    bool ta, tb;
    int64_t batch, m, n, k;
  };
  for (const Case& g : {Case{false, true, 0, 1031, 1037, 389}, Case{false, false, 0, 77, 131, 389},
                        Case{true, false, 0, 389, 129, 1031}, Case{true, true, 3, 33, 65, 47}}) {
    SCOPED_TRACE(std::string(g.ta ? "T" : "N") + (g.tb ? "T" : "N") + " batch " +
                 std::to_string(g.batch) + " m " + std::to_string(g.m));
    auto shape = [&](int64_t r, int64_t c) {
      return g.batch == 0 ? Shape{r, c} : Shape{g.batch, r, c};
    };
    const Tensor a = To(Dev(Random(g.ta ? shape(g.k, g.m) : shape(g.m, g.k), 62)), DType::kBF16);
    const Tensor b = To(Dev(Random(g.tb ? shape(g.n, g.k) : shape(g.k, g.n), 63)), DType::kBF16);
    const Transpose ta = g.ta ? Transpose::kYes : Transpose::kNo;
    const Transpose tb = g.tb ? Transpose::kYes : Transpose::kNo;
    Tensor c32 = Poisoned(shape(g.m, g.n)), c16 = P16(shape(g.m, g.n));
    SMAT_ASSERT_OK(gpu_->Gemm(ta, tb, 1.f, a, b, 0.f, c32));
    SMAT_ASSERT_OK(gpu_->Gemm(ta, tb, 1.f, a, b, 0.f, c16));
    ExpectClose(Host(To(c16, DType::kF32)), Host(c32), 1.0 / 256, 1e-5, "Gemm bf16 c");
  }
  const Tensor a = To(Dev(Random({4, 5}, 64)), DType::kBF16);
  const Tensor b = To(Dev(Random({5, 3}, 65)), DType::kBF16);
  Tensor c = P16({4, 3});
  const absl::Status s = gpu_->Gemm(Transpose::kNo, Transpose::kNo, 1.f, a, b, 1.f, c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("beta must be 0"), std::string::npos) << s;
}

// ------------------------------------------------------------------ narrow linear layer
// Against the CPU at odd sizes (in = 389; out 1, 6 and 16; rows that fill
// partial blocks unevenly), fp32 and bf16 x and w, with and without a bias, dx
// written (poisoned first) and accumulated, gradients that start non-zero;
// two runs bitwise equal. The GPU sums in another fixed order (lane trees,
// row groups, partials), so the comparison is close: 1e-5 of the element plus
// 1e-6 of the largest magnitude (1e-5 for the sums over rows).
TEST_F(ModelKernelsBf16GpuTest, NarrowLinearMatchesCpu) {
  struct Case {
    int64_t N, in, out;
    bool bf16, bias;
  };
  for (const Case& c : {Case{1031, 389, 6, true, true}, Case{1031, 389, 16, false, true},
                        Case{1031, 389, 1, true, false}, Case{40009, 389, 6, true, true},
                        Case{257, 31, 12, false, false}}) {
    SCOPED_TRACE("N " + std::to_string(c.N) + " in " + std::to_string(c.in) + " out " +
                 std::to_string(c.out) + (c.bf16 ? " bf16" : " fp32") +
                 (c.bias ? " bias" : " no bias"));
    const int64_t N = c.N, in = c.in, out = c.out;
    Tensor gx = Dev(Random({N, in}, 81, 2.f)), gw = Dev(Random({out, in}, 82));
    if (c.bf16) {
      gx = To(gx, DType::kBF16);
      gw = To(gw, DType::kBF16);
    }
    const Tensor x = Host(gx), w = Host(gw), b = Random({out}, 83), dy = Random({N, out}, 84);
    const Tensor dx0 = Random({N, in}, 85), dw0 = Random({out, in}, 86), db0 = Random({out}, 87);
    Tensor no_bias;
    // Forward.
    Tensor y = *Tensor::Empty({N, out}, DType::kF32);
    SMAT_ASSERT_OK(cmk_->NarrowLinearForward(x, w, c.bias ? b : no_bias, y));
    const Tensor gb = Dev(b);
    Tensor gy = Poisoned({N, out});
    SMAT_ASSERT_OK(gmk_->NarrowLinearForward(gx, gw, c.bias ? gb : no_bias, gy));
    ExpectClose(Host(gy), y, 1e-5, 1e-6, "NarrowLinearForward y");
    Tensor gy2 = Poisoned({N, out});
    SMAT_ASSERT_OK(gmk_->NarrowLinearForward(gx, gw, c.bias ? gb : no_bias, gy2));
    ExpectSameBits(Host(gy2), Host(gy), "NarrowLinearForward y");
    // Backward, dx written and accumulated.
    const Tensor gdy = Dev(dy);
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(accumulate ? "dx +=" : "dx =");
      Tensor dx = Clone(dx0), dw = Clone(dw0), db = Clone(db0);
      SMAT_ASSERT_OK(
          cmk_->NarrowLinearBackward(x, w, dy, dx, accumulate, dw, c.bias ? db : no_bias));
      Tensor results[2][3];
      for (Tensor(&r)[3] : results) {
        Tensor gdx = accumulate ? Dev(dx0) : Poisoned({N, in}), gdw = Dev(dw0), gdb = Dev(db0);
        SMAT_ASSERT_OK(gmk_->NarrowLinearBackward(gx, gw, gdy, gdx, accumulate, gdw,
                                                  c.bias ? gdb : no_bias));
        r[0] = Host(gdx);
        r[1] = Host(gdw);
        r[2] = Host(gdb);
      }
      ExpectClose(results[0][0], dx, 1e-5, 1e-6, "NarrowLinearBackward dx");
      ExpectClose(results[0][1], dw, 1e-5, 1e-5, "NarrowLinearBackward d_w (+=)");
      ExpectClose(results[0][2], db, 1e-5, 1e-5, "NarrowLinearBackward d_bias (+=)");
      if (!c.bias) ExpectBitwise(results[0][2], db0, "NarrowLinearBackward d_bias untouched");
      for (int k = 0; k < 3; ++k) ExpectSameBits(results[1][k], results[0][k], "NarrowLinearBackward");
    }
  }
  // The operand checks are the CPU's.
  const Tensor gx = Dev(Random({7, 5}, 88)), gw = Dev(Random({17, 5}, 89));
  Tensor gy = Poisoned({7, 17}), no_bias;
  const absl::Status s = gmk_->NarrowLinearForward(gx, gw, no_bias, gy);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("17 outputs"), std::string::npos) << s;
  Tensor alias = Dev(Random({7, 5}, 90)), gdw = Dev(Random({6, 5}, 91));
  const Tensor gw6 = Dev(Random({6, 5}, 92)), gdy = Dev(Random({7, 6}, 93));
  const absl::Status a = gmk_->NarrowLinearBackward(alias, gw6, gdy, alias, true, gdw, no_bias);
  EXPECT_EQ(a.code(), absl::StatusCode::kInvalidArgument) << a;
  EXPECT_NE(std::string(a.message()).find("dx may not alias x"), std::string::npos) << a;
}

// The fused residual add + norm and norm backward + residual gradient: the
// bits of the GPU's separate ops, on the fused backward (W = 389) and the
// wide-row path (W = 1037), y fp32 and bf16, sum in place of b; close to the
// CPU's.
TEST_F(ModelKernelsBf16GpuTest, FusedResidualNormsEqualTheSeparateOps) {
  for (int64_t W : {int64_t{389}, int64_t{1037}}) {
    SCOPED_TRACE("W " + std::to_string(W));
    const int64_t N = 1031;
    const Tensor ha = Random({N, W}, 121, 2.f), hb = Random({N, W}, 122), hw = Random({W}, 123);
    const Tensor a = Dev(ha), b = Dev(hb), w = Dev(hw);
    for (bool y16 : {false, true}) {
      SCOPED_TRACE(y16 ? "bf16 y" : "fp32 y");
      Tensor sum = Poisoned({N, W}), y = y16 ? P16({N, W}) : Poisoned({N, W});
      Tensor rstd = Poisoned({N});
      SMAT_ASSERT_OK(gmk_->ResidualAdd(a, b, sum));
      SMAT_ASSERT_OK(gmk_->RmsNormForward(sum, w, 1e-6f, y, rstd));
      Tensor in_place = Dev(hb), y2 = y16 ? P16({N, W}) : Poisoned({N, W});
      Tensor rstd2 = Poisoned({N});
      SMAT_ASSERT_OK(gmk_->AddRmsNormForward(a, in_place, w, 1e-6f, in_place, y2, rstd2));
      ExpectBitwise(Host(in_place), Host(sum), "AddRmsNormForward sum");
      ExpectBitwise(Host(y2), Host(y), "AddRmsNormForward y");
      ExpectBitwise(Host(rstd2), Host(rstd), "AddRmsNormForward rstd");
      if (!y16) {
        Tensor csum = Clone(ha), cy = Clone(ha), crstd = *Tensor::Empty({N}, DType::kF32);
        SMAT_ASSERT_OK(cmk_->AddRmsNormForward(ha, hb, hw, 1e-6f, csum, cy, crstd));
        ExpectBitwise(Host(in_place), csum, "AddRmsNormForward sum vs CPU");
        ExpectClose(Host(y2), cy, 4e-7, 0, "AddRmsNormForward y vs CPU");
      }
    }
    const Tensor hdy = Random({N, W}, 124), hres = Random({N, W}, 125), hdw0 = Random({W}, 126);
    const Tensor dy = Dev(hdy), res = Dev(hres);
    Tensor y = Poisoned({N, W}), rstd = Poisoned({N});
    SMAT_ASSERT_OK(gmk_->RmsNormForward(a, w, 1e-6f, y, rstd));
    Tensor dx = Poisoned({N, W}), dw = Dev(hdw0);
    SMAT_ASSERT_OK(gmk_->RmsNormBackward(a, w, rstd, dy, dx, dw));
    SMAT_ASSERT_OK(gmk_->ResidualAdd(dx, res, dx));
    Tensor dx2 = Poisoned({N, W}), dw2 = Dev(hdw0);
    SMAT_ASSERT_OK(gmk_->RmsNormBackwardAdd(a, w, rstd, dy, res, dx2, dw2));
    ExpectBitwise(Host(dx2), Host(dx), "RmsNormBackwardAdd dx");
    ExpectBitwise(Host(dw2), Host(dw), "RmsNormBackwardAdd d_weight");
    Tensor cdx = Clone(ha), cdw = Clone(hdw0);
    SMAT_ASSERT_OK(cmk_->RmsNormBackwardAdd(ha, hw, Host(rstd), hdy, hres, cdx, cdw));
    ExpectClose(Host(dx2), cdx, 1e-5, 1e-6, "RmsNormBackwardAdd dx vs CPU");
    ExpectClose(Host(dw2), cdw, 1e-5, 1e-5, "RmsNormBackwardAdd d_weight vs CPU");
    Tensor alias = Dev(hres);
    const absl::Status s = gmk_->RmsNormBackwardAdd(a, w, rstd, dy, alias, alias, dw2);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
}

TEST_F(ModelKernelsBf16GpuTest, SigmoidScaleBf16OutputIsTheCastOfFp32) {
  const int64_t N = 1031, H = 3, r = 61;
  const Tensor hx = Random({N, H, r}, 131, 3.f), hg = Random({N, H}, 132, 3.f);
  const Tensor x = Dev(hx), g = Dev(hg);
  Tensor y = Poisoned({N, H, r}), y16 = P16({N, H, r});
  SMAT_ASSERT_OK(gmk_->SigmoidScaleForward(x, g, y));
  SMAT_ASSERT_OK(gmk_->SigmoidScaleForward(x, g, y16));
  ExpectBitwise(Host(y16), Host(To(y, DType::kBF16)), "SigmoidScaleForward bf16 y");
  Tensor cy = Clone(hx);
  SMAT_ASSERT_OK(cmk_->SigmoidScaleForward(hx, hg, cy));
  ExpectClose(Host(y), cy, 1e-5, 1e-6, "SigmoidScaleForward y vs CPU");
}

// The backward of softplus(conv(x)) in one pass: the bits of the GPU's
// SoftplusBackward then ShortConvBackward (float4 and scalar paths, fp32 and
// bf16 dx, runs that end inside a sequence and sequences shorter than the
// halo), and close to the CPU's.
TEST_F(ModelKernelsBf16GpuTest, ShortConvSoftplusBackwardEqualsTheSeparateOps) {
  constexpr int64_t K = kShortConvWidth;
  struct Case {
    int64_t nb, L, C;
  };
  for (const Case& k : {Case{3, 347, 389}, Case{2, 37, 132}, Case{3, 2, 12}, Case{2, 1, 4}}) {
    const int64_t nb = k.nb, L = k.L, C = k.C;
    const Tensor hx = Random({nb, L, C}, 141), hp = Random({nb, K - 1, C}, 142);
    const Tensor hw = Random({K, C}, 143), hz = Random({nb, L, C}, 144, 4.f);
    const Tensor hdy = Random({nb, L, C}, 145), hdw0 = Random({K, C}, 146);
    const Tensor x = Dev(hx), prefix = Dev(hp), w = Dev(hw), z = Dev(hz), dy = Dev(hdy);
    for (bool dx16 : {false, true}) {
      SCOPED_TRACE("nb " + std::to_string(nb) + ", L " + std::to_string(L) + ", C " +
                   std::to_string(C) + (dx16 ? ", bf16 dx" : ", fp32 dx"));
      Tensor g = Poisoned({nb, L, C});
      SMAT_ASSERT_OK(gmk_->SoftplusBackward(z, dy, g));
      Tensor dx = dx16 ? P16({nb, L, C}) : Poisoned({nb, L, C});
      Tensor dp = Poisoned({nb, K - 1, C}), dw = Dev(hdw0);
      SMAT_ASSERT_OK(gmk_->ShortConvBackward(x, prefix, w, g, dx, dp, dw));
      Tensor dx2 = dx16 ? P16({nb, L, C}) : Poisoned({nb, L, C});
      Tensor dp2 = Poisoned({nb, K - 1, C}), dw2 = Dev(hdw0);
      SMAT_ASSERT_OK(gmk_->ShortConvSoftplusBackward(x, prefix, w, z, dy, dx2, dp2, dw2));
      ExpectBitwise(Host(dx2), Host(dx), "ShortConvSoftplusBackward dx");
      ExpectBitwise(Host(dp2), Host(dp), "ShortConvSoftplusBackward d_prefix");
      ExpectBitwise(Host(dw2), Host(dw), "ShortConvSoftplusBackward d_w");
      if (!dx16) {
        Tensor cdx = Clone(hx), cdp = Clone(hp), cdw = Clone(hdw0);
        SMAT_ASSERT_OK(cmk_->ShortConvSoftplusBackward(hx, hp, hw, hz, hdy, cdx, cdp, cdw));
        ExpectClose(Host(dx2), cdx, 1e-5, 1e-6, "ShortConvSoftplusBackward dx vs CPU");
        ExpectClose(Host(dp2), cdp, 1e-5, 1e-6, "ShortConvSoftplusBackward d_prefix vs CPU");
        ExpectClose(Host(dw2), cdw, 1e-5, 1e-5, "ShortConvSoftplusBackward d_w vs CPU");
      }
    }
    Tensor alias = Dev(hdy), dp = Poisoned({nb, K - 1, C}), dw = Dev(hdw0);
    const absl::Status s = gmk_->ShortConvSoftplusBackward(x, prefix, w, z, alias, alias, dp, dw);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    // The forward: y and softplus(y) (fp32 and bf16) as the separate ops.
    for (bool f16 : {false, true}) {
      SCOPED_TRACE(f16 ? "forward, bf16 f" : "forward, fp32 f");
      Tensor y = Poisoned({nb, L, C}), f = f16 ? P16({nb, L, C}) : Poisoned({nb, L, C});
      SMAT_ASSERT_OK(gmk_->ShortConvForward(x, prefix, w, y));
      SMAT_ASSERT_OK(gmk_->SoftplusForward(y, f));
      Tensor y2 = Poisoned({nb, L, C}), f2 = f16 ? P16({nb, L, C}) : Poisoned({nb, L, C});
      SMAT_ASSERT_OK(gmk_->ShortConvSoftplusForward(x, prefix, w, y2, f2));
      ExpectBitwise(Host(y2), Host(y), "ShortConvSoftplusForward y");
      ExpectBitwise(Host(f2), Host(f), "ShortConvSoftplusForward f");
      if (!f16) {
        Tensor cy = Clone(hx), cf = Clone(hx);
        SMAT_ASSERT_OK(cmk_->ShortConvSoftplusForward(hx, hp, hw, cy, cf));
        ExpectBitwise(Host(y2), cy, "ShortConvSoftplusForward y vs CPU");
        ExpectClose(Host(f2), cf, 1e-5, 1e-6, "ShortConvSoftplusForward f vs CPU");
      }
    }
  }
}

}  // namespace
}  // namespace gpu_test
}  // namespace smat
