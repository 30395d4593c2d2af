// SmatKernels: the phases of chunkwise SMat-Attention (paper Section 3.1,
// Algorithm 1; gating per Lemma 4; backward per Appendix E, eqs. 18-19), one
// virtual method per phase, forward and backward side by side. A Backend
// returns its implementation from smat(); kernels/cpu/smat_cpu.h is the CPU one
// (fp32), a CUDA one implements the same contract. kernels/smat.h composes the
// phases into the whole op on one device; parallel/ composes them with
// collectives for sequence parallelism (ARCHITECTURE.md section 4).
//
// Notation (ARCHITECTURE.md section 3). Per (sequence, head): tokens
// t = 0..T-1, phi_t, psi_t in R^r (>= 0), v_t in R^dv, p = dv + 1,
// vbar_t = [v_t, 1], Z_t = psi_t vbar_t^T (r x p, never stored per token).
// Distant block [0, n), recent block [n, T), n = plan.n (a multiple of c =
// plan.chunk). Chunk k covers [k c, min((k+1) c, T)); no chunk crosses n.
// Gates: logg_t <= 0, Lambda_t = sum_{s <= t} logg_s; entry (t, s) of the mask
// is weighted exp(Lambda_t - Lambda_s). Ungated = every logg 0: pass an
// undefined Tensor for logg / lam / chunk_decay and every decay factor is 1.
// Only sums of gates over [j+1, i] (i >= j) are ever exponentiated (Lemma 4),
// and never as a difference of two long prefix sums: the log-decay prefix is
// chunk-local (below), so a million-token sequence loses no precision in fp32.
//
// ---------------------------------------------------------------------------
// SPANS. Every phase works on a span [t0, t1) of the global sequence:
//   * t0 is a multiple of c; t1 is a multiple of c or t1 = T; t0 < t1 <= T.
//     The span may straddle n. Single device: span [0, T).
//   * Token tensors hold the span only: phi [batch, L, H, r] with L = t1 - t0,
//     token i of the tensor is global token t0 + i. Chunk tensors hold the
//     span's chunks: [batch, Lc, H, ...], Lc = ceil(L / c), local chunk j is
//     global chunk t0 / c + j (so no local chunk crosses n either).
//   * The span touches the distant block when t0 < n (its distant part is
//     [t0, min(t1, n))) and the recent block when t1 > n (recent part
//     [max(t0, n), t1)). Per-block tensors have a leading block index
//     kDistantBlock = 0 / kRecentBlock = 1: [batch, 2, H, ...]; a block the
//     span does not touch gets zeros (state, decay, gradient) on output and is
//     ignored on input, so folds may run over all ranks: untouched ranks act
//     as the identity.
//   * What crosses span boundaries is explicit (a single span [0, T) passes
//     zeros for every "incoming" input):
//     (i)   ChunkScan outputs span_state[blk] = the span's own contribution to
//           the running state of block blk, referred to the end of the span's
//           part of blk: sum_{s in part} exp(Lambda_e - Lambda_s) Z_s, e = last
//           token of the part; and span_decay[blk] = sum of logg over the part
//           (0 when untouched or ungated). Ranks all-gather both and fold the
//           ranks before them in the same block, in rank order:
//               X <- 0;  for each earlier rank j: X <- exp(span_decay_j) X + span_state_j
//           which gives this span's incoming state for the block.
//     (ii)  incoming[blk]: the state of block blk just before the span's part
//           of it (the sum over earlier tokens of the block, referred to the
//           token before the part). Zero for the first span touching a block;
//           in particular the recent block always starts from zero at n.
//     (iii) ProfilePooling outputs the span's partial profile table, referred
//           to the end e of the span's distant part: F_x = sum exp(Lambda_e -
//           Lambda_s) Z_s over the span's distant s with prof(s) = x. The
//           composer rescales it by exp(distant_tail_decay) (the sum of logg
//           over [e + 1, n), from the gathered span decays) and all-reduces
//           (sum) to get F referred to Lambda_{n-1}.
//     (iv)  recent_offset[b, h] = sum of logg over [n, max(t0, n)): the decay
//           from Lambda_{n-1} to the token before the span's recent part (0
//           when t0 <= n): the sum of span_decay[kRecentBlock] over earlier
//           ranks. A recent t reads gate_t = exp(Lambda_t - Lambda_{n-1}).
//     Backward mirrors it. ChunkScanBackward takes incoming_grad[blk] = dL/dX,
//     X = the block state at the end of the span's part of blk (what the next
//     span receives as incoming), and outputs span_state_grad[blk] =
//     dL/d incoming[blk] through this span's own tokens (without the
//     incoming_grad path). With G_j, d_j = span_state_grad, span_decay of rank
//     j, a rank's incoming_grad folds the later ranks of the block, last first:
//               Y <- 0;  for j = last rank down to this rank + 1: Y <- G_j + exp(d_j) Y
//     TypeReadsBackward outputs the span's contribution to U_bar (sum over
//     ranks: all-reduce); TabulateBackward then runs on the sum.
//     ProfilePoolingBackward takes the same distant_tail_decay as (iii).
//     LogDecayBackward takes suffix_in = the sum of dL/dLambda over all tokens
//     after the span and outputs span_sum, the sum over its own tokens (fold:
//     plain exclusive suffix sum over ranks, last rank first).
// ---------------------------------------------------------------------------
//
// Dtypes. phi, psi, v: fp32 (CUDA may also take bf16; phi, psi and v share one
// dtype). prof, type: int32. Everything else (lam, decays, states, tables,
// ybar, gbar, den, gradients) is fp32. o has the dtype of v. Outputs are
// written in full (every element), except where a method says "+=": those
// accumulate into a tensor the caller has initialised (zeros for a fresh
// gradient), so the backward phases can add their contributions in a fixed
// order. All methods are asynchronous on `stream` (nullptr: default stream)
// and return InvalidArgument naming the tensor whose shape/dtype/device is
// wrong, or a content id out of range (CPU checks ids; CUDA may not).
//
// Content maps: prof [batch, L, H] int32 in [0, P), read at distant tokens;
// type [batch, L, H] int32 in [0, B), read at recent tokens (entries at the
// other block's tokens are ignored). Undefined Tensor: positional maps of
// core/geometry.h at global positions (PositionalProfile(s),
// PositionalType(n, t)).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/backend.h"

