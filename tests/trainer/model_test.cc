// Tests of trainer/model on one rank: the gradient of the whole model against
// finite differences of its loss (d = 1 and 2, positional and token-hash
// routing, gated or not, short conv on and off, key gate, tied or untied
// head), recomputation giving bit-identical gradients, run-to-run determinism,
// identical initialisation from the seed, the token-hash mask semantic, and
// errors for bad input.
#include "trainer/model.h"

#include <cmath>
#include <cstring>
#include <set>
#include <ostream>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/rng.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/smat.h"
#include "parallel/sequence_parallel_smat.h"
#include "tests/trainer/model_test_util.h"
#include "tests/trainer/single_rank_communicator.h"
#include "trainer/layers.h"
#include "trainer/smat_mixer.h"

namespace smat {
namespace {

constexpr int64_t kBatch = 2;

// Mean loss of one forward (double): loss_sum / token_count.
double MeanLoss(Model& model, Communicator& comm, const ModelInputs& in) {
  auto parts = model.Forward(comm, in);
  SMAT_CHECK(parts.ok());
  return parts->loss_sum / parts->token_count;
}

std::vector<std::vector<float>> Grads(const Model& model) {
  std::vector<std::vector<float>> g;
  for (const Parameter& p : model.parameters()) {
    g.emplace_back(p.grad.data<float>(), p.grad.data<float>() + p.grad.numel());
  }
  return g;
}

struct GradCase {
  std::string name;
  TinyModelOptions options;
};

void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }

class ModelGradientTest : public ::testing::TestWithParam<GradCase> {};

// Directional derivatives, one random unit direction per parameter tensor:
// analytic sum(grad * u) vs (L(theta + h u) - L(theta - h u)) / 2h on the mean
// loss, the difference taken in double. The forward is fp32, so the quotient
// carries rounding noise (measured ~3e-5 at h = 1e-3) and truncation error
// O(h^2) (measured up to 4e-3 at h = 1e-2 and 3.5e-4 at h = 3e-3 on these
// O(1) random parameters, shrinking as h^2). h = 3e-3 balances the two; the
// tolerance 3e-4 + 5e-3 |analytic| sits above both, while a missing or wrong
// gradient term is an O(1) relative error of a derivative that is typically
// 0.01 .. 0.3 (the test asserts most are not negligible).
TEST_P(ModelGradientTest, MatchesFiniteDifferences) {
  const GradCase& c = GetParam();
  CpuBackend cpu;
  SingleRankCommunicator comm;
  TrainConfig cfg = TinyModelConfig(c.options);
  auto model_or = Model::Create(cfg, cpu);
  ASSERT_TRUE(model_or.ok()) << model_or.status();
  Model& model = **model_or;
  RandomizeParameters(model, 77);
  const ModelInputs in = RandomModelInputs(kBatch, c.options.T, 13, 91);

  ASSERT_TRUE(model.ZeroGrad().ok());
  auto parts = model.Forward(comm, in);
  ASSERT_TRUE(parts.ok()) << parts.status();
  ASSERT_GT(parts->token_count, 0);
  ASSERT_TRUE(std::isfinite(parts->loss_sum));
  ASSERT_TRUE(model.Backward(parts->token_count).ok());

  constexpr double h = 3e-3;
  int checked_nonzero = 0;
  auto& params = model.parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    Parameter& p = params[k];
    SCOPED_TRACE(p.name);
    const int64_t n = p.value.numel();
    std::vector<float> u(n);
    {
      Tensor ut = Tensor::Wrap(u.data(), {n}, DType::kF32);
      ASSERT_TRUE(FillNormal(ut, 123, 0, 0.f, 1.f, k).ok());
      double norm = 0;
      for (float x : u) norm += double{x} * x;
      for (float& x : u) x = static_cast<float>(x / std::sqrt(norm));
    }
    double analytic = 0;
    for (int64_t i = 0; i < n; ++i) analytic += double{p.grad.data<float>()[i]} * u[i];
    std::vector<float> saved(p.value.data<float>(), p.value.data<float>() + n);
    for (int64_t i = 0; i < n; ++i) p.value.data<float>()[i] = saved[i] + h * u[i];
    const double lp = MeanLoss(model, comm, in);
    for (int64_t i = 0; i < n; ++i) p.value.data<float>()[i] = saved[i] - h * u[i];
    const double lm = MeanLoss(model, comm, in);
    std::copy(saved.begin(), saved.end(), p.value.data<float>());
    const double fd = (lp - lm) / (2 * h);
    EXPECT_NEAR(analytic, fd, 3e-4 + 5e-3 * std::fabs(analytic));
    if (std::fabs(analytic) > 1e-2) ++checked_nonzero;
  }
  // Most directional derivatives must be clearly nonzero, else the check is empty.
  EXPECT_GT(checked_nonzero, static_cast<int>(params.size()) / 2);
}

