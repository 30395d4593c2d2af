// The training loop (train_loop.h).
#include "trainer/train_loop.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/exit_codes.h"
#include "core/status.h"
#include "trainer/checkpoint.h"
#include "trainer/phase_timer.h"

namespace smat {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool IsRecallTask(const DataConfig& data) { return data.kind() != DataConfig::TEXT; }

bool AllFinite(const std::vector<Parameter>& params) {
  for (const Parameter& p : params) {
    if (!p.value.device().is_cpu()) continue;  // device values: the loss check covers them
    const float* v = p.value.data<float>();
    for (int64_t i = 0, n = p.value.numel(); i < n; ++i) {
      if (!std::isfinite(v[i])) return false;
    }
  }
  return true;
}

// A diverging run does not always reach the loss check: a NaN/inf produced
// inside the model (e.g. a log-gate) is rejected by the kernel that receives
// it, as InvalidArgument. That is not bad input a user can fix in the config
// file but the same divergence as a NaN loss, so it gets the same exit code
// (and the launcher does not restart into it).
absl::Status ClassifyModelError(const absl::Status& s, const std::vector<Parameter>& params,
                                int64_t step, const char* phase) {
  if (s.code() != absl::StatusCode::kInvalidArgument) return s;
  const std::string msg = absl::AsciiStrToLower(s.message());
  const bool non_finite_value = absl::StrContains(msg, "nan") || absl::StrContains(msg, " inf");
  if (!non_finite_value && AllFinite(params)) return s;
  return MarkNonFiniteLoss(absl::InternalError(absl::StrCat(
      "step ", step + 1, ": the model produced non-finite values in ", phase, " (", s.message(),
      "); the run diverged. Lower optimizer.lr, raise optimizer.warmup_steps or set "
      "optimizer.grad_clip, and resume from the last checkpoint")));
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> TrainState::Tensors() const {
  std::vector<std::pair<std::string, Tensor>> out;
  if (model != nullptr) {
    for (const Parameter& p : model->parameters()) out.emplace_back(p.name, p.value);
  }
  if (optimizer != nullptr) {
    for (auto& named : optimizer->moments()) out.push_back(std::move(named));
  }
  return out;
}

void TrainState::RestoreStep(int64_t completed_steps, int64_t sampler_cursor) {
  step = completed_steps;
  cursor = sampler_cursor;
  if (optimizer != nullptr) optimizer->set_step_count(completed_steps);
}

absl::StatusOr<uint32_t> TrainStateCrc32(const TrainState& state, Backend& backend) {
  uint32_t crc = 0;
  for (const auto& [name, t] : state.Tensors()) {
    Tensor host = t;
    if (!t.device().is_cpu()) {
      SMAT_ASSIGN_OR_RETURN(host, Tensor::Empty(t.shape(), t.dtype()));
      SMAT_RETURN_IF_ERROR(backend.Copy(t, host));
      SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
    }
    crc = Crc32(crc, host.raw(), host.nbytes());
  }
  return crc;
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(const TrainConfig& config,
                                                         ProcessGroup& pg, Backend& backend) {
  if (pg.dp() != config.parallel().dp() || pg.sp() != config.parallel().sp()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the process grid is dp ", pg.dp(), " x sp ", pg.sp(), " but the config asks for parallel.dp = ",
        config.parallel().dp(), " x parallel.sp = ", config.parallel().sp()));
  }
  if (config.run().eval_every() > 0 && config.data().kind() == DataConfig::TEXT &&
      config.data().heldout_path().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "run.eval_every = ", config.run().eval_every(),
        " needs held-out data: set data.heldout_path (smat_data bytes --heldout_fraction writes "
        "it) or set run.eval_every = 0"));
  }
  std::unique_ptr<Trainer> t(new Trainer(config, pg, backend));
  SMAT_ASSIGN_OR_RETURN(t->sampler_,
                        BatchSampler::Create(config.data(), config.model().vocab_size(), pg.dp()));
  SMAT_ASSIGN_OR_RETURN(t->model_, Model::Create(config, t->backend_));
  std::vector<OptimizerParam> params;
  int64_t total = 0;
  for (Parameter& p : t->model_->parameters()) {
    params.push_back({p.name, p.value, p.grad, p.decay});
    total += p.value.numel();
  }
  SMAT_ASSIGN_OR_RETURN(t->optimizer_,
                        AdamW::Create(config.optimizer(), std::move(params), &t->backend_));
  if (pg.world_size() > 1) {
    // On the communicator's device: host for MPI, the GPU for NCCL (the copies
    // in and out are device-to-device then).
    Allocator& alloc = pg.world().device().is_cpu() ? CpuAllocator() : t->backend_.allocator();
    SMAT_ASSIGN_OR_RETURN(t->grad_buffer_,
                          Tensor::Empty({std::max<int64_t>(total, 1)}, DType::kF32, alloc));
  }
  t->sequence_ = std::make_unique<RecordingCommunicator>(pg.sequence(), &t->comm_);
  t->world_ = std::make_unique<RecordingCommunicator>(pg.world(), &t->comm_);
  t->host_world_ = std::make_unique<RecordingCommunicator>(pg.host_world(), &t->comm_);
  t->state_.model = t->model_.get();
  t->state_.optimizer = t->optimizer_.get();
  t->state_.dp = pg.dp();
  t->state_.batch_size = config.data().batch_size();
  return t;
}