namespace smat {

// Block index of per-block tensors [batch, 2, H, ...].
inline constexpr int kDistantBlock = 0;
inline constexpr int kRecentBlock = 1;

// A span [t0, t1) of the global sequence (see SPANS above).
struct SmatSpan {
  int64_t t0 = 0;
  int64_t t1 = 0;

  static SmatSpan Whole(const SmatPlan& plan) { return {0, plan.T}; }
  int64_t length() const { return t1 - t0; }
  int64_t num_chunks(const SmatPlan& plan) const {
    return (length() + plan.chunk - 1) / plan.chunk;
  }
  int64_t first_chunk(const SmatPlan& plan) const { return t0 / plan.chunk; }
  // The span's distant part [t0, distant_end) (empty when t0 >= n) and recent
  // part [recent_begin, t1) (empty when t1 <= n).
  int64_t distant_end(const SmatPlan& plan) const { return std::max(t0, std::min(t1, plan.n)); }
  int64_t recent_begin(const SmatPlan& plan) const { return std::min(t1, std::max(t0, plan.n)); }
  bool touches_distant(const SmatPlan& plan) const { return t0 < plan.n; }
  bool touches_recent(const SmatPlan& plan) const { return t1 > plan.n; }
};

// InvalidArgument unless span is a valid span of plan (chunk-aligned t0,
// t1 chunk-aligned or T, 0 <= t0 < t1 <= T).
absl::Status ValidateSmatSpan(const SmatPlan& plan, const SmatSpan& span);

// How a phase treats an output it could add to (TypeReads' ybar, the
// gradients of ChunkOutputsBackward): kAdd adds into it (+=); kAssign writes
// every element the phase covers (=), so the caller need not zero it first
// and the phase reads nothing back.
enum class SmatWrite { kAdd, kAssign };

// The long-range branch of the backward (B2-B4: the per-type reads' adjoint,
// the tabulation's, the pooling's) as the composer runs it, writing phi_bar's
// recent rows and psi_bar's and v_bar's distant rows in the given mode. It
// runs on the stream of the ChunkBackward call that is handed it, with gbar's
// column dv (or gbar) already written (see ChunkBackward).
using SmatLongRangeBackward = std::function<absl::Status(SmatWrite write)>;

class SmatKernels {
 public:
  virtual ~SmatKernels() = default;

