// CudaModelKernels (model_kernels_cuda.h): the operand checks shared with the
// CPU (kernels/model_kernels_check.h) plus the ones of these kernels (aliasing,
// 32-bit sizes, ids and targets on the device), then the launches of
// model_kernels_{elementwise,loss,norm_conv}.cu on the call's stream.
#include "kernels/cuda/model_kernels_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_scratch.h"
#include "kernels/cuda/model_kernels_kernels.h"
#include "kernels/model_kernels_check.h"

namespace smat {
namespace {

static_assert(kCudaShortConvWidth == kShortConvWidth, "model_kernels_kernels.h is out of date");
static_assert(kCudaNarrowMaxOut == kNarrowLinearMaxOut, "model_kernels_kernels.h is out of date");
static_assert(static_cast<int>(CudaFeatureMap::kEluPlusOne) ==
                      static_cast<int>(FeatureMap::kEluPlusOne) &&
                  static_cast<int>(CudaFeatureMap::kReluEps) ==
                      static_cast<int>(FeatureMap::kReluEps) &&
                  kCudaReluFeatureFloor == kReluFeatureFloor,
              "model_kernels_kernels.h is out of date");

const float* F32(const Tensor& t) { return static_cast<const float*>(t.raw()); }
float* F32(Tensor& t) { return static_cast<float*>(t.raw()); }
const int32_t* I32(const Tensor& t) { return static_cast<const int32_t*>(t.raw()); }
bool IsBf16(const Tensor& t) { return t.dtype() == DType::kBF16; }

class CudaModelKernels final : public ModelKernels {
 public:
  CudaModelKernels(int device, CudaStreamResolver stream_of, int max_blocks)
      : device_(device), stream_of_(std::move(stream_of)), max_blocks_(max_blocks) {}

  // --------------------------------------------------------------- embedding
  absl::Status EmbeddingForward(const Tensor& table, const Tensor& ids, Tensor& out,
                                Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(VocabDims d, CheckEmbedding("EmbeddingForward", {table, "table"}, ids,
                                                      {out, "out"}, device()));
    const auto [N, V, W] = d;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    // The gather skips bad rows, so it can be queued before the check's result
    // is back: one synchronisation per call.
    SMAT_CUDA_RETURN_IF_ERROR(
        LaunchEmbeddingForward(F32(table), I32(ids), F32(out), N, W, V, max_blocks_, s));
    return CheckIndices(ids, nullptr, V, s, "EmbeddingForward: token id",
                        "; check model.vocab_size against the data");
  }

  absl::Status EmbeddingBackward(const Tensor& ids, const Tensor& d_out, Tensor& d_table,
                                 Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(VocabDims d, CheckEmbedding("EmbeddingBackward", {d_table, "d_table"},
                                                      ids, {d_out, "d_out"}, device()));
    const auto [N, V, W] = d;
    if (N > INT_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("EmbeddingBackward: ", N, " rows exceed the sort's 32-bit range"));
    }
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    // Checked before d_table is touched: a bad id leaves the gradient as it was.
    SMAT_RETURN_IF_ERROR(CheckIndices(ids, nullptr, V, s, "EmbeddingBackward: token id", ""));
    if (N == 0 || W == 0) return absl::OkStatus();
    size_t bytes = 0;
    SMAT_CUDA_RETURN_IF_ERROR(EmbeddingBackwardScratchBytes(N, V, &bytes));
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(char* buffer, scratch.Get<char>(static_cast<int64_t>(bytes)));
    return CudaStatus(
        LaunchEmbeddingBackward(I32(ids), F32(d_out), F32(d_table), N, W, V, buffer, bytes, s),
        "EmbeddingBackward kernels");
  }

