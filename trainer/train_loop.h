// The training loop: data -> forward -> loss all-reduce -> backward ->
// gradient all-reduce -> clip -> AdamW -> schedule, with periodic evaluation,
// on a dp x sp grid of ranks (ARCHITECTURE.md section 4).
//
// One step on world rank w (dp group w / sp, sequence rank w % sp):
//   1. batch = sampler.TrainBatchAt(cursor, dp_rank): every sp rank of a group
//      reads the same sequences and runs its own chunk-aligned span of them;
//      the cursor (global index of the next sequence) then moves by
//      dp * batch_size (trainer/data.h).
//   2. (loss_sum, token_count) of the span; all-gathered over the world and
//      summed in rank order in double, so every rank sees the same global loss.
//      A NaN/inf loss stops here, on every rank, before any update
//      (MarkNonFiniteLoss: exit code 4, core/exit_codes.h).
//   3. backward with the global token count as normaliser; parameter gradients
//      packed into one buffer and all-reduced (sum) over the WHOLE grid
//      (deterministic, rank order), so every rank holds identical gradients.
//   4. global norm (fixed order, no collective needed), clip, AdamW with the
//      scheduled learning rate: every rank makes the identical update.
// Same config and grid -> bitwise-identical runs; sp = 1, 2, 4 agree to fp32
// rounding of the differently ordered sums (tests/trainer/train_loop_mpi_test.cc).
//
// Seams for the rest of the trainer: TrainState is what a checkpoint saves and
// restores; StepStats is what a metrics sink consumes after every step;
// TrainHooks lets main attach both without the loop knowing about either.
//
//   SMAT_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(cfg, *pg, *backend));
//   TrainHooks hooks;
//   hooks.on_step = [&](const StepStats& s) { metrics->RecordStep(...); };
//   SMAT_RETURN_IF_ERROR(trainer->Run(hooks));
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/config.pb.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "parallel/comm_stats.h"
#include "parallel/process_group.h"
#include "trainer/data.h"
#include "trainer/model.h"
#include "trainer/optimizer.h"
#include "trainer/progress.h"

namespace smat {

// Everything a checkpoint must hold to continue a run bit for bit. Parameters
// are replicated (identical on every rank), so any one rank's copy is the state.
struct TrainState {
  int64_t step = 0;  // optimizer steps completed
  Model* model = nullptr;
  AdamW* optimizer = nullptr;
  int64_t dp = 1, batch_size = 1;
  // Global index of the next training sequence. Each step consumes dp *
  // batch_size sequences from here (trainer/data.h); it equals step * dp *
  // batch_size only while the grid never changed, so it is saved and restored
  // itself: a run resumed on another dp continues the same data stream.
  int64_t cursor = 0;

  int64_t sampler_cursor() const { return cursor; }

  // Named host tensors, sharing the live buffers (restoring = copying into
  // them): every parameter under its model name, then "adam_m/<name>" and
  // "adam_v/<name>". Device parameters are not host tensors: a checkpoint of a
  // CUDA run copies them out first.
  std::vector<std::pair<std::string, Tensor>> Tensors() const;