  // ====================== forward (Algorithm 1, Lemma 4) ======================

  // F1. Chunk-local log-decay prefix (Lemma 4's prefix sum, kept per chunk):
  //   lam[t] = sum_{s = start of t's chunk}^{t} logg_s, so exp(lam[t] - lam[s])
  //   = exp(Lambda_t - Lambda_s) inside a chunk and exp(lam[t]) decays from the
  //   chunk's incoming state (referred to the token before the chunk) to t;
  //   chunk_decay[k] = lam at the last token of chunk k (the chunk's total).
  virtual absl::Status ChunkLogDecay(const SmatPlan& plan, const SmatSpan& span,
                                     const Tensor& logg,   // [batch, L, H]
                                     Tensor* lam,          // [batch, L, H]
                                     Tensor* chunk_decay,  // [batch, Lc, H]
                                     Stream* stream) = 0;

  // F2. Chunk summaries (Algorithm 1 step 5; gated per Lemma 4: referred to
  //   the chunk end e(k)): D[k] = sum_{s in chunk k} exp(Lambda_e(k) - Lambda_s) Z_s.
  virtual absl::Status ChunkSummaries(const SmatPlan& plan, const SmatSpan& span,
                                      const Tensor& psi,          // [batch, L, H, r]
                                      const Tensor& v,            // [batch, L, H, dv]
                                      const Tensor& lam,          // [batch, L, H] or undefined
                                      const Tensor& chunk_decay,  // [batch, Lc, H] or undefined
                                      Tensor* D,                  // [batch, Lc, H, r, p]
                                      Stream* stream) = 0;

  // F3. Exclusive scan over chunks, separately in [0, n) and [n, T) (step 6):
  //   S_in[k] = state entering chunk k, referred to the token before it:
  //     S_in[first chunk of the span in blk] = incoming[blk],
  //     S_in[k+1] = exp(chunk_decay[k]) S_in[k] + D[k]   (k, k+1 in one block).
  //   span_state / span_decay: (i) in SPANS, independent of `incoming`.
  //   S_in may be null (only span_state / span_decay wanted: the first call of
  //   a sequence-parallel composer, before the incoming states are known).
  virtual absl::Status ChunkScan(const SmatPlan& plan, const SmatSpan& span,
                                 const Tensor& D,            // [batch, Lc, H, r, p]
                                 const Tensor& chunk_decay,  // [batch, Lc, H] or undefined
                                 const Tensor& incoming,     // [batch, 2, H, r, p] or undefined (0)
                                 Tensor* S_in,               // [batch, Lc, H, r, p] or null
                                 Tensor* span_state,         // [batch, 2, H, r, p]
                                 Tensor* span_decay,         // [batch, 2, H]
                                 Stream* stream) = 0;

  // F4. Profile pooling (Algorithm 1 step 2, eq. 9; gated per Lemma 4): the
  //   span's partial table, referred to the end e of its distant part:
  //   F[x] = sum_{s in [t0, distant_end), prof(s) = x} exp(Lambda_e - Lambda_s) Z_s.
  //   All zeros when the span has no distant tokens.
  virtual absl::Status ProfilePooling(const SmatPlan& plan, const SmatSpan& span,
                                      const Tensor& psi,          // [batch, L, H, r]
                                      const Tensor& v,            // [batch, L, H, dv]
                                      const Tensor& lam,          // [batch, L, H] or undefined
                                      const Tensor& chunk_decay,  // [batch, Lc, H] or undefined
                                      const Tensor& prof,         // [batch, L, H] int32 or undefined
                                      Tensor* F,                  // [batch, H, P, r, p]
                                      Stream* stream) = 0;

