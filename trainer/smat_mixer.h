// SmatMixer: the token mixer of one block of the SMat language model (paper
// Section 3.4), forward and backward, on this rank's span of the sequence:
//
//   q, k, v = x Wq^T, x Wk^T, x Wv^T                      per head: r, r, dv
//   [short conv]  width-4 causal depthwise conv on q, k, v (the 3 rows before
//                 the span come from the previous rank through the sequence
//                 communicator; zeros at the start of the sequence)
//   phi = f(q), psi = f(k)                                feature map (model.feature_map,
//                                                         through ModelKernels)
//   [key gate]    psi *= sigmoid(x Wkg^T + bkg)            per token and head
//   [gated]       logg = -softplus(x Wdecay^T + bdecay)    per token and head (Eq. 13)
//   o = SMat(phi, psi, v, logg; prof, type)               sequence-parallel op (the
//                                                         single-device op when the
//                                                         sequence group has one rank)
//   out = o Wo^T
//
// Routing (which distant keys a recent query reads) is positional or hashed
// from token content (TokenHashRouting below, paper Appendix G).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/config.pb.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/feature_map.h"
#include "kernels/model_kernels.h"
#include "kernels/smat_kernels.h"
#include "parallel/communicator.h"
#include "parallel/sequence_parallel_smat.h"
#include "trainer/layers.h"
#include "trainer/model.h"

namespace smat {

// The mixer's parameters: pointers into Model::parameters() (whose list never
// changes size, so the pointers stay valid). Optional ones are null when the
// config turns the feature off.
struct MixerParameters {
  Parameter* wq = nullptr;          // [H r, W]
  Parameter* wk = nullptr;          // [H r, W]
  Parameter* wv = nullptr;          // [H dv, W]
  Parameter* wo = nullptr;          // [W, H dv]
  Parameter* conv_q = nullptr;      // [K, H r]  (short_conv)
  Parameter* conv_k = nullptr;      // [K, H r]  (short_conv)
  Parameter* conv_v = nullptr;      // [K, H dv] (short_conv)
  Parameter* w_decay = nullptr;     // [H, W]    (gated)
  Parameter* b_decay = nullptr;     // [H]       (gated)
  Parameter* w_key_gate = nullptr;  // [H, W]    (key_gate)
  Parameter* b_key_gate = nullptr;  // [H]       (key_gate)
};

// What every mixer of one model forward shares.
struct MixerStep {
  Communicator* comm = nullptr;   // the sequence group
  const SmatPlan* plan = nullptr;
  std::vector<SmatSpan> spans;    // every rank's span; this rank's is spans[comm->rank()]
  int64_t batch = 0;
  Tensor prof;  // [batch, L, H] int32 (token-hash routing) or undefined (positional)
  Tensor type;  // [batch, L, H] int32 (token-hash routing) or undefined (positional)
  const SmatSpan& span() const { return spans[comm->rank()]; }
  int64_t L() const { return span().length(); }
};

// Activations one mixer forward keeps for its backward (N = batch L rows).
struct MixerActivations {
  Tensor q_proj, k_proj, v_proj;        // [N, H r], [N, H r], [N, H dv] projections
  Tensor q_prefix, k_prefix, v_prefix;  // [batch, K-1, C] rows before the span (short_conv)
  Tensor q_in, k_in;                    // [N, H r] feature-map inputs (conv outputs or projections)
  // With run.bf16, v (a conv output) and the features the backward does not
  // read (all but EXP's; psi_raw unless key_gate) are written in bf16: what
  // the SMat op reads.
  Tensor v;                             // [N, H dv] values (conv output or projection)
  Tensor phi, psi_raw, psi;             // [N, H r] features; psi = psi_raw * key gate
  Tensor key_gate;                      // [N, H] pre-sigmoid key gate (key_gate)
  Tensor decay_in, logg;                // [N, H] pre-softplus decay, log-gate (gated)
  // The SMat op's phi, psi, v [N, H r | H dv]: phi, psi, v themselves in fp32;
  // with run.bf16 on CUDA the bf16 tensors themselves (written in bf16 above)
  // or their bf16 casts, and on the CPU, whose SMat kernels are fp32, the same
  // bf16-rounded values widened back to fp32.
  Tensor smat_phi, smat_psi, smat_v;
  // o [batch, L, H, dv] and the op's saved state (a one-rank group: the
  // single-device op's, in saved.local)
  SpSmatForwardOutputs smat;
  int64_t Bytes() const;                // every defined tensor above (shared buffers once)
};

class SmatMixer {
 public:
  // `config` supplies the sizes and switches (model.*, smat.eps); `params`
  // must hold every parameter the switches ask for; `dense` runs the
  // projections (its precision is run.bf16's) and must outlive the mixer.
  // InvalidArgument for a feature map the kernels do not provide.
  static absl::StatusOr<SmatMixer> Create(const TrainConfig& config, MixerParameters params,
                                          Backend& backend, Dense& dense);

