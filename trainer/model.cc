// The SMat language model: parameters, blocks, loss, forward and backward with
// optional per-block recomputation. See trainer/model.h.
#include "trainer/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/config.h"
#include "core/rng.h"
#include "core/status.h"
#include "kernels/model_kernels.h"
#include "parallel/sequence_parallel_smat.h"
#include "trainer/layers.h"
#include "trainer/phase_timer.h"
#include "trainer/smat_mixer.h"

namespace smat {
namespace {

// RMSNorm epsilon (Zhang and Sennrich 2019 use 1e-8; 1e-6 keeps fp32 rstd
// finite for an all-zero row).
constexpr float kNormEps = 1e-6f;
// Initial scale of weight matrices (GPT-2); projections into the residual
// stream are further divided by sqrt(2 layers) so the stream's variance does
// not grow with depth.
constexpr float kInitStd = 0.02f;
// Rows of the [rows, vocab] logits scratch of the chunked cross-entropy: about
// 4M floats (16 MiB) whatever the vocabulary.
constexpr int64_t kLossScratchFloats = int64_t{1} << 22;

int64_t Bytes(const Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

struct BlockParameters {
  Parameter* norm1 = nullptr;   // [W]
  MixerParameters mixer;
  Parameter* norm2 = nullptr;   // [W]
  Parameter* w_gate = nullptr;  // [F, W]
  Parameter* w_up = nullptr;    // [F, W]
  Parameter* w_down = nullptr;  // [W, F]
};

// What one block keeps for its backward (N = batch L rows of this span).
struct BlockActivations {
  // n1, n2 and act are read only by matrix products, gate and up only by
  // SwiGLU: bf16 with run.bf16 (Dense::NewOperand), written so by the kernels
  // and products that produce them.
  Tensor x;            // [N, W] block input (kept when recomputing too)
  Tensor n1, rstd1;    // [N, W], [N]
  MixerActivations mixer;
  Tensor x_mid;        // [N, W] x + mixer output
  Tensor n2, rstd2;    // [N, W], [N]
  Tensor gate, up;     // [N, F] MLP pre-activations
  Tensor act;          // [N, F] silu(gate) * up
  int64_t Bytes() const {
    int64_t b = mixer.Bytes();
    for (const Tensor* t : {&x, &n1, &rstd1, &x_mid, &n2, &rstd2, &gate, &up, &act}) {
      b += smat::Bytes(*t);
    }
    return b;
  }
};

// Contiguous [batch * L] host copy of the span [t0, t1) of a host [batch, T] tensor.
absl::StatusOr<Tensor> SpanRows(const Tensor& full, const SmatSpan& span) {
  const int64_t nb = full.dim(0), T = full.dim(1), L = span.length();
  const size_t es = DTypeSize(full.dtype());
  SMAT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({nb * L}, full.dtype()));
  for (int64_t b = 0; b < nb; ++b) {
    std::memcpy(static_cast<char*>(out.raw()) + b * L * es,
                static_cast<const char*>(full.raw()) + (b * T + span.t0) * es, L * es);
  }
  return out;
}

// `host` itself on a CPU backend, else its copy in the backend's memory.
absl::StatusOr<Tensor> OnBackend(Backend& backend, const Tensor& host) {
  if (backend.device().is_cpu()) return host;
  SMAT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(host.shape(), host.dtype(), backend.allocator()));
  SMAT_RETURN_IF_ERROR(backend.Copy(host, t));
  return t;
}

// A host copy of `t` (t itself when it is a host tensor).
absl::StatusOr<Tensor> OnHost(Backend& backend, const Tensor& t) {
  if (t.device().is_cpu()) return t;
  SMAT_ASSIGN_OR_RETURN(Tensor h, Tensor::Empty(t.shape(), t.dtype()));
  SMAT_RETURN_IF_ERROR(backend.Copy(t, h));
  SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  return h;
}

// The model and smat parts of ValidateConfig (core/config.cc): a model is
// also built by tools and tests whose data / optimizer sections are empty.
absl::Status ValidateModelParts(const TrainConfig& cfg) {
  const ModelConfig& m = cfg.model();
  const SmatConfig& s = cfg.smat();
  std::vector<std::string> errors;
  auto require = [&](bool ok, const char* field, auto value, const char* problem) {
    if (!ok) errors.push_back(absl::StrCat("config: ", field, " = ", value, " ", problem));
  };
  require(m.vocab_size() >= 2, "model.vocab_size", m.vocab_size(), "must be at least 2");
  require(m.width() >= 1, "model.width", m.width(), "must be at least 1");
  require(m.layers() >= 1, "model.layers", m.layers(), "must be at least 1");
  require(m.heads() >= 1, "model.heads", m.heads(), "must be at least 1");
  require(m.head_dim_qk() >= 1, "model.head_dim_qk", m.head_dim_qk(), "must be at least 1");
  require(m.head_dim_v() >= 1, "model.head_dim_v", m.head_dim_v(), "must be at least 1");
  require(m.mlp_hidden() >= 1, "model.mlp_hidden", m.mlp_hidden(), "must be at least 1");
  require(m.recompute_above_t() >= 0, "model.recompute_above_t", m.recompute_above_t(),
          "must be >= 0 (0: never recompute)");
  require(s.d() >= 1 && s.d() <= 8, "smat.d", s.d(), "is out of range; expected 1..8");
  require(s.q() == 0 || IsPrime(s.q()), "smat.q", s.q(), "is not prime (0 picks q automatically)");
  require(s.chunk() >= 1, "smat.chunk", s.chunk(), "must be at least 1");
  require(s.eps() > 0 && std::isfinite(s.eps()), "smat.eps", s.eps(), "must be > 0");
  if (errors.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrJoin(errors, "\n"));
}

}  // namespace

