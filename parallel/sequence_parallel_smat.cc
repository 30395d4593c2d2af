// Sequence-parallel SMat-Attention: phase kernels + collectives + the folds
// across ranks of kernels/smat_kernels.h (SPANS). See the header for the shape
// of a step.
#include "parallel/sequence_parallel_smat.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace smat {

// --- spans -----------------------------------------------------------------------

absl::StatusOr<std::vector<SmatSpan>> SplitSequence(const SmatPlan& plan, int ranks) {
  if (ranks < 1) return absl::InvalidArgumentError("SplitSequence: ranks must be >= 1");
  const int64_t chunks = (plan.T + plan.chunk - 1) / plan.chunk;
  if (chunks < ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence parallelism: T = ", plan.T, " with chunk ", plan.chunk, " has ", chunks,
        " chunks, fewer than the ", ranks, " sequence-parallel ranks; use at most ", chunks,
        " ranks (sp) or a longer sequence"));
  }
  std::vector<SmatSpan> spans;
  int64_t chunk0 = 0;
  for (int i = 0; i < ranks; ++i) {
    const int64_t mine = chunks / ranks + (i < chunks % ranks ? 1 : 0);
    SmatSpan s{chunk0 * plan.chunk, std::min(plan.T, (chunk0 + mine) * plan.chunk)};
    spans.push_back(s);
    chunk0 += mine;
  }
  return spans;
}

absl::StatusOr<std::vector<SmatSpan>> SpansFromCuts(const SmatPlan& plan,
                                                    const std::vector<int64_t>& cuts) {
  std::vector<SmatSpan> spans;
  int64_t t0 = 0;
  for (int64_t cut : cuts) {
    if (cut <= t0 || cut >= plan.T) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence split: cut at ", cut, " must be increasing and inside (0, T = ", plan.T, ")"));
    }
    if (cut % plan.chunk != 0) {
      const int64_t below = cut / plan.chunk * plan.chunk;
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence split: cut at token ", cut, " cuts chunk ", cut / plan.chunk, " (width ",
          plan.chunk, "); spans must hold whole chunks: cut at ", below, " or ",
          below + plan.chunk, " instead"));
    }
    spans.push_back({t0, cut});
    t0 = cut;
  }
  spans.push_back({t0, plan.T});
  return spans;
}

absl::Status ValidateSpans(const SmatPlan& plan, const std::vector<SmatSpan>& spans, int ranks) {
  if (static_cast<int>(spans.size()) != ranks) {
    return absl::InvalidArgumentError(absl::StrCat("sequence split: ", spans.size(),
                                                   " spans for ", ranks, " ranks"));
  }
  int64_t expect = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    if (spans[i].t0 != expect) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence split: span ", i, " starts at ", spans[i].t0, ", expected ", expect,
          " (spans must cover [0, T) in rank order)"));
    }
    SMAT_RETURN_IF_ERROR(Annotate(ValidateSmatSpan(plan, spans[i]),
                                  absl::StrCat("sequence split: span ", i)));
    expect = spans[i].t1;
  }
  if (expect != plan.T) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence split: spans end at ", expect, ", not at T = ", plan.T));
  }
  return absl::OkStatus();
}

std::string SpSmatVolume::ToString() const {
  return absl::StrFormat("scan all-gather %d words (%.1f KiB), table all-reduce %d words (%.1f KiB)",
                         scan_words, scan_words * 4 / 1024.0, table_words,
                         table_words * 4 / 1024.0);
}

SpSmatVolume SequenceParallelVolume(const SmatPlan& plan, int sp, int64_t batch, int64_t H,
                                    int64_t r, int64_t p) {
  SpSmatVolume v;
  v.scan_words = int64_t{sp} * batch * 2 * H * (r * p + 1);
  v.table_words = SmatHasLongRange(plan) ? batch * H * plan.geo.P * r * p : 0;
  return v;
}

// --- helpers -----------------------------------------------------------------------

