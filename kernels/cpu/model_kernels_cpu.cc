// CPU model ops: see kernels/model_kernels.h for the definitions and
// kernels/cpu/model_kernels_cpu.h for the role of this file.
#include "kernels/cpu/model_kernels_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/model_kernels_check.h"

namespace smat {
namespace {

// The CPU kernels read and write host memory.
const Device kHost = Device::Cpu();

float Sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// Element i of an fp32 or bf16 tensor as fp32 (bf16 widened exactly).
class FloatIn {
 public:
  explicit FloatIn(const Tensor& t)
      : f_(t.dtype() == DType::kF32 ? static_cast<const float*>(t.raw()) : nullptr),
        h_(static_cast<const uint16_t*>(t.raw())) {}
  float operator[](int64_t i) const { return f_ != nullptr ? f_[i] : Bf16ToFloat(h_[i]); }

 private:
  const float* f_;
  const uint16_t* h_;
};

// Stores fp32 values into an fp32 tensor, or (bf16) their FloatToBf16
// rounding: the bits Cast of the fp32 result would give.
class FloatOut {
 public:
  explicit FloatOut(Tensor& t)
      : f_(t.dtype() == DType::kF32 ? static_cast<float*>(t.raw()) : nullptr),
        h_(static_cast<uint16_t*>(t.raw())) {}
  void Set(int64_t i, float v) const {
    if (f_ != nullptr) {
      f_[i] = v;
    } else {
      h_[i] = FloatToBf16(v);
    }
  }

 private:
  float* f_;
  uint16_t* h_;
};

bool AllF32(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (t->dtype() != DType::kF32) return false;
  }
  return true;
}

// An fp32 output written in place, with FloatOut's Set.
struct F32Out {
  float* p;
  void Set(int64_t i, float v) const { p[i] = v; }
};

// SwiGLU's loops, one for every dtype: In is `const float*` or FloatIn, Out
// F32Out or FloatOut. On fp32 tensors the raw pointers spare the loop a test
// of the dtype at every element; the arithmetic is the same either way.
template <class In, class Out>
void SwiGluForwardLoop(const In& a, const In& b, int64_t n, const Out& o) {
  for (int64_t i = 0; i < n; ++i) {
    const float ai = a[i];
    o.Set(i, ai * Sigmoid(ai) * b[i]);
  }
}

template <class In, class Out>
void SwiGluBackwardLoop(const In& a, const In& b, const In& g, int64_t n, const Out& ga,
                        const Out& gb) {
  for (int64_t i = 0; i < n; ++i) {
    const float ai = a[i], s = Sigmoid(ai);
    const float gi = g[i], bi = b[i];  // read first: d_gate may alias dy
    gb.Set(i, gi * ai * s);
    ga.Set(i, gi * bi * s * (1.f + ai * (1.f - s)));  // silu'(a) = s (1 + a (1 - s))
  }
}

class CpuModelKernels final : public ModelKernels {
 public:
  absl::Status EmbeddingForward(const Tensor& table, const Tensor& ids, Tensor& out,
                                Stream*) override {
    SMAT_ASSIGN_OR_RETURN(VocabDims d, CheckEmbedding("EmbeddingForward", {table, "table"}, ids,
                                                      {out, "out"}, kHost));
    const auto [N, V, W] = d;
    const int32_t* id = ids.data<int32_t>();  // [N]
    const float* tab = table.data<float>();    // [V, W]
    float* o = out.data<float>();              // [N, W]
    for (int64_t i = 0; i < N; ++i) {
      if (id[i] < 0 || id[i] >= V) {
        return absl::InvalidArgumentError(absl::StrCat("EmbeddingForward: token id ", id[i],
                                                       " at row ", i, " is outside [0, ", V,
                                                       "); check model.vocab_size against the data"));
      }
      std::copy(tab + id[i] * W, tab + (id[i] + 1) * W, o + i * W);
    }
    return absl::OkStatus();
  }

  absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& d_out, Tensor& d_table,
                                 Stream*) override {
    SMAT_ASSIGN_OR_RETURN(VocabDims d, CheckEmbedding("EmbeddingBackward", {d_table, "d_table"},
                                                      ids, {d_out, "d_out"}, kHost));
    const auto [N, V, W] = d;
    const int32_t* id = ids.data<int32_t>();  // [N]
    const float* g = d_out.data<float>();      // [N, W]
    float* dt = d_table.data<float>();         // [V, W]
    // Rows in increasing order: a token repeated in the batch always sums its
    // rows in the same order, so the result is the same bits every run.
    for (int64_t i = 0; i < N; ++i) {
      if (id[i] < 0 || id[i] >= V) {
        return absl::InvalidArgumentError(absl::StrCat("EmbeddingBackward: token id ", id[i],
                                                       " at row ", i, " is outside [0, ", V, ")"));
      }
      float* row = dt + id[i] * W;
      for (int64_t j = 0; j < W; ++j) row[j] += g[i * W + j];
    }
    return absl::OkStatus();
  }

  absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                              Tensor& rstd, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols nw, CheckRmsNormForward(x, weight, y, rstd, kHost));
    const auto [N, W] = nw;
    const float* xp = x.data<float>();       // [N, W]
    const float* w = weight.data<float>();   // [W]
    const FloatOut yp(y);                    // [N, W]
    float* rs = rstd.data<float>();          // [N]
    for (int64_t i = 0; i < N; ++i) {
      const float* row = xp + i * W;
      double ss = 0.0;  // double: W up to thousands of squares, summed in order
      for (int64_t j = 0; j < W; ++j) ss += double{row[j]} * row[j];
      const float r = static_cast<float>(1.0 / std::sqrt(ss / W + eps));
      rs[i] = r;
      for (int64_t j = 0; j < W; ++j) yp.Set(i * W + j, row[j] * r * w[j]);
    }
    return absl::OkStatus();
  }

  absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                               const Tensor& dy, Tensor& dx, Tensor& d_weight, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols nw,
                          CheckRmsNormBackward(x, weight, rstd, dy, dx, d_weight, kHost));
    const auto [N, W] = nw;
    const float* xp = x.data<float>();      // [N, W]
    const float* w = weight.data<float>();  // [W]
    const float* rs = rstd.data<float>();   // [N]
    const float* g = dy.data<float>();      // [N, W]
    float* gx = dx.data<float>();           // [N, W]
    float* gw = d_weight.data<float>();     // [W]
    for (int64_t i = 0; i < N; ++i) {
      const float* row = xp + i * W;
      const float* grow = g + i * W;
      const float r = rs[i];
      // y_j = x_j r w_j with r = (mean x^2 + eps)^-1/2, so
      // dx_j = r w_j dy_j - x_j r^3 / W * sum_k dy_k w_k x_k.
      double dot = 0.0;
      for (int64_t j = 0; j < W; ++j) dot += double{grow[j]} * w[j] * row[j];
      const float c = static_cast<float>(dot * r * r * r / W);
      for (int64_t j = 0; j < W; ++j) {
        gx[i * W + j] = r * w[j] * grow[j] - row[j] * c;
        gw[j] += grow[j] * row[j] * r;
      }
    }
    return absl::OkStatus();
  }

  absl::Status AddRmsNormForward(const Tensor& a, const Tensor& b, const Tensor& weight, float eps,
                                 Tensor& sum, Tensor& y, Tensor& rstd, Stream*) override {
    SMAT_RETURN_IF_ERROR(CheckAddRmsNormForward(a, b, weight, sum, y, rstd, kHost).status());
    SMAT_RETURN_IF_ERROR(ResidualAdd(a, b, sum, nullptr));
    return RmsNormForward(sum, weight, eps, y, rstd, nullptr);
  }

  absl::Status RmsNormBackwardAdd(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                  const Tensor& dy, const Tensor& d_residual, Tensor& dx,
                                  Tensor& d_weight, Stream*) override {
    SMAT_RETURN_IF_ERROR(
        CheckRmsNormBackwardAdd(x, weight, rstd, dy, d_residual, dx, d_weight, kHost).status());
    SMAT_RETURN_IF_ERROR(RmsNormBackward(x, weight, rstd, dy, dx, d_weight, nullptr));
    return ResidualAdd(dx, d_residual, dx, nullptr);
  }

  absl::Status SwiGluForward(const Tensor& gate, const Tensor& up, Tensor& y, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols nf, CheckSwiGluForward(gate, up, y, kHost));
    const int64_t n = nf.rows * nf.cols;
    if (AllF32({&gate, &up, &y})) {
      SwiGluForwardLoop(gate.data<float>(), up.data<float>(), n, F32Out{y.data<float>()});
    } else {
      SwiGluForwardLoop(FloatIn(gate), FloatIn(up), n, FloatOut(y));  // [N, F] each
    }
    return absl::OkStatus();
  }

  absl::Status SwiGluBackward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                              Tensor& d_gate, Tensor& d_up, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols nf, CheckSwiGluBackward(gate, up, dy, d_gate, d_up, kHost));
    const int64_t n = nf.rows * nf.cols;
    if (AllF32({&gate, &up, &dy, &d_gate, &d_up})) {
      SwiGluBackwardLoop(gate.data<float>(), up.data<float>(), dy.data<float>(), n,
                         F32Out{d_gate.data<float>()}, F32Out{d_up.data<float>()});
    } else {
      SwiGluBackwardLoop(FloatIn(gate), FloatIn(up), FloatIn(dy), n, FloatOut(d_gate),
                         FloatOut(d_up));  // [N, F] each
    }
    return absl::OkStatus();
  }

  absl::Status ResidualAdd(const Tensor& a, const Tensor& b, Tensor& out, Stream*) override {
    SMAT_RETURN_IF_ERROR(
        CheckElementwise("ResidualAdd", {{a, "a"}, {b, "b"}, {out, "out"}}, kHost));
    const float* x = a.data<float>();
    const float* z = b.data<float>();
    float* o = out.data<float>();
    for (int64_t i = 0; i < a.numel(); ++i) o[i] = x[i] + z[i];
    return absl::OkStatus();
  }

  absl::Status NegSoftplusForward(const Tensor& x, Tensor& y, Stream*) override {
    SMAT_RETURN_IF_ERROR(CheckUnaryForward("NegSoftplusForward", x, y, kHost));
    const float* xp = x.data<float>();
    const FloatOut yp(y);
    // softplus(x) = max(x, 0) + log1p(exp(-|x|)): no overflow for large |x|.
    for (int64_t i = 0; i < x.numel(); ++i) {
      yp.Set(i, -(std::max(xp[i], 0.f) + std::log1p(std::exp(-std::fabs(xp[i])))));
    }
    return absl::OkStatus();
  }

  absl::Status NegSoftplusBackward(const Tensor& x, const Tensor& dy, Tensor& dx,
                                   Stream*) override {
    SMAT_RETURN_IF_ERROR(
        CheckElementwise("NegSoftplusBackward", {{x, "x"}, {dy, "dy"}, {dx, "dx"}}, kHost));
    const float* xp = x.data<float>();
    const float* g = dy.data<float>();
    float* gx = dx.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) gx[i] = -Sigmoid(xp[i]) * g[i];
    return absl::OkStatus();
  }

  absl::Status SigmoidScaleForward(const Tensor& x, const Tensor& g, Tensor& y, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckSigmoidScaleForward(x, g, y, kHost));
    const auto [N, H, r] = d;
    const float* xp = x.data<float>();  // [N, H, r]
    const float* gp = g.data<float>();  // [N, H]
    const FloatOut yp(y);               // [N, H, r]
    for (int64_t i = 0; i < N * H; ++i) {
      const float s = Sigmoid(gp[i]);
      for (int64_t j = 0; j < r; ++j) yp.Set(i * r + j, xp[i * r + j] * s);
    }
    return absl::OkStatus();
  }

  absl::Status SigmoidScaleBackward(const Tensor& x, const Tensor& g, const Tensor& dy,
                                    Tensor& dx, Tensor& dg, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckSigmoidScaleBackward(x, g, dy, dx, dg, kHost));
    const auto [N, H, r] = d;
    const float* xp = x.data<float>();   // [N, H, r]
    const float* gp = g.data<float>();   // [N, H]
    const float* gy = dy.data<float>();  // [N, H, r]
    float* gx = dx.data<float>();        // [N, H, r]
    float* gg = dg.data<float>();        // [N, H]
    for (int64_t i = 0; i < N * H; ++i) {
      const float s = Sigmoid(gp[i]);
      double dot = 0.0;
      for (int64_t j = 0; j < r; ++j) dot += double{xp[i * r + j]} * gy[i * r + j];
      for (int64_t j = 0; j < r; ++j) gx[i * r + j] = s * gy[i * r + j];
      gg[i] = static_cast<float>(dot) * s * (1.f - s);
    }
    return absl::OkStatus();
  }

  absl::Status FeatureMapForward(FeatureMap f, const Tensor& x, Tensor& y, Stream*) override {
    SMAT_RETURN_IF_ERROR(CheckFeatureMapForward(f, x, y, kHost));
    // The host loop of kernels/feature_map.h (qualified: this member hides it).
    if (y.dtype() == DType::kF32) {
      smat::FeatureMapForward(f, x.data<float>(), y.data<float>(), x.numel());
      return absl::OkStatus();
    }
    std::vector<float> wide(static_cast<size_t>(x.numel()));  // bf16 y: fp32 first, then rounded
    smat::FeatureMapForward(f, x.data<float>(), wide.data(), x.numel());
    const FloatOut yp(y);
    for (int64_t i = 0; i < x.numel(); ++i) yp.Set(i, wide[i]);
    return absl::OkStatus();
  }

  absl::Status FeatureMapBackward(FeatureMap f, const Tensor& x, const Tensor& dy, Tensor& dx,
                                  Stream*) override {
    SMAT_RETURN_IF_ERROR(
        CheckFeatureMap("FeatureMapBackward", f, {{x, "x"}, {dy, "dy"}, {dx, "dx"}}, kHost));
    smat::FeatureMapBackward(f, x.data<float>(), dy.data<float>(), dx.data<float>(), x.numel());
    return absl::OkStatus();
  }

  absl::Status SoftplusForward(const Tensor& x, Tensor& y, Stream*) override {
    SMAT_RETURN_IF_ERROR(CheckUnaryForward("SoftplusForward", x, y, kHost));
    const float* xp = x.data<float>();
    const FloatOut yp(y);
    for (int64_t i = 0; i < x.numel(); ++i) {
      yp.Set(i, std::max(xp[i], 0.f) + std::log1p(std::exp(-std::fabs(xp[i]))));
    }
    return absl::OkStatus();
  }

  absl::Status SoftplusBackward(const Tensor& x, const Tensor& dy, Tensor& dx, Stream*) override {
    SMAT_RETURN_IF_ERROR(
        CheckElementwise("SoftplusBackward", {{x, "x"}, {dy, "dy"}, {dx, "dx"}}, kHost));
    const float* xp = x.data<float>();
    const float* g = dy.data<float>();
    float* gx = dx.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) gx[i] = Sigmoid(xp[i]) * g[i];
    return absl::OkStatus();
  }

  absl::Status ExpRowMaxForward(const Tensor& x, Tensor& y, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols mr,
                          CheckMatrices("ExpRowMaxForward", {{x, "x"}, {y, "y"}}, kHost));
    const auto [M, r] = mr;
    const float* xp = x.data<float>();  // [M, r]
    float* yp = y.data<float>();        // [M, r]
    for (int64_t i = 0; i < M; ++i) {
      const float* row = xp + i * r;
      const float mx = *std::max_element(row, row + r);
      for (int64_t j = 0; j < r; ++j) yp[i * r + j] = std::exp(row[j] - mx);
    }
    return absl::OkStatus();
  }

  absl::Status ExpRowMaxBackward(const Tensor& x, const Tensor& y, const Tensor& dy, Tensor& dx,
                                 Stream*) override {
    SMAT_ASSIGN_OR_RETURN(
        RowsCols mr,
        CheckMatrices("ExpRowMaxBackward", {{x, "x"}, {y, "y"}, {dy, "dy"}, {dx, "dx"}}, kHost));
    const auto [M, r] = mr;
    const float* xp = x.data<float>();   // [M, r]
    const float* yp = y.data<float>();   // [M, r]
    const float* g = dy.data<float>();   // [M, r]
    float* gx = dx.data<float>();        // [M, r]
    for (int64_t i = 0; i < M; ++i) {
      const float* row = xp + i * r;
      const int64_t a = std::max_element(row, row + r) - row;  // first argmax
      double dot = 0.0;
      for (int64_t j = 0; j < r; ++j) dot += double{yp[i * r + j]} * g[i * r + j];
      for (int64_t j = 0; j < r; ++j) gx[i * r + j] = yp[i * r + j] * g[i * r + j];
      gx[i * r + a] -= static_cast<float>(dot);
    }
    return absl::OkStatus();
  }

  absl::Status ShortConvForward(const Tensor& x, const Tensor& prefix, const Tensor& w, Tensor& y,
                                Stream*) override {
    constexpr int64_t K = kShortConvWidth;
    SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckShortConvForward(x, prefix, w, y, kHost));
    const auto [nb, L, C] = d;
    const float* xp = x.data<float>();       // [batch, L, C]
    const float* pp = prefix.data<float>();  // [batch, K-1, C]
    const float* wp = w.data<float>();       // [K, C]
    const FloatOut yp(y);                    // [batch, L, C]
    std::vector<float> out(static_cast<size_t>(C));  // one output row in fp32
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t t = 0; t < L; ++t) {
        for (int64_t c = 0; c < C; ++c) out[c] = 0.f;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t s = t - (K - 1) + j;  // source row, negative: from the prefix
          const float* in = s >= 0 ? xp + (b * L + s) * C : pp + (b * (K - 1) + (K - 1) + s) * C;
          for (int64_t c = 0; c < C; ++c) out[c] += wp[j * C + c] * in[c];
        }
        for (int64_t c = 0; c < C; ++c) yp.Set((b * L + t) * C + c, out[c]);
      }
    }
    return absl::OkStatus();
  }

  absl::Status ShortConvBackward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                 const Tensor& dy, Tensor& dx, Tensor& d_prefix, Tensor& d_w,
                                 Stream*) override {
    constexpr int64_t K = kShortConvWidth;
    SMAT_ASSIGN_OR_RETURN(Dims3 d,
                          CheckShortConvBackward(x, prefix, w, dy, dx, d_prefix, d_w, kHost));
    const auto [nb, L, C] = d;
    const float* xp = x.data<float>();       // [batch, L, C]
    const float* pp = prefix.data<float>();  // [batch, K-1, C]
    const float* wp = w.data<float>();       // [K, C]
    const float* gy = dy.data<float>();      // [batch, L, C]
    const FloatOut gx(dx);                   // [batch, L, C]
    float* gp = d_prefix.data<float>();      // [batch, K-1, C]
    float* gw = d_w.data<float>();           // [K, C]
    std::vector<float> row(static_cast<size_t>(C));  // one dx row in fp32
    // Gather form (each input row sums the outputs it fed, taps in increasing
    // order): no scatter, so the order of additions is fixed per element.
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t s = -(K - 1); s < L; ++s) {
        float* out = s >= 0 ? row.data() : gp + (b * (K - 1) + (K - 1) + s) * C;
        for (int64_t c = 0; c < C; ++c) out[c] = 0.f;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t t = s + (K - 1) - j;  // the output row that read s through tap j
          if (t < 0 || t >= L) continue;
          const float* g = gy + (b * L + t) * C;
          for (int64_t c = 0; c < C; ++c) out[c] += wp[j * C + c] * g[c];
        }
        if (s >= 0) {
          for (int64_t c = 0; c < C; ++c) gx.Set((b * L + s) * C + c, row[c]);
        }
      }
      for (int64_t t = 0; t < L; ++t) {
        const float* g = gy + (b * L + t) * C;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t s = t - (K - 1) + j;
          const float* in = s >= 0 ? xp + (b * L + s) * C : pp + (b * (K - 1) + (K - 1) + s) * C;
          for (int64_t c = 0; c < C; ++c) gw[j * C + c] += g[c] * in[c];
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status ShortConvSoftplusForward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                        Tensor& y, Tensor& f, Stream*) override {
    SMAT_RETURN_IF_ERROR(CheckShortConvSoftplusForward(x, prefix, w, y, f, kHost).status());
    SMAT_RETURN_IF_ERROR(ShortConvForward(x, prefix, w, y, nullptr));
    return SoftplusForward(y, f, nullptr);
  }

  absl::Status ShortConvSoftplusBackward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                         const Tensor& z, const Tensor& dy, Tensor& dx,
                                         Tensor& d_prefix, Tensor& d_w, Stream*) override {
    SMAT_RETURN_IF_ERROR(
        CheckShortConvSoftplusBackward(x, prefix, w, z, dy, dx, d_prefix, d_w, kHost).status());
    SMAT_ASSIGN_OR_RETURN(Tensor g, Tensor::Empty(dy.shape(), DType::kF32));
    SMAT_RETURN_IF_ERROR(SoftplusBackward(z, dy, g, nullptr));
    return ShortConvBackward(x, prefix, w, g, dx, d_prefix, d_w, nullptr);
  }

  absl::Status NarrowLinearForward(const Tensor& x, const Tensor& w, const Tensor& bias,
                                   Tensor& y, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckNarrowLinearForward(x, w, bias, y, kHost));
    const auto [N, in, out] = d;
    const FloatIn xp(x);  // [N, in]
    const FloatIn wp(w);  // [out, in]
    const float* bp = bias.defined() ? bias.data<float>() : nullptr;
    float* yp = y.data<float>();  // [N, out]
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t o = 0; o < out; ++o) {
        float s = 0.f;
        for (int64_t j = 0; j < in; ++j) s += xp[i * in + j] * wp[o * in + j];
        yp[i * out + o] = bp != nullptr ? s + bp[o] : s;
      }
    }
    return absl::OkStatus();
  }

  absl::Status NarrowLinearBackward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                    Tensor& dx, bool accumulate_dx, Tensor& d_w, Tensor& d_bias,
                                    Stream*) override {
    SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckNarrowLinearBackward(x, w, dy, dx, d_w, d_bias, kHost));
    const auto [N, in, out] = d;
    const FloatIn xp(x);              // [N, in]
    const FloatIn wp(w);              // [out, in]
    const float* g = dy.data<float>();  // [N, out]
    float* gx = dx.data<float>();     // [N, in]
    float* gw = d_w.data<float>();    // [out, in]
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t j = 0; j < in; ++j) {
        float s = 0.f;
        for (int64_t o = 0; o < out; ++o) s += g[i * out + o] * wp[o * in + j];
        gx[i * in + j] = accumulate_dx ? gx[i * in + j] + s : s;
      }
    }
    // Per element of d_w and d_bias: the rows' terms summed in row order, then
    // added to the gradient.
    std::vector<float> acc(static_cast<size_t>(out * in), 0.f), acc_b(static_cast<size_t>(out), 0.f);
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t o = 0; o < out; ++o) {
        const float go = g[i * out + o];
        for (int64_t j = 0; j < in; ++j) acc[o * in + j] += go * xp[i * in + j];
        acc_b[o] += go;
      }
    }
    for (int64_t k = 0; k < out * in; ++k) gw[k] += acc[k];
    if (d_bias.defined()) {
      float* gb = d_bias.data<float>();
      for (int64_t o = 0; o < out; ++o) gb[o] += acc_b[o];
    }
    return absl::OkStatus();
  }

  absl::Status CrossEntropyForward(Backend& backend, const Tensor& h, const Tensor& w_head,
                                   const Tensor& targets, const Tensor& weights,
                                   int64_t chunk_tokens, Tensor& lse, double* loss_sum,
                                   Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(VocabDims d,
                          CheckCrossEntropyForward(h, w_head, targets, weights, chunk_tokens, lse,
                                                   loss_sum, kHost));
    const auto [N, V, W] = d;
    const int32_t* tg = targets.data<int32_t>();  // [N]
    const float* wt = weights.data<float>();       // [N]
    float* ls = lse.data<float>();                 // [N]
    SMAT_RETURN_IF_ERROR(CheckTargets(tg, wt, N, V, "CrossEntropyForward"));
    const int64_t rows = std::min(chunk_tokens, std::max<int64_t>(N, 1));
    SMAT_ASSIGN_OR_RETURN(Tensor scratch, Tensor::Empty({rows, V}, DType::kF32));  // [chunk, V]
    double total = 0.0;
    for (int64_t i0 = 0; i0 < N; i0 += rows) {
      const int64_t m = std::min(rows, N - i0);
      Tensor hc = h.View(i0 * W, {m, W});        // [m, W]
      Tensor logits = scratch.View(0, {m, V});   // [m, V]
      SMAT_RETURN_IF_ERROR(
          backend.Gemm(Transpose::kNo, Transpose::kYes, 1.f, hc, w_head, 0.f, logits, stream));
      const float* lg = logits.data<float>();
      for (int64_t i = 0; i < m; ++i) {
        const float* row = lg + i * V;
        const double l = LogSumExp(row, V);
        ls[i0 + i] = static_cast<float>(l);
        if (wt[i0 + i] != 0.f) total += double{wt[i0 + i]} * (l - row[tg[i0 + i]]);
      }
    }
    *loss_sum = total;
    return absl::OkStatus();
  }

  absl::Status CrossEntropyBackward(Backend& backend, const Tensor& h, const Tensor& w_head,
                                    const Tensor& targets, const Tensor& weights, const Tensor& lse,
                                    float scale, int64_t chunk_tokens, Tensor& dh,
                                    Tensor& d_w_head, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(VocabDims d,
                          CheckCrossEntropyBackward(h, w_head, targets, weights, lse, chunk_tokens,
                                                    dh, d_w_head, kHost));
    const auto [N, V, W] = d;
    const int32_t* tg = targets.data<int32_t>();  // [N]
    const float* wt = weights.data<float>();       // [N]
    const float* ls = lse.data<float>();           // [N]
    SMAT_RETURN_IF_ERROR(CheckTargets(tg, wt, N, V, "CrossEntropyBackward"));
    const int64_t rows = std::min(chunk_tokens, std::max<int64_t>(N, 1));
    SMAT_ASSIGN_OR_RETURN(Tensor scratch, Tensor::Empty({rows, V}, DType::kF32));  // [chunk, V]
    for (int64_t i0 = 0; i0 < N; i0 += rows) {
      const int64_t m = std::min(rows, N - i0);
      Tensor hc = h.View(i0 * W, {m, W});        // [m, W]
      Tensor dhc = dh.View(i0 * W, {m, W});      // [m, W]
      Tensor logits = scratch.View(0, {m, V});   // [m, V], becomes dlogits in place
      SMAT_RETURN_IF_ERROR(
          backend.Gemm(Transpose::kNo, Transpose::kYes, 1.f, hc, w_head, 0.f, logits, stream));
      float* lg = logits.data<float>();
      for (int64_t i = 0; i < m; ++i) {
        float* row = lg + i * V;
        const float a = scale * wt[i0 + i];
        if (a == 0.f) {
          std::fill(row, row + V, 0.f);
          continue;
        }
        for (int64_t v = 0; v < V; ++v) row[v] = a * std::exp(row[v] - ls[i0 + i]);
        row[tg[i0 + i]] -= a;
      }
      SMAT_RETURN_IF_ERROR(
          backend.Gemm(Transpose::kNo, Transpose::kNo, 1.f, logits, w_head, 0.f, dhc, stream));
      SMAT_RETURN_IF_ERROR(
          backend.Gemm(Transpose::kYes, Transpose::kNo, 1.f, logits, hc, 1.f, d_w_head, stream));
    }
    return absl::OkStatus();
  }

  absl::Status Cast(const Tensor& src, Tensor& dst, Stream*) override {
    SMAT_RETURN_IF_ERROR(CheckCast(src, dst, kHost));
    const int64_t n = src.numel();
    if (src.dtype() == dst.dtype()) {
      std::copy_n(static_cast<const char*>(src.raw()), src.nbytes(), static_cast<char*>(dst.raw()));
    } else if (src.dtype() == DType::kF32) {
      const float* x = src.data<float>();
      uint16_t* y = static_cast<uint16_t*>(dst.raw());
      for (int64_t i = 0; i < n; ++i) y[i] = FloatToBf16(x[i]);
    } else {
      const uint16_t* x = static_cast<const uint16_t*>(src.raw());
      float* y = dst.data<float>();
      for (int64_t i = 0; i < n; ++i) y[i] = Bf16ToFloat(x[i]);
    }
    return absl::OkStatus();
  }

  absl::Status AdamWUpdate(Tensor& value, const Tensor& grad, Tensor& m, Tensor& v,
                           const AdamWScalars& s, Stream*) override {
    SMAT_RETURN_IF_ERROR(CheckElementwise(
        "AdamWUpdate", {{value, "value"}, {grad, "grad"}, {m, "m"}, {v, "v"}}, kHost));
    float* w = value.data<float>();
    const float* g = grad.data<float>();
    float* mp = m.data<float>();
    float* vp = v.data<float>();
    const int64_t n = value.numel();
    // Plain fp32 multiplies and adds: the CPU build targets baseline x86-64,
    // which has no fused multiply-add, and the CUDA kernel spells each
    // operation out (__fmul_rn, __fadd_rn), so both round alike.
    for (int64_t k = 0; k < n; ++k) {
      const float gk = g[k] * s.grad_scale;
      const float m1 = s.beta1 * mp[k], m2 = s.one_minus_beta1 * gk;
      mp[k] = m1 + m2;
      const float v1 = s.beta2 * vp[k], v2 = (s.one_minus_beta2 * gk) * gk;
      vp[k] = v1 + v2;
      const float denom = std::sqrt(vp[k]) * s.inv_sqrt_bc2 + s.eps;
      const float w1 = w[k] * s.decay, w2 = s.step_size * mp[k] / denom;
      w[k] = w1 - w2;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<double> SumOfSquares(absl::Span<const Tensor> tensors, Stream*) override {
    SMAT_RETURN_IF_ERROR(CheckSumOfSquares(tensors, kHost));
    double total = 0.0;
    for (const Tensor& t : tensors) {
      const float* p = t.data<float>();
      for (int64_t i = 0; i < t.numel(); ++i) total += double{p[i]} * p[i];
    }
    return total;
  }

 private:
  static double LogSumExp(const float* row, int64_t V) {
    float mx = row[0];
    for (int64_t v = 1; v < V; ++v) mx = std::max(mx, row[v]);
    double s = 0.0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(double{row[v]} - mx);
    return mx + std::log(s);
  }

  // Targets of counted rows (weight != 0) must index the vocabulary: they come
  // from data. Rows with weight 0 are never read.
  static absl::Status CheckTargets(const int32_t* tg, const float* wt, int64_t N, int64_t V,
                                   const char* op) {
    for (int64_t i = 0; i < N; ++i) {
      if (wt[i] != 0.f && (tg[i] < 0 || tg[i] >= V)) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": target ", tg[i], " at row ", i,
                                                       " is outside [0, ", V,
                                                       "); check model.vocab_size against the data"));
      }
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<ModelKernels> MakeCpuModelKernels() { return std::make_unique<CpuModelKernels>(); }

}  // namespace smat