struct Model::Impl {
  ModelKernels* kernels = nullptr;
  std::unique_ptr<Dense> dense;  // every linear layer; precision from run.bf16
  Parameter* embedding = nullptr;   // [V, W]
  Parameter* final_norm = nullptr;  // [W]
  Parameter* head = nullptr;        // [V, W]; == embedding when tied
  std::vector<BlockParameters> blocks;
  std::vector<SmatMixer> mixers;
  std::map<int64_t, std::unique_ptr<SmatPlan>> plans;  // by T

  // The last Forward (valid while has_forward).
  bool has_forward = false;
  bool recompute = false;
  MixerStep step;
  SmatSpan span;
  Tensor ids, targets, weights;  // [N] int32, int32, fp32
  std::vector<BlockActivations> acts;
  Tensor x_final, n_final, rstd_final, lse;  // [N, W], [N, W], [N], [N]

  absl::Status BlockForward(Backend& be, size_t l, const Tensor& x, BlockActivations* a,
                            Tensor* y);
  absl::Status BlockBackward(Backend& be, size_t l, const BlockActivations& a, const Tensor& dy,
                             Tensor* dx);
};

absl::Status Model::Impl::BlockForward(Backend& be, size_t l, const Tensor& x,
                                       BlockActivations* a, Tensor* y) {
  const BlockParameters& p = blocks[l];
  const int64_t N = x.dim(0), W = x.dim(1), F = p.w_gate->value.dim(0);
  a->x = x;
  SMAT_ASSIGN_OR_RETURN(a->n1, dense->NewOperand({N, W}));
  SMAT_ASSIGN_OR_RETURN(a->rstd1, NewActivation(be, {N}));
  SMAT_RETURN_IF_ERROR(kernels->RmsNormForward(x, p.norm1->value, kNormEps, a->n1, a->rstd1));
  Tensor mixed;  // [N, W]
  {
    PhaseScope phase(be, "fwd.mixer");
    SMAT_RETURN_IF_ERROR(
        Annotate(mixers[l].Forward(step, a->n1, &a->mixer, &mixed), "block ", l, " mixer"));
  }
  PhaseScope phase(be, "fwd.mlp");
  // x_mid = x + mixed (in place) and n2 = norm2(x_mid) in one pass.
  a->x_mid = mixed;
  SMAT_ASSIGN_OR_RETURN(a->n2, dense->NewOperand({N, W}));
  SMAT_ASSIGN_OR_RETURN(a->rstd2, NewActivation(be, {N}));
  SMAT_RETURN_IF_ERROR(kernels->AddRmsNormForward(x, mixed, p.norm2->value, kNormEps, a->x_mid,
                                                  a->n2, a->rstd2));
  // gate and up are read only by SwiGLU (forward and backward), which reads
  // bf16: with run.bf16 the products write them in bf16.
  SMAT_ASSIGN_OR_RETURN(a->gate, dense->NewOperand({N, F}));
  SMAT_ASSIGN_OR_RETURN(a->up, dense->NewOperand({N, F}));
  SMAT_ASSIGN_OR_RETURN(a->act, dense->NewOperand({N, F}));
  SMAT_ASSIGN_OR_RETURN(const Tensor n2s, dense->Operand(a->n2, Dense::kInput));
  SMAT_RETURN_IF_ERROR(dense->Forward(n2s, *p.w_gate, nullptr, a->gate));
  SMAT_RETURN_IF_ERROR(dense->Forward(n2s, *p.w_up, nullptr, a->up));
  SMAT_RETURN_IF_ERROR(kernels->SwiGluForward(a->gate, a->up, a->act));
  SMAT_ASSIGN_OR_RETURN(*y, NewActivation(be, {N, W}));
  SMAT_RETURN_IF_ERROR(dense->Forward(a->act, *p.w_down, nullptr, *y));
  return kernels->ResidualAdd(a->x_mid, *y, *y);
}