INSTANTIATE_TEST_SUITE_P(
    Configs, ModelGradientTest,
    ::testing::Values(
        GradCase{"d1_positional", {.d = 1}},
        GradCase{"d1_gated_conv_keygate",
                 {.d = 1, .gated = true, .short_conv = true, .key_gate = true}},
        GradCase{"d2_positional_gated", {.d = 2, .gated = true}},
        GradCase{"d2_positional_conv", {.d = 2, .short_conv = true}},
        GradCase{"d2_hash", {.d = 2, .token_hash = true}},
        GradCase{"d2_hash_gated_conv_untied",
                 {.d = 2, .token_hash = true, .gated = true, .short_conv = true, .tied = false}},
        GradCase{"d1_hash_keygate", {.d = 1, .token_hash = true, .key_gate = true}},
        GradCase{"d2_softplus_features_gated",
                 {.d = 2, .gated = true, .feature_map = ModelConfig::SOFTPLUS}},
        GradCase{"d2_exp_features_conv_keygate",
                 {.d = 2, .short_conv = true, .key_gate = true, .feature_map = ModelConfig::EXP}},
        // The shipped lm_*_gpu layout: the conv's backward applies the
        // softplus derivative itself.
        GradCase{"d2_softplus_conv_gated_keygate",
                 {.d = 2, .token_hash = true, .gated = true, .short_conv = true,
                  .key_gate = true, .feature_map = ModelConfig::SOFTPLUS}}),
    [](const ::testing::TestParamInfo<GradCase>& info) { return info.param.name; });

// Recomputation runs the same kernels on the same block inputs, so the
// gradients (and the loss) must be the same bits; it must also keep less.
TEST(ModelTest, RecomputationGivesBitIdenticalGradients) {
  CpuBackend cpu;
  SingleRankCommunicator comm;
  TinyModelOptions o{.d = 2, .token_hash = true, .gated = true, .short_conv = true,
                     .key_gate = true};
  const ModelInputs in = RandomModelInputs(kBatch, o.T, 13, 5);
  std::vector<std::vector<float>> grads[2];
  LossParts parts[2];
  int64_t bytes[2];
  for (int rc = 0; rc < 2; ++rc) {
    o.recompute_above_t = rc ? o.T - 1 : 0;
    auto model = Model::Create(TinyModelConfig(o), cpu);
    ASSERT_TRUE(model.ok()) << model.status();
    RandomizeParameters(**model, 3);
    auto p = (*model)->Forward(comm, in);
    ASSERT_TRUE(p.ok()) << p.status();
    parts[rc] = *p;
    EXPECT_EQ((*model)->recomputing(), rc == 1);
    bytes[rc] = (*model)->ActivationBytes();
    ASSERT_TRUE((*model)->Backward(7.0).ok());
    grads[rc] = Grads(**model);
  }
  EXPECT_EQ(parts[0].loss_sum, parts[1].loss_sum);
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t k = 0; k < grads[0].size(); ++k) {
    ASSERT_EQ(0, std::memcmp(grads[0][k].data(), grads[1][k].data(), grads[0][k].size() * 4))
        << "parameter " << k;
  }
  EXPECT_GT(bytes[1], 0);
  EXPECT_LT(bytes[1] * 3, bytes[0]) << "recomputation should keep a fraction of the activations";
}