  // F5. Tabulation U = C F (step 3, Algorithm 2), per (sequence, head).
  virtual absl::Status Tabulate(const SmatPlan& plan,
                                const Tensor& F,  // [batch, H, P, r, p]
                                Tensor* U,        // [batch, H, B, r, p]
                                Stream* stream) = 0;

  // F6. Chunk-local outputs (eq. 10, gated per Lemma 4), written to ybar:
  //   ybar_t = exp(lam[t]) phi_t^T S_in[k] + sum_{s in chunk k, s <= t}
  //            exp(lam[t] - lam[s]) (phi_t . psi_s) vbar_s.
  virtual absl::Status ChunkOutputs(const SmatPlan& plan, const SmatSpan& span,
                                    const Tensor& phi,   // [batch, L, H, r]
                                    const Tensor& psi,   // [batch, L, H, r]
                                    const Tensor& v,     // [batch, L, H, dv]
                                    const Tensor& lam,   // [batch, L, H] or undefined
                                    const Tensor& S_in,  // [batch, Lc, H, r, p]
                                    Tensor* ybar,        // [batch, L, H, p]
                                    Stream* stream) = 0;

  // F7. Per-type reads (step 4, eq. 9), += into ybar for the span's recent t:
  //   ybar_t += gate_t phi_t^T U[type(t)],  gate_t = exp(Lambda_t - Lambda_{n-1})
  //   = exp(recent_offset + (sum of logg over [recent_begin, t])).
  //   Distant tokens are untouched. With SmatWrite::kAssign, ybar_t = the read
  //   for every recent t of the span (0 where t reads nothing: n = 0, or a
  //   content type out of range), the input of NormalizedOutputs.
  virtual absl::Status TypeReads(const SmatPlan& plan, const SmatSpan& span,
                                 const Tensor& phi,            // [batch, L, H, r]
                                 const Tensor& U,              // [batch, H, B, r, p]
                                 const Tensor& lam,            // [batch, L, H] or undefined
                                 const Tensor& chunk_decay,    // [batch, Lc, H] or undefined
                                 const Tensor& recent_offset,  // [batch, H] or undefined (0)
                                 const Tensor& type,           // [batch, L, H] int32 or undefined
                                 Tensor* ybar,                 // [batch, L, H, p] (+=)
                                 SmatWrite write, Stream* stream) = 0;

  // F8. Normalisation (eq. 3): den_t = ybar_t[dv] + eps, o_t = ybar_t[0:dv] / den_t.
  //   den is what backward needs (with o it gives ybar back).
  virtual absl::Status Normalize(const Tensor& ybar,  // [batch, L, H, p]
                                 float eps,
                                 Tensor* o,    // [batch, L, H, dv]
                                 Tensor* den,  // [batch, L, H]
                                 Stream* stream) = 0;

  // F6 + F7 + F8 without ybar in memory: per token t of the span,
  //   ybar_t = (F6's chunk-local part) + [t recent] reads_t,
  //   den_t = ybar_t[dv] + eps,  o_t = ybar_t[0:dv] / den_t,
  //   where reads holds TypeReads' rows written with SmatWrite::kAssign (its
  //   distant rows are not read; undefined: no reads, as when the op leaves
  //   the long-range branch out: SmatHasLongRange, kernels/smat.h). The same values, bit for bit,
  //   as ChunkOutputs, TypeReads (kAdd) and Normalize in turn, in one pass over the tokens: the
  //   single-device forward (kernels/smat.cc) uses it.
  virtual absl::Status NormalizedOutputs(const SmatPlan& plan, const SmatSpan& span,
                                         const Tensor& phi,    // [batch, L, H, r]
                                         const Tensor& psi,    // [batch, L, H, r]
                                         const Tensor& v,      // [batch, L, H, dv]
                                         const Tensor& lam,    // [batch, L, H] or undefined
                                         const Tensor& S_in,   // [batch, Lc, H, r, p]
                                         const Tensor& reads,  // [batch, L, H, p] or undefined
                                         float eps,
                                         Tensor* o,    // [batch, L, H, dv], phi's dtype or fp32
                                         Tensor* den,  // [batch, L, H]
                                         Stream* stream) = 0;

