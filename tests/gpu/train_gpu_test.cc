// The trainer on the GPU: the same small SMat language model (2 layers, width
// 64, T = 512, short conv, per-token decay, token-hash routing, d = 2) built on
// the CPU backend and on the CUDA backend from one seed, trained 5 full steps
// (forward, backward, gradient norm, clipping, AdamW) on the same batches.
//
// Tolerances:
// - fp32, CPU against GPU: losses within 1e-4 relative and parameters within
//   1e-4 of each other (absolute, on parameters of size <= ~1). Both sides
//   compute in fp32 with fp32 (not TF32) products and the same AdamW
//   operations; they differ only in the order of the sums inside products, the
//   SMat phases and reductions, which moves results by a few fp32 ulps per
//   operation (~1e-6 relative through the model, measured in
//   tests/gpu/smat_gpu_test.cc for the SMat op). Five AdamW steps of lr = 1e-3
//   move a parameter by at most 5e-3, and m / sqrt(v) changes by the relative
//   gradient error, so 1e-4 leaves two orders of magnitude of room while any
//   wrong kernel (a missing term, a wrong index) moves losses by far more.
// - bf16 against fp32 (both on the GPU): losses within 2e-2 relative. bf16
//   rounds each operand of a product by at most 2^-9 relative; with fp32
//   accumulation the products' errors average out to ~1e-3 of the output, and
//   a 2-layer model's loss moves by about that; 2e-2 is an order of magnitude
//   above it and far below the gap a broken bf16 path opens (a garbage
//   operand gives losses that are off by O(1)).
// - Two GPU runs: bitwise equal (no floating-point atomics anywhere). Every
//   GPU run allocates through PoisonBackend, which fills each new buffer with
//   NaN, so a kernel that reads an element nobody wrote shows up as NaN.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/trainer/model_test_util.h"
#include "tests/trainer/single_rank_communicator.h"
#include "kernels/decode.h"
#include "trainer/model.h"
#include "trainer/optimizer.h"

namespace smat {
namespace {

using gpu_test::GpuTest;

constexpr int kSteps = 5;
constexpr int64_t kBatch = 2;
constexpr int64_t kT = 512;
constexpr int64_t kVocab = 64;

TrainConfig SmallConfig(bool bf16) {
  TrainConfig c;
  ModelConfig* m = c.mutable_model();
  m->set_vocab_size(kVocab);
  m->set_width(64);
  m->set_heads(2);  // r = dv = 32
  m->set_layers(2);
  m->set_short_conv(true);
  m->set_gated(true);
  m->set_routing(ModelConfig::TOKEN_HASH);
  m->set_feature_map(ModelConfig::SOFTPLUS);
  c.mutable_smat()->set_d(2);
  c.mutable_smat()->set_chunk(32);
  c.mutable_data()->set_seq_len(kT);
  c.mutable_run()->set_seed(11);
  c.mutable_run()->set_steps(kSteps);
  c.mutable_run()->set_bf16(bf16);
  c.mutable_optimizer()->set_lr(1e-3);
  c.mutable_optimizer()->set_grad_clip(1.0);
  ApplyDefaults(c);
  return c;
}

struct RunResult {
  std::vector<double> losses;
  std::vector<double> grad_norms;
  std::vector<std::vector<float>> params;  // host copies, in parameter order
  std::vector<std::string> names;
};

// kSteps training steps on `backend`; batches depend on the step only.
absl::StatusOr<RunResult> Train(Backend& backend, const TrainConfig& cfg) {
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::Create(cfg, backend));
  std::vector<OptimizerParam> params;
  for (Parameter& p : model->parameters()) params.push_back({p.name, p.value, p.grad, p.decay});
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<AdamW> opt,
                        AdamW::Create(cfg.optimizer(), params, &backend));
  SingleRankCommunicator comm;
  RunResult r;
  for (int step = 0; step < kSteps; ++step) {
    ModelInputs in = RandomModelInputs(kBatch, kT, kVocab, 100 + step);
    SMAT_RETURN_IF_ERROR(model->ZeroGrad());
    SMAT_ASSIGN_OR_RETURN(LossParts parts, model->Forward(comm, in));
    SMAT_RETURN_IF_ERROR(model->Backward(parts.token_count));
    SMAT_ASSIGN_OR_RETURN(double norm, GlobalGradNorm(opt->params(), &backend));
    SMAT_RETURN_IF_ERROR(opt->Step(ScheduledLearningRate(cfg.optimizer(), step),
                                   ClipScale(norm, cfg.optimizer().grad_clip())));
    r.losses.push_back(parts.loss_sum / parts.token_count);
    r.grad_norms.push_back(norm);
  }
  for (const Parameter& p : model->parameters()) {
    SMAT_ASSIGN_OR_RETURN(Tensor host, gpu_test::ToHost(backend, p.value));
    r.params.push_back(gpu_test::FloatValues(host));
    r.names.push_back(p.name);
  }
  return r;
}

