// CudaModelKernels (model_kernels_cuda.h): validation of every operand against
// the contract of kernels/model_kernels.h, then the launches of
// model_kernels_{elementwise,loss,norm_conv}.cu on the call's stream.
#include "kernels/cuda/model_kernels_cuda.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/model_kernels_kernels.h"

namespace smat {
namespace {

static_assert(kCudaShortConvWidth == kShortConvWidth, "model_kernels_kernels.h is out of date");
static_assert(static_cast<int>(CudaFeatureMap::kEluPlusOne) ==
                      static_cast<int>(FeatureMap::kEluPlusOne) &&
                  static_cast<int>(CudaFeatureMap::kReluEps) ==
                      static_cast<int>(FeatureMap::kReluEps) &&
                  kCudaReluFeatureFloor == kReluFeatureFloor,
              "model_kernels_kernels.h is out of date");

// Stream-ordered scratch memory, freed on the stream when it goes out of scope.
class Scratch {
 public:
  explicit Scratch(cudaStream_t s) : stream_(s) {}
  ~Scratch() {
    for (void* p : ptrs_) cudaFreeAsync(p, stream_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename T>
  absl::StatusOr<T*> Get(int64_t count) {
    void* p = nullptr;
    SMAT_CUDA_RETURN_IF_ERROR(
        cudaMallocAsync(&p, std::max<int64_t>(1, count) * sizeof(T), stream_));
    ptrs_.push_back(p);
    return static_cast<T*>(p);
  }

 private:
  cudaStream_t stream_;
  std::vector<void*> ptrs_;
};

const float* F32(const Tensor& t) { return static_cast<const float*>(t.raw()); }
float* F32(Tensor& t) { return static_cast<float*>(t.raw()); }
const int32_t* I32(const Tensor& t) { return static_cast<const int32_t*>(t.raw()); }

class CudaModelKernels final : public ModelKernels {
 public:
  CudaModelKernels(int device, CudaStreamResolver stream_of, int max_blocks)
      : device_(device), stream_of_(std::move(stream_of)), max_blocks_(max_blocks) {}

  // --------------------------------------------------------------- embedding
  absl::Status EmbeddingForward(const Tensor& table, const Tensor& ids, Tensor& out,
                                Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(auto vw, Matrix(table, "EmbeddingForward", "table"));
    const auto [V, W] = vw;
    if (!ids.defined() || ids.rank() != 1) {
      return absl::InvalidArgumentError("EmbeddingForward: ids must be int32 [N]");
    }
    const int64_t N = ids.dim(0);
    SMAT_RETURN_IF_ERROR(Expect(ids, DType::kI32, {N}, "EmbeddingForward", "ids"));
    SMAT_RETURN_IF_ERROR(Expect(out, DType::kF32, {N, W}, "EmbeddingForward", "out"));
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
    SMAT_ASSIGN_OR_RETURN(auto vw, Matrix(d_table, "EmbeddingBackward", "d_table"));
    const auto [V, W] = vw;
    if (!ids.defined() || ids.rank() != 1) {
      return absl::InvalidArgumentError("EmbeddingBackward: ids must be int32 [N]");
    }
    const int64_t N = ids.dim(0);
    SMAT_RETURN_IF_ERROR(Expect(ids, DType::kI32, {N}, "EmbeddingBackward", "ids"));
    SMAT_RETURN_IF_ERROR(Expect(d_out, DType::kF32, {N, W}, "EmbeddingBackward", "d_out"));
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
    Scratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(char* buffer, scratch.Get<char>(static_cast<int64_t>(bytes)));
    return CudaStatus(
        LaunchEmbeddingBackward(I32(ids), F32(d_out), F32(d_table), N, W, V, buffer, bytes, s),
        "EmbeddingBackward kernels");
  }

  // --------------------------------------------------------------- RMSNorm
  absl::Status RmsNormForward(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                              Tensor& rstd, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(auto nw, Matrix(x, "RmsNormForward", "x"));
    const auto [N, W] = nw;
    SMAT_RETURN_IF_ERROR(Expect(weight, DType::kF32, {W}, "RmsNormForward", "weight"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {N, W}, "RmsNormForward", "y"));
    SMAT_RETURN_IF_ERROR(Expect(rstd, DType::kF32, {N}, "RmsNormForward", "rstd"));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchRmsNormForward(F32(x), F32(weight), eps, F32(y), F32(rstd), N, W, s),
                      "RmsNormForward kernel");
  }

  absl::Status RmsNormBackward(const Tensor& x, const Tensor& weight, const Tensor& rstd,
                               const Tensor& dy, Tensor& dx, Tensor& d_weight,
                               Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(auto nw, Matrix(x, "RmsNormBackward", "x"));
    const auto [N, W] = nw;
    SMAT_RETURN_IF_ERROR(Expect(weight, DType::kF32, {W}, "RmsNormBackward", "weight"));
    SMAT_RETURN_IF_ERROR(Expect(rstd, DType::kF32, {N}, "RmsNormBackward", "rstd"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {N, W}, "RmsNormBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, {N, W}, "RmsNormBackward", "dx"));
    SMAT_RETURN_IF_ERROR(Expect(d_weight, DType::kF32, {W}, "RmsNormBackward", "d_weight"));
    if (N * W > 0 && dx.raw() == dy.raw()) {
      return absl::InvalidArgumentError("RmsNormBackward: dx may not alias dy");
    }
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    // dx may overwrite x: each element of x is read before it is written.
    Scratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* partials, scratch.Get<float>(RmsNormBackwardPartials(N, W) * W));
    return CudaStatus(LaunchRmsNormBackward(F32(x), F32(weight), F32(rstd), F32(dy), F32(dx),
                                            F32(d_weight), partials, N, W, s),
                      "RmsNormBackward kernel");
  }

  // --------------------------------------------------------------- SwiGLU, residual
  absl::Status SwiGluForward(const Tensor& gate, const Tensor& up, Tensor& y,
                             Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(auto nf, Matrix(gate, "SwiGluForward", "gate"));
    SMAT_RETURN_IF_ERROR(Expect(up, DType::kF32, gate.shape(), "SwiGluForward", "up"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, gate.shape(), "SwiGluForward", "y"));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchSwiGluForward(F32(gate), F32(up), F32(y), nf.first * nf.second,
                                          max_blocks_, s),
                      "SwiGluForward kernel");
  }

  absl::Status SwiGluBackward(const Tensor& gate, const Tensor& up, const Tensor& dy,
                              Tensor& d_gate, Tensor& d_up, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(auto nf, Matrix(gate, "SwiGluBackward", "gate"));
    SMAT_RETURN_IF_ERROR(Expect(up, DType::kF32, gate.shape(), "SwiGluBackward", "up"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, gate.shape(), "SwiGluBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(d_gate, DType::kF32, gate.shape(), "SwiGluBackward", "d_gate"));
    SMAT_RETURN_IF_ERROR(Expect(d_up, DType::kF32, gate.shape(), "SwiGluBackward", "d_up"));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchSwiGluBackward(F32(gate), F32(up), F32(dy), F32(d_gate), F32(d_up),
                                           nf.first * nf.second, max_blocks_, s),
                      "SwiGluBackward kernel");
  }

  absl::Status ResidualAdd(const Tensor& a, const Tensor& b, Tensor& out, Stream* stream) override {
    SMAT_RETURN_IF_ERROR(Expect(a, DType::kF32, a.shape(), "ResidualAdd", "a"));
    SMAT_RETURN_IF_ERROR(Expect(b, DType::kF32, a.shape(), "ResidualAdd", "b"));
    SMAT_RETURN_IF_ERROR(Expect(out, DType::kF32, a.shape(), "ResidualAdd", "out"));
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
    SMAT_ASSIGN_OR_RETURN(CudaFeatureMap map, ToCuda(f, "FeatureMapForward"));
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, x.shape(), "FeatureMapForward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, x.shape(), "FeatureMapForward", "y"));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchFeatureMapForward(map, F32(x), F32(y), x.numel(), max_blocks_, s),
                      "FeatureMapForward kernel");
  }

  absl::Status FeatureMapBackward(FeatureMap f, const Tensor& x, const Tensor& dy, Tensor& dx,
                                  Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(CudaFeatureMap map, ToCuda(f, "FeatureMapBackward"));
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, x.shape(), "FeatureMapBackward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, x.shape(), "FeatureMapBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, x.shape(), "FeatureMapBackward", "dx"));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchFeatureMapBackward(map, F32(x), F32(dy), F32(dx), x.numel(), max_blocks_, s),
        "FeatureMapBackward kernel");
  }