TEST(ModelTest, SameInputsGiveSameBitsAndGradientsAccumulate) {
  CpuBackend cpu;
  SingleRankCommunicator comm;
  TinyModelOptions o{.d = 2, .gated = true, .short_conv = true};
  auto model = Model::Create(TinyModelConfig(o), cpu);
  ASSERT_TRUE(model.ok()) << model.status();
  RandomizeParameters(**model, 4);
  const ModelInputs in = RandomModelInputs(kBatch, o.T, 13, 6);
  ASSERT_TRUE((*model)->Forward(comm, in).ok());
  ASSERT_TRUE((*model)->Backward(10.0).ok());
  const auto once = Grads(**model);
  auto norm1 = (*model)->GradientNorm();
  ASSERT_TRUE(norm1.ok());
  EXPECT_GT(*norm1, 0);
  // Same inputs again from zero gradients: the same bits.
  ASSERT_TRUE((*model)->ZeroGrad().ok());
  ASSERT_TRUE((*model)->Forward(comm, in).ok());
  ASSERT_TRUE((*model)->Backward(10.0).ok());
  const auto again = Grads(**model);
  for (size_t k = 0; k < once.size(); ++k) {
    ASSERT_EQ(0, std::memcmp(once[k].data(), again[k].data(), once[k].size() * 4)) << k;
  }
  // Without ZeroGrad a second backward accumulates: twice the gradient, up to
  // the rounding of adding partial sums in a different grouping (tied
  // embedding: head and lookup terms), a few fp32 ulps.
  ASSERT_TRUE((*model)->Forward(comm, in).ok());
  ASSERT_TRUE((*model)->Backward(10.0).ok());
  const auto twice = Grads(**model);
  for (size_t k = 0; k < once.size(); ++k) {
    for (size_t i = 0; i < once[k].size(); ++i) {
      ASSERT_NEAR(twice[k][i], 2 * once[k][i], 1e-6 * (1 + std::fabs(once[k][i]))) << k << " " << i;
    }
  }
  EXPECT_NEAR(*(*model)->GradientNorm(), 2 * *norm1, 1e-6 * *norm1);
  ASSERT_TRUE((*model)->ZeroGrad().ok());
  EXPECT_EQ(*(*model)->GradientNorm(), 0.0);
}

TEST(ModelTest, InitialisationFollowsTheSeed) {
  CpuBackend cpu;
  TinyModelOptions o{.gated = true, .short_conv = true, .key_gate = true, .tied = false};
  TrainConfig cfg = TinyModelConfig(o);
  auto a = Model::Create(cfg, cpu), b = Model::Create(cfg, cpu);
  cfg.mutable_run()->set_seed(6);
  auto c = Model::Create(cfg, cpu);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  std::set<std::string> names;
  const auto& pa = (*a)->parameters();
  bool any_differs = false;
  for (size_t k = 0; k < pa.size(); ++k) {
    EXPECT_TRUE(names.insert(pa[k].name).second) << "duplicate name " << pa[k].name;
    const Tensor& va = pa[k].value;
    EXPECT_EQ(va.shape(), pa[k].grad.shape());
    EXPECT_EQ(0, std::memcmp(va.raw(), (*b)->parameters()[k].value.raw(), va.nbytes()));
    any_differs |= std::memcmp(va.raw(), (*c)->parameters()[k].value.raw(), va.nbytes()) != 0;
  }
  EXPECT_TRUE(any_differs);
  EXPECT_TRUE(names.count("head"));
  EXPECT_TRUE(names.count("blocks.1.mixer.conv_v"));
  EXPECT_TRUE(names.count("blocks.0.mixer.b_decay"));
  o.tied = true;
  auto tied = Model::Create(TinyModelConfig(o), cpu);
  ASSERT_TRUE(tied.ok());
  EXPECT_EQ((*tied)->NumParameterElements() + 13 * 8, (*a)->NumParameterElements());
}