absl::Status Model::Impl::BlockBackward(Backend& be, size_t l, const BlockActivations& a,
                                        const Tensor& dy, Tensor* dx) {
  const BlockParameters& p = blocks[l];
  const int64_t N = a.x.dim(0), W = a.x.dim(1), F = p.w_gate->value.dim(0);
  // MLP branch: y = x_mid + act Wd^T.
  std::optional<PhaseScope> phase(std::in_place, be, "bwd.mlp");
  // d_act is read only by SwiGLU's backward, which reads bf16 exactly: with
  // run.bf16 the product writes it in bf16.
  SMAT_ASSIGN_OR_RETURN(Tensor d_act, dense->NewOperand({N, F}));
  SMAT_RETURN_IF_ERROR(dense->Backward(a.act, dy, *p.w_down, nullptr, &d_act, false));
  // d_gate and d_up are read only by the products below: bf16 with run.bf16.
  SMAT_ASSIGN_OR_RETURN(Tensor d_gate, dense->NewOperand({N, F}));
  SMAT_ASSIGN_OR_RETURN(Tensor d_up, dense->NewOperand({N, F}));
  SMAT_RETURN_IF_ERROR(kernels->SwiGluBackward(a.gate, a.up, d_act, d_gate, d_up));
  SMAT_ASSIGN_OR_RETURN(Tensor d_n2, NewActivation(be, {N, W}));
  SMAT_ASSIGN_OR_RETURN(const Tensor n2s, dense->Operand(a.n2, Dense::kInput));
  SMAT_RETURN_IF_ERROR(dense->Backward(n2s, d_gate, *p.w_gate, nullptr, &d_n2, false));
  SMAT_RETURN_IF_ERROR(dense->Backward(n2s, d_up, *p.w_up, nullptr, &d_n2, true));
  // d_mid = norm2's backward + dy (the residual path), in one pass.
  SMAT_ASSIGN_OR_RETURN(Tensor d_mid, NewActivation(be, {N, W}));
  SMAT_RETURN_IF_ERROR(kernels->RmsNormBackwardAdd(a.x_mid, p.norm2->value, a.rstd2, d_n2, dy,
                                                   d_mid, p.norm2->grad));
  // Mixer branch: x_mid = x + mixer(norm1(x)).
  phase.emplace(be, "bwd.mixer");
  Tensor d_n1;  // [N, W]
  SMAT_RETURN_IF_ERROR(Annotate(mixers[l].Backward(step, a.n1, a.mixer, d_mid, &d_n1),
                                "block ", l, " mixer backward"));
  SMAT_ASSIGN_OR_RETURN(*dx, NewActivation(be, {N, W}));
  return kernels->RmsNormBackwardAdd(a.x, p.norm1->value, a.rstd1, d_n1, d_mid, *dx,
                                     p.norm1->grad);
}

Model::Model(const TrainConfig& config, Backend& backend)
    : config_(config), backend_(backend), impl_(std::make_unique<Impl>()) {}

Model::~Model() = default;