  absl::Status SigmoidScaleForward(const Tensor& x, const Tensor& g, Tensor& y,
                                   Stream* stream) override {
    if (!x.defined() || x.rank() != 3) {
      return absl::InvalidArgumentError("SigmoidScaleForward: x must be fp32 [N, H, r]");
    }
    const int64_t N = x.dim(0), H = x.dim(1), r = x.dim(2);
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, {N, H, r}, "SigmoidScaleForward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(g, DType::kF32, {N, H}, "SigmoidScaleForward", "g"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {N, H, r}, "SigmoidScaleForward", "y"));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchSigmoidScaleForward(F32(x), F32(g), F32(y), N * H, r, max_blocks_, s),
        "SigmoidScaleForward kernel");
  }

  absl::Status SigmoidScaleBackward(const Tensor& x, const Tensor& g, const Tensor& dy,
                                    Tensor& dx, Tensor& dg, Stream* stream) override {
    if (!x.defined() || x.rank() != 3) {
      return absl::InvalidArgumentError("SigmoidScaleBackward: x must be fp32 [N, H, r]");
    }
    const int64_t N = x.dim(0), H = x.dim(1), r = x.dim(2);
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, {N, H, r}, "SigmoidScaleBackward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(g, DType::kF32, {N, H}, "SigmoidScaleBackward", "g"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {N, H, r}, "SigmoidScaleBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, {N, H, r}, "SigmoidScaleBackward", "dx"));
    SMAT_RETURN_IF_ERROR(Expect(dg, DType::kF32, {N, H}, "SigmoidScaleBackward", "dg"));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchSigmoidScaleBackward(F32(x), F32(g), F32(dy), F32(dx), F32(dg), N * H,
                                                 r, max_blocks_, s),
                      "SigmoidScaleBackward kernel");
  }

  absl::Status ExpRowMaxForward(const Tensor& x, Tensor& y, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(auto mr, Matrix(x, "ExpRowMaxForward", "x"));
    const auto [M, r] = mr;
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {M, r}, "ExpRowMaxForward", "y"));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchExpRowMaxForward(F32(x), F32(y), M, r, max_blocks_, s),
                      "ExpRowMaxForward kernel");
  }

  absl::Status ExpRowMaxBackward(const Tensor& x, const Tensor& y, const Tensor& dy, Tensor& dx,
                                 Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(auto mr, Matrix(x, "ExpRowMaxBackward", "x"));
    const auto [M, r] = mr;
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {M, r}, "ExpRowMaxBackward", "y"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, {M, r}, "ExpRowMaxBackward", "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, {M, r}, "ExpRowMaxBackward", "dx"));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchExpRowMaxBackward(F32(x), F32(y), F32(dy), F32(dx), M, r, max_blocks_, s),
        "ExpRowMaxBackward kernel");
  }

  // --------------------------------------------------------------- short convolution
  absl::Status ShortConvForward(const Tensor& x, const Tensor& prefix, const Tensor& w, Tensor& y,
                                Stream* stream) override {
    constexpr int64_t K = kShortConvWidth;
    if (!x.defined() || x.rank() != 3) {
      return absl::InvalidArgumentError("ShortConvForward: x must be fp32 [batch, L, C]");
    }
    const int64_t nb = x.dim(0), L = x.dim(1), C = x.dim(2);
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, {nb, L, C}, "ShortConvForward", "x"));
    SMAT_RETURN_IF_ERROR(Expect(prefix, DType::kF32, {nb, K - 1, C}, "ShortConvForward", "prefix"));
    SMAT_RETURN_IF_ERROR(Expect(w, DType::kF32, {K, C}, "ShortConvForward", "w"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, {nb, L, C}, "ShortConvForward", "y"));
    if (nb * L * C > 0 && y.raw() == x.raw()) {
      return absl::InvalidArgumentError("ShortConvForward: y may not alias x");
    }
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchShortConvForward(F32(x), F32(prefix), F32(w), F32(y), nb, L, C, s),
        "ShortConvForward kernel");
  }

  absl::Status ShortConvBackward(const Tensor& x, const Tensor& prefix, const Tensor& w,
                                 const Tensor& dy, Tensor& dx, Tensor& d_prefix, Tensor& d_w,
                                 Stream* stream) override {
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
    if (nb * L * C > 0 && (dx.raw() == dy.raw() || dx.raw() == x.raw())) {
      return absl::InvalidArgumentError("ShortConvBackward: dx may not alias dy or x");
    }
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    Scratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* partials,
                          scratch.Get<float>(ShortConvBackwardPartials(nb, L) * K * C));
    return CudaStatus(LaunchShortConvBackward(F32(x), F32(prefix), F32(w), F32(dy), F32(dx),
                                              F32(d_prefix), F32(d_w), partials, nb, L, C, s),
                      "ShortConvBackward kernel");
  }

  // --------------------------------------------------------------- cross-entropy
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
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_RETURN_IF_ERROR(CheckIndices(targets, &weights, V, s, "CrossEntropyForward: target",
                                      "; check model.vocab_size against the data"));
    const int64_t rows = std::min(chunk_tokens, std::max<int64_t>(N, 1));
    Scratch scratch(s);
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
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_RETURN_IF_ERROR(CheckIndices(targets, &weights, V, s, "CrossEntropyBackward: target",
                                      "; check model.vocab_size against the data"));
    const int64_t rows = std::min(chunk_tokens, std::max<int64_t>(N, 1));
    Scratch scratch(s);
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
    auto floating = [](DType t) { return t == DType::kF32 || t == DType::kBF16; };
    if (!src.defined() || !dst.defined() || !floating(src.dtype()) || !floating(dst.dtype())) {
      return absl::InvalidArgumentError("Cast: src and dst must be defined fp32 or bf16 tensors");
    }
    for (const auto& [t, operand] : {std::pair<const Tensor*, const char*>{&src, "src"},
                                     std::pair<const Tensor*, const char*>{&dst, "dst"}}) {
      if (!(t->device() == Device::Cuda(device_))) {
        return absl::InvalidArgumentError(absl::StrCat("Cast: ", operand, " is on ",
                                                       t->device().ToString(), "; expected ",
                                                       Device::Cuda(device_).ToString()));
      }
    }
    if (src.numel() != dst.numel()) {
      return absl::InvalidArgumentError(absl::StrCat("Cast: src has ", src.numel(),
                                                     " elements, dst ", dst.numel()));
    }
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
    SMAT_RETURN_IF_ERROR(Expect(value, DType::kF32, value.shape(), "AdamWUpdate", "value"));
    SMAT_RETURN_IF_ERROR(Expect(grad, DType::kF32, value.shape(), "AdamWUpdate", "grad"));
    SMAT_RETURN_IF_ERROR(Expect(m, DType::kF32, value.shape(), "AdamWUpdate", "m"));
    SMAT_RETURN_IF_ERROR(Expect(v, DType::kF32, value.shape(), "AdamWUpdate", "v"));
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
    int64_t blocks = 0;
    for (size_t k = 0; k < tensors.size(); ++k) {
      const Tensor& t = tensors[k];
      SMAT_RETURN_IF_ERROR(Expect(t, DType::kF32, t.shape(), "SumOfSquares",
                                  absl::StrCat("tensor ", k).c_str()));
      blocks += SumOfSquaresBlocks(t.numel());
    }
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    Scratch scratch(s);
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
  // The CUDA stream of `stream` with this device current; the first call also
  // keeps the default stream-ordered pool's memory across synchronisations.
  absl::StatusOr<cudaStream_t> Enter(Stream* stream) {
    SMAT_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!pool_ready_) {
        cudaMemPool_t pool;
        SMAT_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, device_));
        uint64_t keep = UINT64_MAX;
        SMAT_CUDA_RETURN_IF_ERROR(
            cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
        pool_ready_ = true;
      }
    }
    return stream_of_(stream);
  }

  // InvalidArgument unless t is a defined tensor of `dtype` and `shape` on this device.
  absl::Status Expect(const Tensor& t, DType dtype, absl::Span<const int64_t> shape, const char* op,
                      const char* operand) const {
    if (!t.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " is undefined"));
    }
    if (!(t.device() == Device::Cuda(device_))) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": ", operand, " is on ", t.device().ToString(), "; the CUDA model kernels of ",
          Device::Cuda(device_).ToString(), " need tensors there (Backend::Copy)"));
    }
    if (t.dtype() != dtype) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " is ",
                                                     DTypeName(t.dtype()), "; expected ",
                                                     DTypeName(dtype)));
    }
    if (t.shape() != Shape(shape.begin(), shape.end())) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " has shape ",
                                                     ShapeToString(t.shape()), "; expected ",
                                                     ShapeToString(shape)));
    }
    return absl::OkStatus();
  }

  // Rank-2 fp32 tensor on this device: returns {rows, cols}.
  absl::StatusOr<std::pair<int64_t, int64_t>> Matrix(const Tensor& t, const char* op,
                                                     const char* operand) const {
    if (!t.defined() || t.rank() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", operand, " must be a rank-2 tensor",
                                                     t.defined() ? "; got " + t.DebugString() : ""));
    }
    SMAT_RETURN_IF_ERROR(Expect(t, DType::kF32, t.shape(), op, operand));
    return std::make_pair(t.dim(0), t.dim(1));
  }

  // InvalidArgument "<what> <id> at row <i> is outside [0, V)<hint>" for the
  // first row whose index is outside [0, V) (only rows with a non-zero weight
  // when `weights` is given), as the CPU reports it. Waits for the stream.
  absl::Status CheckIndices(const Tensor& ids, const Tensor* weights, int64_t V, cudaStream_t s,
                            const char* what, const char* hint) {
    const int64_t n = ids.numel();
    if (n == 0) return absl::OkStatus();
    Scratch scratch(s);
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

  // The kernels' enumerator for f; InvalidArgument for a value outside FeatureMap,
  // as the CPU.
  static absl::StatusOr<CudaFeatureMap> ToCuda(FeatureMap f, const char* op) {
    switch (f) {
      case FeatureMap::kEluPlusOne:
        return CudaFeatureMap::kEluPlusOne;
      case FeatureMap::kReluEps:
        return CudaFeatureMap::kReluEps;
    }
    return absl::InvalidArgumentError(absl::StrCat(op, ": unknown feature map ",
                                                   static_cast<int>(f),
                                                   "; expected kEluPlusOne or kReluEps"));
  }

  absl::Status Softplus(const Tensor& x, Tensor& y, bool negate, const char* op, Stream* stream) {
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, x.shape(), op, "x"));
    SMAT_RETURN_IF_ERROR(Expect(y, DType::kF32, x.shape(), op, "y"));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(LaunchSoftplus(F32(x), F32(y), x.numel(), negate, max_blocks_, s), op);
  }

  absl::Status SigmoidTimes(const Tensor& x, const Tensor& dy, Tensor& dx, bool negate,
                            const char* op, Stream* stream) {
    SMAT_RETURN_IF_ERROR(Expect(x, DType::kF32, x.shape(), op, "x"));
    SMAT_RETURN_IF_ERROR(Expect(dy, DType::kF32, x.shape(), op, "dy"));
    SMAT_RETURN_IF_ERROR(Expect(dx, DType::kF32, x.shape(), op, "dx"));
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    return CudaStatus(
        LaunchSigmoidTimes(F32(x), F32(dy), F32(dx), x.numel(), negate, max_blocks_, s), op);
  }

  const int device_;
  const CudaStreamResolver stream_of_;
  const int max_blocks_;
  std::mutex mu_;
  bool pool_ready_ = false;  // guarded by mu_
};

}  // namespace

std::unique_ptr<ModelKernels> MakeCudaModelKernels(int device, CudaStreamResolver stream_of,
                                                   int max_blocks) {
  return std::make_unique<CudaModelKernels>(device, std::move(stream_of), max_blocks);
}

}  // namespace smat