  // out [N, W] (allocated) from x [N, W], the block's normalised input.
  // Collective over step.comm.
  absl::Status Forward(const MixerStep& step, const Tensor& x, MixerActivations* acts,
                       Tensor* out);
  // dx [N, W] (allocated, overwritten) from dout [N, W]; parameter gradients
  // accumulate. Collective over step.comm.
  absl::Status Backward(const MixerStep& step, const Tensor& x, const MixerActivations& acts,
                        const Tensor& dout, Tensor* dx);

 private:
  SmatMixer(Backend& backend, ModelKernels& kernels, Dense& dense, MixerParameters params,
            ModelConfig::FeatureMap features, int64_t heads, int64_t r, int64_t dv, float eps)
      : backend_(&backend), kernels_(&kernels), dense_(&dense), p_(params), features_(features),
        H_(heads), r_(r), dv_(dv), eps_(eps) {}
  // What the SMat op reads for the features t, fp32 or already bf16 (see
  // smat_phi above).
  absl::StatusOr<Tensor> SmatOperand(const Tensor& t);
  // y = f(x) and dx = f'(x) dy for the configured feature map; x, y, dx [N, H r].
  absl::Status Features(const Tensor& x, Tensor& y);
  absl::Status FeaturesBackward(const Tensor& x, const Tensor& y, const Tensor& dy, Tensor& dx);

  Backend* backend_;
  ModelKernels* kernels_;
  Dense* dense_;
  MixerParameters p_;
  ModelConfig::FeatureMap features_;
  int64_t H_, r_, dv_;
  float eps_;
};

// --- content routing (paper Appendix G) -------------------------------------------------
// A fixed random hash of token ids, keyed by `seed` (Philox), to points of
// F_q^(d-1) and to directions. Id -1 stands for "no token" (before position 0).
int64_t TokenPoint(const SmatGeometry& geo, uint64_t seed, int64_t token);
int64_t TokenDirection(const SmatGeometry& geo, uint64_t seed, int64_t token);
// The type (core/geometry.h order) of the hyperplane through TokenPoint(token)
// with direction TokenDirection(token): {x : a_e . x = a_e . h(token)}. It
// contains h(token), so a query reads every key whose profile is h(token).
// For d = 2 (one direction) that is the cell h(token) itself.
int64_t TokenType(const SmatGeometry& geo, uint64_t seed, int64_t token);

// prof and type [batch, L, H] (int32, allocated) of the tokens of `span`:
// prof(s) = TokenPoint(token at s - 1) (s = 0: id -1), type(t) =
// TokenType(token at t); the same for every head. tokens [batch, T] int32.
// A distant key s thus becomes visible to every later recent query t whose
// token equals the token before s ("what followed this token last time").
absl::Status TokenHashRouting(const SmatPlan& plan, uint64_t seed, const Tensor& tokens,
                              const SmatSpan& span, int64_t heads, Tensor* prof, Tensor* type);

// The rows [t0 - (K-1), t0) of every projection in `proj` ([batch, L, C_i]
// each, this rank's span, fp32 on the backend) gathered from the ranks that
// own them (one AllGather of every rank's last K-1 rows; zeros before position
// 0): one [batch, K-1, C_i] tensor per projection, on the backend. Rows move by
// Backend::Copy of tensor views, so device tensors never visit the host; the
// gathered buffers live where the communicator wants them (host for MPI, the
// GPU for NCCL). One rank: zeros, no collective. Collective over comm.
absl::StatusOr<std::vector<Tensor>> ExchangeConvPrefix(Backend& backend, Communicator& comm,
                                                       const std::vector<SmatSpan>& spans,
                                                       const std::vector<Tensor>& proj);
// The adjoint: every rank's prefix gradients d_prefix[i] [batch, K-1, C_i] are
// all-gathered and each owner adds the rows of its span into d_proj[i]
// [batch, L, C_i] (ranks in increasing order, Backend::Axpy). Collective over
// comm.
absl::Status ReturnConvPrefixGradients(Backend& backend, Communicator& comm,
                                       const std::vector<SmatSpan>& spans,
                                       const std::vector<Tensor>& d_prefix,
                                       std::vector<Tensor>& d_proj);

}  // namespace smat