bool BitwiseEqual(const RunResult& a, const RunResult& b) {
  if (a.losses != b.losses || a.grad_norms != b.grad_norms) return false;
  for (size_t i = 0; i < a.params.size(); ++i) {
    if (std::memcmp(a.params[i].data(), b.params[i].data(), a.params[i].size() * 4) != 0) {
      return false;
    }
  }
  return true;
}

// The CUDA backend, except that every allocation is filled with NaN (fp32
// NaN bit patterns over the whole buffer) before it is handed out.
class PoisonAllocator final : public Allocator {
 public:
  explicit PoisonAllocator(Backend& backend) : backend_(backend) {}
  Device device() const override { return backend_.allocator().device(); }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    SMAT_ASSIGN_OR_RETURN(void* p, backend_.allocator().Allocate(bytes));
    if (bytes >= sizeof(float)) {
      Tensor t = Tensor::Wrap(p, {static_cast<int64_t>(bytes / sizeof(float))}, DType::kF32,
                              device());
      SMAT_RETURN_IF_ERROR(backend_.Fill(t, std::nan("")));
    }
    RecordAllocate(p, bytes);
    return p;
  }
  void Free(void* ptr) override {
    RecordFree(ptr);
    backend_.allocator().Free(ptr);
  }

 private:
  Backend& backend_;
};

class PoisonBackend final : public Backend {
 public:
  explicit PoisonBackend(Backend& inner) : inner_(inner), alloc_(inner) {}
  Device device() const override { return inner_.device(); }
  std::string name() const override { return inner_.name(); }
  Allocator& allocator() override { return alloc_; }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override { return inner_.CreateStream(); }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override { return inner_.CreateEvent(); }
  absl::Status Record(Event& e, Stream* s) override { return inner_.Record(e, s); }
  absl::Status Wait(Stream* s, Event& e) override { return inner_.Wait(s, e); }
  absl::Status Synchronize(Stream* s) override { return inner_.Synchronize(s); }
  absl::StatusOr<float> ElapsedMs(Event& a, Event& b) override { return inner_.ElapsedMs(a, b); }
  absl::Status Copy(const Tensor& src, Tensor& dst, Stream* s) override {
    return inner_.Copy(src, dst, s);
  }
  absl::Status Fill(Tensor& t, double v, Stream* s) override { return inner_.Fill(t, v, s); }
  absl::Status Axpy(float alpha, const Tensor& x, Tensor& y, Stream* s) override {
    return inner_.Axpy(alpha, x, y, s);
  }
  absl::Status Gemm(Transpose ta, Transpose tb, float alpha, const Tensor& a, const Tensor& b,
                    float beta, Tensor& c, Stream* s) override {
    return inner_.Gemm(ta, tb, alpha, a, b, beta, c, s);
  }
  absl::StatusOr<SmatKernels*> smat() override { return inner_.smat(); }
  absl::StatusOr<ModelKernels*> model() override { return inner_.model(); }
  absl::StatusOr<std::unique_ptr<Decoder>> CreateDecoder(const DecoderSpec& spec) override {
    return inner_.CreateDecoder(spec);
  }

 private:
  Backend& inner_;
  PoisonAllocator alloc_;
};

class TrainGpuTest : public GpuTest {};