  // The forward's long-range phases (ProfilePooling, Tabulate, TypeReads)
  //   need nothing of its causal branch until the outputs add the reads.
  //   Where a backend has a second stream, ForkSide returns it, its work
  //   ordered after everything `stream` holds so far, for those phases to run
  //   beside the causal branch's first phases; JoinSide(stream) makes
  //   `stream` wait for all that was issued to it. ChunkStatesAndOutputs
  //   joins by itself, after the launches that do not read `reads`. Without
  //   a second stream ForkSide returns `stream` and JoinSide does nothing.
  //   The results are the same bits either way.
  virtual absl::StatusOr<Stream*> ForkSide(Stream* stream) { return stream; }
  virtual absl::Status JoinSide(Stream* stream) { return absl::OkStatus(); }

  // F2 + F3 + NormalizedOutputs in one call, where a backend has a path that
  //   never reads the states back from memory: S_in as ChunkScan writes it
  //   (from `incoming`, zero where undefined), then o and den as
  //   NormalizedOutputs writes them from that S_in and `reads`. Returns false,
  //   having written nothing, where the backend has no such path for these
  //   inputs: the composer then runs the three phases. The results agree with
  //   the three phases' within the phases' tolerances (the state sums run in
  //   another order), and repeat bit for bit. Joins the side stream (see
  //   ForkSide) before it reads `reads`.
  virtual absl::StatusOr<bool> ChunkStatesAndOutputs(
      const SmatPlan& plan, const SmatSpan& span,
      const Tensor& phi,          // [batch, L, H, r]
      const Tensor& psi,          // [batch, L, H, r]
      const Tensor& v,            // [batch, L, H, dv]
      const Tensor& lam,          // [batch, L, H] or undefined
      const Tensor& chunk_decay,  // [batch, Lc, H] or undefined
      const Tensor& incoming,     // [batch, 2, H, r, p] or undefined (0)
      const Tensor& reads,        // [batch, L, H, p] or undefined (none)
      float eps,
      Tensor* S_in,  // [batch, Lc, H, r, p], or null: not kept (inference)
      Tensor* o,     // [batch, L, H, dv], phi's dtype or fp32
      Tensor* den,   // [batch, L, H]
      Stream* stream) {
    return false;
  }

  // ====================== backward (Appendix E) ======================
  // gbar_t = dL/dybar_t. Gradients phi_bar, psi_bar, v_bar are fp32 and
  // accumulated (+=) by several phases in the order of kernels/smat.cc; B7,
  // which covers every token of the span, can write them instead (see
  // SmatWrite), so that they need no zeroing first.

  // B1. Jacobian of the division (Appendix E, last display):
  //   gbar_t[0:dv] = do_t / den_t,  gbar_t[dv] = -(do_t . o_t) / den_t;
  //   dlam_row_t = gbar_t . ybar_t = eps (do_t . o_t) / den_t (the row part of
  //   dL/dLambda_t, see LogDecayBackward; exactly 0 when eps = 0).
  virtual absl::Status NormalizeBackward(const Tensor& d_o,  // [batch, L, H, dv]
                                         const Tensor& o,    // [batch, L, H, dv]
                                         const Tensor& den,  // [batch, L, H]
                                         float eps,
                                         Tensor* gbar,      // [batch, L, H, p]
                                         Tensor* dlam_row,  // [batch, L, H] or null (ungated)
                                         Stream* stream) = 0;

  // B1 + B5 in one pass over the tokens: gbar and dlam_row (where not null)
  //   as NormalizeBackward writes them, and S_in_bar as ChunkStateGradients
  //   computes it from that gbar, without reading gbar back. The same values
  //   as the two phases in turn: gbar and dlam_row bit for bit, S_in_bar bit
  //   for bit ungated and to within fp32 rounding gated (a backend may weight
  //   gbar_t instead of phi_t). The backward of kernels/smat.cc and of the
  //   span composer use it.
  virtual absl::Status NormalizeBackwardStates(const SmatPlan& plan, const SmatSpan& span,
                                               const Tensor& d_o,  // [batch, L, H, dv]
                                               const Tensor& o,    // [batch, L, H, dv]
                                               const Tensor& den,  // [batch, L, H]
                                               float eps,
                                               const Tensor& phi,  // [batch, L, H, r]
                                               const Tensor& lam,  // [batch, L, H] or undefined
                                               Tensor* gbar,       // [batch, L, H, p]
                                               Tensor* dlam_row,   // [batch, L, H] or null
                                               Tensor* S_in_bar,   // [batch, Lc, H, r, p]
                                               Stream* stream) = 0;