absl::StatusOr<std::vector<double>> Trainer::GatherDoubles(const std::vector<double>& values) {
  const int64_t n = static_cast<int64_t>(values.size());
  const int world = pg_.world_size();
  std::vector<double> out(static_cast<size_t>(n) * world);
  if (world == 1) {
    std::copy(values.begin(), values.end(), out.begin());
    return out;
  }
  // Doubles travel as int64 bit patterns (communicators reduce fp32 at most);
  // the all-gather moves them unchanged and every rank sums them itself in rank
  // order, so the result is exact to double and identical everywhere.
  SMAT_ASSIGN_OR_RETURN(Tensor send, Tensor::Empty({n}, DType::kI64));
  SMAT_ASSIGN_OR_RETURN(Tensor recv, Tensor::Empty({n * world}, DType::kI64));
  std::memcpy(send.raw(), values.data(), n * sizeof(double));
  SMAT_RETURN_IF_ERROR(host_world_->AllGather(send, recv));
  std::memcpy(out.data(), recv.raw(), out.size() * sizeof(double));
  return out;
}

absl::Status Trainer::AllReduceGradients() {
  const int world = pg_.world_size();
  if (world == 1) return absl::OkStatus();
  // One packed all-reduce instead of one per parameter: a small model has
  // dozens of tensors, and each collective costs a latency.
  int64_t offset = 0;
  for (Parameter& p : model_->parameters()) {
    Tensor dst = grad_buffer_.View(offset, {p.grad.numel()});
    SMAT_RETURN_IF_ERROR(backend_.Copy(p.grad, dst));
    offset += p.grad.numel();
  }
  SMAT_RETURN_IF_ERROR(backend_.Synchronize(nullptr));
  Tensor all = grad_buffer_.View(0, {offset});
  SMAT_RETURN_IF_ERROR(world_->AllReduce(all));
  offset = 0;
  for (Parameter& p : model_->parameters()) {
    Tensor src = grad_buffer_.View(offset, {p.grad.numel()});
    SMAT_RETURN_IF_ERROR(backend_.Copy(src, p.grad));
    offset += p.grad.numel();
  }
  return backend_.Synchronize(nullptr);
}