namespace {

absl::StatusOr<Tensor> ZerosOn(Backend& backend, Shape shape, Stream* stream) {
  SMAT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(std::move(shape), DType::kF32, backend.allocator()));
  SMAT_RETURN_IF_ERROR(backend.Fill(t, 0.0, stream));
  return t;
}

absl::StatusOr<Tensor> EmptyOn(Backend& backend, Shape shape, DType dt = DType::kF32) {
  return Tensor::Empty(std::move(shape), dt, backend.allocator());
}

// A host copy of t (t itself when it is host memory already; the stream is
// synchronised first so the values are complete).
absl::StatusOr<Tensor> HostOf(Backend& backend, const Tensor& t, Stream* stream) {
  SMAT_RETURN_IF_ERROR(backend.Synchronize(stream));
  if (t.device().is_cpu()) return t;
  SMAT_ASSIGN_OR_RETURN(Tensor h, Tensor::Empty(t.shape(), t.dtype()));
  SMAT_RETURN_IF_ERROR(backend.Copy(t, h, stream));
  SMAT_RETURN_IF_ERROR(backend.Synchronize(stream));
  return h;
}

// Copies host data into t (on the backend); a no-op when they are one buffer.
absl::Status Upload(Backend& backend, const Tensor& host, Tensor& t, Stream* stream) {
  if (host.raw() == t.raw()) return absl::OkStatus();
  return backend.Copy(host, t, stream);
}

// The tensor a collective works on: `t` itself when the communicator can use
// its memory, else a host copy (MPI with a GPU backend).
absl::StatusOr<Tensor> CommBuffer(Backend& backend, Communicator& comm, const Tensor& t,
                                  Stream* stream) {
  SMAT_RETURN_IF_ERROR(backend.Synchronize(stream));
  if (comm.device() == t.device()) return t;
  if (!comm.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence-parallel SMat: the communicator works on ", comm.device().ToString(),
        " but the backend on ", t.device().ToString(),
        "; use an MPI communicator or a backend on the communicator's device"));
  }
  return HostOf(backend, t, stream);
}

float* F32(const Tensor& t) { return t.data<float>(); }

struct Sizes {
  int64_t batch, L, Lc, H, r, dv, p;
  int64_t state() const { return batch * 2 * H * r * p; }  // [batch, 2, H, r, p]
  int64_t decay() const { return batch * 2 * H; }          // [batch, 2, H]
};

// X <- exp(decay) X + state over the ranks before `me`, in rank order, per
// (batch, block, head): the incoming state of this rank's span in each block.
// gathered: [W, Ns + Nd] (span states then span decays of every rank).
void FoldIncoming(const Sizes& z, const float* gathered, int me, float* incoming) {
  const int64_t rp = z.r * z.p, Ns = z.state(), Nd = z.decay(), stride = Ns + Nd;
  std::memset(incoming, 0, sizeof(float) * Ns);
  for (int j = 0; j < me; ++j) {
    const float* st = gathered + j * stride;
    const float* dec = st + Ns;
    for (int64_t g = 0; g < Nd; ++g) {  // g = (b, blk, h)
      const float a = std::exp(dec[g]);
      float* x = incoming + g * rp;
      const float* s = st + g * rp;
      for (int64_t e = 0; e < rp; ++e) x[e] = a * x[e] + s[e];
    }
  }
}

// Y <- G_j + exp(d_j) Y over the ranks after `me`, last first (backward of the
// fold above). grads: [W, Ns]; decays: [W, Nd].
void FoldIncomingGrad(const Sizes& z, const float* grads, const float* decays, int W, int me,
                      float* incoming_grad) {
  const int64_t rp = z.r * z.p, Ns = z.state(), Nd = z.decay();
  std::memset(incoming_grad, 0, sizeof(float) * Ns);
  for (int j = W - 1; j > me; --j) {
    const float* G = grads + j * Ns;
    const float* dec = decays + j * Nd;
    for (int64_t g = 0; g < Nd; ++g) {
      const float a = std::exp(dec[g]);
      float* y = incoming_grad + g * rp;
      const float* s = G + g * rp;
      for (int64_t e = 0; e < rp; ++e) y[e] = s[e] + a * y[e];
    }
  }
}