  // B2. Adjoint of the per-type reads (eq. 18), for the span's recent t:
  //   phi_bar_t += gate_t U[type(t)] gbar_t;
  //   U_bar[h] = sum_{recent t in span, type(t) = h} gate_t phi_t gbar_t^T
  //   (written, the span's part; the composer all-reduces it).
  //   With SmatWrite::kAssign, phi_bar_t = that read for every recent t of the
  //   span (0 where t reads nothing: n = 0, or a content type out of range);
  //   distant rows are untouched either way.
  virtual absl::Status TypeReadsBackward(const SmatPlan& plan, const SmatSpan& span,
                                         const Tensor& phi,          // [batch, L, H, r]
                                         const Tensor& U,            // [batch, H, B, r, p]
                                         const Tensor& gbar,         // [batch, L, H, p]
                                         const Tensor& lam,          // [batch, L, H] or undefined
                                         const Tensor& chunk_decay,  // [batch, Lc, H] or undefined
                                         const Tensor& recent_offset,  // [batch, H] or undefined
                                         const Tensor& type,  // [batch, L, H] int32 or undefined
                                         Tensor* phi_bar,  // [batch, L, H, r] (+= or =, as write)
                                         Tensor* U_bar,    // [batch, H, B, r, p]
                                         SmatWrite write, Stream* stream) = 0;

  // B2 with gbar by its factors (B1): gbar_t[0:dv] = d_o_t / den_t and
  //   gbar_t[dv] = gden_t, so that gbar need not be written in full (the
  //   column dv alone, as ChunkBackward writes it given [batch, L, H]). The
  //   same sums as TypeReadsBackward from that gbar, within its tolerances.
  //   Returns false, having written nothing, where the backend has no such
  //   path for these inputs: the composer then forms gbar (NormalizeBackward)
  //   and runs TypeReadsBackward.
  virtual absl::StatusOr<bool> TypeReadsBackwardFromFactors(
      const SmatPlan& plan, const SmatSpan& span,
      const Tensor& phi,            // [batch, L, H, r]
      const Tensor& U,              // [batch, H, B, r, p]
      const Tensor& d_o,            // [batch, L, H, dv]
      const Tensor& den,            // [batch, L, H]
      const Tensor& gden,           // [batch, L, H]
      const Tensor& lam,            // [batch, L, H] or undefined
      const Tensor& chunk_decay,    // [batch, Lc, H] or undefined
      const Tensor& recent_offset,  // [batch, H] or undefined
      const Tensor& type,           // [batch, L, H] int32 or undefined
      Tensor* phi_bar,              // [batch, L, H, r] (+= or =, as write)
      Tensor* U_bar,                // [batch, H, B, r, p]
      SmatWrite write, Stream* stream) {
    return false;
  }

  // B3. Adjoint of the tabulation (eq. 18): F_bar = C^T U_bar.
  virtual absl::Status TabulateBackward(const SmatPlan& plan,
                                        const Tensor& U_bar,  // [batch, H, B, r, p]
                                        Tensor* F_bar,        // [batch, H, P, r, p]
                                        Stream* stream) = 0;