absl::StatusOr<std::unique_ptr<Model>> Model::Create(const TrainConfig& config,
                                                     Backend& backend) {
  TrainConfig cfg = config;
  ApplyDefaults(cfg);
  SMAT_RETURN_IF_ERROR(ValidateModelParts(cfg));
  const ModelConfig& m = cfg.model();
  std::unique_ptr<Model> model(new Model(cfg, backend));
  Impl& im = *model->impl_;
  SMAT_ASSIGN_OR_RETURN(im.kernels, backend.model());
  im.dense = std::make_unique<Dense>(backend, *im.kernels, cfg.run().bf16());

  const int64_t V = m.vocab_size(), W = m.width(), H = m.heads(), r = m.head_dim_qk(),
                dv = m.head_dim_v(), F = m.mlp_hidden(), K = kShortConvWidth;
  const float out_std = kInitStd / std::sqrt(2.f * m.layers());
  // Every parameter: name, shape, decay, init. Init kinds: normal(0, std),
  // ones, conv (normal(0, std) plus 1 on the newest tap: starts near the
  // identity, so the conv begins as a no-op), decay bias (uniform [-7, -3]:
  // per-token decay exp(-softplus(b)) between 0.999 and 0.95, a spread of
  // memory lengths across heads), zeros.
  enum class Init { kNormal, kOnes, kConv, kDecayBias, kZeros };
  struct Spec {
    std::string name;
    Shape shape;
    bool decay;
    Init init;
    float std;
  };
  std::vector<Spec> specs;
  specs.push_back({"embedding", {V, W}, true, Init::kNormal, kInitStd});
  for (int l = 0; l < m.layers(); ++l) {
    const std::string b = absl::StrCat("blocks.", l, ".");
    specs.push_back({b + "norm1.weight", {W}, false, Init::kOnes, 0.f});
    specs.push_back({b + "mixer.wq", {H * r, W}, true, Init::kNormal, kInitStd});
    specs.push_back({b + "mixer.wk", {H * r, W}, true, Init::kNormal, kInitStd});
    specs.push_back({b + "mixer.wv", {H * dv, W}, true, Init::kNormal, kInitStd});
    if (m.short_conv()) {
      specs.push_back({b + "mixer.conv_q", {K, H * r}, false, Init::kConv, kInitStd});
      specs.push_back({b + "mixer.conv_k", {K, H * r}, false, Init::kConv, kInitStd});
      specs.push_back({b + "mixer.conv_v", {K, H * dv}, false, Init::kConv, kInitStd});
    }
    if (m.gated()) {
      specs.push_back({b + "mixer.w_decay", {H, W}, true, Init::kNormal, kInitStd});
      specs.push_back({b + "mixer.b_decay", {H}, false, Init::kDecayBias, 0.f});
    }
    if (m.key_gate()) {
      specs.push_back({b + "mixer.w_key_gate", {H, W}, true, Init::kNormal, kInitStd});
      specs.push_back({b + "mixer.b_key_gate", {H}, false, Init::kZeros, 0.f});
    }
    specs.push_back({b + "mixer.wo", {W, H * dv}, true, Init::kNormal, out_std});
    specs.push_back({b + "norm2.weight", {W}, false, Init::kOnes, 0.f});
    specs.push_back({b + "mlp.w_gate", {F, W}, true, Init::kNormal, kInitStd});
    specs.push_back({b + "mlp.w_up", {F, W}, true, Init::kNormal, kInitStd});
    specs.push_back({b + "mlp.w_down", {W, F}, true, Init::kNormal, out_std});
  }
  specs.push_back({"final_norm.weight", {W}, false, Init::kOnes, 0.f});
  if (!m.tied_embeddings()) specs.push_back({"head", {V, W}, true, Init::kNormal, kInitStd});

  const uint64_t seed = static_cast<uint64_t>(cfg.run().seed());
  std::vector<Parameter>& params = model->params_;
  params.reserve(specs.size());  // pointers below stay valid: the list never grows again
  std::map<std::string, Parameter*> by_name;
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& s = specs[i];
    Parameter p;
    p.name = s.name;
    p.decay = s.decay;
    SMAT_ASSIGN_OR_RETURN(Tensor host, Tensor::Empty(s.shape, DType::kF32));  // init on the host
    switch (s.init) {
      case Init::kNormal:
      case Init::kConv:
        // Stream = the parameter's index: values independent of the other parameters.
        SMAT_RETURN_IF_ERROR(FillNormal(host, seed, 0, 0.f, s.std, i));
        if (s.init == Init::kConv) {
          float* w = host.data<float>();  // [K, C]
          const int64_t C = s.shape[1];
          for (int64_t c = 0; c < C; ++c) w[(K - 1) * C + c] += 1.f;
        }
        break;
      case Init::kOnes:
      case Init::kZeros:
        std::fill(host.data<float>(), host.data<float>() + host.numel(),
                  s.init == Init::kOnes ? 1.f : 0.f);
        break;
      case Init::kDecayBias:
        SMAT_RETURN_IF_ERROR(FillUniform(host, seed, 0, -7.f, -3.f, i));
        break;
    }
    SMAT_ASSIGN_OR_RETURN(p.value, NewActivation(backend, s.shape));
    SMAT_RETURN_IF_ERROR(backend.Copy(host, p.value));
    SMAT_ASSIGN_OR_RETURN(p.grad, NewZeros(backend, s.shape));
    params.push_back(std::move(p));
    by_name[s.name] = &params.back();
  }
  auto get = [&](const std::string& name) {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : it->second;
  };
  im.embedding = get("embedding");
  im.final_norm = get("final_norm.weight");
  im.head = m.tied_embeddings() ? im.embedding : get("head");
  for (int l = 0; l < m.layers(); ++l) {
    const std::string b = absl::StrCat("blocks.", l, ".");
    BlockParameters bp;
    bp.norm1 = get(b + "norm1.weight");
    bp.norm2 = get(b + "norm2.weight");
    bp.w_gate = get(b + "mlp.w_gate");
    bp.w_up = get(b + "mlp.w_up");
    bp.w_down = get(b + "mlp.w_down");
    MixerParameters& mp = bp.mixer;
    mp.wq = get(b + "mixer.wq");
    mp.wk = get(b + "mixer.wk");
    mp.wv = get(b + "mixer.wv");
    mp.wo = get(b + "mixer.wo");
    mp.conv_q = get(b + "mixer.conv_q");
    mp.conv_k = get(b + "mixer.conv_k");
    mp.conv_v = get(b + "mixer.conv_v");
    mp.w_decay = get(b + "mixer.w_decay");
    mp.b_decay = get(b + "mixer.b_decay");
    mp.w_key_gate = get(b + "mixer.w_key_gate");
    mp.b_key_gate = get(b + "mixer.b_key_gate");
    im.blocks.push_back(bp);
    SMAT_ASSIGN_OR_RETURN(SmatMixer mixer, SmatMixer::Create(cfg, mp, backend, *im.dense));
    im.mixers.push_back(mixer);
  }
  return model;
}