absl::StatusOr<StepStats> Trainer::Step() {
  PhaseScope step_scope(backend_, "step");
  const double t_start = Now();
  const int64_t step = state_.step;
  StepStats st;
  comm_.Reset();
  backend_.allocator().ResetPeak();
  st.first_sequence = state_.cursor;
  st.sequences = sampler_->GlobalBatchSequences();
  std::optional<PhaseScope> phase(std::in_place, backend_, "data");
  SMAT_ASSIGN_OR_RETURN(Batch batch, sampler_->TrainBatchAt(state_.cursor, pg_.dp_rank()));
  SMAT_RETURN_IF_ERROR(model_->ZeroGrad());
  phase.emplace(backend_, "forward");
  ModelInputs in;
  in.tokens = batch.inputs;
  in.targets = batch.targets;
  in.loss_mask = batch.loss_mask;
  in.count_correct = false;  // evaluations count answers; steps need the loss only
  absl::StatusOr<LossParts> forward = model_->Forward(*sequence_, in);
  if (!forward.ok()) {
    return ClassifyModelError(forward.status(), model_->parameters(), step, "forward");
  }
  const LossParts& parts = *forward;
  st.activation_bytes = model_->ActivationBytes();
  phase.emplace(backend_, "loss_gather");

  SMAT_ASSIGN_OR_RETURN(std::vector<double> all,
                        GatherDoubles({parts.loss_sum, parts.token_count}));
  double loss_sum = 0, count = 0;
  for (int r = 0; r < pg_.world_size(); ++r) {
    loss_sum += all[2 * r];
    count += all[2 * r + 1];
  }
  if (!(count > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", step + 1, ": no token of the batch carries loss (every loss_mask is 0); check "
        "the data (data.kind, data.path)"));
  }
  st.loss = loss_sum / count;
  st.loss_tokens = count;
  if (!std::isfinite(st.loss)) {
    // Every rank sees the same gathered sum, so all stop here together and
    // nothing has been updated: the last checkpoint is the last good state.
    return MarkNonFiniteLoss(absl::InternalError(absl::StrFormat(
        "step %d: the training loss is %f (loss sum %g over %.0f tokens); stopping before the "
        "update. Lower optimizer.lr, raise optimizer.warmup_steps or set optimizer.grad_clip, "
        "and resume from the last checkpoint",
        step + 1, st.loss, loss_sum, count)));
  }
  phase.emplace(backend_, "backward");
  if (absl::Status b = model_->Backward(count); !b.ok()) {
    return ClassifyModelError(b, model_->parameters(), step, "backward");
  }
  phase.emplace(backend_, "grad_allreduce");
  SMAT_RETURN_IF_ERROR(AllReduceGradients());
  phase.emplace(backend_, "grad_norm");
  SMAT_ASSIGN_OR_RETURN(st.grad_norm, GlobalGradNorm(optimizer_->params(), &backend_));
  if (!std::isfinite(st.grad_norm)) {
    return MarkNonFiniteLoss(absl::InternalError(absl::StrFormat(
        "step %d: the gradient norm is %f with a finite loss %.6f; stopping before the update. "
        "Lower optimizer.lr or set optimizer.grad_clip, and resume from the last checkpoint",
        step + 1, st.grad_norm, st.loss)));
  }
  st.learning_rate = ScheduledLearningRate(config_.optimizer(), step);
  phase.emplace(backend_, "optimizer");
  SMAT_RETURN_IF_ERROR(
      optimizer_->Step(static_cast<float>(st.learning_rate),
                       ClipScale(st.grad_norm, config_.optimizer().grad_clip())));
  state_.step = step + 1;
  state_.cursor += st.sequences;
  st.step = state_.step;
  const int64_t T = config_.data().seq_len();
  const int64_t B = config_.data().batch_size();
  st.tokens = pg_.dp() * B * T;
  const SmatSpan span = model_->span();
  st.tokens_local = B * (span.length() > 0 ? span.length() : T);
  phase.reset();
  st.comm = comm_.totals();
  st.memory_peak_bytes = backend_.allocator().stats().peak_bytes;
  st.step_seconds = Now() - t_start;
  return st;
}

