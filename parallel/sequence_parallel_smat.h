// Sequence-parallel SMat-Attention: the forward and backward op of
// kernels/smat.h over sp ranks, each holding one contiguous, chunk-aligned span
// of the sequence (ARCHITECTURE.md section 4), composed from the phase kernels
// of kernels/smat_kernels.h and a Communicator. No SMat math lives here beyond
// the folds across ranks that the SPANS section of smat_kernels.h defines.
//
// Forward, per rank (-> collective, with what overlaps it):
//   ChunkLogDecay, ChunkSummaries, ChunkScan (span totals per block)
//   -> AllGather(span totals, span log-decays)      || ProfilePooling
//   fold the earlier ranks (fp32, rank order) into the incoming states;
//   rescale the partial profile table by its distant-tail decay
//   -> AllReduce(sum) of the profile table F        || ChunkScan, ChunkOutputs
//   Tabulate U = C F, TypeReads, Normalize.
// Backward mirrors it:
//   NormalizeBackwardStates (the division's Jacobian and the chunks' state
//   gradients in one pass), ChunkScanBackward (span state gradients)
//   -> AllGather(state gradients)                   || TypeReadsBackward (span
//   part of U_bar)
//   -> AllReduce(sum) of U_bar                      (the gather still in flight)
//   fold the later ranks (last first), ChunkScanBackward, ChunkOutputsBackward,
//   TabulateBackward, ProfilePoolingBackward; gated: LogDecayBackward, with an
//   AllGather of the span sums of dL/dLambda for the suffix over later ranks.
// Both run the plan SmatForward runs (SmatOpPlan, kernels/smat.h): for d = 1
// with positional maps one causal block, with no pooling, tabulation, reads or
// table all-reduce (nor their adjoints and the U_bar all-reduce).
// Volumes per layer (SequenceParallelVolume): the scan moves sp x batch x 2 x H
// x (r p + 1) words per rank (all-gathered), the table batch x H x P x r x p
// (all-reduced, 2 (sp-1)/sp of it per rank on a ring; none for a plan without
// a long-range branch).
//
// Every collective is deterministic (communicator.h) and every fold has a fixed
// order, so the same run on the same ranks gives the same bits.
//
//   SMAT_ASSIGN_OR_RETURN(std::vector<SmatSpan> spans, SplitSequence(plan, comm.size()));
//   SmatInputs mine = ...;  // phi, psi, v, logg, prof, type of spans[comm.rank()]
//   SpSmatForwardOutputs fwd;
//   SMAT_RETURN_IF_ERROR(SequenceParallelSmatForward(backend, comm, plan, spans, mine, &fwd));
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/smat.h"
#include "kernels/smat_kernels.h"
#include "parallel/communicator.h"

namespace smat {

// Whole chunks per rank, as even as possible: with K = ceil(T / c) chunks and W
// ranks, the first K mod W ranks take one chunk more; a partial last chunk goes
// to the last rank. Fewer chunks than ranks is InvalidArgument.
absl::StatusOr<std::vector<SmatSpan>> SplitSequence(const SmatPlan& plan, int ranks);

// The spans of an explicitly requested split: `cuts` are the W - 1 interior
// boundaries, increasing, strictly inside (0, T). A cut that is not a multiple
// of the chunk width is InvalidArgument naming the cut and the nearest aligned
// positions.
absl::StatusOr<std::vector<SmatSpan>> SpansFromCuts(const SmatPlan& plan,
                                                    const std::vector<int64_t>& cuts);

// InvalidArgument unless `spans` are `ranks` valid spans covering [0, T) in order.
absl::Status ValidateSpans(const SmatPlan& plan, const std::vector<SmatSpan>& spans, int ranks);

// Words (fp32 elements) each collective of one layer's forward moves per rank.
struct SpSmatVolume {
  int64_t scan_words = 0;   // all-gathered: sp x batch x 2 x H x (r p + 1)
  int64_t table_words = 0;  // all-reduced: batch x H x P x r x p (0: SmatHasLongRange false)
  std::string ToString() const;  // "scan 1234 words (4.8 KiB), table ..."
};
SpSmatVolume SequenceParallelVolume(const SmatPlan& plan, int sp, int64_t batch, int64_t H,
                                    int64_t r, int64_t p);

// What backward needs beyond the span's SmatSaved (lam, chunk_decay, S_in, U,
// den of the span: kernels/smat.h, with Lc chunks in place of Nc).
struct SpSmatSaved {
  SmatSaved local;
  Tensor span_decays;         // [sp, batch, 2, H] fp32 host: every rank's span log-decays
  Tensor recent_offset;       // [batch, H] fp32 on the backend (undefined: ungated)
  Tensor distant_tail_decay;  // [batch, H] fp32 on the backend (undefined: ungated)
};

struct SpSmatForwardOutputs {
  Tensor o;  // [batch, L, H, dv] of this rank's span, dtype of v
  SpSmatSaved saved;
  SpSmatVolume volume;
};

// Forward of this rank's span: `in` holds the span's tokens (phi [batch, L, H,
// r], ...; L = spans[rank].length()); `spans` lists every rank's span (the same
// on every rank; comm.size() of them). Collective over `comm`.
absl::Status SequenceParallelSmatForward(Backend& backend, Communicator& comm,
                                         const SmatPlan& plan, const std::vector<SmatSpan>& spans,
                                         const SmatInputs& in, SpSmatForwardOutputs* fwd,
                                         Stream* stream = nullptr);

// Backward of L = sum(d_o * o) over the whole sequence; d_o [batch, L, H, dv]
// fp32 of this rank's span; grads hold the span's gradients. Collective.
absl::Status SequenceParallelSmatBackward(Backend& backend, Communicator& comm,
                                          const SmatPlan& plan,
                                          const std::vector<SmatSpan>& spans,
                                          const SmatInputs& in, const SpSmatForwardOutputs& fwd,
                                          const Tensor& d_o, SmatGradients* grads,
                                          Stream* stream = nullptr);

// Host helpers for drivers (smat_op, tests). SliceSpan copies tokens
// [t0, t1) of a host tensor [batch, T, ...] into a new [batch, L, ...] tensor.
absl::StatusOr<Tensor> SliceSpan(const Tensor& full, const SmatSpan& span);
// Every rank's span part [batch, L_rank, ...] (host) -> the whole [batch, T,
// ...] on every rank (padded AllGather). Collective over a host communicator.
absl::StatusOr<Tensor> GatherSpans(Communicator& comm, const std::vector<SmatSpan>& spans,
                                   const Tensor& part);

}  // namespace smat