  // B4. Adjoint of the pooling: gather F_bar back to the span's distant s,
  //   Zbar_s = w_s F_bar[prof(s)], w_s = exp(Lambda_{n-1} - Lambda_s)
  //   = exp(distant_tail_decay + (sum of logg over (s, distant_end))):
  //   psi_bar_s += Zbar_s vbar_s, v_bar_s += (Zbar_s^T psi_s)[0:dv].
  //   With SmatWrite::kAssign, = for every distant s of the span (0 where s
  //   pools into nothing: a content profile out of range); recent rows are
  //   untouched either way.
  virtual absl::Status ProfilePoolingBackward(
      const SmatPlan& plan, const SmatSpan& span,
      const Tensor& psi,                 // [batch, L, H, r]
      const Tensor& v,                   // [batch, L, H, dv]
      const Tensor& lam,                 // [batch, L, H] or undefined
      const Tensor& chunk_decay,         // [batch, Lc, H] or undefined
      const Tensor& distant_tail_decay,  // [batch, H] or undefined (0)
      const Tensor& prof,                // [batch, L, H] int32 or undefined
      const Tensor& F_bar,               // [batch, H, P, r, p]
      Tensor* psi_bar,                   // [batch, L, H, r] (+= or =, as write)
      Tensor* v_bar,                     // [batch, L, H, dv] (+= or =, as write)
      SmatWrite write, Stream* stream) = 0;

  // B5. Gradient of the chunks' incoming states (eq. 19, gated):
  //   S_in_bar[k] = sum_{t in chunk k} exp(lam[t]) phi_t gbar_t^T.
  virtual absl::Status ChunkStateGradients(const SmatPlan& plan, const SmatSpan& span,
                                           const Tensor& phi,   // [batch, L, H, r]
                                           const Tensor& gbar,  // [batch, L, H, p]
                                           const Tensor& lam,   // [batch, L, H] or undefined
                                           Tensor* S_in_bar,    // [batch, Lc, H, r, p]
                                           Stream* stream) = 0;

  // B6. Adjoint of the scan (Appendix E: an exclusive suffix scan), within
  //   each block. With Sigma[k] = dL/dS_in[k] in total,
  //     Sigma[k] = S_in_bar[k] + exp(chunk_decay[k]) Sigma[k+1],
  //     Sigma[last + 1] = incoming_grad[blk]  (last = the part's last chunk),
  //     D_bar[k] = Sigma[k+1];
  //   span_state_grad[blk] = Sigma[first] computed with incoming_grad = 0
  //   (the incoming_grad path is folded across ranks, see SPANS).
  virtual absl::Status ChunkScanBackward(const SmatPlan& plan, const SmatSpan& span,
                                         const Tensor& S_in_bar,       // [batch, Lc, H, r, p]
                                         const Tensor& chunk_decay,    // [batch, Lc, H] or undefined
                                         const Tensor& incoming_grad,  // [batch, 2, H, r, p] or undefined (0)
                                         Tensor* D_bar,                // [batch, Lc, H, r, p]
                                         Tensor* span_state_grad,      // [batch, 2, H, r, p]
                                         Stream* stream) = 0;

  // B7. Chunk-local adjoint tiles (eq. 19, gated) and the summaries' adjoint.
  //   For t, s in chunk k, W[t, s] = exp(lam[t] - lam[s]) (s <= t, else 0),
  //   w_s = exp(chunk_decay[k] - lam[s]):
  //     phi_bar_t += exp(lam[t]) S_in[k] gbar_t + sum_s W[t, s] (vbar_s . gbar_t) psi_s
  //     Zbar_s     = sum_t W[t, s] phi_t gbar_t^T + w_s D_bar[k]
  //     psi_bar_s += Zbar_s vbar_s,   v_bar_s += (Zbar_s^T psi_s)[0:dv].
  //   With SmatWrite::kAssign, = in place of += in all three (every element
  //   of the span's phi_bar, psi_bar and v_bar is written).
  virtual absl::Status ChunkOutputsBackward(const SmatPlan& plan, const SmatSpan& span,
                                            const Tensor& phi,          // [batch, L, H, r]
                                            const Tensor& psi,          // [batch, L, H, r]
                                            const Tensor& v,            // [batch, L, H, dv]
                                            const Tensor& lam,          // [batch, L, H] or undefined
                                            const Tensor& chunk_decay,  // [batch, Lc, H] or undefined
                                            const Tensor& S_in,         // [batch, Lc, H, r, p]
                                            const Tensor& gbar,         // [batch, L, H, p]
                                            const Tensor& D_bar,        // [batch, Lc, H, r, p]
                                            Tensor* phi_bar,            // [batch, L, H, r] (+=)
                                            Tensor* psi_bar,            // [batch, L, H, r] (+=)
                                            Tensor* v_bar,              // [batch, L, H, dv] (+=)
                                            SmatWrite write, Stream* stream) = 0;