// Token-hash routing: a distant key s is readable by a recent query t whenever
// the token at t equals the token before s (the hyperplane of type(t) contains
// prof(s)), and not by queries whose hyperplane misses prof(s).
TEST(ModelTest, TokenHashRoutingMakesARepeatedTokensKeyVisible) {
  for (int d : {2, 3}) {
    SCOPED_TRACE(d);
    const int64_t T = d == 2 ? 64 : 160, chunk = 8;
    auto plan = MakeSmatPlan(T, d, chunk);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const SmatGeometry& geo = plan->geo;
    const uint64_t seed = 17;
    Tensor tokens = *Tensor::Empty({1, T}, DType::kI32);
    ASSERT_TRUE(FillUniformInt(tokens, 3, 0, 0, 50).ok());
    int32_t* tok = tokens.data<int32_t>();
    // Plant the pattern: distant s = 5 follows token 42; recent t = T - 3 is token 42.
    const int64_t s = 5, t = T - 3;
    tok[s - 1] = 42;
    tok[t] = 42;
    Tensor prof, type;
    ASSERT_TRUE(TokenHashRouting(*plan, seed, tokens, SmatSpan::Whole(*plan), 1, &prof, &type).ok());
    ASSERT_LT(s, plan->n);
    ASSERT_GE(t, plan->n);
    const int32_t* pf = prof.data<int32_t>();
    const int32_t* ty = type.data<int32_t>();
    EXPECT_EQ(pf[s], TokenPoint(geo, seed, 42));
    EXPECT_EQ(pf[0], TokenPoint(geo, seed, -1));
    EXPECT_TRUE(geo.Incident(ty[t], pf[s]));
    for (int64_t i = 0; i < T; ++i) {
      ASSERT_GE(pf[i], 0);
      ASSERT_LT(pf[i], geo.P);
      ASSERT_GE(ty[i], 0);
      ASSERT_LT(ty[i], geo.B);
      if (i >= 1 && i < plan->n) {
        for (int64_t j = plan->n; j < T; ++j) {
          if (tok[j] == tok[i - 1]) {
            ASSERT_TRUE(geo.Incident(ty[j], pf[i])) << i << " " << j;
          }
        }
      }
    }
    if (d == 2) {
      // d = 2: the hyperplane of a token is the single cell h(token).
      for (int64_t j = plan->n; j < T; ++j) {
        EXPECT_EQ(ty[j], geo.flat_to_type[TokenPoint(geo, seed, tok[j])]);
      }
    }

    // The op: perturbing v at s moves o at t, and leaves every recent query
    // whose hyperplane misses prof(s) untouched.
    CpuBackend cpu;
    const int64_t H = 1, r = 3, dv = 2;
    auto rnd = [&](Shape shape, uint64_t stream, float lo) {
      Tensor x = *Tensor::Empty(std::move(shape), DType::kF32);
      SMAT_CHECK(FillUniform(x, 9, 0, lo, 1.f, stream).ok());
      return x;
    };
    SmatInputs in;  // ungated: a distant key reaches recent queries only through types
    in.phi = rnd({1, T, H, r}, 1, 0.1f);
    in.psi = rnd({1, T, H, r}, 2, 0.1f);
    in.v = rnd({1, T, H, dv}, 3, -1.f);
    in.prof = prof;
    in.type = type;
    in.eps = 1e-6f;
    SmatForwardOutputs base, moved;
    ASSERT_TRUE(SmatForward(cpu, *plan, in, &base).ok());
    Tensor v2 = rnd({1, T, H, dv}, 3, -1.f);
    v2.data<float>()[s * dv] += 5.f;
    in.v = v2;
    ASSERT_TRUE(SmatForward(cpu, *plan, in, &moved).ok());
    const float* o0 = base.o.data<float>();
    const float* o1 = moved.o.data<float>();
    EXPECT_NE(o0[t * dv], o1[t * dv]) << "the query at t does not see the key at s";
    int unseen = 0;
    for (int64_t j = plan->n; j < T; ++j) {
      if (!geo.Incident(ty[j], pf[s])) {
        ++unseen;
        EXPECT_EQ(o0[j * dv], o1[j * dv]) << "query " << j << " sees a key off its hyperplane";
      }
    }
    EXPECT_GT(unseen, 0);
  }
}

