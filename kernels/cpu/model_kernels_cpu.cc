// CPU model ops: see kernels/model_kernels.h for the definitions and
// kernels/cpu/model_kernels_cpu.h for the role of this file.
#include "kernels/cpu/model_kernels_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace smat {
namespace {

// InvalidArgument unless t is a defined host tensor of `dtype` and `shape`.
absl::Status Expect(const Tensor& t, DType dtype, absl::Span<const int64_t> shape, const char* op,
                    const char* operand) {
  if (!t.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " is undefined"));
  }
  if (!t.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " is on ",
                                                   t.device().ToString(),
                                                   "; the CPU model kernels need host tensors"));
  }
  if (t.dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " is ", DTypeName(t.dtype()),
                                                   "; expected ", DTypeName(dtype)));
  }
  if (t.shape() != Shape(shape.begin(), shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " has shape ",
                                                   ShapeToString(t.shape()), "; expected ",
                                                   ShapeToString(shape)));
  }
  return absl::OkStatus();
}

// Rank-2 fp32 host tensor: returns {rows, cols}.
absl::StatusOr<std::pair<int64_t, int64_t>> Matrix(const Tensor& t, const char* op,
                                                   const char* operand) {
  if (!t.defined() || t.rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " must be a rank-2 tensor",
                                                   t.defined() ? "; got " + t.DebugString() : ""));
  }
  SMAT_RETURN_IF_ERROR(Expect(t, DType::kF32, t.shape(), op, operand));
  return std::make_pair(t.dim(0), t.dim(1));
}

float Sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// InvalidArgument unless f is one of the FeatureMap enumerators (a value cast
// from elsewhere would reach the host loops' SMAT_CHECK).
absl::Status ExpectFeatureMap(FeatureMap f, const char* op) {
  if (f == FeatureMap::kEluPlusOne || f == FeatureMap::kReluEps) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": unknown feature map ",
                                                 static_cast<int>(f),
                                                 "; expected kEluPlusOne or kReluEps"));
}

class CpuModelKernels final : public ModelKernels {
 public:
  absl::Status EmbeddingForward(const Tensor& table, const Tensor& ids, Tensor& out,
                                Stream*) override {
    SMAT_ASSIGN_OR_RETURN(auto vw, Matrix(table, "EmbeddingForward", "table"));
    const auto [V, W] = vw;
    if (!ids.defined() || ids.rank() != 1) {
      return absl::InvalidArgumentError("EmbeddingForward: ids must be int32 [N]");
    }
    const int64_t N = ids.dim(0);
    SMAT_RETURN_IF_ERROR(Expect(ids, DType::kI32, {N}, "EmbeddingForward", "ids"));
    SMAT_RETURN_IF_ERROR(Expect(out, DType::kF32, {N, W}, "EmbeddingForward", "out"));
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
    SMAT_ASSIGN_OR_RETURN(auto vw, Matrix(d_table, "EmbeddingBackward", "d_table"));
    const auto [V, W] = vw;
    if (!ids.defined() || ids.rank() != 1) {
      return absl::InvalidArgumentError("EmbeddingBackward: ids must be int32 [N]");
    }
    const int64_t N = ids.dim(0);
    SMAT_RETURN_IF_ERROR(Expect(ids, DType::kI32, {N}, "EmbeddingBackward", "ids"));
    SMAT_RETURN_IF_ERROR(Expect(d_out, DType::kF32, {N, W}, "EmbeddingBackward", "d_out"));
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
    SMAT_ASSIGN_OR_RETURN(auto nw, Matrix(x, "RmsNormForward", "x"));
    const auto [N, W] = nw;
    SMAT_RETURN_IF_ERROR(Expect(weight, DType::kF32, {W}, "RmsNormForward", "weight"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {N, W}, "RmsNormForward", "y"));
    SMAT_RETURN_IF_ERROR(Expect(rstd, DType::kF32, {N}, "RmsNormForward", "rstd"));
    const float* xp = x.data<float>();       // [N, W]
    const float* w = weight.data<float>();   // [W]
    float* yp = y.data<float>();             // [N, W]
    float* rs = rstd.data<float>();          // [N]
    for (int64_t i = 0; i < N; ++i) {
      const float* row = xp + i * W;
      double ss = 0.0;  // double: W up to thousands of squares, summed in order
      for (int64_t j = 0; j < W; ++j) ss += double{row[j]} * row[j];
      const float r = static_cast<float>(1.0 / std::sqrt(ss / W + eps));
      rs[i] = r;
      for (int64_t j = 0; j < W; ++j) yp[i * W + j] = row[j] * r * w[j];
    }
    return absl::OkStatus();
  }

  absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                               const Tensor& dy, Tensor& dx, Tensor& d_weight, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(auto nw, Matrix(x, "RmsNormBackward", "x"));
    const auto [N, W] = nw;
    SMAT_RETURN_IF_ERROR(Expect(weight, DType::kF32, {W}, "RmsNormBackward", "weight"));
    SMAT_RETURN_IF_ERROR(Expect(rstd, DType::kF32, {N}, "RmsNormBackward", "rstd"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {N, W}, "RmsNormBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, {N, W}, "RmsNormBackward", "dx"));
    SMAT_RETURN_IF_ERROR(Expect(d_weight, DType::kF32, {W}, "RmsNormBackward", "d_weight"));
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

  absl::Status SwiGluForward(const Tensor& gate, const Tensor& up, Tensor& y, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(auto nf, Matrix(gate, "SwiGluForward", "gate"));
    SMAT_RETURN_IF_ERROR(Expect(up, DType::kF32, gate.shape(), "SwiGluForward", "up"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, gate.shape(), "SwiGluForward", "y"));
    const int64_t n = nf.first * nf.second;
    const float* a = gate.data<float>();  // [N, F]
    const float* b = up.data<float>();    // [N, F]
    float* o = y.data<float>();           // [N, F]
    for (int64_t i = 0; i < n; ++i) o[i] = a[i] * Sigmoid(a[i]) * b[i];
    return absl::OkStatus();
  }

  absl::Status SwiGluBackward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                              Tensor& d_gate, Tensor& d_up, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(auto nf, Matrix(gate, "SwiGluBackward", "gate"));
    SMAT_RETURN_IF_ERROR(Expect(up, DType::kF32, gate.shape(), "SwiGluBackward", "up"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, gate.shape(), "SwiGluBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(d_gate, DType::kF32, gate.shape(), "SwiGluBackward", "d_gate"));
    SMAT_RETURN_IF_ERROR(Expect(d_up, DType::kF32, gate.shape(), "SwiGluBackward", "d_up"));
    const int64_t n = nf.first * nf.second;
    const float* a = gate.data<float>();  // [N, F]
    const float* b = up.data<float>();    // [N, F]
    const float* g = dy.data<float>();    // [N, F]
    float* ga = d_gate.data<float>();     // [N, F]
    float* gb = d_up.data<float>();       // [N, F]
    for (int64_t i = 0; i < n; ++i) {
      const float s = Sigmoid(a[i]);
      const float gi = g[i], bi = b[i];  // read first: d_gate may alias dy
      gb[i] = gi * a[i] * s;
      ga[i] = gi * bi * s * (1.f + a[i] * (1.f - s));  // silu'(a) = s (1 + a (1 - s))
    }
    return absl::OkStatus();
  }

  absl::Status ResidualAdd(const Tensor& a, const Tensor& b, Tensor& out, Stream*) override {
    SMAT_RETURN_IF_ERROR(Expect(a, DType::kF32, a.shape(), "ResidualAdd", "a"));
    SMAT_RETURN_IF_ERROR(Expect(b, DType::kF32, a.shape(), "ResidualAdd", "b"));
    SMAT_RETURN_IF_ERROR(Expect(out, DType::kF32, a.shape(), "ResidualAdd", "out"));
    const float* x = a.data<float>();
    const float* z = b.data<float>();
    float* o = out.data<float>();
    for (int64_t i = 0; i < a.numel(); ++i) o[i] = x[i] + z[i];
    return absl::OkStatus();
  }

  absl::Status NegSoftplusForward(const Tensor& x, Tensor& y, Stream*) override {
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, x.shape(), "NegSoftplusForward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, x.shape(), "NegSoftplusForward", "y"));
    const float* xp = x.data<float>();
    float* yp = y.data<float>();
    // softplus(x) = max(x, 0) + log1p(exp(-|x|)): no overflow for large |x|.
    for (int64_t i = 0; i < x.numel(); ++i) {
      yp[i] = -(std::max(xp[i], 0.f) + std::log1p(std::exp(-std::fabs(xp[i]))));
    }
    return absl::OkStatus();
  }

  absl::Status NegSoftplusBackward(const Tensor& x, const Tensor& dy, Tensor& dx,
                                   Stream*) override {
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, x.shape(), "NegSoftplusBackward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, x.shape(), "NegSoftplusBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, x.shape(), "NegSoftplusBackward", "dx"));
    const float* xp = x.data<float>();
    const float* g = dy.data<float>();
    float* gx = dx.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) gx[i] = -Sigmoid(xp[i]) * g[i];
    return absl::OkStatus();
  }