TEST_F(TrainGpuTest, Fp32MatchesCpuAndRepeatsBitwise) {
  const TrainConfig cfg = SmallConfig(/*bf16=*/false);
  SMAT_ASSERT_OK_AND_ASSIGN(RunResult cpu, Train(*cpu_, cfg));
  PoisonBackend gpu(*gpu_);
  SMAT_ASSERT_OK_AND_ASSIGN(RunResult g1, Train(gpu, cfg));

  ASSERT_EQ(cpu.losses.size(), static_cast<size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    ASSERT_TRUE(std::isfinite(g1.losses[s])) << "step " << s;
    EXPECT_NEAR(g1.losses[s], cpu.losses[s], 1e-4 * std::abs(cpu.losses[s])) << "step " << s;
    EXPECT_NEAR(g1.grad_norms[s], cpu.grad_norms[s], 1e-4 * cpu.grad_norms[s]) << "step " << s;
  }
  // Training moved the loss: the comparison is not between two idle models.
  EXPECT_NE(cpu.losses.front(), cpu.losses.back());
  ASSERT_EQ(g1.params.size(), cpu.params.size());
  for (size_t i = 0; i < cpu.params.size(); ++i) {
    ASSERT_EQ(g1.params[i].size(), cpu.params[i].size()) << cpu.names[i];
    double worst = 0;
    for (size_t k = 0; k < cpu.params[i].size(); ++k) {
      worst = std::max(worst, std::abs(double{g1.params[i][k]} - cpu.params[i][k]));
    }
    EXPECT_LE(worst, 1e-4) << cpu.names[i];
  }

  // Same bits again.
  SMAT_ASSERT_OK_AND_ASSIGN(RunResult g2, Train(gpu, cfg));
  EXPECT_TRUE(BitwiseEqual(g1, g2)) << "two GPU runs of the same steps differ";
}

TEST_F(TrainGpuTest, Bf16TrainsCloseToFp32AndMatchesCpuBf16) {
  PoisonBackend gpu(*gpu_);
  SMAT_ASSERT_OK_AND_ASSIGN(RunResult fp32, Train(gpu, SmallConfig(false)));
  SMAT_ASSERT_OK_AND_ASSIGN(RunResult bf16, Train(gpu, SmallConfig(true)));
  SMAT_ASSERT_OK_AND_ASSIGN(RunResult bf16_again, Train(gpu, SmallConfig(true)));
  SMAT_ASSERT_OK_AND_ASSIGN(RunResult cpu_bf16, Train(*cpu_, SmallConfig(true)));
  bool any_differs = false;
  for (int s = 0; s < kSteps; ++s) {
    ASSERT_TRUE(std::isfinite(bf16.losses[s])) << "step " << s;
    EXPECT_NEAR(bf16.losses[s], fp32.losses[s], 2e-2 * std::abs(fp32.losses[s])) << "step " << s;
    // The CPU rounds the same operands to bf16 (its SMat computes on the
    // rounded values in fp32): only the order of sums differs, but a value on
    // a rounding boundary may round the other way, hence 5e-3, not 1e-4.
    EXPECT_NEAR(bf16.losses[s], cpu_bf16.losses[s], 5e-3 * std::abs(cpu_bf16.losses[s]))
        << "step " << s;
    any_differs = any_differs || bf16.losses[s] != fp32.losses[s];
  }
  // bf16 is really in effect (the products round their operands).
  EXPECT_TRUE(any_differs);
  EXPECT_TRUE(BitwiseEqual(bf16, bf16_again)) << "two bf16 GPU runs differ";
  // Master weights stay fp32 and finite.
  for (size_t i = 0; i < bf16.params.size(); ++i) {
    for (float v : bf16.params[i]) ASSERT_TRUE(std::isfinite(v)) << bf16.names[i];
  }
}

// The paper's default feature map, ELU_PLUS_ONE, through ModelKernels on both
// backends: the CUDA map differs from the CPU's only in expf (within 2 ulp),
// so the fp32 tolerances above hold.
TEST_F(TrainGpuTest, EluFeaturesMatchCpu) {
  TrainConfig cfg = SmallConfig(false);
  cfg.mutable_model()->set_feature_map(ModelConfig::ELU_PLUS_ONE);
  SMAT_ASSERT_OK_AND_ASSIGN(RunResult cpu, Train(*cpu_, cfg));
  PoisonBackend gpu(*gpu_);
  SMAT_ASSERT_OK_AND_ASSIGN(RunResult g, Train(gpu, cfg));
  for (int s = 0; s < kSteps; ++s) {
    ASSERT_TRUE(std::isfinite(g.losses[s])) << "step " << s;
    EXPECT_NEAR(g.losses[s], cpu.losses[s], 1e-4 * std::abs(cpu.losses[s])) << "step " << s;
  }
  for (size_t i = 0; i < cpu.params.size(); ++i) {
    double worst = 0;
    for (size_t k = 0; k < cpu.params[i].size(); ++k) {
      worst = std::max(worst, std::abs(double{g.params[i][k]} - cpu.params[i][k]));
    }
    EXPECT_LE(worst, 1e-4) << cpu.names[i];
  }
}

}  // namespace
}  // namespace smat