int64_t Model::NumParameterElements() const {
  int64_t n = 0;
  for (const Parameter& p : params_) n += p.value.numel();
  return n;
}

absl::Status Model::ZeroGrad() {
  for (Parameter& p : params_) SMAT_RETURN_IF_ERROR(backend_.Fill(p.grad, 0.0));
  return absl::OkStatus();
}

absl::StatusOr<double> Model::GradientNorm() {
  std::vector<Tensor> grads;
  for (const Parameter& p : params_) grads.push_back(p.grad);
  SMAT_ASSIGN_OR_RETURN(double ss, impl_->kernels->SumOfSquares(grads));
  return std::sqrt(ss);
}

int64_t Model::ActivationBytes() const {
  const Impl& im = *impl_;
  if (!im.has_forward) return 0;
  int64_t b = 0;
  for (const BlockActivations& a : im.acts) b += a.Bytes();
  for (const Tensor* t : {&im.x_final, &im.n_final, &im.rstd_final, &im.lse, &im.ids,
                          &im.targets, &im.weights, &im.step.prof, &im.step.type}) {
    b += Bytes(*t);
  }
  return b;
}

SmatSpan Model::span() const { return impl_->span; }
bool Model::recomputing() const { return impl_->recompute; }

absl::StatusOr<LossParts> Model::Forward(Communicator& sequence, const ModelInputs& inputs) {
  Impl& im = *impl_;
  const ModelConfig& m = config_.model();
  im.has_forward = false;
  im.acts.clear();
  const Tensor& tok = inputs.tokens;
  if (!tok.defined() || tok.dtype() != DType::kI32 || tok.rank() != 2 || !tok.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Model::Forward: tokens must be host int32 [batch, T]; got ",
        tok.defined() ? tok.DebugString() : std::string("undefined")));
  }
  const int64_t nb = tok.dim(0), T = tok.dim(1);
  SMAT_RETURN_IF_ERROR(CheckShape(inputs.targets, {nb, T}, "Model::Forward targets"));
  SMAT_RETURN_IF_ERROR(CheckShape(inputs.loss_mask, {nb, T}, "Model::Forward loss_mask"));
  if (inputs.targets.dtype() != DType::kI32 || inputs.loss_mask.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(
        "Model::Forward: targets must be int32 and loss_mask fp32 [batch, T]");
  }
  auto plan_it = im.plans.find(T);
  if (plan_it == im.plans.end()) {
    const SmatConfig& s = config_.smat();
    auto plan = MakeSmatPlan(T, s.d(), s.chunk(), s.q());
    if (!plan.ok()) {
      return Annotate(plan.status(), "Model::Forward: no SMat plan for sequence length T = ", T);
    }
    plan_it = im.plans.emplace(T, std::make_unique<SmatPlan>(*std::move(plan))).first;
  }
  const SmatPlan& plan = *plan_it->second;
  std::vector<SmatSpan> spans = inputs.spans;
  if (spans.empty()) {
    SMAT_ASSIGN_OR_RETURN(spans, SplitSequence(plan, sequence.size()));
  }
  SMAT_RETURN_IF_ERROR(ValidateSpans(plan, spans, sequence.size()));

  im.dense->BeginForward();  // the weights may have changed since the last forward
  im.step = MixerStep();
  im.step.comm = &sequence;
  im.step.plan = &plan;
  im.step.spans = spans;
  im.step.batch = nb;
  im.span = spans[sequence.rank()];
  const uint64_t seed = static_cast<uint64_t>(config_.run().seed());
  if (m.routing() == ModelConfig::TOKEN_HASH) {
    // Hashed on the host (the tokens are there), copied to the device once per
    // forward; every layer (and a recomputed one) reads the same tables.
    Tensor prof, type;
    SMAT_RETURN_IF_ERROR(TokenHashRouting(plan, seed, tok, im.span, m.heads(), &prof, &type));
    SMAT_ASSIGN_OR_RETURN(im.step.prof, OnBackend(backend_, prof));
    SMAT_ASSIGN_OR_RETURN(im.step.type, OnBackend(backend_, type));
  }
  im.recompute = m.recompute_above_t() > 0 && T > m.recompute_above_t();
  // The span's rows, sliced on the host, then (device backend) copied over.
  SMAT_ASSIGN_OR_RETURN(const Tensor ids_host, SpanRows(tok, im.span));
  SMAT_ASSIGN_OR_RETURN(const Tensor targets_host, SpanRows(inputs.targets, im.span));
  SMAT_ASSIGN_OR_RETURN(const Tensor weights_host, SpanRows(inputs.loss_mask, im.span));
  SMAT_ASSIGN_OR_RETURN(im.ids, OnBackend(backend_, ids_host));
  SMAT_ASSIGN_OR_RETURN(im.targets, OnBackend(backend_, targets_host));
  SMAT_ASSIGN_OR_RETURN(im.weights, OnBackend(backend_, weights_host));
  const int64_t N = im.ids.numel(), W = m.width(), V = m.vocab_size();

  SMAT_ASSIGN_OR_RETURN(Tensor x, NewActivation(backend_, {N, W}));  // residual stream
  SMAT_RETURN_IF_ERROR(im.kernels->EmbeddingForward(im.embedding->value, im.ids, x));
  im.acts.resize(im.blocks.size());
  for (size_t l = 0; l < im.blocks.size(); ++l) {
    Tensor y;  // [N, W]
    SMAT_RETURN_IF_ERROR(im.BlockForward(backend_, l, x, &im.acts[l], &y));
    if (im.recompute) {
      // Keep only the block input; backward recomputes the rest.
      BlockActivations kept;
      kept.x = x;
      im.acts[l] = std::move(kept);
    }
    x = y;
  }
  im.x_final = x;
  SMAT_ASSIGN_OR_RETURN(im.n_final, NewActivation(backend_, {N, W}));
  SMAT_ASSIGN_OR_RETURN(im.rstd_final, NewActivation(backend_, {N}));
  SMAT_RETURN_IF_ERROR(im.kernels->RmsNormForward(x, im.final_norm->value, kNormEps, im.n_final,
                                                  im.rstd_final));
  SMAT_ASSIGN_OR_RETURN(im.lse, NewActivation(backend_, {N}));
  PhaseScope loss_phase(backend_, "fwd.loss");
  LossParts parts;
  SMAT_RETURN_IF_ERROR(im.kernels->CrossEntropyForward(
      backend_, im.n_final, im.head->value, im.targets, im.weights,
      std::max<int64_t>(1, kLossScratchFloats / V), im.lse, &parts.loss_sum));
  const float* w = weights_host.data<float>();
  for (int64_t i = 0; i < N; ++i) parts.token_count += w[i];
  // Exact-match counts (LossParts::correct / counted) for recall tasks, whose
  // loss rows are a few answer positions per sequence: their logits are
  // recomputed here on the host (P rows x V x W per sequence, negligible next
  // to the forward). TEXT counts every row, so it skips this, and so does a
  // caller that does not want them (training steps). On a device the final
  // hidden states and the head are copied to the host first: evaluation only.
  if (config_.data().kind() != DataConfig::TEXT && inputs.count_correct) {
    const int64_t L = N / nb;
    parts.correct.assign(nb, 0.0);
    parts.counted.assign(nb, 0.0);
    SMAT_ASSIGN_OR_RETURN(const Tensor h_host, OnHost(backend_, im.n_final));
    SMAT_ASSIGN_OR_RETURN(const Tensor head_host, OnHost(backend_, im.head->value));
    const float* h = h_host.data<float>();           // [N, W]
    const float* wh = head_host.data<float>();       // [V, W]
    const int32_t* tg = targets_host.data<int32_t>();  // [N]
    for (int64_t i = 0; i < N; ++i) {
      if (w[i] <= 0.f) continue;
      int64_t best = 0;
      float best_logit = -INFINITY;
      for (int64_t v = 0; v < V; ++v) {
        float z = 0.f;
        for (int64_t k = 0; k < W; ++k) z += h[i * W + k] * wh[v * W + k];
        if (z > best_logit) {  // strict: the lowest index wins ties
          best_logit = z;
          best = v;
        }
      }
      parts.counted[i / L] += w[i];
      if (best == tg[i]) parts.correct[i / L] += w[i];
    }
  }
  im.has_forward = true;
  return parts;
}