  absl::Status SigmoidScaleForward(const Tensor& x, const Tensor& g, Tensor& y, Stream*) override {
    if (!x.defined() || x.rank() != 3) {
      return absl::InvalidArgumentError("SigmoidScaleForward: x must be fp32 [N, H, r]");
    }
    const int64_t N = x.dim(0), H = x.dim(1), r = x.dim(2);
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, {N, H, r}, "SigmoidScaleForward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(g, DType::kF32, {N, H}, "SigmoidScaleForward", "g"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {N, H, r}, "SigmoidScaleForward", "y"));
    const float* xp = x.data<float>();  // [N, H, r]
    const float* gp = g.data<float>();  // [N, H]
    float* yp = y.data<float>();        // [N, H, r]
    for (int64_t i = 0; i < N * H; ++i) {
      const float s = Sigmoid(gp[i]);
      for (int64_t j = 0; j < r; ++j) yp[i * r + j] = xp[i * r + j] * s;
    }
    return absl::OkStatus();
  }

  absl::Status SigmoidScaleBackward(const Tensor& x, const Tensor& g, const Tensor& dy,
                                    Tensor& dx, Tensor& dg, Stream*) override {
    if (!x.defined() || x.rank() != 3) {
      return absl::InvalidArgumentError("SigmoidScaleBackward: x must be fp32 [N, H, r]");
    }
    const int64_t N = x.dim(0), H = x.dim(1), r = x.dim(2);
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, {N, H, r}, "SigmoidScaleBackward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(g, DType::kF32, {N, H}, "SigmoidScaleBackward", "g"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {N, H, r}, "SigmoidScaleBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, {N, H, r}, "SigmoidScaleBackward", "dx"));
    SMAT_RETURN_IF_ERROR(Expect(dg, DType::kF32, {N, H}, "SigmoidScaleBackward", "dg"));
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
    SMAT_RETURN_IF_ERROR(ExpectFeatureMap(f, "FeatureMapForward"));
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, x.shape(), "FeatureMapForward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, x.shape(), "FeatureMapForward", "y"));
    // The host loop of kernels/feature_map.h (qualified: this member hides it).
    smat::FeatureMapForward(f, x.data<float>(), y.data<float>(), x.numel());
    return absl::OkStatus();
  }

  absl::Status FeatureMapBackward(FeatureMap f, const Tensor& x, const Tensor& dy, Tensor& dx,
                                  Stream*) override {
    SMAT_RETURN_IF_ERROR(ExpectFeatureMap(f, "FeatureMapBackward"));
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, x.shape(), "FeatureMapBackward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, x.shape(), "FeatureMapBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, x.shape(), "FeatureMapBackward", "dx"));
    smat::FeatureMapBackward(f, x.data<float>(), dy.data<float>(), dx.data<float>(), x.numel());
    return absl::OkStatus();
  }

  absl::Status SoftplusForward(const Tensor& x, Tensor& y, Stream*) override {
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, x.shape(), "SoftplusForward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, x.shape(), "SoftplusForward", "y"));
    const float* xp = x.data<float>();
    float* yp = y.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      yp[i] = std::max(xp[i], 0.f) + std::log1p(std::exp(-std::fabs(xp[i])));
    }
    return absl::OkStatus();
  }

  absl::Status SoftplusBackward(const Tensor& x, const Tensor& dy, Tensor& dx, Stream*) override {
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, x.shape(), "SoftplusBackward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, x.shape(), "SoftplusBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, x.shape(), "SoftplusBackward", "dx"));
    const float* xp = x.data<float>();
    const float* g = dy.data<float>();
    float* gx = dx.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) gx[i] = Sigmoid(xp[i]) * g[i];
    return absl::OkStatus();
  }

  absl::Status ExpRowMaxForward(const Tensor& x, Tensor& y, Stream*) override {
    SMAT_ASSIGN_OR_RETURN(auto mr, Matrix(x, "ExpRowMaxForward", "x"));
    const auto [M, r] = mr;
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {M, r}, "ExpRowMaxForward", "y"));
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
    SMAT_ASSIGN_OR_RETURN(auto mr, Matrix(x, "ExpRowMaxBackward", "x"));
    const auto [M, r] = mr;
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {M, r}, "ExpRowMaxBackward", "y"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {M, r}, "ExpRowMaxBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, {M, r}, "ExpRowMaxBackward", "dx"));
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
    if (!x.defined() || x.rank() != 3) {
      return absl::InvalidArgumentError("ShortConvForward: x must be fp32 [batch, L, C]");
    }
    const int64_t nb = x.dim(0), L = x.dim(1), C = x.dim(2);
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, {nb, L, C}, "ShortConvForward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(prefix, DType::kF32, {nb, K - 1, C}, "ShortConvForward", "prefix"));
    SMAT_RETURN_IF_ERROR(Expect(w, DType::kF32, {K, C}, "ShortConvForward", "w"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {nb, L, C}, "ShortConvForward", "y"));
    const float* xp = x.data<float>();       // [batch, L, C]
    const float* pp = prefix.data<float>();  // [batch, K-1, C]
    const float* wp = w.data<float>();       // [K, C]
    float* yp = y.data<float>();             // [batch, L, C]
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t t = 0; t < L; ++t) {
        float* out = yp + (b * L + t) * C;
        for (int64_t c = 0; c < C; ++c) out[c] = 0.f;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t s = t - (K - 1) + j;  // source row, negative: from the prefix
          const float* in = s >= 0 ? xp + (b * L + s) * C : pp + (b * (K - 1) + (K - 1) + s) * C;
          for (int64_t c = 0; c < C; ++c) out[c] += wp[j * C + c] * in[c];
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status ShortConvBackward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                 const Tensor& dy, Tensor& dx, Tensor& d_prefix, Tensor& d_w,
                                 Stream*) override {
    constexpr int64_t K = kShortConvWidth;
    if (!x.defined() || x.rank() != 3) {
      return absl::InvalidArgumentError("ShortConvBackward: x must be fp32 [batch, L, C]");
    }
    const int64_t nb = x.dim(0), L = x.dim(1), C = x.dim(2);
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, {nb, L, C}, "ShortConvBackward", "x"));
    SMAT_RETURN_IF_ERROR(
        Expect(prefix, DType::kF32, {nb, K - 1, C}, "ShortConvBackward", "prefix"));
    SMAT_RETURN_IF_ERROR(Expect(w, DType::kF32, {K, C}, "ShortConvBackward", "w"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {nb, L, C}, "ShortConvBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, {nb, L, C}, "ShortConvBackward", "dx"));
    SMAT_RETURN_IF_ERROR(
        Expect(d_prefix, DType::kF32, {nb, K - 1, C}, "ShortConvBackward", "d_prefix"));
    SMAT_RETURN_IF_ERROR(Expect(d_w, DType::kF32, {K, C}, "ShortConvBackward", "d_w"));
    const float* xp = x.data<float>();       // [batch, L, C]
    const float* pp = prefix.data<float>();  // [batch, K-1, C]
    const float* wp = w.data<float>();       // [K, C]
    const float* gy = dy.data<float>();      // [batch, L, C]
    float* gx = dx.data<float>();            // [batch, L, C]
    float* gp = d_prefix.data<float>();      // [batch, K-1, C]
    float* gw = d_w.data<float>();           // [K, C]
    // Gather form (each input row sums the outputs it fed, taps in increasing
    // order): no scatter, so the order of additions is fixed per element.
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t s = -(K - 1); s < L; ++s) {
        float* out = s >= 0 ? gx + (b * L + s) * C : gp + (b * (K - 1) + (K - 1) + s) * C;
        for (int64_t c = 0; c < C; ++c) out[c] = 0.f;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t t = s + (K - 1) - j;  // the output row that read s through tap j
          if (t < 0 || t >= L) continue;
          const float* g = gy + (b * L + t) * C;
          for (int64_t c = 0; c < C; ++c) out[c] += wp[j * C + c] * g[c];
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

  absl::Status CrossEntropyForward(Backend& backend, const Tensor& h, const Tensor& w_head,
                                   const Tensor& targets, const Tensor& weights,
                                   int64_t chunk_tokens, Tensor& lse, double* loss_sum,
                                   Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(auto nw, Matrix(h, "CrossEntropyForward", "h"));
    const auto [N, W] = nw;
    SMAT_ASSIGN_OR_RETURN(auto vw, Matrix(w_head, "CrossEntropyForward", "w_head"));
    const int64_t V = vw.first;
    SMAT_RETURN_IF_ERROR(Expect(w_head, DType::kF32, {V, W}, "CrossEntropyForward", "w_head"));
    SMAT_RETURN_IF_ERROR(Expect(targets, DType::kI32, {N}, "CrossEntropyForward", "targets"));
    SMAT_RETURN_IF_ERROR(Expect(weights, DType::kF32, {N}, "CrossEntropyForward", "weights"));
    SMAT_RETURN_IF_ERROR(Expect(lse, DType::kF32, {N}, "CrossEntropyForward", "lse"));
    if (chunk_tokens < 1 || loss_sum == nullptr) {
      return absl::InvalidArgumentError("CrossEntropyForward: chunk_tokens must be >= 1");
    }
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
    SMAT_ASSIGN_OR_RETURN(auto nw, Matrix(h, "CrossEntropyBackward", "h"));
    const auto [N, W] = nw;
    SMAT_ASSIGN_OR_RETURN(auto vw, Matrix(w_head, "CrossEntropyBackward", "w_head"));
    const int64_t V = vw.first;
    SMAT_RETURN_IF_ERROR(Expect(w_head, DType::kF32, {V, W}, "CrossEntropyBackward", "w_head"));
    SMAT_RETURN_IF_ERROR(Expect(targets, DType::kI32, {N}, "CrossEntropyBackward", "targets"));
    SMAT_RETURN_IF_ERROR(Expect(weights, DType::kF32, {N}, "CrossEntropyBackward", "weights"));
    SMAT_RETURN_IF_ERROR(Expect(lse, DType::kF32, {N}, "CrossEntropyBackward", "lse"));
    SMAT_RETURN_IF_ERROR(Expect(dh, DType::kF32, {N, W}, "CrossEntropyBackward", "dh"));
    SMAT_RETURN_IF_ERROR(
        Expect(d_w_head, DType::kF32, {V, W}, "CrossEntropyBackward", "d_w_head"));
    if (chunk_tokens < 1) {
      return absl::InvalidArgumentError("CrossEntropyBackward: chunk_tokens must be >= 1");
    }
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
    auto floating = [](DType t) { return t == DType::kF32 || t == DType::kBF16; };
    if (!src.defined() || !dst.defined() || !floating(src.dtype()) || !floating(dst.dtype())) {
      return absl::InvalidArgumentError("Cast: src and dst must be defined fp32 or bf16 tensors");
    }
    if (!src.device().is_cpu() || !dst.device().is_cpu()) {
      return absl::InvalidArgumentError("Cast: the CPU model kernels need host tensors");
    }
    if (src.numel() != dst.numel()) {
      return absl::InvalidArgumentError(absl::StrCat("Cast: src has ", src.numel(),
                                                     " elements, dst ", dst.numel()));
    }
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
    SMAT_RETURN_IF_ERROR(Expect(value, DType::kF32, value.shape(), "AdamWUpdate", "value"));
    SMAT_RETURN_IF_ERROR(Expect(grad, DType::kF32, value.shape(), "AdamWUpdate", "grad"));
    SMAT_RETURN_IF_ERROR(Expect(m, DType::kF32, value.shape(), "AdamWUpdate", "m"));
    SMAT_RETURN_IF_ERROR(Expect(v, DType::kF32, value.shape(), "AdamWUpdate", "v"));
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
    double total = 0.0;
    for (size_t k = 0; k < tensors.size(); ++k) {
      const Tensor& t = tensors[k];
      SMAT_RETURN_IF_ERROR(Expect(t, DType::kF32, t.shape(), "SumOfSquares",
                                  absl::StrCat("tensor ", k).c_str()));
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