int64_t Trainer::NumEvalBatches() const {
  const int64_t dp = pg_.dp();
  const int64_t per_batch = config_.data().batch_size() * config_.data().seq_len();
  int64_t n = std::max<int64_t>(1, (kEvalTokens + per_batch - 1) / per_batch);
  if (config_.data().kind() == DataConfig::TEXT) {
    // Whole rounds of dp batches within the held-out windows, so no window is
    // counted twice; a file too short for one round wraps around (data.h).
    n = std::min<int64_t>(n, std::max<int64_t>(1, sampler_->NumEvalBatches()));
    return std::max<int64_t>(dp, n / dp * dp);
  }
  return (n + dp - 1) / dp * dp;
}

absl::StatusOr<EvalStats> Trainer::Evaluate() {
  if (!sampler_->has_eval()) {
    return absl::FailedPreconditionError(
        "evaluation needs held-out data: set data.heldout_path");
  }
  const int64_t B = config_.data().batch_size();
  const int dp = pg_.dp();
  const int64_t rounds = NumEvalBatches() / dp;
  // Per rank: loss_sum, token_count, then per round and sequence (correct, counted).
  std::vector<double> mine(2 + 2 * rounds * B, 0.0);
  bool have_argmax = true;
  for (int64_t round = 0; round < rounds; ++round) {
    SMAT_ASSIGN_OR_RETURN(Batch batch, sampler_->EvalBatch(round * dp + pg_.dp_rank()));
    ModelInputs in;
    in.tokens = batch.inputs;
    in.targets = batch.targets;
    in.loss_mask = batch.loss_mask;
    SMAT_ASSIGN_OR_RETURN(LossParts parts, model_->Forward(*sequence_, in));
    mine[0] += parts.loss_sum;
    mine[1] += parts.token_count;
    if (static_cast<int64_t>(parts.correct.size()) != B ||
        static_cast<int64_t>(parts.counted.size()) != B) {
      have_argmax = false;
      continue;
    }
    for (int64_t b = 0; b < B; ++b) {
      mine[2 + 2 * (round * B + b)] = parts.correct[b];
      mine[2 + 2 * (round * B + b) + 1] = parts.counted[b];
    }
  }
  // have_argmax is the same on every rank (same model code), so the gathered
  // vectors have one length everywhere.
  SMAT_ASSIGN_OR_RETURN(std::vector<double> all, GatherDoubles(mine));
  const size_t n = mine.size();
  EvalStats ev;
  ev.step = state_.step;
  double loss_sum = 0;
  for (int r = 0; r < pg_.world_size(); ++r) {
    loss_sum += all[r * n];
    ev.tokens += all[r * n + 1];
  }
  ev.loss = ev.tokens > 0 ? loss_sum / ev.tokens : 0.0;
  if (config_.data().kind() == DataConfig::TEXT && config_.model().vocab_size() == 256) {
    // Byte tokens: nats per token / ln 2 = bits per byte.
    ev.bits_per_byte = ev.loss / std::log(2.0);
  }
  if (IsRecallTask(config_.data()) && have_argmax) {
    // A sequence of dp group g is spread over its sp ranks g*sp .. g*sp+sp-1:
    // sum their span counts before asking whether every answer was right.
    const int sp = pg_.sp();
    double correct = 0, counted = 0, seq_ok = 0, seqs = 0;
    for (int g = 0; g < dp; ++g) {
      for (int64_t k = 0; k < rounds * B; ++k) {
        double c = 0, m = 0;
        for (int s = 0; s < sp; ++s) {
          const size_t base = static_cast<size_t>(g * sp + s) * n + 2 + 2 * k;
          c += all[base];
          m += all[base + 1];
        }
        correct += c;
        counted += m;
        if (m > 0) {
          seqs += 1;
          if (c == m) seq_ok += 1;
        }
      }
    }
    ev.answers = counted;
    ev.accuracy = counted > 0 ? correct / counted : 0.0;
    ev.sequences = seqs;
    ev.sequences_correct = seq_ok;
  }
  if (!std::isfinite(ev.loss)) {
    return MarkNonFiniteLoss(absl::InternalError(absl::StrFormat(
        "evaluation after step %d: the loss is %f; stopping", ev.step, ev.loss)));
  }
  return ev;
}