// Starts an AllGather of the host vector `pack` (n floats) through the
// communicator's memory; `*gathered` receives [W, n] once the handle is done.
struct GatherJob {
  Tensor send, recv;  // on the communicator's device
  std::unique_ptr<CollectiveHandle> handle;
};

absl::StatusOr<GatherJob> StartGather(Backend& backend, Communicator& comm, const Tensor& pack,
                                      Stream* stream) {
  GatherJob job;
  const int64_t n = pack.numel();
  if (comm.device().is_cpu()) {
    job.send = pack;
    SMAT_ASSIGN_OR_RETURN(job.recv, Tensor::Empty({comm.size() * n}, DType::kF32));
  } else {
    SMAT_ASSIGN_OR_RETURN(job.send, EmptyOn(backend, {n}));
    SMAT_ASSIGN_OR_RETURN(job.recv, EmptyOn(backend, {comm.size() * n}));
    SMAT_RETURN_IF_ERROR(backend.Copy(pack, job.send, stream));
    SMAT_RETURN_IF_ERROR(backend.Synchronize(stream));
  }
  SMAT_ASSIGN_OR_RETURN(job.handle, comm.StartAllGather(job.send, job.recv, comm.default_timeout()));
  return job;
}

absl::StatusOr<Tensor> FinishGather(Backend& backend, GatherJob& job, Stream* stream) {
  SMAT_RETURN_IF_ERROR(job.handle->Wait());
  return HostOf(backend, job.recv, stream);
}