  // After a checkpoint's tensors were copied in: sets the step, the data
  // cursor (CheckpointState::sampler_cursor) and the optimizer's
  // bias-correction count (one update per step).
  void RestoreStep(int64_t completed_steps, int64_t sampler_cursor);
};

// CRC-32 over the bytes of every tensor of state.Tensors() in order (device
// tensors copied to host first): one number that two processes compare to
// show they hold the same parameters and optimizer moments, e.g. a run
// resumed on another grid against the checkpoint it loaded.
absl::StatusOr<uint32_t> TrainStateCrc32(const TrainState& state, Backend& backend);

// What one step produced, for progress lines and metrics. The same on every
// rank except tokens_local and the comm figures.
struct StepStats {
  int64_t step = 0;            // steps completed, this one included
  int64_t first_sequence = 0;  // global sequences [first_sequence, first_sequence +
  int64_t sequences = 0;       //   sequences) made this step's batch (all dp ranks)
  double loss = 0;             // mean loss over the job's counted tokens
  double loss_tokens = 0;      // tokens the loss counted (job)
  int64_t tokens = 0;          // tokens processed by the job: dp * batch * T
  int64_t tokens_local = 0;    // tokens of this rank's spans: batch * span length
  double step_seconds = 0;     // wall time of the step on this rank
  double grad_norm = 0;        // global norm before clipping
  double learning_rate = 0;
  // Every collective this rank issued in the step, per kind: the SMat layers'
  // and the short-conv halo exchange inside Model::Forward/Backward (sequence
  // group) and the loop's loss all-gather and gradient all-reduce (world).
  // Seconds blocked in them and bytes of the tensors they filled
  // (parallel/comm_stats.h); one-rank communicators count nothing.
  CommStats comm;
  int64_t activation_bytes = 0;
  // Most bytes the backend's allocator had in use at once during the step
  // (Allocator::stats: device memory on a GPU, host memory on the CPU).
  int64_t memory_peak_bytes = 0;
};

// One evaluation over the fixed evaluation set.
struct EvalStats {
  int64_t step = 0;
  double loss = 0;            // mean over counted tokens
  double tokens = 0;          // counted tokens
  double bits_per_byte = -1;  // TEXT with the byte vocabulary: loss / ln 2; else -1
  // Recall tasks (MQAR): answer positions whose argmax is the target, and
  // sequences with every answer right; -1 when not a recall task or the model
  // reports no argmax counts.
  double accuracy = -1;
  double answers = 0;
  double sequences_correct = -1;
  double sequences = 0;
};

struct TrainHooks {
  std::function<void(const StepStats&)> on_step;   // every step, every rank
  std::function<void(const EvalStats&)> on_eval;   // every evaluation, every rank
  // After every step's update (e.g. checkpointing); an error stops the run.
  std::function<absl::Status(const TrainState&)> after_step;
  // Rank 0's progress lines; null: silent.
  ProgressPrinter* progress = nullptr;
};

class Trainer {
 public:
  // Builds the sampler (opening and checking data files), the model and the
  // optimizer. `config` must be validated (LoadConfig); pg's grid must be
  // parallel.dp x parallel.sp. `backend` and `pg` must outlive the trainer.
  // Errors are the user's to fix (kInvalidArgument, kNotFound, kDataLoss).
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const TrainConfig& config,
                                                         ProcessGroup& pg, Backend& backend);

  // Steps from state().step to run.steps, evaluating every run.eval_every steps
  // and after the last step (when eval_every > 0; also when a resumed run has
  // no step left), logging every run.log_every (and, with run.log_data, every
  // step's global sequence range: "data: step N sequences [a, b)").
  absl::Status Run(const TrainHooks& hooks);

  // One optimizer step (collective over the grid).
  absl::StatusOr<StepStats> Step();

  // Loss and accuracy over the evaluation set: MQAR examples from the sampler's
  // evaluation stream, or the held-out file's first windows (TEXT; FailedPrecondition
  // without one). About kEvalTokens tokens, split over the dp groups.
  absl::StatusOr<EvalStats> Evaluate();

  TrainState& state() { return state_; }
  Model& model() { return *model_; }
  AdamW& optimizer() { return *optimizer_; }
  const BatchSampler& sampler() const { return *sampler_; }
  const TrainConfig& config() const { return config_; }

  // Evaluation set size in tokens: rounded up to whole batches for every dp
  // group (recall tasks), or down to the held-out file's whole windows (TEXT).
  static constexpr int64_t kEvalTokens = 65536;
  // Number of evaluation batches, a multiple of dp.
  int64_t NumEvalBatches() const;

 private:
  Trainer(const TrainConfig& config, ProcessGroup& pg, Backend& backend)
      : config_(config), pg_(pg), backend_(backend) {}

  // Sums `values` (n doubles per rank) over the world in rank order; returns
  // [world, n] so callers can also sum per group. Deterministic, exact inputs.
  absl::StatusOr<std::vector<double>> GatherDoubles(const std::vector<double>& values);
  absl::Status AllReduceGradients();

  TrainConfig config_;
  ProcessGroup& pg_;
  Backend& backend_;
  std::unique_ptr<BatchSampler> sampler_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<AdamW> optimizer_;
  TrainState state_;
  Tensor grad_buffer_;  // fp32 [sum of parameter sizes]: the packed gradient all-reduce
  // Every collective goes through these wrappers of pg_'s communicators, so a
  // step reports all it sent (StepStats::comm); Step resets the recorder.
  CommRecorder comm_;
  std::unique_ptr<RecordingCommunicator> sequence_, world_, host_world_;
};

}  // namespace smat