TEST(ModelTest, BadInputsAreErrors) {
  CpuBackend cpu;
  SingleRankCommunicator comm;
  TinyModelOptions o;
  auto model = Model::Create(TinyModelConfig(o), cpu);
  ASSERT_TRUE(model.ok());
  EXPECT_EQ((*model)->Backward(1.0).code(), absl::StatusCode::kFailedPrecondition);
  ModelInputs in = RandomModelInputs(kBatch, o.T, 13, 1);
  in.tokens.data<int32_t>()[3] = 13;  // outside the vocabulary
  EXPECT_EQ((*model)->Forward(comm, in).status().code(), absl::StatusCode::kInvalidArgument);
  in = RandomModelInputs(kBatch, o.T, 13, 1);
  ASSERT_TRUE((*model)->Forward(comm, in).ok());
  EXPECT_GT((*model)->ActivationBytes(), 0);
  EXPECT_EQ((*model)->Backward(0.0).code(), absl::StatusCode::kInvalidArgument);
  TrainConfig cfg = TinyModelConfig(o);
  cfg.mutable_model()->set_vocab_size(1);
  EXPECT_EQ(Model::Create(cfg, cpu).status().code(), absl::StatusCode::kInvalidArgument);
  cfg = TinyModelConfig(o);
  cfg.mutable_model()->set_heads(0);
  EXPECT_EQ(Model::Create(cfg, cpu).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace smat

namespace smat {
namespace {

// run.bf16 on the CPU: the products read bf16-rounded operands (the CPU Gemm
// widens them back and accumulates in fp32) and the SMat op reads features
// rounded to bf16 (its CPU kernels compute on them in fp32). The loss and the
// gradients move by the rounding only: within 2e-2 relative of fp32 (operands
// rounded by at most 2^-9 relative, the errors averaging in fp32 sums), but
// not bit-equal to it; gradients stay fp32 and finite, two runs agree bitwise.
TEST(ModelTest, Bf16OnTheCpuRoundsOperandsOnly) {
  CpuBackend cpu;
  SingleRankCommunicator comm;
  TinyModelOptions o;
  o.token_hash = true;
  o.gated = true;
  o.short_conv = true;
  o.key_gate = true;
  const ModelInputs in = RandomModelInputs(2, o.T, 13, 77);
  auto run = [&](bool bf16, double* loss, std::vector<std::vector<float>>* grads) {
    TrainConfig cfg = TinyModelConfig(o);
    cfg.mutable_run()->set_bf16(bf16);
    auto model = Model::Create(cfg, cpu);
    ASSERT_TRUE(model.ok()) << model.status();
    RandomizeParameters(**model, 9);
    ASSERT_TRUE((*model)->ZeroGrad().ok());
    auto parts = (*model)->Forward(comm, in);
    ASSERT_TRUE(parts.ok()) << parts.status();
    ASSERT_TRUE((*model)->Backward(parts->token_count).ok());
    *loss = parts->loss_sum / parts->token_count;
    *grads = Grads(**model);
  };
  double l32 = 0, l16 = 0, l16b = 0;
  std::vector<std::vector<float>> g32, g16, g16b;
  run(false, &l32, &g32);
  run(true, &l16, &g16);
  run(true, &l16b, &g16b);
  EXPECT_NE(l16, l32);
  EXPECT_NEAR(l16, l32, 2e-2 * std::abs(l32));
  EXPECT_EQ(l16, l16b);
  EXPECT_EQ(g16, g16b);
  double num = 0, den = 0;
  for (size_t i = 0; i < g32.size(); ++i) {
    for (size_t k = 0; k < g32[i].size(); ++k) {
      ASSERT_TRUE(std::isfinite(g16[i][k]));
      num += (double{g16[i][k]} - g32[i][k]) * (double{g16[i][k]} - g32[i][k]);
      den += double{g32[i][k]} * g32[i][k];
    }
  }
  // Relative error of the whole gradient: rounding-sized, not a broken path.
  EXPECT_LT(std::sqrt(num / den), 5e-2);
  EXPECT_GT(num, 0.0);
}

}  // namespace
}  // namespace smat

namespace smat {
namespace {

// The shipped GPU configs load and validate, their SMat plans exist and split
// over their sp ranks, and an impossible shape is refused at load time (before
// any rank starts work).
TEST(ModelTest, ShippedGpuConfigsValidate) {
  const std::string dir = std::string(SMAT_SOURCE_DIR) + "/configs/";
  for (const char* name : {"lm_16k_gpu", "lm_1m_gpu", "lm_2m_sp2", "mqar_64k_gpu"}) {
    auto cfg = LoadConfig(dir + name + ".textproto");
    ASSERT_TRUE(cfg.ok()) << name << ": " << cfg.status();
    EXPECT_EQ(cfg->parallel().device(), "cuda") << name;
    EXPECT_TRUE(cfg->run().bf16()) << name;
    auto plan = MakeSmatPlan(cfg->data().seq_len(), cfg->smat().d(), cfg->smat().chunk(),
                             cfg->smat().q());
    ASSERT_TRUE(plan.ok()) << name << ": " << plan.status();
    auto spans = SplitSequence(*plan, cfg->parallel().sp());
    EXPECT_TRUE(spans.ok()) << name << ": " << spans.status();
  }
  EXPECT_FALSE(LoadConfig(dir + "lm_16k_gpu.textproto", {"model.heads=5"}).ok());
  EXPECT_FALSE(LoadConfig(dir + "lm_1m_gpu.textproto", {"smat.d=0"}).ok());
}

}  // namespace
}  // namespace smat

namespace smat {
namespace {

// Dense with bf16 on casts each weight once per BeginForward: a second product
// with the weight reuses that cast, a changed weight is cast again at the next
// BeginForward, and the results equal those of the per-call cast (no
// BeginForward yet) bit for bit.
TEST(DenseTest, Bf16WeightsAreCastOncePerForward) {
  CpuBackend cpu;
  ModelKernels* mk = *cpu.model();
  const int64_t N = 7, in = 11, out = 5;
  Tensor x = *Tensor::Empty({N, in}, DType::kF32);
  ASSERT_TRUE(FillNormal(x, 3, 0, 0.f, 1.f, 0).ok());
  Parameter w;
  w.name = "w";
  w.value = *Tensor::Empty({out, in}, DType::kF32);
  ASSERT_TRUE(FillNormal(w.value, 3, 0, 0.f, 1.f, 1).ok());
  w.grad = *Tensor::Zeros({out, in}, DType::kF32);
  auto product = [&](Dense& d) {
    Tensor y = *Tensor::Empty({N, out}, DType::kF32);
    EXPECT_TRUE(d.Forward(x, w, nullptr, y).ok());
    return std::vector<float>(y.data<float>(), y.data<float>() + y.numel());
  };
  Dense per_call(cpu, *mk, /*bf16=*/true), cached(cpu, *mk, /*bf16=*/true);
  const std::vector<float> before = product(per_call);
  cached.BeginForward();
  EXPECT_EQ(product(cached), before);
  // Within one forward the weight must not change; if it does, the cast of
  // this forward is what the products read.
  for (int64_t i = 0; i < w.value.numel(); ++i) w.value.data<float>()[i] *= 2.f;
  EXPECT_EQ(product(cached), before);
  cached.BeginForward();
  const std::vector<float> after = product(per_call);
  EXPECT_NE(after, before);
  EXPECT_EQ(product(cached), after);
  // NewOperand: bf16 with bf16 on, fp32 otherwise.
  EXPECT_EQ(cached.NewOperand({2, 3})->dtype(), DType::kBF16);
  Dense fp32(cpu, *mk, /*bf16=*/false);
  EXPECT_EQ(fp32.NewOperand({2, 3})->dtype(), DType::kF32);
}

}  // namespace
}  // namespace smat
