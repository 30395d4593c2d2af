// SMat-Attention on one device: span validation, input checks, and the
// forward / backward op composed from the SmatKernels phases over the single
// span [0, T) (see kernels/smat.h; the phase order is Algorithm 1's and its
// adjoint's, Appendix E).
#include "kernels/smat.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace smat {

absl::Status ValidateSmatSpan(const SmatPlan& plan, const SmatSpan& span) {
  const int64_t c = plan.chunk;
  if (span.t0 < 0 || span.t0 >= span.t1 || span.t1 > plan.T) {
    return absl::InvalidArgumentError(absl::StrCat("smat: span [", span.t0, ", ", span.t1,
                                                   ") must satisfy 0 <= t0 < t1 <= T = ", plan.T));
  }
  if (span.t0 % c != 0 || (span.t1 != plan.T && span.t1 % c != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat: span [", span.t0, ", ", span.t1, ") must start on a chunk boundary and end on one "
        "or at T = ", plan.T, " (chunk ", c, "); e.g. [", (span.t0 / c) * c, ", ",
        span.t1 == plan.T ? plan.T : (span.t1 / c) * c, ")"));
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckTokens(const Tensor& t, const char* name, int64_t batch, int64_t L, int64_t H,
                         int64_t last, Device device, bool features) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat("smat: ", name, " is missing"));
  if (!(t.device() == device)) {
    return absl::InvalidArgumentError(absl::StrCat("smat: ", name, " is on ", t.device().ToString(),
                                                   ", expected ", device.ToString()));
  }
  if (features && t.dtype() != DType::kF32 && t.dtype() != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat: ", name, " must be fp32 or bf16; got ", t.DebugString()));
  }
  Shape shape = {batch, L, H};
  if (last >= 0) shape.push_back(last);
  return CheckShape(t, shape, name);
}

absl::StatusOr<Tensor> Alloc(Backend& backend, Shape shape) {
  return Tensor::Empty(std::move(shape), DType::kF32, backend.allocator());
}

}  // namespace

absl::StatusOr<SmatDims> CheckSmatInputs(const SmatPlan& plan, const SmatSpan& span,
                                         const SmatInputs& in) {
  SMAT_RETURN_IF_ERROR(ValidateSmatSpan(plan, span));
  if (!in.phi.defined() || in.phi.rank() != 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat: phi must be [batch, L, H, r]; got ",
        in.phi.defined() ? in.phi.DebugString() : std::string("nothing")));
  }
  if (!in.v.defined() || in.v.rank() != 4) {
    return absl::InvalidArgumentError("smat: v must be [batch, L, H, dv]");
  }
  SmatDims d;
  d.batch = in.phi.dim(0);
  d.L = span.length();
  d.Lc = span.num_chunks(plan);
  d.H = in.phi.dim(2);
  d.r = in.phi.dim(3);
  d.dv = in.v.dim(3);
  d.p = d.dv + 1;
  const Device dev = in.phi.device();
  SMAT_RETURN_IF_ERROR(CheckTokens(in.phi, "phi", d.batch, d.L, d.H, d.r, dev, true));
  SMAT_RETURN_IF_ERROR(CheckTokens(in.psi, "psi", d.batch, d.L, d.H, d.r, dev, true));
  SMAT_RETURN_IF_ERROR(CheckTokens(in.v, "v", d.batch, d.L, d.H, d.dv, dev, true));
  if (in.psi.dtype() != in.phi.dtype() || in.v.dtype() != in.phi.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat: phi, psi and v must share one dtype; got ", in.phi.DebugString(), ", ",
        in.psi.DebugString(), ", ", in.v.DebugString()));
  }
  if (d.r < 1 || d.dv < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat: need r >= 1 and dv >= 1; got r = ", d.r, ", dv = ", d.dv));
  }
  if (in.logg.defined()) {
    SMAT_RETURN_IF_ERROR(CheckTokens(in.logg, "logg", d.batch, d.L, d.H, -1, dev, false));
    if (in.logg.dtype() != DType::kF32) {
      return absl::InvalidArgumentError("smat: logg must be fp32 log-gates <= 0");
    }
  }
  for (const auto& [t, name] : {std::pair{&in.prof, "prof"}, std::pair{&in.type, "type"}}) {
    if (!t->defined()) continue;
    SMAT_RETURN_IF_ERROR(CheckTokens(*t, name, d.batch, d.L, d.H, -1, dev, false));
    if (t->dtype() != DType::kI32) {
      return absl::InvalidArgumentError(
          absl::StrCat("smat: ", name, " must be int32 ids; got ", t->DebugString()));
    }
  }
  if (!(in.eps >= 0.f)) {
    return absl::InvalidArgumentError(absl::StrCat("smat: eps must be >= 0; got ", in.eps));
  }
  return d;
}