absl::Status Trainer::Run(const TrainHooks& hooks) {
  const RunConfig& run = config_.run();
  const int64_t total = run.steps();
  const int64_t log_every = std::max<int64_t>(1, run.log_every());
  ProgressPrinter* progress = hooks.progress;

  auto evaluate = [&]() -> absl::Status {
    SMAT_ASSIGN_OR_RETURN(EvalStats ev, Evaluate());
    if (hooks.on_eval) hooks.on_eval(ev);
    if (progress != nullptr) {
      EvalLine line;
      line.step = ev.step;
      line.total_steps = total;
      line.loss = ev.loss;
      line.bits_per_byte = ev.bits_per_byte;
      line.accuracy = ev.accuracy;
      line.answers = ev.answers;
      line.sequences_correct = ev.sequences_correct;
      line.sequences = ev.sequences;
      progress->Eval(line);
    }
    return absl::OkStatus();
  };

  // Throughput since the last progress line; the first step (allocations,
  // page faults) is left out of the rate once a later one exists.
  double window_seconds = 0, window_tokens = 0;
  int64_t window_steps = 0;
  int64_t window_peak = 0;  // most backend memory in use in a step since the last line
  double steady_seconds = 0;
  int64_t steady_steps = 0;
  const int64_t first = state_.step;
  // Resumed from a checkpoint of the last step: nothing to train, but the
  // caller still gets the run's evaluation.
  if (first >= total && run.eval_every() > 0) return evaluate();
  while (state_.step < total) {
    SMAT_ASSIGN_OR_RETURN(StepStats st, Step());
    if (hooks.on_step) hooks.on_step(st);
    if (progress != nullptr && run.log_data()) {
      progress->Line(absl::StrFormat("data: step %d sequences [%d, %d) (dp %d x batch %d)", st.step,
                                     st.first_sequence, st.first_sequence + st.sequences, pg_.dp(),
                                     config_.data().batch_size()));
    }
    window_seconds += st.step_seconds;
    window_tokens += static_cast<double>(st.tokens);
    ++window_steps;
    window_peak = std::max(window_peak, st.memory_peak_bytes);
    // Phase times leave out the first step (allocations, cuBLAS set-up).
    if (st.step == first + 1) GlobalPhaseTimes().Reset();
    if (st.step > first + 1) {
      steady_seconds += st.step_seconds;
      ++steady_steps;
    }
    if (hooks.after_step) SMAT_RETURN_IF_ERROR(hooks.after_step(state_));
    if (progress != nullptr && (st.step % log_every == 0 || st.step == total || st.step == first + 1)) {
      ProgressLine line;
      line.step = st.step;
      line.total_steps = total;
      line.loss = st.loss;
      line.learning_rate = st.learning_rate;
      line.grad_norm = st.grad_norm;
      line.tokens_per_second = window_seconds > 0 ? window_tokens / window_seconds : 0;
      line.seconds_per_step = window_seconds / window_steps;
      const double per_step = steady_steps > 0 ? steady_seconds / steady_steps : st.step_seconds;
      line.eta_seconds = per_step * static_cast<double>(total - st.step);
      line.memory_bytes = window_peak;
      line.activation_bytes = st.activation_bytes;
      progress->Step(line);
      window_seconds = window_tokens = 0;
      window_steps = 0;
      window_peak = 0;
    }
    if (run.eval_every() > 0 && (st.step % run.eval_every() == 0 || st.step == total)) {
      SMAT_RETURN_IF_ERROR(evaluate());
    }
  }
  if (progress != nullptr) {
    const std::string phases = GlobalPhaseTimes().Report(steady_steps);
    if (!phases.empty()) progress->Line(phases.substr(0, phases.size() - 1));
  }
  return absl::OkStatus();
}

}  // namespace smat