absl::Status Model::Backward(double normaliser) {
  Impl& im = *impl_;
  if (!im.has_forward) {
    return absl::FailedPreconditionError(
        "Model::Backward: no forward to differentiate; call Forward before every Backward");
  }
  if (!(normaliser > 0) || !std::isfinite(normaliser)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Model::Backward: normaliser = ", normaliser,
        " must be positive and finite (the global count of loss tokens; a batch without "
        "loss tokens has no gradient)"));
  }
  im.has_forward = false;  // activations are consumed (and freed) below
  const int64_t N = im.ids.numel(), W = config_.model().width(),
                V = config_.model().vocab_size();
  SMAT_ASSIGN_OR_RETURN(Tensor d_n, NewActivation(backend_, {N, W}));
  std::optional<PhaseScope> phase(std::in_place, backend_, "bwd.loss");
  SMAT_RETURN_IF_ERROR(im.kernels->CrossEntropyBackward(
      backend_, im.n_final, im.head->value, im.targets, im.weights, im.lse,
      static_cast<float>(1.0 / normaliser), std::max<int64_t>(1, kLossScratchFloats / V), d_n,
      im.head->grad));
  SMAT_ASSIGN_OR_RETURN(Tensor dx, NewActivation(backend_, {N, W}));
  SMAT_RETURN_IF_ERROR(im.kernels->RmsNormBackward(im.x_final, im.final_norm->value,
                                                   im.rstd_final, d_n, dx, im.final_norm->grad));
  phase.reset();
  for (size_t l = im.blocks.size(); l-- > 0;) {
    if (im.recompute) {
      PhaseScope recompute(backend_, "bwd.recompute");
      // The same kernels on the same input (and the same collectives on every
      // rank) reproduce the forward's activations bit for bit.
      Tensor y;
      const Tensor x = im.acts[l].x;
      SMAT_RETURN_IF_ERROR(im.BlockForward(backend_, l, x, &im.acts[l], &y));
    }
    Tensor dx_in;
    SMAT_RETURN_IF_ERROR(im.BlockBackward(backend_, l, im.acts[l], dx, &dx_in));
    im.acts[l] = BlockActivations();
    dx = dx_in;
  }
  SMAT_RETURN_IF_ERROR(im.kernels->EmbeddingBackward(im.ids, dx, im.embedding->grad));
  im.acts.clear();
  im.x_final = im.n_final = im.rstd_final = im.lse = Tensor();
  return absl::OkStatus();
}

}  // namespace smat