  // B1 + B5 + B6 + B7 in one call, where a backend has a path that writes
  //   neither S_in_bar nor D_bar in full: gbar and dlam_row (where not null)
  //   as NormalizeBackwardStates writes them (gbar given as [batch, L, H]:
  //   its column dv alone, for a backend whose per-type reads' adjoint takes
  //   gbar's other columns from d_o and den, TypeReadsBackwardFromFactors;
  //   a backend without such a path returns false), then phi_bar, psi_bar and v_bar
  //   written (SmatWrite::kAssign) as ChunkOutputsBackward writes them from
  //   the D_bar of ChunkScanBackward with incoming_grad zero. Returns false,
  //   having written nothing, where the backend has no such path for these
  //   inputs: the composer then runs the four phases. The results agree with
  //   the phases' within their tolerances (the state gradients are summed in
  //   another order) and repeat bit for bit.
  //   long_range (may be empty): where the call returns true it has run
  //   long_range exactly once on `stream`, either long_range(kAssign) after
  //   gbar is written and before B7, which then adds to the rows it wrote
  //   (phi_bar's recent rows, psi_bar's and v_bar's distant ones) and writes
  //   the others, so that those rows are read back once, by B7, where a
  //   backend's B7 can take the loads beside its products; or
  //   long_range(kAdd) after B7. Either way the gradients are the tiles' plus
  //   the long-range branch's, each element summed once in fp32: the same
  //   values in either order. Where it returns false it has run nothing.
  virtual absl::StatusOr<bool> ChunkBackward(
      const SmatPlan& plan, const SmatSpan& span,
      const Tensor& d_o,  // [batch, L, H, dv]
      const Tensor& o,    // [batch, L, H, dv]
      const Tensor& den,  // [batch, L, H]
      float eps,
      const Tensor& phi,          // [batch, L, H, r]
      const Tensor& psi,          // [batch, L, H, r]
      const Tensor& v,            // [batch, L, H, dv]
      const Tensor& lam,          // [batch, L, H] or undefined
      const Tensor& chunk_decay,  // [batch, Lc, H] or undefined
      const Tensor& S_in,         // [batch, Lc, H, r, p]
      Tensor* gbar,               // [batch, L, H, p] or [batch, L, H] (column dv)
      Tensor* dlam_row,           // [batch, L, H] or null
      Tensor* phi_bar,            // [batch, L, H, r] (=)
      Tensor* psi_bar,            // [batch, L, H, r] (=)
      Tensor* v_bar,              // [batch, L, H, dv] (=)
      const SmatLongRangeBackward& long_range, Stream* stream) {
    return false;
  }

  // B8. Gate gradient. Every mask weight is exp(Lambda_i - Lambda_j), so
  //   dL/dLambda_t = (sum over t's row) - (sum over t's column)
  //                = dlam_row_t - psi_t . psi_bar_t
  //   (psi_bar complete: all phases above have run), and dL/dlogg_s =
  //   sum_{t >= s} dL/dLambda_t: a suffix sum within the span plus
  //   suffix_in[b, h] = the sum of dL/dLambda over all tokens after the span
  //   (0 for the last span). span_sum = the sum over the span's own tokens.
  virtual absl::Status LogDecayBackward(const SmatPlan& plan, const SmatSpan& span,
                                        const Tensor& psi,        // [batch, L, H, r]
                                        const Tensor& psi_bar,    // [batch, L, H, r]
                                        const Tensor& dlam_row,   // [batch, L, H]
                                        const Tensor& suffix_in,  // [batch, H] or undefined (0)
                                        Tensor* logg_bar,         // [batch, L, H]
                                        Tensor* span_sum,         // [batch, H]
                                        Stream* stream) = 0;
};

}  // namespace smat