SmatPlan SmatOpPlan(const SmatPlan& plan, bool content_maps) {
  if (plan.geo.d != 1 || content_maps || plan.n == 0) return plan;
  SmatPlan causal = plan;
  causal.n = 0;
  causal.m = plan.T;
  causal.num_distant_chunks = 0;
  causal.num_chunks = (plan.T + plan.chunk - 1) / plan.chunk;
  return causal;
}

absl::Status SmatForward(Backend& backend, const SmatPlan& plan, const SmatInputs& in,
                         SmatForwardOutputs* fwd, Stream* stream, SmatKeep keep) {
  SMAT_ASSIGN_OR_RETURN(SmatKernels * k, backend.smat());
  return SmatForward(backend, *k, plan, in, fwd, stream, keep);
}

namespace {

absl::Status Forward(Backend& backend, SmatKernels& kernels, const SmatPlan& op_plan,
                     const SmatInputs& in, bool keep, SmatForwardOutputs* fwd, Stream* stream) {
  const SmatPlan plan = SmatOpPlan(op_plan, in.prof.defined() || in.type.defined());
  const SmatSpan span = SmatSpan::Whole(plan);
  SMAT_ASSIGN_OR_RETURN(SmatDims d, CheckSmatInputs(plan, span, in));
  SmatKernels* k = &kernels;
  const int64_t P = plan.geo.P, B = plan.geo.B;
  SmatSaved& sv = fwd->saved;
  sv = SmatSaved();

  // Lemma 4: the chunk-local log-decay prefix, once.
  if (in.logg.defined()) {
    SMAT_ASSIGN_OR_RETURN(sv.lam, Alloc(backend, {d.batch, d.L, d.H}));
    SMAT_ASSIGN_OR_RETURN(sv.chunk_decay, Alloc(backend, {d.batch, d.Lc, d.H}));
    SMAT_RETURN_IF_ERROR(k->ChunkLogDecay(plan, span, in.logg, &sv.lam, &sv.chunk_decay, stream));
  }
  // Long-range branch tables: pooling and tabulation (steps 2, 3). One span
  // ends its distant part at n - 1, so F is already referred to Lambda_{n-1}.
  // Without tokens on both sides of n, U is the table of an empty F and no
  // token reads it: the branch is left out (reads undefined: none). Where C
  // is the identity (d <= 2) U is F: the pooling writes U. The branch runs
  // on the backend's side stream where it has one, beside the causal
  // branch's states, until the outputs need the reads.
  SMAT_ASSIGN_OR_RETURN(sv.U, Alloc(backend, {d.batch, d.H, B, d.r, d.p}));
  Tensor reads;
  if (SmatHasLongRange(plan)) {
    // Ungated at d = 2 the side stream neither gains nor loses: the forward
    // took 2.188-2.211 ms with it and 2.195-2.204 ms with the branch on
    // `stream` (H200, bf16, T = 524288, 8 heads, 2026-12-02).
    SMAT_ASSIGN_OR_RETURN(Stream* const side, k->ForkSide(stream));
    if (plan.geo.IncidenceIsIdentity()) {
      SMAT_RETURN_IF_ERROR(k->ProfilePooling(plan, span, in.psi, in.v, sv.lam, sv.chunk_decay,
                                             in.prof, &sv.U, side));
    } else {
      SMAT_ASSIGN_OR_RETURN(Tensor F, Alloc(backend, {d.batch, d.H, P, d.r, d.p}));
      SMAT_RETURN_IF_ERROR(
          k->ProfilePooling(plan, span, in.psi, in.v, sv.lam, sv.chunk_decay, in.prof, &F, side));
      SMAT_RETURN_IF_ERROR(k->Tabulate(plan, F, &sv.U, side));
    }
    // The per-type reads of the recent tokens (step 4).
    SMAT_ASSIGN_OR_RETURN(reads, Alloc(backend, {d.batch, d.L, d.H, d.p}));
    SMAT_RETURN_IF_ERROR(k->TypeReads(plan, span, in.phi, sv.U, sv.lam, sv.chunk_decay, Tensor(),
                                      in.type, &reads, SmatWrite::kAssign, side));
  } else {
    SMAT_RETURN_IF_ERROR(backend.Fill(sv.U, 0.0, stream));
  }
  // Outputs (step 7): the causal branch's states (steps 5, 6), the
  // chunk-local part, the reads, the sum and the division: in one walk over
  // the chunks where the backend has one, else summaries, the exclusive scan
  // and one pass over the tokens.
  SMAT_ASSIGN_OR_RETURN(fwd->o, Tensor::Empty({d.batch, d.L, d.H, d.dv}, in.v.dtype(),
                                              backend.allocator()));
  SMAT_ASSIGN_OR_RETURN(sv.den, Alloc(backend, {d.batch, d.L, d.H}));
  // Without backward the walk keeps no states (S_in null); the three phases
  // pass them from the scan to the outputs either way.
  if (keep) {
    SMAT_ASSIGN_OR_RETURN(sv.S_in, Alloc(backend, {d.batch, d.Lc, d.H, d.r, d.p}));
  }
  SMAT_ASSIGN_OR_RETURN(
      const bool walked,
      k->ChunkStatesAndOutputs(plan, span, in.phi, in.psi, in.v, sv.lam, sv.chunk_decay, Tensor(),
                               reads, in.eps, keep ? &sv.S_in : nullptr, &fwd->o, &sv.den, stream));
  if (walked) return k->JoinSide(stream);  // joined before the reads: a no-op
  if (!keep) {
    SMAT_ASSIGN_OR_RETURN(sv.S_in, Alloc(backend, {d.batch, d.Lc, d.H, d.r, d.p}));
  }
  SMAT_ASSIGN_OR_RETURN(Tensor D, Alloc(backend, {d.batch, d.Lc, d.H, d.r, d.p}));
  SMAT_RETURN_IF_ERROR(
      k->ChunkSummaries(plan, span, in.psi, in.v, sv.lam, sv.chunk_decay, &D, stream));
  SMAT_ASSIGN_OR_RETURN(Tensor span_state, Alloc(backend, {d.batch, 2, d.H, d.r, d.p}));
  SMAT_ASSIGN_OR_RETURN(Tensor span_decay, Alloc(backend, {d.batch, 2, d.H}));
  SMAT_RETURN_IF_ERROR(k->ChunkScan(plan, span, D, sv.chunk_decay, Tensor(), &sv.S_in, &span_state,
                                    &span_decay, stream));
  SMAT_RETURN_IF_ERROR(k->JoinSide(stream));
  return k->NormalizedOutputs(plan, span, in.phi, in.psi, in.v, sv.lam, sv.S_in, reads, in.eps,
                              &fwd->o, &sv.den, stream);
}

}  // namespace