// t[b, h, ...] *= exp(log_scale[b, h]) for t [batch, H, rest] (host or device).
absl::Status ScaleRows(Backend& backend, Tensor& t, const float* log_scale, int64_t rows,
                       Stream* stream) {
  const int64_t rest = t.numel() / rows;
  for (int64_t i = 0; i < rows; ++i) {
    if (log_scale[i] == 0.f) continue;
    const float a = std::exp(log_scale[i]);
    if (t.device().is_cpu()) {
      float* x = F32(t) + i * rest;
      for (int64_t e = 0; e < rest; ++e) x[e] *= a;
    } else {
      // y += (a - 1) y: one Axpy per row, on the device.
      Tensor row = t.View(i * rest, {rest});
      SMAT_RETURN_IF_ERROR(backend.Axpy(a - 1.f, row, row, stream));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// --- forward -----------------------------------------------------------------------

absl::Status SequenceParallelSmatForward(Backend& backend, Communicator& comm,
                                         const SmatPlan& op_plan,
                                         const std::vector<SmatSpan>& spans, const SmatInputs& in,
                                         SpSmatForwardOutputs* fwd, Stream* stream) {
  // The plan SmatForward runs (d = 1 with positional maps as one causal
  // block): the same on every rank, so every rank skips the same collectives.
  const SmatPlan plan = SmatOpPlan(op_plan, in.prof.defined() || in.type.defined());
  const bool long_range = SmatHasLongRange(plan);
  const int W = comm.size(), me = comm.rank();
  SMAT_RETURN_IF_ERROR(ValidateSpans(plan, spans, W));
  const SmatSpan span = spans[me];
  SMAT_ASSIGN_OR_RETURN(SmatDims dims, CheckSmatInputs(plan, span, in));
  SMAT_ASSIGN_OR_RETURN(SmatKernels * k, backend.smat());
  const Sizes z{dims.batch, dims.L, dims.Lc, dims.H, dims.r, dims.dv, dims.p};
  const bool gated = in.logg.defined();
  const int64_t b = z.batch, L = z.L, Lc = z.Lc, H = z.H, r = z.r, p = z.p;
  SpSmatSaved& sv = fwd->saved;

  // Local: decays, chunk summaries, the span's own totals per block.
  Tensor lam, cd;
  if (gated) {
    SMAT_ASSIGN_OR_RETURN(lam, EmptyOn(backend, {b, L, H}));
    SMAT_ASSIGN_OR_RETURN(cd, EmptyOn(backend, {b, Lc, H}));
    SMAT_RETURN_IF_ERROR(k->ChunkLogDecay(plan, span, in.logg, &lam, &cd, stream));
  }
  SMAT_ASSIGN_OR_RETURN(Tensor D, EmptyOn(backend, {b, Lc, H, r, p}));
  SMAT_RETURN_IF_ERROR(k->ChunkSummaries(plan, span, in.psi, in.v, lam, cd, &D, stream));
  SMAT_ASSIGN_OR_RETURN(Tensor zero_in, ZerosOn(backend, {b, 2, H, r, p}, stream));
  SMAT_ASSIGN_OR_RETURN(Tensor span_state, EmptyOn(backend, {b, 2, H, r, p}));
  SMAT_ASSIGN_OR_RETURN(Tensor span_decay, EmptyOn(backend, {b, 2, H}));
  SMAT_RETURN_IF_ERROR(
      k->ChunkScan(plan, span, D, cd, zero_in, nullptr, &span_state, &span_decay, stream));

  // Collect 1: AllGather (span totals, span log-decays), overlapped with pooling.
  SMAT_ASSIGN_OR_RETURN(Tensor pack, Tensor::Empty({z.state() + z.decay()}, DType::kF32));
  {
    SMAT_ASSIGN_OR_RETURN(Tensor hs, HostOf(backend, span_state, stream));
    SMAT_ASSIGN_OR_RETURN(Tensor hd, HostOf(backend, span_decay, stream));
    std::memcpy(F32(pack), hs.raw(), hs.nbytes());
    std::memcpy(F32(pack) + z.state(), hd.raw(), hd.nbytes());
  }
  SMAT_ASSIGN_OR_RETURN(GatherJob gather, StartGather(backend, comm, pack, stream));
  SMAT_ASSIGN_OR_RETURN(Tensor F, EmptyOn(backend, {b, H, plan.geo.P, r, p}));
  if (long_range) {
    SMAT_RETURN_IF_ERROR(k->ProfilePooling(plan, span, in.psi, in.v, lam, cd, in.prof, &F, stream));
  }
  SMAT_ASSIGN_OR_RETURN(Tensor gathered, FinishGather(backend, gather, stream));

  // Fold the earlier ranks into the incoming states (fp32, rank order); the
  // decays give the distant-tail decay (ranks after this one, distant block)
  // and the recent offset (ranks before it, recent block), summed in rank order.
  SMAT_ASSIGN_OR_RETURN(Tensor incoming_h, Tensor::Empty({b, 2, H, r, p}, DType::kF32));
  FoldIncoming(z, F32(gathered), me, F32(incoming_h));
  SMAT_ASSIGN_OR_RETURN(sv.span_decays, Tensor::Empty({W, b, 2, H}, DType::kF32));
  for (int j = 0; j < W; ++j) {
    std::memcpy(F32(sv.span_decays) + j * z.decay(),
                F32(gathered) + j * (z.state() + z.decay()) + z.state(), z.decay() * sizeof(float));
  }
  std::vector<float> tail(b * H, 0.f), offset(b * H, 0.f);
  for (int j = 0; j < W; ++j) {
    const float* dec = F32(sv.span_decays) + j * z.decay();  // [b, 2, H]
    for (int64_t bb = 0; bb < b; ++bb) {
      for (int64_t h = 0; h < H; ++h) {
        if (j > me) tail[bb * H + h] += dec[(bb * 2 + kDistantBlock) * H + h];
        if (j < me) offset[bb * H + h] += dec[(bb * 2 + kRecentBlock) * H + h];
      }
    }
  }
  SMAT_ASSIGN_OR_RETURN(Tensor incoming, EmptyOn(backend, {b, 2, H, r, p}));
  SMAT_RETURN_IF_ERROR(Upload(backend, incoming_h, incoming, stream));
  if (gated) {
    SMAT_ASSIGN_OR_RETURN(sv.recent_offset, EmptyOn(backend, {b, H}));
    SMAT_ASSIGN_OR_RETURN(sv.distant_tail_decay, EmptyOn(backend, {b, H}));
    Tensor off_h = Tensor::Wrap(offset.data(), {b, H}, DType::kF32);
    Tensor tail_h = Tensor::Wrap(tail.data(), {b, H}, DType::kF32);
    SMAT_RETURN_IF_ERROR(backend.Copy(off_h, sv.recent_offset, stream));
    SMAT_RETURN_IF_ERROR(backend.Copy(tail_h, sv.distant_tail_decay, stream));
    SMAT_RETURN_IF_ERROR(backend.Synchronize(stream));  // tail/offset are on this stack
  }

  // Collect 2: AllReduce(sum) of the profile table, each part first referred
  // to Lambda_{n-1}; overlapped with the chunk scan and chunk-local outputs.
  // Without a long-range branch there is no table to reduce.
  Tensor F_comm;
  std::unique_ptr<CollectiveHandle> table;
  if (long_range) {
    SMAT_ASSIGN_OR_RETURN(F_comm, CommBuffer(backend, comm, F, stream));
    if (gated) SMAT_RETURN_IF_ERROR(ScaleRows(backend, F_comm, tail.data(), b * H, stream));
    SMAT_RETURN_IF_ERROR(backend.Synchronize(stream));
    SMAT_ASSIGN_OR_RETURN(table, comm.StartAllReduce(F_comm, comm.default_timeout()));
  }

  SMAT_ASSIGN_OR_RETURN(Tensor S_in, EmptyOn(backend, {b, Lc, H, r, p}));
  SMAT_RETURN_IF_ERROR(
      k->ChunkScan(plan, span, D, cd, incoming, &S_in, &span_state, &span_decay, stream));
  SMAT_ASSIGN_OR_RETURN(Tensor ybar, EmptyOn(backend, {b, L, H, p}));
  SMAT_RETURN_IF_ERROR(k->ChunkOutputs(plan, span, in.phi, in.psi, in.v, lam, S_in, &ybar, stream));

  // U = C F (F itself where C is the identity, d <= 2).
  Tensor U;
  if (long_range && plan.geo.IncidenceIsIdentity()) {
    U = F;
  } else {
    SMAT_ASSIGN_OR_RETURN(U, EmptyOn(backend, {b, H, plan.geo.B, r, p}));
  }
  if (long_range) {
    SMAT_RETURN_IF_ERROR(table->Wait());
    SMAT_RETURN_IF_ERROR(Upload(backend, F_comm, F, stream));
    if (!plan.geo.IncidenceIsIdentity()) SMAT_RETURN_IF_ERROR(k->Tabulate(plan, F, &U, stream));
    SMAT_RETURN_IF_ERROR(k->TypeReads(plan, span, in.phi, U, lam, cd, sv.recent_offset, in.type,
                                      &ybar, SmatWrite::kAdd, stream));
  } else {
    SMAT_RETURN_IF_ERROR(backend.Fill(U, 0.0, stream));  // the table no token reads
  }
  SMAT_ASSIGN_OR_RETURN(fwd->o, EmptyOn(backend, {b, L, H, z.dv}, in.v.dtype()));
  SMAT_ASSIGN_OR_RETURN(Tensor den, EmptyOn(backend, {b, L, H}));
  SMAT_RETURN_IF_ERROR(k->Normalize(ybar, in.eps, &fwd->o, &den, stream));

  sv.local.lam = lam;
  sv.local.chunk_decay = cd;
  sv.local.S_in = S_in;
  sv.local.U = U;
  sv.local.den = den;
  fwd->volume = SequenceParallelVolume(plan, W, b, H, r, p);
  return absl::OkStatus();
}

// --- backward ----------------------------------------------------------------------

absl::Status SequenceParallelSmatBackward(Backend& backend, Communicator& comm,
                                          const SmatPlan& op_plan,
                                          const std::vector<SmatSpan>& spans, const SmatInputs& in,
                                          const SpSmatForwardOutputs& fwd, const Tensor& d_o,
                                          SmatGradients* grads, Stream* stream) {
  const SmatPlan plan = SmatOpPlan(op_plan, in.prof.defined() || in.type.defined());
  const bool long_range = SmatHasLongRange(plan);
  const int W = comm.size(), me = comm.rank();
  SMAT_RETURN_IF_ERROR(ValidateSpans(plan, spans, W));
  const SmatSpan span = spans[me];
  SMAT_ASSIGN_OR_RETURN(SmatDims dims, CheckSmatInputs(plan, span, in));
  SMAT_RETURN_IF_ERROR(CheckShape(d_o, {dims.batch, dims.L, dims.H, dims.dv}, "d_o"));
  SMAT_ASSIGN_OR_RETURN(SmatKernels * k, backend.smat());
  const Sizes z{dims.batch, dims.L, dims.Lc, dims.H, dims.r, dims.dv, dims.p};
  const bool gated = in.logg.defined();
  const int64_t b = z.batch, L = z.L, Lc = z.Lc, H = z.H, r = z.r, p = z.p;
  const SpSmatSaved& sv = fwd.saved;
  const Tensor& lam = sv.local.lam;
  const Tensor& cd = sv.local.chunk_decay;

  SMAT_ASSIGN_OR_RETURN(Tensor gbar, EmptyOn(backend, {b, L, H, p}));
  SMAT_ASSIGN_OR_RETURN(Tensor dlam_row, EmptyOn(backend, {b, L, H}));
  // The division's Jacobian and the span's own state gradients first, and
  // their AllGather (the reverse scan over ranks) started at once: it is the
  // backward's one wait, and the type-table work below is what differs most
  // between ranks (only spans with recent tokens read U). With
  // TypeReadsBackward first, a distant-only rank idled for the recent ranks'
  // TypeReadsBackward here (9.5 ms of 247 ms on 2 H200s, T = 1M, d = 2:
  // docs/PERFORMANCE.md, "Sequence parallelism").
  SMAT_ASSIGN_OR_RETURN(Tensor S_in_bar, EmptyOn(backend, {b, Lc, H, r, p}));
  SMAT_RETURN_IF_ERROR(k->NormalizeBackwardStates(plan, span, d_o, fwd.o, sv.local.den, in.eps,
                                                  in.phi, lam, &gbar, &dlam_row, &S_in_bar,
                                                  stream));
  SMAT_ASSIGN_OR_RETURN(grads->phi, ZerosOn(backend, {b, L, H, r}, stream));
  SMAT_ASSIGN_OR_RETURN(grads->psi, ZerosOn(backend, {b, L, H, r}, stream));
  SMAT_ASSIGN_OR_RETURN(grads->v, ZerosOn(backend, {b, L, H, z.dv}, stream));
  SMAT_ASSIGN_OR_RETURN(Tensor zero_in, ZerosOn(backend, {b, 2, H, r, p}, stream));
  SMAT_ASSIGN_OR_RETURN(Tensor D_bar, EmptyOn(backend, {b, Lc, H, r, p}));
  SMAT_ASSIGN_OR_RETURN(Tensor ssg, EmptyOn(backend, {b, 2, H, r, p}));
  SMAT_RETURN_IF_ERROR(k->ChunkScanBackward(plan, span, S_in_bar, cd, zero_in, &D_bar, &ssg, stream));
  SMAT_ASSIGN_OR_RETURN(Tensor ssg_h, HostOf(backend, ssg, stream));
  SMAT_ASSIGN_OR_RETURN(Tensor pack, Tensor::Empty({z.state()}, DType::kF32));
  std::memcpy(pack.raw(), ssg_h.raw(), pack.nbytes());
  SMAT_ASSIGN_OR_RETURN(GatherJob gather, StartGather(backend, comm, pack, stream));

  // The span's part of U_bar, all-reduced while the chunk-local backward runs.
  SMAT_ASSIGN_OR_RETURN(Tensor U_bar, EmptyOn(backend, {b, H, plan.geo.B, r, p}));
  Tensor U_bar_comm;
  std::unique_ptr<CollectiveHandle> table;
  if (long_range) {
    SMAT_RETURN_IF_ERROR(k->TypeReadsBackward(plan, span, in.phi, sv.local.U, gbar, lam, cd,
                                              sv.recent_offset, in.type, &grads->phi, &U_bar,
                                              SmatWrite::kAdd, stream));
    SMAT_ASSIGN_OR_RETURN(U_bar_comm, CommBuffer(backend, comm, U_bar, stream));
    SMAT_ASSIGN_OR_RETURN(table, comm.StartAllReduce(U_bar_comm, comm.default_timeout()));
  }

  // Reverse scan over ranks: fold the later ranks' state gradients (last
  // first) into this span's incoming gradient.
  SMAT_ASSIGN_OR_RETURN(Tensor grads_all, FinishGather(backend, gather, stream));
  SMAT_ASSIGN_OR_RETURN(Tensor incoming_grad_h, Tensor::Empty({b, 2, H, r, p}, DType::kF32));
  FoldIncomingGrad(z, F32(grads_all), F32(sv.span_decays), W, me, F32(incoming_grad_h));
  SMAT_ASSIGN_OR_RETURN(Tensor incoming_grad, EmptyOn(backend, {b, 2, H, r, p}));
  SMAT_RETURN_IF_ERROR(Upload(backend, incoming_grad_h, incoming_grad, stream));
  SMAT_RETURN_IF_ERROR(
      k->ChunkScanBackward(plan, span, S_in_bar, cd, incoming_grad, &D_bar, &ssg, stream));
  SMAT_RETURN_IF_ERROR(k->ChunkOutputsBackward(plan, span, in.phi, in.psi, in.v, lam, cd,
                                               sv.local.S_in, gbar, D_bar, &grads->phi, &grads->psi,
                                               &grads->v, SmatWrite::kAdd, stream));

  if (long_range) {
    SMAT_RETURN_IF_ERROR(table->Wait());
    SMAT_RETURN_IF_ERROR(Upload(backend, U_bar_comm, U_bar, stream));
    Tensor F_bar = U_bar;  // C^T U_bar: U_bar itself where C is the identity
    if (!plan.geo.IncidenceIsIdentity()) {
      SMAT_ASSIGN_OR_RETURN(F_bar, EmptyOn(backend, {b, H, plan.geo.P, r, p}));
      SMAT_RETURN_IF_ERROR(k->TabulateBackward(plan, U_bar, &F_bar, stream));
    }
    SMAT_RETURN_IF_ERROR(
        k->ProfilePoolingBackward(plan, span, in.psi, in.v, lam, cd, sv.distant_tail_decay, in.prof,
                                  F_bar, &grads->psi, &grads->v, SmatWrite::kAdd, stream));
  }

  if (gated) {
    // dL/dlogg_s sums dL/dLambda over t >= s: this span's own suffix plus the
    // span sums of every later rank (summed last rank first).
    SMAT_ASSIGN_OR_RETURN(grads->logg, EmptyOn(backend, {b, L, H}));
    SMAT_ASSIGN_OR_RETURN(Tensor span_sum, EmptyOn(backend, {b, H}));
    Tensor no_suffix;
    SMAT_RETURN_IF_ERROR(k->LogDecayBackward(plan, span, in.psi, grads->psi, dlam_row, no_suffix,
                                             &grads->logg, &span_sum, stream));
    SMAT_ASSIGN_OR_RETURN(Tensor sum_h, HostOf(backend, span_sum, stream));
    SMAT_ASSIGN_OR_RETURN(Tensor sum_pack, Tensor::Empty({b * H}, DType::kF32));
    std::memcpy(sum_pack.raw(), sum_h.raw(), sum_pack.nbytes());
    SMAT_ASSIGN_OR_RETURN(GatherJob sums, StartGather(backend, comm, sum_pack, stream));
    SMAT_ASSIGN_OR_RETURN(Tensor sums_all, FinishGather(backend, sums, stream));
    if (me < W - 1) {
      SMAT_ASSIGN_OR_RETURN(Tensor suffix_h, Tensor::Zeros({b, H}, DType::kF32));
      for (int j = W - 1; j > me; --j) {
        for (int64_t i = 0; i < b * H; ++i) F32(suffix_h)[i] += F32(sums_all)[j * b * H + i];
      }
      SMAT_ASSIGN_OR_RETURN(Tensor suffix, EmptyOn(backend, {b, H}));
      SMAT_RETURN_IF_ERROR(Upload(backend, suffix_h, suffix, stream));
      SMAT_RETURN_IF_ERROR(k->LogDecayBackward(plan, span, in.psi, grads->psi, dlam_row, suffix,
                                               &grads->logg, &span_sum, stream));
    }
  }
  return backend.Synchronize(stream);
}

// --- host helpers --------------------------------------------------------------------

absl::StatusOr<Tensor> SliceSpan(const Tensor& full, const SmatSpan& span) {
  if (!full.device().is_cpu() || full.rank() < 2 || span.t0 < 0 || span.t1 > full.dim(1) ||
      span.t0 >= span.t1) {
    return absl::InvalidArgumentError(absl::StrCat("SliceSpan: need a host tensor [batch, T, ...] "
                                                   "and 0 <= t0 < t1 <= T; got ",
                                                   full.DebugString(), " and [", span.t0, ", ",
                                                   span.t1, ")"));
  }
  Shape shape = full.shape();
  const int64_t T = shape[1];
  const int64_t row = full.numel() / (shape[0] * T) * DTypeSize(full.dtype());  // bytes per token
  shape[1] = span.length();
  SMAT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(shape, full.dtype()));
  for (int64_t bb = 0; bb < shape[0]; ++bb) {
    std::memcpy(static_cast<char*>(out.raw()) + bb * span.length() * row,
                static_cast<const char*>(full.raw()) + (bb * T + span.t0) * row,
                span.length() * row);
  }
  return out;
}

absl::StatusOr<Tensor> GatherSpans(Communicator& comm, const std::vector<SmatSpan>& spans,
                                   const Tensor& part) {
  const int W = comm.size();
  if (static_cast<int>(spans.size()) != W || part.rank() < 2 ||
      part.dim(1) != spans[comm.rank()].length()) {
    return absl::InvalidArgumentError(absl::StrCat("GatherSpans: part ", part.DebugString(),
                                                   " does not match span ", comm.rank()));
  }
  int64_t max_len = 0;
  for (const SmatSpan& s : spans) max_len = std::max(max_len, s.length());
  const int64_t batch = part.dim(0);
  const size_t es = DTypeSize(part.dtype());
  const int64_t row = part.numel() / (batch * part.dim(1));  // elements per token
  // Pad every part to [batch, max_len, ...] so one AllGather moves them all.
  Shape padded_shape = part.shape();
  padded_shape[1] = max_len;
  SMAT_ASSIGN_OR_RETURN(Tensor padded, Tensor::Zeros(padded_shape, part.dtype()));
  for (int64_t bb = 0; bb < batch; ++bb) {
    std::memcpy(static_cast<char*>(padded.raw()) + bb * max_len * row * es,
                static_cast<const char*>(part.raw()) + bb * part.dim(1) * row * es,
                part.dim(1) * row * es);
  }
  SMAT_ASSIGN_OR_RETURN(Tensor all, Tensor::Empty({W * padded.numel()}, part.dtype()));
  SMAT_RETURN_IF_ERROR(comm.AllGather(padded, all));
  Shape full_shape = part.shape();
  full_shape[1] = spans.back().t1;
  SMAT_ASSIGN_OR_RETURN(Tensor full, Tensor::Empty(full_shape, part.dtype()));
  const int64_t T = full_shape[1];
  for (int j = 0; j < W; ++j) {
    for (int64_t bb = 0; bb < batch; ++bb) {
      std::memcpy(static_cast<char*>(full.raw()) + (bb * T + spans[j].t0) * row * es,
                  static_cast<const char*>(all.raw()) +
                      (j * padded.numel() + bb * max_len * row) * es,
                  spans[j].length() * row * es);
    }
  }
  return full;
}

}  // namespace smat