  // --------------------------------------------------------------- RMSNorm
  absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                              Tensor& rstd, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols nw, CheckRmsNormForward(x, weight, y, rstd, device()));
    const auto [N, W] = nw;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchRmsNormForward(F32(x), F32(weight), eps, y.raw(), IsBf16(y), F32(rstd), N, W, s),
        "RmsNormForward kernel");
  }

  absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                               const Tensor& dy, Tensor& dx, Tensor& d_weight,
                               Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols nw,
                          CheckRmsNormBackward(x, weight, rstd, dy, dx, d_weight, device()));
    const auto [N, W] = nw;
    if (N * W > 0 && dx.raw() == dy.raw()) {
      return absl::InvalidArgumentError("RmsNormBackward: dx may not alias dy");
    }
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    // dx may overwrite x: each element of x is read before it is written.
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* partials, scratch.Get<float>(RmsNormBackwardPartials(N, W) * W));
    return CudaStatus(LaunchRmsNormBackward(F32(x), F32(weight), F32(rstd), F32(dy), nullptr,
                                            F32(dx), F32(d_weight), partials, N, W, s),
                      "RmsNormBackward kernel");
  }

  absl::Status AddRmsNormForward(const Tensor& a, const Tensor& b, const Tensor& weight, float eps,
                                 Tensor& sum, Tensor& y, Tensor& rstd, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols nw,
                          CheckAddRmsNormForward(a, b, weight, sum, y, rstd, device()));
    const auto [N, W] = nw;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchAddRmsNormForward(F32(a), F32(b), F32(sum), F32(weight), eps, y.raw(),
                                              IsBf16(y), F32(rstd), N, W, s),
                      "AddRmsNormForward kernel");
  }

  absl::Status RmsNormBackwardAdd(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                                  const Tensor& dy, const Tensor& d_residual, Tensor& dx,
                                  Tensor& d_weight, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols nw, CheckRmsNormBackwardAdd(x, weight, rstd, dy, d_residual,
                                                               dx, d_weight, device()));
    const auto [N, W] = nw;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* partials, scratch.Get<float>(RmsNormBackwardPartials(N, W) * W));
    return CudaStatus(LaunchRmsNormBackward(F32(x), F32(weight), F32(rstd), F32(dy),
                                            F32(d_residual), F32(dx), F32(d_weight), partials, N,
                                            W, s),
                      "RmsNormBackwardAdd kernel");
  }

  // --------------------------------------------------------------- SwiGLU, residual
  absl::Status SwiGluForward(const Tensor& gate, const Tensor& up, Tensor& y,
                             Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols nf, CheckSwiGluForward(gate, up, y, device()));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchSwiGluForward(gate.raw(), up.raw(), IsBf16(gate), y.raw(), IsBf16(y),
                                          nf.rows * nf.cols, max_blocks_, s),
                      "SwiGluForward kernel");
  }

  absl::Status SwiGluBackward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                              Tensor& d_gate, Tensor& d_up, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols nf,
                          CheckSwiGluBackward(gate, up, dy, d_gate, d_up, device()));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchSwiGluBackward(gate.raw(), up.raw(), IsBf16(gate), dy.raw(), IsBf16(dy),
                                           d_gate.raw(), d_up.raw(), IsBf16(d_gate),
                                           nf.rows * nf.cols, max_blocks_, s),
                      "SwiGluBackward kernel");
  }

  absl::Status ResidualAdd(const Tensor& a, const Tensor& b, Tensor& out, Stream* stream) override {
    SMAT_RETURN_IF_ERROR(
        CheckElementwise("ResidualAdd", {{a, "a"}, {b, "b"}, {out, "out"}}, device()));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchResidualAdd(F32(a), F32(b), F32(out), a.numel(), max_blocks_, s),
                      "ResidualAdd kernel");
  }

  // --------------------------------------------------------------- gates
  absl::Status NegSoftplusForward(const Tensor& x, Tensor& y, Stream* stream) override {
    return Softplus(x, y, /*negate=*/true, "NegSoftplusForward", stream);
  }
  absl::Status NegSoftplusBackward(const Tensor& x, const Tensor& dy, Tensor& dx,
                                   Stream* stream) override {
    return SigmoidTimes(x, dy, dx, /*negate=*/true, "NegSoftplusBackward", stream);
  }
  absl::Status SoftplusForward(const Tensor& x, Tensor& y, Stream* stream) override {
    return Softplus(x, y, /*negate=*/false, "SoftplusForward", stream);
  }
  absl::Status SoftplusBackward(const Tensor& x, const Tensor& dy, Tensor& dx,
                                Stream* stream) override {
    return SigmoidTimes(x, dy, dx, /*negate=*/false, "SoftplusBackward", stream);
  }

  // --------------------------------------------------------------- feature maps
  absl::Status FeatureMapForward(FeatureMap f, const Tensor& x, Tensor& y,
                                 Stream* stream) override {
    SMAT_RETURN_IF_ERROR(CheckFeatureMapForward(f, x, y, device()));
    const CudaFeatureMap map = ToCuda(f);
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchFeatureMapForward(map, F32(x), y.raw(), IsBf16(y), x.numel(), max_blocks_, s),
        "FeatureMapForward kernel");
  }

  absl::Status FeatureMapBackward(FeatureMap f, const Tensor& x, const Tensor& dy, Tensor& dx,
                                  Stream* stream) override {
    SMAT_RETURN_IF_ERROR(
        CheckFeatureMap("FeatureMapBackward", f, {{x, "x"}, {dy, "dy"}, {dx, "dx"}}, device()));
    const CudaFeatureMap map = ToCuda(f);
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchFeatureMapBackward(map, F32(x), F32(dy), F32(dx), x.numel(), max_blocks_, s),
        "FeatureMapBackward kernel");
  }

  absl::Status SigmoidScaleForward(const Tensor& x, const Tensor& g, Tensor& y,
                                   Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckSigmoidScaleForward(x, g, y, device()));
    const auto [N, H, r] = d;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchSigmoidScaleForward(F32(x), F32(g), y.raw(), IsBf16(y), N * H, r, max_blocks_, s),
        "SigmoidScaleForward kernel");
  }

  absl::Status SigmoidScaleBackward(const Tensor& x, const Tensor& g, const Tensor& dy,
                                    Tensor& dx, Tensor& dg, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckSigmoidScaleBackward(x, g, dy, dx, dg, device()));
    const auto [N, H, r] = d;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchSigmoidScaleBackward(F32(x), F32(g), F32(dy), F32(dx), F32(dg), N * H,
                                                 r, max_blocks_, s),
                      "SigmoidScaleBackward kernel");
  }

  absl::Status ExpRowMaxForward(const Tensor& x, Tensor& y, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(RowsCols mr,
                          CheckMatrices("ExpRowMaxForward", {{x, "x"}, {y, "y"}}, device()));
    const auto [M, r] = mr;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchExpRowMaxForward(F32(x), F32(y), M, r, max_blocks_, s),
                      "ExpRowMaxForward kernel");
  }

  absl::Status ExpRowMaxBackward(const Tensor& x, const Tensor& y, const Tensor& dy, Tensor& dx,
                                 Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(
        RowsCols mr,
        CheckMatrices("ExpRowMaxBackward", {{x, "x"}, {y, "y"}, {dy, "dy"}, {dx, "dx"}}, device()));
    const auto [M, r] = mr;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchExpRowMaxBackward(F32(x), F32(y), F32(dy), F32(dx), M, r, max_blocks_, s),
        "ExpRowMaxBackward kernel");
  }

  // --------------------------------------------------------------- short convolution
  absl::Status ShortConvForward(const Tensor& x, const Tensor& prefix, const Tensor& w, Tensor& y,
                                Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckShortConvForward(x, prefix, w, y, device()));
    const auto [nb, L, C] = d;
    if (nb * L * C > 0 && y.raw() == x.raw()) {
      return absl::InvalidArgumentError("ShortConvForward: y may not alias x");
    }
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchShortConvForward(F32(x), F32(prefix), F32(w), y.raw(), IsBf16(y), nb, L, C, s),
        "ShortConvForward kernel");
  }

  absl::Status ShortConvSoftplusForward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                        Tensor& y, Tensor& f, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckShortConvSoftplusForward(x, prefix, w, y, f, device()));
    const auto [nb, L, C] = d;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchShortConvSoftplusForward(F32(x), F32(prefix), F32(w), F32(y), f.raw(),
                                                     IsBf16(f), nb, L, C, s),
                      "ShortConvSoftplusForward kernel");
  }

  absl::Status ShortConvBackward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                 const Tensor& dy, Tensor& dx, Tensor& d_prefix, Tensor& d_w,
                                 Stream* stream) override {
    constexpr int64_t K = kShortConvWidth;
    SMAT_ASSIGN_OR_RETURN(Dims3 d,
                          CheckShortConvBackward(x, prefix, w, dy, dx, d_prefix, d_w, device()));
    const auto [nb, L, C] = d;
    if (nb * L * C > 0 && (dx.raw() == dy.raw() || dx.raw() == x.raw())) {
      return absl::InvalidArgumentError("ShortConvBackward: dx may not alias dy or x");
    }
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* partials,
                          scratch.Get<float>(ShortConvBackwardPartials(nb, L) * K * C));
    return CudaStatus(LaunchShortConvBackward(F32(x), F32(prefix), F32(w), F32(dy), nullptr,
                                              dx.raw(), IsBf16(dx), F32(d_prefix), F32(d_w),
                                              partials, nb, L, C, s),
                      "ShortConvBackward kernel");
  }

  absl::Status ShortConvSoftplusBackward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                         const Tensor& z, const Tensor& dy, Tensor& dx,
                                         Tensor& d_prefix, Tensor& d_w, Stream* stream) override {
    constexpr int64_t K = kShortConvWidth;
    SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckShortConvSoftplusBackward(x, prefix, w, z, dy, dx,
                                                                  d_prefix, d_w, device()));
    const auto [nb, L, C] = d;
    if (nb * L * C > 0 && (dx.raw() == dy.raw() || dx.raw() == x.raw())) {
      return absl::InvalidArgumentError("ShortConvSoftplusBackward: dx may not alias dy or x");
    }
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* partials,
                          scratch.Get<float>(ShortConvBackwardPartials(nb, L) * K * C));
    return CudaStatus(LaunchShortConvBackward(F32(x), F32(prefix), F32(w), F32(dy), F32(z),
                                              dx.raw(), IsBf16(dx), F32(d_prefix), F32(d_w),
                                              partials, nb, L, C, s),
                      "ShortConvSoftplusBackward kernel");
  }

  // --------------------------------------------------------------- narrow linear layer
  absl::Status NarrowLinearForward(const Tensor& x, const Tensor& w, const Tensor& bias,
                                   Tensor& y, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(Dims3 d, CheckNarrowLinearForward(x, w, bias, y, device()));
    const auto [N, in, out] = d;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchNarrowLinearForward(x.raw(), IsBf16(x), w.raw(), IsBf16(w),
                                                bias.defined() ? F32(bias) : nullptr, F32(y), N,
                                                in, static_cast<int>(out), s),
                      "NarrowLinearForward kernel");
  }

  absl::Status NarrowLinearBackward(const Tensor& x, const Tensor& w, const Tensor& dy,
                                    Tensor& dx, bool accumulate_dx, Tensor& d_w, Tensor& d_bias,
                                    Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(Dims3 d,
                          CheckNarrowLinearBackward(x, w, dy, dx, d_w, d_bias, device()));
    const auto [N, in, out] = d;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* partials,
                          scratch.Get<float>(NarrowLinearPartials(N) * out * (in + 1)));
    return CudaStatus(LaunchNarrowLinearBackward(
                          x.raw(), IsBf16(x), w.raw(), IsBf16(w), F32(dy), F32(dx), accumulate_dx,
                          F32(d_w), d_bias.defined() ? F32(d_bias) : nullptr, partials, N, in,
                          static_cast<int>(out), s),
                      "NarrowLinearBackward kernels");
  }

  // --------------------------------------------------------------- cross-entropy
  absl::Status CrossEntropyForward(Backend& backend, const Tensor& h, const Tensor& w_head,
                                   const Tensor& targets, const Tensor& weights,
                                   int64_t chunk_tokens, Tensor& lse, double* loss_sum,
                                   Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(VocabDims d,
                          CheckCrossEntropyForward(h, w_head, targets, weights, chunk_tokens, lse,
                                                   loss_sum, device()));
    const auto [N, V, W] = d;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_RETURN_IF_ERROR(CheckIndices(targets, &weights, V, s, "CrossEntropyForward: target",
                                      "; check model.vocab_size against the data"));
    const int64_t rows = std::min(chunk_tokens, std::max<int64_t>(N, 1));
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* logits_buffer, scratch.Get<float>(rows * V));  // [chunk, V]
    SMAT_ASSIGN_OR_RETURN(double* terms, scratch.Get<double>(N));              // [N]
    SMAT_ASSIGN_OR_RETURN(double* total, scratch.Get<double>(1));
    for (int64_t i0 = 0; i0 < N; i0 += rows) {
      const int64_t m = std::min(rows, N - i0);
      Tensor hc = h.View(i0 * W, {m, W});                                            // [m, W]
      Tensor logits = Tensor::Wrap(logits_buffer, {m, V}, DType::kF32, h.device());  // [m, V]
      SMAT_RETURN_IF_ERROR(
          backend.Gemm(Transpose::kNo, Transpose::kYes, 1.f, hc, w_head, 0.f, logits, stream));
      SMAT_CUDA_RETURN_IF_ERROR(LaunchCrossEntropyRows(logits_buffer, m, V, I32(targets) + i0,
                                                       F32(weights) + i0, F32(lse) + i0,
                                                       terms + i0, s));
    }
    SMAT_CUDA_RETURN_IF_ERROR(LaunchSumDoubles(terms, N, total, s));
    double host_total = 0.0;
    // Into pageable memory: returns once the copy (and the work before it) is done.
    SMAT_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&host_total, total, sizeof(double), cudaMemcpyDeviceToHost, s));
    SMAT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    *loss_sum = host_total;
    return absl::OkStatus();
  }

  absl::Status CrossEntropyBackward(Backend& backend, const Tensor& h, const Tensor& w_head,
                                    const Tensor& targets, const Tensor& weights, const Tensor& lse,
                                    float scale, int64_t chunk_tokens, Tensor& dh,
                                    Tensor& d_w_head, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(VocabDims d,
                          CheckCrossEntropyBackward(h, w_head, targets, weights, lse, chunk_tokens,
                                                    dh, d_w_head, device()));
    const auto [N, V, W] = d;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_RETURN_IF_ERROR(CheckIndices(targets, &weights, V, s, "CrossEntropyBackward: target",
                                      "; check model.vocab_size against the data"));
    const int64_t rows = std::min(chunk_tokens, std::max<int64_t>(N, 1));
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* logits_buffer, scratch.Get<float>(rows * V));  // [chunk, V]
    for (int64_t i0 = 0; i0 < N; i0 += rows) {
      const int64_t m = std::min(rows, N - i0);
      Tensor hc = h.View(i0 * W, {m, W});    // [m, W]
      Tensor dhc = dh.View(i0 * W, {m, W});  // [m, W]
      Tensor logits = Tensor::Wrap(logits_buffer, {m, V}, DType::kF32, h.device());  // [m, V]
      SMAT_RETURN_IF_ERROR(
          backend.Gemm(Transpose::kNo, Transpose::kYes, 1.f, hc, w_head, 0.f, logits, stream));
      SMAT_CUDA_RETURN_IF_ERROR(LaunchCrossEntropyRowGrads(
          logits_buffer, m, V, I32(targets) + i0, F32(weights) + i0, F32(lse) + i0, scale, s));
      SMAT_RETURN_IF_ERROR(
          backend.Gemm(Transpose::kNo, Transpose::kNo, 1.f, logits, w_head, 0.f, dhc, stream));
      SMAT_RETURN_IF_ERROR(
          backend.Gemm(Transpose::kYes, Transpose::kNo, 1.f, logits, hc, 1.f, d_w_head, stream));
    }
    return absl::OkStatus();
  }

  // --------------------------------------------------------------- Cast, AdamW
  absl::Status Cast(const Tensor& src, Tensor& dst, Stream* stream) override {
    SMAT_RETURN_IF_ERROR(CheckCast(src, dst, device()));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    const int64_t n = src.numel();
    if (src.dtype() == dst.dtype()) {
      if (n == 0 || src.raw() == dst.raw()) return absl::OkStatus();
      SMAT_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyDeviceToDevice, s));
      return absl::OkStatus();
    }
    if (src.dtype() == DType::kF32) {
      return CudaStatus(LaunchCastF32ToBf16(F32(src), static_cast<uint16_t*>(dst.raw()), n,
                                            max_blocks_, s),
                        "Cast kernel");
    }
    return CudaStatus(LaunchCastBf16ToF32(static_cast<const uint16_t*>(src.raw()), F32(dst), n,
                                          max_blocks_, s),
                      "Cast kernel");
  }

  absl::Status AdamWUpdate(Tensor& value, const Tensor& grad, Tensor& m, Tensor& v,
                           const AdamWScalars& a, Stream* stream) override {
    SMAT_RETURN_IF_ERROR(CheckElementwise(
        "AdamWUpdate", {{value, "value"}, {grad, "grad"}, {m, "m"}, {v, "v"}}, device()));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    const CudaAdamWScalars scalars{a.grad_scale, a.beta1, a.one_minus_beta1,
                                   a.beta2,      a.one_minus_beta2, a.eps,
                                   a.step_size,  a.inv_sqrt_bc2,    a.decay};
    return CudaStatus(LaunchAdamW(F32(value), F32(grad), F32(m), F32(v), value.numel(), scalars,
                                  max_blocks_, s),
                      "AdamWUpdate kernel");
  }

  // --------------------------------------------------------------- gradient norm
  absl::StatusOr<double> SumOfSquares(absl::Span<const Tensor> tensors, Stream* stream) override {
    SMAT_RETURN_IF_ERROR(CheckSumOfSquares(tensors, device()));
    int64_t blocks = 0;
    for (const Tensor& t : tensors) blocks += SumOfSquaresBlocks(t.numel());
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(double* partials, scratch.Get<double>(blocks));  // in tensor order
    SMAT_ASSIGN_OR_RETURN(double* total, scratch.Get<double>(1));
    int64_t offset = 0;
    for (const Tensor& t : tensors) {
      SMAT_CUDA_RETURN_IF_ERROR(LaunchSumOfSquaresPartials(F32(t), t.numel(), partials + offset, s));
      offset += SumOfSquaresBlocks(t.numel());
    }
    SMAT_CUDA_RETURN_IF_ERROR(LaunchSumDoubles(partials, blocks, total, s));
    double host_total = 0.0;
    SMAT_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&host_total, total, sizeof(double), cudaMemcpyDeviceToHost, s));
    SMAT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    return host_total;
  }

 private:
  // The CUDA stream of `stream` with this device current (UseDevice).
  absl::StatusOr<cudaStream_t> Enter(Stream* stream) {
    SMAT_RETURN_IF_ERROR(UseDevice(device_));
    return stream_of_(stream);
  }

  // Where this object's operands live (kernels/model_kernels_check.h).
  Device device() const { return Device::Cuda(device_); }

  // InvalidArgument "<what> <id> at row <i> is outside [0, V)<hint>" for the
  // first row whose index is outside [0, V) (only rows with a non-zero weight
  // when `weights` is given), as the CPU reports it. Waits for the stream.
  absl::Status CheckIndices(const Tensor& ids, const Tensor* weights, int64_t V, cudaStream_t s,
                            const char* what, const char* hint) {
    const int64_t n = ids.numel();
    if (n == 0) return absl::OkStatus();
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(unsigned long long* first_bad, scratch.Get<unsigned long long>(1));
    SMAT_CUDA_RETURN_IF_ERROR(LaunchFirstBadIndex(I32(ids),
                                                  weights != nullptr ? F32(*weights) : nullptr, n,
                                                  V, first_bad, max_blocks_, s));
    unsigned long long row = 0;
    SMAT_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&row, first_bad, sizeof(row), cudaMemcpyDeviceToHost, s));
    SMAT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    if (row == ULLONG_MAX) return absl::OkStatus();
    int32_t id = 0;
    SMAT_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&id, I32(ids) + row, sizeof(id),
                                              cudaMemcpyDeviceToHost, s));
    SMAT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", id, " at row ", row, " is outside [0, ", V, ")", hint));
  }

  // The kernels' enumerator for f, once CheckFeatureMap has accepted f (the
  // static_asserts above keep the two enumerations in step).
  static CudaFeatureMap ToCuda(FeatureMap f) { return static_cast<CudaFeatureMap>(f); }

  absl::Status Softplus(const Tensor& x, Tensor& y, bool negate, const char* op, Stream* stream) {
    SMAT_RETURN_IF_ERROR(CheckUnaryForward(op, x, y, device()));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchSoftplus(F32(x), y.raw(), IsBf16(y), x.numel(), negate, max_blocks_, s), op);
  }

  absl::Status SigmoidTimes(const Tensor& x, const Tensor& dy, Tensor& dx, bool negate,
                            const char* op, Stream* stream) {
    SMAT_RETURN_IF_ERROR(CheckElementwise(op, {{x, "x"}, {dy, "dy"}, {dx, "dx"}}, device()));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchSigmoidTimes(F32(x), F32(dy), F32(dx), x.numel(), negate, max_blocks_, s), op);
  }

  const int device_;
  const CudaStreamResolver stream_of_;
  const int max_blocks_;
};

}  // namespace

std::unique_ptr<ModelKernels> MakeCudaModelKernels(int device, CudaStreamResolver stream_of,
                                                   int max_blocks) {
  return std::make_unique<CudaModelKernels>(device, std::move(stream_of), max_blocks);
}

}  // namespace smat