absl::Status SmatForward(Backend& backend, SmatKernels& kernels, const SmatPlan& plan,
                         const SmatInputs& in, SmatForwardOutputs* fwd, Stream* stream,
                         SmatKeep keep) {
  SMAT_CHECK(fwd != nullptr);
  const bool for_backward = keep == SmatKeep::kForBackward;
  const absl::Status st = Forward(backend, kernels, plan, in, for_backward, fwd, stream);
  // The saved tensors go back to the backend's allocator, which hands a
  // block out again only once the work queued on it is done.
  if (!for_backward) fwd->saved = SmatSaved();
  return st;
}

absl::Status SmatBackward(Backend& backend, const SmatPlan& plan, const SmatInputs& in,
                          const SmatForwardOutputs& fwd, const Tensor& d_o, SmatGradients* grads,
                          Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(SmatKernels * k, backend.smat());
  return SmatBackward(backend, *k, plan, in, fwd, d_o, grads, stream);
}

absl::Status SmatBackward(Backend& backend, SmatKernels& kernels, const SmatPlan& op_plan,
                          const SmatInputs& in, const SmatForwardOutputs& fwd, const Tensor& d_o,
                          SmatGradients* grads, Stream* stream) {
  SMAT_CHECK(grads != nullptr);
  const SmatPlan plan = SmatOpPlan(op_plan, in.prof.defined() || in.type.defined());
  const SmatSpan span = SmatSpan::Whole(plan);
  SMAT_ASSIGN_OR_RETURN(SmatDims d, CheckSmatInputs(plan, span, in));
  SmatKernels* k = &kernels;
  const int64_t P = plan.geo.P, B = plan.geo.B;
  const SmatSaved& sv = fwd.saved;
  const bool gated = in.logg.defined();
  if (fwd.o.defined() && !sv.S_in.defined() && !sv.U.defined() && !sv.den.defined()) {
    return absl::InvalidArgumentError(
        "smat: SmatBackward needs what SmatForward keeps for it; this forward ran with "
        "SmatKeep::kNothing (inference) and kept nothing");
  }
  if (!sv.S_in.defined() || !sv.U.defined() || !sv.den.defined() || !fwd.o.defined() ||
      gated != sv.lam.defined()) {
    return absl::InvalidArgumentError(
        "smat: SmatBackward needs the outputs of SmatForward on the same inputs");
  }

  // The division's Jacobian (Appendix E), the chunks' state gradients
  // (eq. 19), their suffix scan and the chunk tiles: in one call where the
  // backend has one, else four phases. The tiles cover every token, so they
  // write the three gradients (no zeroing before) and the long-range branch
  // adds to them; or, where the backend's one call runs the branch before
  // its tiles, the branch writes its rows and the tiles add to those. The one
  // call writes gbar's column dv alone where the backend takes the rest from
  // d_o and den (gden), else gbar in full.
  Tensor dlam_row;
  if (gated) {
    SMAT_ASSIGN_OR_RETURN(dlam_row, Alloc(backend, {d.batch, d.L, d.H}));
  }
  *grads = SmatGradients();
  SMAT_ASSIGN_OR_RETURN(grads->phi, Alloc(backend, {d.batch, d.L, d.H, d.r}));
  SMAT_ASSIGN_OR_RETURN(grads->psi, Alloc(backend, {d.batch, d.L, d.H, d.r}));
  SMAT_ASSIGN_OR_RETURN(grads->v, Alloc(backend, {d.batch, d.L, d.H, d.dv}));
  auto full_gbar = [&]() { return Alloc(backend, {d.batch, d.L, d.H, d.p}); };
  Tensor gbar, gden;

  // Long-range branch, eq. 18: U_bar by type, F_bar = C^T U_bar (U_bar itself
  // where C is the identity), gather to tokens (nothing to carry without
  // tokens on both sides of n). With gbar's column dv alone, the per-type
  // reads' adjoint takes the rest from d_o and den, or gbar is formed in full
  // for it where the backend has no such path.
  auto long_range = [&](SmatWrite write) -> absl::Status {
    SMAT_ASSIGN_OR_RETURN(Tensor U_bar, Alloc(backend, {d.batch, d.H, B, d.r, d.p}));
    bool read = false;
    if (gden.defined()) {
      SMAT_ASSIGN_OR_RETURN(
          read, k->TypeReadsBackwardFromFactors(plan, span, in.phi, sv.U, d_o, sv.den, gden, sv.lam,
                                                sv.chunk_decay, Tensor(), in.type, &grads->phi,
                                                &U_bar, write, stream));
      if (!read) {
        SMAT_ASSIGN_OR_RETURN(gbar, full_gbar());
        SMAT_RETURN_IF_ERROR(
            k->NormalizeBackward(d_o, fwd.o, sv.den, in.eps, &gbar, nullptr, stream));
      }
    }
    if (!read) {
      SMAT_RETURN_IF_ERROR(k->TypeReadsBackward(plan, span, in.phi, sv.U, gbar, sv.lam,
                                                sv.chunk_decay, Tensor(), in.type, &grads->phi,
                                                &U_bar, write, stream));
    }
    Tensor F_bar = U_bar;
    if (!plan.geo.IncidenceIsIdentity()) {
      SMAT_ASSIGN_OR_RETURN(F_bar, Alloc(backend, {d.batch, d.H, P, d.r, d.p}));
      SMAT_RETURN_IF_ERROR(k->TabulateBackward(plan, U_bar, &F_bar, stream));
    }
    return k->ProfilePoolingBackward(plan, span, in.psi, in.v, sv.lam, sv.chunk_decay, Tensor(),
                                     in.prof, F_bar, &grads->psi, &grads->v, write, stream);
  };
  SmatLongRangeBackward branch;
  if (SmatHasLongRange(plan)) branch = long_range;
  auto chunk_backward = [&](Tensor* g) {
    return k->ChunkBackward(plan, span, d_o, fwd.o, sv.den, in.eps, in.phi, in.psi, in.v, sv.lam,
                            sv.chunk_decay, sv.S_in, g, gated ? &dlam_row : nullptr, &grads->phi,
                            &grads->psi, &grads->v, branch, stream);
  };
  SMAT_ASSIGN_OR_RETURN(gden, Alloc(backend, {d.batch, d.L, d.H}));
  SMAT_ASSIGN_OR_RETURN(bool fused, chunk_backward(&gden));
  if (!fused) {
    gden = Tensor();
    SMAT_ASSIGN_OR_RETURN(gbar, full_gbar());
    SMAT_ASSIGN_OR_RETURN(fused, chunk_backward(&gbar));
  }
  if (!fused) {
    SMAT_ASSIGN_OR_RETURN(Tensor S_in_bar, Alloc(backend, {d.batch, d.Lc, d.H, d.r, d.p}));
    SMAT_RETURN_IF_ERROR(k->NormalizeBackwardStates(plan, span, d_o, fwd.o, sv.den, in.eps, in.phi,
                                                    sv.lam, &gbar, gated ? &dlam_row : nullptr,
                                                    &S_in_bar, stream));
    SMAT_ASSIGN_OR_RETURN(Tensor D_bar, Alloc(backend, {d.batch, d.Lc, d.H, d.r, d.p}));
    SMAT_ASSIGN_OR_RETURN(Tensor state_grad, Alloc(backend, {d.batch, 2, d.H, d.r, d.p}));
    SMAT_RETURN_IF_ERROR(k->ChunkScanBackward(plan, span, S_in_bar, sv.chunk_decay, Tensor(),
                                              &D_bar, &state_grad, stream));
    SMAT_RETURN_IF_ERROR(k->ChunkOutputsBackward(
        plan, span, in.phi, in.psi, in.v, sv.lam, sv.chunk_decay, sv.S_in, gbar, D_bar, &grads->phi,
        &grads->psi, &grads->v, SmatWrite::kAssign, stream));
    if (branch) SMAT_RETURN_IF_ERROR(branch(SmatWrite::kAdd));
  }

  // Gates last: dL/dLambda needs the complete psi_bar.
  if (gated) {
    SMAT_ASSIGN_OR_RETURN(grads->logg, Alloc(backend, {d.batch, d.L, d.H}));
    SMAT_ASSIGN_OR_RETURN(Tensor span_sum, Alloc(backend, {d.batch, d.H}));
    SMAT_RETURN_IF_ERROR(k->LogDecayBackward(plan, span, in.psi, grads->psi, dlam_row, Tensor(),
                                             &grads->logg, &span_sum, stream));
  }
  return absl::OkStatus();
}

}  // namespace smat
