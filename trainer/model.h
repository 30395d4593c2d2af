// Model: the SMat language model (paper Section 3.4) as one object with a flat
// parameter list, a forward that returns the span's loss parts and a backward
// that accumulates parameter gradients, sequence-parallel aware.
//
//   token embedding
//   L x [ RMSNorm -> SMat mixer -> + residual -> RMSNorm -> SwiGLU MLP -> + residual ]
//   final RMSNorm -> LM head (optionally tied to the embedding) -> cross-entropy
//
// The mixer (trainer/smat_mixer.h) projects q, k, v per head, optionally runs a
// width-4 causal depthwise conv over them, applies the feature map, optionally
// a per-token decay (paper Eq. 13) and a key gate, and calls the
// sequence-parallel SMat op (parallel/sequence_parallel_smat.h) with positional
// or token-hash routing (Appendix G).
//
// Sequence parallelism: every rank of a sequence group receives the FULL token
// sequences [batch, T] (small) and runs on its own chunk-aligned span
// spans[rank] = SplitSequence(plan, sp)[rank]. Everything that crosses span
// boundaries goes through the group's communicator: the SMat op's collectives
// and the 3 rows before the span that the short conv needs. With sp = 1 pass a
// one-rank communicator (MpiCommunicator over MPI_COMM_SELF, or the
// ProcessGroup's sequence()). The loss of a span is returned as (sum, count);
// the caller all-reduces both over the grid and passes the normaliser to
// Backward, which computes the gradient of global_loss_sum / normaliser on this
// rank's share. Parameter gradients are this rank's contribution; the caller
// all-reduces them over the whole dp x sp grid.
//
//   SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::Create(config, backend));
//   SMAT_RETURN_IF_ERROR(model->ZeroGrad());
//   ModelInputs in{.tokens = batch.inputs, .targets = batch.targets,
//                  .loss_mask = batch.loss_mask};
//   SMAT_ASSIGN_OR_RETURN(LossParts parts, model->Forward(pg->sequence(), in));
//   ... all-reduce parts over the grid ...
//   SMAT_RETURN_IF_ERROR(model->Backward(total_count));
//   for (Parameter& p : model->parameters()) ... all-reduce p.grad ...
//
// Parameters are initialised from Philox keyed by run.seed with one stream per
// parameter (its index in the list), so every rank of every grid builds the
// same values. Activations of each block are kept between Forward and Backward,
// or, for sequences longer than model.recompute_above_t (when > 0), only each
// block's input is kept and the block's forward is recomputed during backward
// (bit-identical gradients: the same kernels run on the same inputs).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/config.pb.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/smat_kernels.h"
#include "parallel/communicator.h"

namespace smat {

// One named fp32 parameter and its gradient (same shape), so the optimizer,
// checkpoints and the gradient all-reduce treat every parameter alike.
struct Parameter {
  std::string name;  // e.g. "embedding", "blocks.0.mixer.wq", "final_norm.weight"
  Tensor value;      // fp32, shape per parameter (e.g. [vocab, width])
  Tensor grad;       // fp32, shape of value; Backward accumulates (+=) into it
  // False for parameters that weight decay should skip (norm weights, biases).
  bool decay = true;
};

// One step's input: full sequences, of which this rank uses its span.
struct ModelInputs {
  Tensor tokens;     // int32 [batch, T] in [0, vocab)
  Tensor targets;    // int32 [batch, T] in [0, vocab) where loss_mask > 0
  Tensor loss_mask;  // fp32 [batch, T] loss weights (0: not counted, 1: counted)
  // Every rank's span (comm.size() of them, covering [0, T), chunk-aligned);
  // empty: SplitSequence(plan, comm.size()).
  std::vector<SmatSpan> spans;
  // Recall tasks: fill LossParts::correct / counted (an argmax over the
  // vocabulary on the host; evaluations want it, training steps do not).
  bool count_correct = true;
};

// The loss of this rank's span: sum over its tokens of loss_mask * -log p(target)
// and sum of loss_mask. The global mean loss is (sum of loss_sum) / (sum of
// token_count) over all ranks.
struct LossParts {
  double loss_sum = 0.0;
  double token_count = 0.0;
  // Exact-match accuracy of the span, for evaluation of recall tasks (MQAR):
  // per sequence b of the batch, correct[b] = sum of loss_mask over the span's
  // positions whose argmax logit (lowest index on ties) equals the target, and
  // counted[b] = sum of loss_mask over the span. [batch] each; the trainer sums
  // them over the sequence group (a sequence is fully correct when the sums agree).
  std::vector<double> correct;
  std::vector<double> counted;
};

class Model {
 public:
  // Validates the model / smat parts of `config` (InvalidArgument naming the
  // field) and initialises the parameters from run.seed. `backend` must outlive
  // the model and provide model() kernels. Parameters, gradients and every
  // activation live in the backend's memory; only tokens, targets and loss
  // weights arrive on the host (their span is copied over once per Forward).
  // run.bf16: linear layers and the SMat op read bf16 operands (trainer/layers.h,
  // trainer/smat_mixer.h), accumulating in fp32; weights stay fp32.
  static absl::StatusOr<std::unique_ptr<Model>> Create(const TrainConfig& config,
                                                        Backend& backend);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // Parameters in a fixed order (the order of the init streams and of
  // checkpoints). Values may be changed in place (optimizer, checkpoint load);
  // the list itself must not be resized.
  std::vector<Parameter>& parameters() { return params_; }
  const std::vector<Parameter>& parameters() const { return params_; }
  int64_t NumParameterElements() const;

  // Sets every gradient to zero.
  absl::Status ZeroGrad();

  // Forward of this rank's span (spans[comm.rank()]) of every sequence in the
  // batch. Collective over `sequence` (every rank of the group calls it with
  // the same tokens and spans). Keeps what Backward needs until the next Forward.
  absl::StatusOr<LossParts> Forward(Communicator& sequence, const ModelInputs& inputs);

  // Accumulates into every Parameter::grad the gradient of
  // (sum over all ranks of loss_sum) / normaliser, restricted to this rank's
  // share (the sum over the group's ranks is the full gradient). Collective over
  // the communicator of the last Forward. normaliser > 0 (usually the global
  // token count). FailedPrecondition without a preceding Forward.
  absl::Status Backward(double normaliser);

  // sqrt(sum of squares of every gradient), parameters in list order, summed in
  // double (ModelKernels::SumOfSquares).
  absl::StatusOr<double> GradientNorm();

  // Bytes of activations kept between the last Forward and Backward (saved
  // block activations or, when recomputing, the block inputs; SMat saved state
  // included). 0 before the first Forward.
  int64_t ActivationBytes() const;

  // This rank's span in the last Forward ({0, 0} before the first).
  SmatSpan span() const;
  // True when the last Forward kept only block inputs (recomputation).
  bool recomputing() const;

  const TrainConfig& config() const { return config_; }

 private:
  struct Impl;  // trainer/model.cc: mixers, plans, saved activations.
  Model(const TrainConfig& config, Backend& backend);

  TrainConfig config_;
  Backend& backend_;
  std::vector<Parameter> params_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace smat
