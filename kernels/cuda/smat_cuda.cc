// CudaSmatKernels: the SmatKernels contract (kernels/smat_kernels.h) on one
// GPU. This file validates tensors (with SmatCudaArgs, smat_cuda_args.h), works
// out the span's geometry (distant / recent parts, token groups, segment
// counts, with smat_cuda_groups.h), keeps the incidence lists of Algorithm 2 on
// the device (IncidenceCache), and launches the kernels of smat_scan.cu,
// smat_grouped.cu, smat_tabulate.cu and smat_chunk.cu (and the fast tiles
// they pick), and the walk of smat_chunk_walk.cu. Scratch memory is stream-ordered
// (cudaMallocAsync / cudaFreeAsync on the call's stream), so calls on different
// streams never share a buffer.
#include "kernels/cuda/smat_cuda.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_scratch.h"
#include "kernels/cuda/smat_cuda_args.h"
#include "kernels/cuda/smat_cuda_groups.h"
#include "kernels/cuda/smat_cuda_kernels.h"

namespace smat {
namespace {

const float* F32(const Tensor& t) { return t.defined() ? static_cast<const float*>(t.raw()) : nullptr; }
float* F32(Tensor* t) { return t != nullptr ? static_cast<float*>(t->raw()) : nullptr; }

using cuda_groups::CheckGroups;
using cuda_groups::ChunkOffsets;
using cuda_groups::GroupedSum;
using cuda_groups::GroupTokens;
using cuda_groups::IncidenceCache;
using cuda_groups::IncidenceLists;
using cuda_groups::ReadSegmentsFor;
using cuda_groups::RecentGroups;
using cuda_groups::RecentTypeReadsBackward;
using cuda_groups::SegmentsFor;
using cuda_groups::ZeroTokenRows;

class CudaSmatKernels final : public SmatKernels {
 public:
  CudaSmatKernels(int device, CudaStreamResolver stream_of, CudaSideStreamMaker make_side)
      : device_(device),
        args_(device),
        stream_of_(std::move(stream_of)),
        make_side_(std::move(make_side)) {}
  ~CudaSmatKernels() override {
    if (fork_ != nullptr) cudaEventDestroy(fork_);
    if (join_ != nullptr) cudaEventDestroy(join_);
  }

  // ------------------------------------------------------------ side stream
  absl::StatusOr<Stream*> ForkSide(Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    if (!make_side_) return stream;
    std::lock_guard<std::mutex> lock(side_mu_);
    if (side_ == nullptr) {
      SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Stream> side, make_side_());
      SMAT_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
      SMAT_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
      side_ = std::move(side);
    }
    SMAT_ASSIGN_OR_RETURN(cudaStream_t side, Enter(side_.get()));
    SMAT_CUDA_RETURN_IF_ERROR(cudaEventRecord(fork_, s));
    SMAT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side, fork_, 0));
    return side_.get();
  }

  absl::Status JoinSide(Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    std::lock_guard<std::mutex> lock(side_mu_);
    SMAT_ASSIGN_OR_RETURN(cudaEvent_t done, SideDone());
    if (done != nullptr) SMAT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, done, 0));
    return absl::OkStatus();
  }

  // ---------------------------------------------------------------- forward
  absl::Status ChunkLogDecay(const SmatPlan& plan, const SmatSpan& span, const Tensor& logg,
                             Tensor* lam, Tensor* chunk_decay, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.Dims(plan, span, logg, "logg", 0, 0, false));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(logg, {d.batch, d.L, d.H}, "logg"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(lam, {d.batch, d.L, d.H}, "lam"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(chunk_decay, {d.batch, d.Lc, d.H}, "chunk_decay"));
    return CudaStatus(LaunchSmatChunkLogDecay(d, F32(logg), F32(lam), F32(chunk_decay), s),
                      "ChunkLogDecay kernel");
  }

  absl::Status ChunkSummaries(const SmatPlan& plan, const SmatSpan& span, const Tensor& psi,
                              const Tensor& v, const Tensor& lam, const Tensor& chunk_decay,
                              Tensor* D, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.FeatureDims(plan, span, psi, v));
    SMAT_RETURN_IF_ERROR(args_.CheckGates(d, lam, chunk_decay));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(D, {d.batch, d.Lc, d.H, d.r, d.p}, "D"));
    SmatTokenGroups groups;
    groups.mode = SmatGroupMode::kChunks;
    groups.num_groups = d.Lc;
    SMAT_RETURN_IF_ERROR(CheckGroups(groups.num_groups, "chunks"));
    SmatTokenWeights w{F32(lam), F32(chunk_decay), nullptr, nullptr, /*key_side=*/true};
    const SmatMatrixLayout lay{static_cast<int64_t>(d.Lc) * d.H, d.H, 1};
    return CudaStatus(LaunchSmatGroupedOuterSum(d, groups, 1, psi.raw(), v.raw(), true, w, lay,
                                                F32(D), s),
                      "ChunkSummaries kernel");
  }

  absl::Status ChunkScan(const SmatPlan& plan, const SmatSpan& span, const Tensor& D,
                         const Tensor& chunk_decay, const Tensor& incoming, Tensor* S_in,
                         Tensor* span_state, Tensor* span_decay, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.StateDims(plan, span, D, "D"));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(chunk_decay, {d.batch, d.Lc, d.H}, "chunk_decay"));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(incoming, {d.batch, 2, d.H, d.r, d.p}, "incoming"));
    if (S_in != nullptr) {
      SMAT_RETURN_IF_ERROR(args_.CheckOut(S_in, {d.batch, d.Lc, d.H, d.r, d.p}, "S_in"));
    }
    SMAT_RETURN_IF_ERROR(args_.CheckOut(span_state, {d.batch, 2, d.H, d.r, d.p}, "span_state"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(span_decay, {d.batch, 2, d.H}, "span_decay"));
    return CudaStatus(LaunchSmatChunkScan(d, F32(D), F32(chunk_decay), F32(incoming), F32(S_in),
                                          F32(span_state), F32(span_decay), s),
                      "ChunkScan kernel");
  }

  absl::Status ProfilePooling(const SmatPlan& plan, const SmatSpan& span, const Tensor& psi,
                              const Tensor& v, const Tensor& lam, const Tensor& chunk_decay,
                              const Tensor& prof, Tensor* F, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.FeatureDims(plan, span, psi, v));
    SMAT_RETURN_IF_ERROR(args_.CheckGates(d, lam, chunk_decay));
    SMAT_RETURN_IF_ERROR(args_.CheckMap(d, prof, "prof"));
    const int64_t P = plan.geo.P;
    SMAT_RETURN_IF_ERROR(args_.CheckOut(F, {d.batch, d.H, P, d.r, d.p}, "F"));
    SMAT_RETURN_IF_ERROR(CheckGroups(P, "profiles (P)"));
    CudaScratch scratch(s);
    const int64_t end = span.distant_end(plan) - span.t0;  // local distant part [0, end)
    SMAT_ASSIGN_OR_RETURN(SmatTokenGroups groups,
                          GroupTokens(d, prof, 0, end, P, span.t0 % P, &scratch, s));
    SmatTokenWeights w{F32(lam), F32(chunk_decay), nullptr, nullptr, /*key_side=*/true};
    if (lam.defined()) {
      SMAT_ASSIGN_OR_RETURN(w.off, ChunkOffsets(d, F32(chunk_decay), &scratch, s));
    }
    const SmatMatrixLayout lay{static_cast<int64_t>(d.H) * P, 1, P};
    return GroupedSum(d, groups, end, psi.raw(), v.raw(), true, w, lay, F32(F), &scratch, s,
                      "ProfilePooling", cuda_groups::kTokensPerTableSegment);
  }

  absl::Status Tabulate(const SmatPlan& plan, const Tensor& F, Tensor* U,
                        Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    const SmatGeometry& g = plan.geo;
    if (!F.defined() || F.rank() != 5 || F.dim(2) != g.P) {
      return absl::InvalidArgumentError(absl::StrCat("smat cuda: F must be [batch, H, P = ", g.P,
                                                     ", r, p]; got ", SmatCudaArgs::Describe(F)));
    }
    SMAT_RETURN_IF_ERROR(args_.CheckF32(F, F.shape(), "F"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(U, {F.dim(0), F.dim(1), g.B, F.dim(3), F.dim(4)}, "U"));
    SMAT_RETURN_IF_ERROR(CheckGroups(g.B, "types (B)"));
    return TabulateOnDevice(g, /*adjoint=*/false, F.dim(0) * F.dim(1), F.dim(3) * F.dim(4), F32(F),
                            F32(U), s);
  }

  absl::Status ChunkOutputs(const SmatPlan& plan, const SmatSpan& span, const Tensor& phi,
                            const Tensor& psi, const Tensor& v, const Tensor& lam,
                            const Tensor& S_in, Tensor* ybar, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d,
                          args_.ChunkOutputDims(plan, span, phi, psi, v, lam, S_in));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(ybar, {d.batch, d.L, d.H, d.p}, "ybar"));
    SMAT_ASSIGN_OR_RETURN(int tile, ChunkTile(d, false));
    return CudaStatus(LaunchSmatChunkOutputs(d, tile, phi.raw(), psi.raw(), v.raw(), F32(lam),
                                             F32(S_in), F32(ybar), s),
                      "ChunkOutputs kernel");
  }

  absl::Status TypeReads(const SmatPlan& plan, const SmatSpan& span, const Tensor& phi,
                         const Tensor& U, const Tensor& lam, const Tensor& chunk_decay,
                         const Tensor& recent_offset, const Tensor& type, Tensor* ybar,
                         SmatWrite write, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.TableDims(plan, span, phi, U, "U"));
    SMAT_RETURN_IF_ERROR(args_.CheckGates(d, lam, chunk_decay));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(recent_offset, {d.batch, d.H}, "recent_offset"));
    SMAT_RETURN_IF_ERROR(args_.CheckMap(d, type, "type"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(ybar, {d.batch, d.L, d.H, d.p}, "ybar"));
    const int64_t begin = span.recent_begin(plan) - span.t0;
    // n = 0: there is no distant block, so no recent token reads U (the CPU
    // phases' convention; U is then the table of an empty F anyway). Content
    // types out of range read nothing either: with =, those rows are zeroed
    // first. Positional types give every recent token one read.
    const bool reads = plan.n > 0 && begin < d.L;
    bool assign = write == SmatWrite::kAssign;
    if (assign && begin < d.L && (!reads || type.defined())) {
      SMAT_RETURN_IF_ERROR(ZeroTokenRows(d, begin, d.L, d.p, ybar, s, "TypeReads"));
      assign = false;
    }
    if (!reads) return absl::OkStatus();
    CudaScratch scratch(s);
    SmatTokenGroups groups;
    SmatTokenWeights w;
    SMAT_RETURN_IF_ERROR(RecentGroups(plan, span, d, lam, chunk_decay, recent_offset, type,
                                      &scratch, s, &groups, &w));
    if (groups.begin >= groups.end) return absl::OkStatus();
    const int64_t B = plan.geo.B;
    const SmatMatrixLayout lay{static_cast<int64_t>(d.H) * B, 1, B};
    return CudaStatus(
        LaunchSmatGroupedReads(d, groups, ReadSegmentsFor(groups, SmatReadKind::kVecMat),
                               SmatReadKind::kVecMat, F32(U), lay, phi.raw(), nullptr, nullptr, w,
                               F32(ybar), nullptr, nullptr, assign, s),
        "TypeReads kernel");
  }

  absl::Status Normalize(const Tensor& ybar, float eps, Tensor* o, Tensor* den,
                         Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    if (!ybar.defined() || ybar.rank() != 4 || ybar.dim(3) < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "smat cuda: ybar must be [batch, L, H, p >= 2]; got ", SmatCudaArgs::Describe(ybar)));
    }
    SMAT_RETURN_IF_ERROR(args_.CheckF32(ybar, ybar.shape(), "ybar"));
    SmatCudaDims d;
    d.batch = ybar.dim(0);
    d.L = ybar.dim(1);
    d.H = ybar.dim(2);
    d.p = ybar.dim(3);
    d.dv = d.p - 1;
    if (o == nullptr || !o->defined() || o->device() != Device::Cuda(device_) ||
        (o->dtype() != DType::kF32 && o->dtype() != DType::kBF16)) {
      return absl::InvalidArgumentError("smat cuda: o must be an fp32 or bf16 tensor on the GPU");
    }
    SMAT_RETURN_IF_ERROR(CheckShape(*o, {d.batch, d.L, d.H, d.dv}, "o"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(den, {d.batch, d.L, d.H}, "den"));
    return CudaStatus(LaunchSmatNormalize(d, F32(ybar), eps, o->raw(), o->dtype() == DType::kBF16,
                                          F32(den), nullptr, 0, s),
                      "Normalize kernel");
  }

  absl::Status NormalizedOutputs(const SmatPlan& plan, const SmatSpan& span, const Tensor& phi,
                                 const Tensor& psi, const Tensor& v, const Tensor& lam,
                                 const Tensor& S_in, const Tensor& reads, float eps, Tensor* o,
                                 Tensor* den, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d,
                          args_.ChunkOutputDims(plan, span, phi, psi, v, lam, S_in));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(reads, {d.batch, d.L, d.H, d.p}, "reads"));
    SMAT_RETURN_IF_ERROR(CheckNormalizedOutputs(d, phi, o, den));
    const int64_t recent_begin = span.recent_begin(plan) - span.t0;
    const bool o_bf16 = o->dtype() == DType::kBF16;
    if (o_bf16 && SmatNormalizedOutputsFused(d)) {
      return CudaStatus(
          LaunchSmatNormalizedOutputsFused(d, phi.raw(), psi.raw(), v.raw(), F32(lam), F32(S_in),
                                           F32(reads), recent_begin, eps, o->raw(), F32(den), s),
          "NormalizedOutputs kernel");
    }
    // Otherwise the chunk tile writes ybar to scratch and the division adds
    // the reads.
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* ybar,
                          scratch.Get<float>(static_cast<int64_t>(d.batch) * d.L * d.H * d.p));
    SMAT_ASSIGN_OR_RETURN(int tile, ChunkTile(d, false));
    SMAT_RETURN_IF_ERROR(CudaStatus(LaunchSmatChunkOutputs(d, tile, phi.raw(), psi.raw(), v.raw(),
                                                           F32(lam), F32(S_in), ybar, s),
                                    "NormalizedOutputs chunk kernel"));
    return CudaStatus(
        LaunchSmatNormalize(d, ybar, eps, o->raw(), o_bf16, F32(den), F32(reads), recent_begin, s),
        "NormalizedOutputs division kernel");
  }

  absl::StatusOr<bool> ChunkStatesAndOutputs(const SmatPlan& plan, const SmatSpan& span,
                                             const Tensor& phi, const Tensor& psi, const Tensor& v,
                                             const Tensor& lam, const Tensor& chunk_decay,
                                             const Tensor& incoming, const Tensor& reads, float eps,
                                             Tensor* S_in, Tensor* o, Tensor* den,
                                             Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.FeatureDims(plan, span, psi, v));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, phi, "phi", d.r));
    SMAT_RETURN_IF_ERROR(args_.CheckGates(d, lam, chunk_decay));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(incoming, {d.batch, 2, d.H, d.r, d.p}, "incoming"));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(reads, {d.batch, d.L, d.H, d.p}, "reads"));
    if (S_in != nullptr) {  // null: the states are not kept
      SMAT_RETURN_IF_ERROR(args_.CheckOut(S_in, {d.batch, d.Lc, d.H, d.r, d.p}, "S_in"));
    }
    SMAT_RETURN_IF_ERROR(CheckNormalizedOutputs(d, phi, o, den));
    // The walk carries ungated states into the bf16 outputs of the fused tile.
    if (lam.defined() || o->dtype() != DType::kBF16 || !SmatNormalizedOutputsFused(d)) {
      return false;
    }
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* work,
                          scratch.Get<float>(SmatChunkWalkScratchFloats(d, reads.defined())));
    const int64_t recent_begin = span.recent_begin(plan) - span.t0;
    // The side stream's reads are waited for after the totals and the starts.
    std::lock_guard<std::mutex> lock(side_mu_);
    SMAT_ASSIGN_OR_RETURN(cudaEvent_t side_done, SideDone());
    SMAT_RETURN_IF_ERROR(CudaStatus(
        LaunchSmatChunkWalk(d, phi.raw(), psi.raw(), v.raw(), F32(incoming), F32(reads),
                            recent_begin, eps, F32(S_in), o->raw(), F32(den), work, side_done, s),
        "ChunkStatesAndOutputs kernels"));
    return true;
  }

  // --------------------------------------------------------------- backward
  absl::Status NormalizeBackward(const Tensor& d_o, const Tensor& o, const Tensor& den, float eps,
                                 Tensor* gbar, Tensor* dlam_row, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    if (!o.defined() || o.rank() != 4) {
      return absl::InvalidArgumentError(
          absl::StrCat("smat cuda: o must be [batch, L, H, dv]; got ", SmatCudaArgs::Describe(o)));
    }
    SmatCudaDims d;
    d.batch = o.dim(0);
    d.L = o.dim(1);
    d.H = o.dim(2);
    d.dv = o.dim(3);
    d.p = d.dv + 1;
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, o, "o", d.dv));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, d_o, "d_o", d.dv));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(den, {d.batch, d.L, d.H}, "den"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(gbar, {d.batch, d.L, d.H, d.p}, "gbar"));
    if (dlam_row != nullptr) {
      SMAT_RETURN_IF_ERROR(args_.CheckOut(dlam_row, {d.batch, d.L, d.H}, "dlam_row"));
    }
    return CudaStatus(
        LaunchSmatNormalizeBackward(d, d_o.raw(), d_o.dtype() == DType::kBF16, o.raw(),
                                    o.dtype() == DType::kBF16, F32(den), eps, F32(gbar),
                                    F32(dlam_row), s),
        "NormalizeBackward kernel");
  }

  absl::Status NormalizeBackwardStates(const SmatPlan& plan, const SmatSpan& span,
                                       const Tensor& d_o, const Tensor& o, const Tensor& den,
                                       float eps, const Tensor& phi, const Tensor& lam,
                                       Tensor* gbar, Tensor* dlam_row, Tensor* S_in_bar,
                                       Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d,
                          args_.Dims(plan, span, phi, "phi", phi.rank() == 4 ? phi.dim(3) : 0,
                                     o.rank() == 4 ? o.dim(3) : 0, true));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, phi, "phi", d.r));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, o, "o", d.dv));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, d_o, "d_o", d.dv));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(den, {d.batch, d.L, d.H}, "den"));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(lam, {d.batch, d.L, d.H}, "lam"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(gbar, {d.batch, d.L, d.H, d.p}, "gbar"));
    if (dlam_row != nullptr) {
      SMAT_RETURN_IF_ERROR(args_.CheckOut(dlam_row, {d.batch, d.L, d.H}, "dlam_row"));
    }
    SMAT_RETURN_IF_ERROR(args_.CheckOut(S_in_bar, {d.batch, d.Lc, d.H, d.r, d.p}, "S_in_bar"));
    const bool do_bf16 = d_o.dtype() == DType::kBF16, o_bf16 = o.dtype() == DType::kBF16;
    if (SmatNormalizeBackwardStatesFusedFits(d, d_o.raw(), do_bf16, o.raw(), o_bf16, phi.raw(),
                                             F32(lam), F32(gbar))) {
      return CudaStatus(LaunchSmatNormalizeBackwardStatesFused(
                            d, d_o.raw(), do_bf16, o.raw(), o_bf16, F32(den), eps, phi.raw(),
                            F32(lam), F32(gbar), F32(dlam_row), F32(S_in_bar), s),
                        "NormalizeBackwardStates kernel");
    }
    SMAT_RETURN_IF_ERROR(NormalizeBackward(d_o, o, den, eps, gbar, dlam_row, stream));
    return ChunkStateGradients(plan, span, phi, *gbar, lam, S_in_bar, stream);
  }

  absl::StatusOr<bool> ChunkBackward(const SmatPlan& plan, const SmatSpan& span, const Tensor& d_o,
                                     const Tensor& o, const Tensor& den, float eps,
                                     const Tensor& phi, const Tensor& psi, const Tensor& v,
                                     const Tensor& lam, const Tensor& chunk_decay,
                                     const Tensor& S_in, Tensor* gbar, Tensor* dlam_row,
                                     Tensor* phi_bar, Tensor* psi_bar, Tensor* v_bar,
                                     const SmatLongRangeBackward& long_range,
                                     Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.FeatureDims(plan, span, psi, v));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, phi, "phi", d.r));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, o, "o", d.dv));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, d_o, "d_o", d.dv));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(den, {d.batch, d.L, d.H}, "den"));
    SMAT_RETURN_IF_ERROR(args_.CheckGates(d, lam, chunk_decay));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(S_in, {d.batch, d.Lc, d.H, d.r, d.p}, "S_in"));
    // gbar in full, or its column dv alone ([batch, L, H]) where B7 takes the
    // other columns from a bf16 d_o and den.
    const bool column_only = gbar != nullptr && gbar->rank() == 3;
    SMAT_RETURN_IF_ERROR(args_.CheckOut(
        gbar, column_only ? Shape{d.batch, d.L, d.H} : Shape{d.batch, d.L, d.H, d.p}, "gbar"));
    if (dlam_row != nullptr) {
      SMAT_RETURN_IF_ERROR(args_.CheckOut(dlam_row, {d.batch, d.L, d.H}, "dlam_row"));
    }
    SMAT_RETURN_IF_ERROR(args_.CheckOut(phi_bar, {d.batch, d.L, d.H, d.r}, "phi_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(psi_bar, {d.batch, d.L, d.H, d.r}, "psi_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(v_bar, {d.batch, d.L, d.H, d.dv}, "v_bar"));
    const bool do_bf16 = d_o.dtype() == DType::kBF16, o_bf16 = o.dtype() == DType::kBF16;
    if (column_only && !do_bf16) return false;
    if (!SmatChunkBackwardFits(d, d_o.raw(), do_bf16, o.raw(), o_bf16, phi.raw(), F32(lam),
                               F32(gbar))) {
      return false;
    }
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* work, scratch.Get<float>(SmatChunkBackwardScratchFloats(d)));
    SMAT_RETURN_IF_ERROR(
        CudaStatus(LaunchSmatChunkBackwardStates(d, d_o.raw(), do_bf16, o.raw(), o_bf16, F32(den),
                                                 eps, phi.raw(), F32(lam), F32(chunk_decay),
                                                 F32(gbar), F32(dlam_row), work, s, column_only),
                   "ChunkBackward kernels"));
    // The long-range branch before B7 where B7 can add to its rows (on
    // warpgroup MMAs): then those rows are read back once, by B7, beside its
    // products, instead of by the branch's own adds (see
    // SmatLongRangeFirst). By default only where the incidence is the
    // identity (d = 2): at d = 3 the per-type reads' adjoint gains nothing
    // from writing, and B7's adds cost more than the pooling's adjoint saves
    // (docs/PERFORMANCE.md, forty-second pass).
    const bool first =
        long_range && do_bf16 && SmatLongRangeFirst(plan.geo.IncidenceIsIdentity()) &&
        SmatChunkBackwardTilesAdd(d, phi.raw(), psi.raw(), v.raw(), F32(lam), d_o.raw(), F32(S_in),
                                  F32(phi_bar), F32(psi_bar), F32(v_bar));
    SmatChunkBackwardAdds adds;
    if (first) {
      SMAT_RETURN_IF_ERROR(long_range(SmatWrite::kAssign));
      const int64_t split = span.distant_end(plan) - span.t0;  // = recent_begin - t0
      adds.query_from = split;
      adds.key_before = split;
    }
    SMAT_RETURN_IF_ERROR(CudaStatus(
        LaunchSmatChunkBackwardTiles(d, d_o.raw(), do_bf16, F32(den), phi.raw(), psi.raw(), v.raw(),
                                     F32(lam), F32(chunk_decay), F32(S_in), F32(gbar), F32(phi_bar),
                                     F32(psi_bar), F32(v_bar), work, s, column_only,
                                     first ? &adds : nullptr),
        "ChunkBackward kernels"));
    if (long_range && !first) SMAT_RETURN_IF_ERROR(long_range(SmatWrite::kAdd));
    return true;
  }

  absl::StatusOr<bool> TypeReadsBackwardFromFactors(
      const SmatPlan& plan, const SmatSpan& span, const Tensor& phi, const Tensor& U,
      const Tensor& d_o, const Tensor& den, const Tensor& gden, const Tensor& lam,
      const Tensor& chunk_decay, const Tensor& recent_offset, const Tensor& type, Tensor* phi_bar,
      Tensor* U_bar, SmatWrite write, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.TableDims(plan, span, phi, U, "U"));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, d_o, "d_o", d.dv));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(den, {d.batch, d.L, d.H}, "den"));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(gden, {d.batch, d.L, d.H}, "gden"));
    SMAT_RETURN_IF_ERROR(args_.CheckGates(d, lam, chunk_decay));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(recent_offset, {d.batch, d.H}, "recent_offset"));
    SMAT_RETURN_IF_ERROR(args_.CheckMap(d, type, "type"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(phi_bar, {d.batch, d.L, d.H, d.r}, "phi_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(U_bar, {d.batch, d.H, plan.geo.B, d.r, d.p}, "U_bar"));
    if (d_o.dtype() != DType::kBF16 || !SmatTypeReadsBackwardFactorsFit(d, phi.raw(), d_o.raw())) {
      return false;
    }
    SmatGbarFactors gf;
    gf.d_o = d_o.raw();
    gf.den = F32(den);
    gf.gden = F32(gden);
    SMAT_RETURN_IF_ERROR(RecentTypeReadsBackward(plan, span, d, phi, U, nullptr, &gf, lam,
                                                 chunk_decay, recent_offset, type, phi_bar, U_bar,
                                                 write, s));
    return true;
  }

  absl::Status TypeReadsBackward(const SmatPlan& plan, const SmatSpan& span, const Tensor& phi,
                                 const Tensor& U, const Tensor& gbar, const Tensor& lam,
                                 const Tensor& chunk_decay, const Tensor& recent_offset,
                                 const Tensor& type, Tensor* phi_bar, Tensor* U_bar,
                                 SmatWrite write, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.TableDims(plan, span, phi, U, "U"));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(gbar, {d.batch, d.L, d.H, d.p}, "gbar"));
    SMAT_RETURN_IF_ERROR(args_.CheckGates(d, lam, chunk_decay));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(recent_offset, {d.batch, d.H}, "recent_offset"));
    SMAT_RETURN_IF_ERROR(args_.CheckMap(d, type, "type"));
    const int64_t B = plan.geo.B;
    SMAT_RETURN_IF_ERROR(args_.CheckOut(phi_bar, {d.batch, d.L, d.H, d.r}, "phi_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(U_bar, {d.batch, d.H, B, d.r, d.p}, "U_bar"));
    return RecentTypeReadsBackward(plan, span, d, phi, U, F32(gbar), nullptr, lam, chunk_decay,
                                   recent_offset, type, phi_bar, U_bar, write, s);
  }

  absl::Status TabulateBackward(const SmatPlan& plan, const Tensor& U_bar, Tensor* F_bar,
                                Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    const SmatGeometry& g = plan.geo;
    if (!U_bar.defined() || U_bar.rank() != 5 || U_bar.dim(2) != g.B) {
      return absl::InvalidArgumentError(
          absl::StrCat("smat cuda: U_bar must be [batch, H, B = ", g.B, ", r, p]; got ",
                       SmatCudaArgs::Describe(U_bar)));
    }
    SMAT_RETURN_IF_ERROR(args_.CheckF32(U_bar, U_bar.shape(), "U_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(
        F_bar, {U_bar.dim(0), U_bar.dim(1), g.P, U_bar.dim(3), U_bar.dim(4)}, "F_bar"));
    SMAT_RETURN_IF_ERROR(CheckGroups(g.P, "profiles (P)"));
    return TabulateOnDevice(g, /*adjoint=*/true, U_bar.dim(0) * U_bar.dim(1),
                            U_bar.dim(3) * U_bar.dim(4), F32(U_bar), F32(F_bar), s);
  }

  absl::Status ProfilePoolingBackward(const SmatPlan& plan, const SmatSpan& span, const Tensor& psi,
                                      const Tensor& v, const Tensor& lam, const Tensor& chunk_decay,
                                      const Tensor& distant_tail_decay, const Tensor& prof,
                                      const Tensor& F_bar, Tensor* psi_bar, Tensor* v_bar,
                                      SmatWrite write, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.FeatureDims(plan, span, psi, v));
    SMAT_RETURN_IF_ERROR(args_.CheckGates(d, lam, chunk_decay));
    SMAT_RETURN_IF_ERROR(
        args_.CheckOptionalF32(distant_tail_decay, {d.batch, d.H}, "distant_tail_decay"));
    SMAT_RETURN_IF_ERROR(args_.CheckMap(d, prof, "prof"));
    const int64_t P = plan.geo.P;
    SMAT_RETURN_IF_ERROR(args_.CheckF32(F_bar, {d.batch, d.H, P, d.r, d.p}, "F_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(psi_bar, {d.batch, d.L, d.H, d.r}, "psi_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(v_bar, {d.batch, d.L, d.H, d.dv}, "v_bar"));
    const int64_t end = span.distant_end(plan) - span.t0;
    if (end <= 0) return absl::OkStatus();
    SMAT_RETURN_IF_ERROR(CheckGroups(P, "profiles (P)"));
    // Content profiles out of range pool into nothing: with =, the rows are
    // zeroed first. Positional profiles give every distant token one.
    bool assign = write == SmatWrite::kAssign;
    if (assign && prof.defined()) {
      SMAT_RETURN_IF_ERROR(
          ZeroTokenRows(d, 0, end, d.r, psi_bar, s, "ProfilePoolingBackward psi_bar"));
      SMAT_RETURN_IF_ERROR(
          ZeroTokenRows(d, 0, end, d.dv, v_bar, s, "ProfilePoolingBackward v_bar"));
      assign = false;
    }
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(SmatTokenGroups groups,
                          GroupTokens(d, prof, 0, end, P, span.t0 % P, &scratch, s));
    SmatTokenWeights w{F32(lam), F32(chunk_decay), nullptr, F32(distant_tail_decay), true};
    if (lam.defined()) {
      SMAT_ASSIGN_OR_RETURN(w.off, ChunkOffsets(d, F32(chunk_decay), &scratch, s));
    }
    const SmatMatrixLayout lay{static_cast<int64_t>(d.H) * P, 1, P};
    return CudaStatus(
        LaunchSmatGroupedReads(d, groups, ReadSegmentsFor(groups, SmatReadKind::kBoth),
                               SmatReadKind::kBoth, F32(F_bar), lay, psi.raw(), v.raw(), nullptr, w,
                               nullptr, F32(psi_bar), F32(v_bar), assign, s),
        "ProfilePoolingBackward kernel");
  }

  absl::Status ChunkStateGradients(const SmatPlan& plan, const SmatSpan& span, const Tensor& phi,
                                   const Tensor& gbar, const Tensor& lam, Tensor* S_in_bar,
                                   Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d,
                          args_.Dims(plan, span, phi, "phi", phi.rank() == 4 ? phi.dim(3) : 0,
                                     gbar.rank() == 4 ? gbar.dim(3) - 1 : 0, true));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, phi, "phi", d.r));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(gbar, {d.batch, d.L, d.H, d.p}, "gbar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(lam, {d.batch, d.L, d.H}, "lam"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(S_in_bar, {d.batch, d.Lc, d.H, d.r, d.p}, "S_in_bar"));
    SmatTokenGroups groups;
    groups.mode = SmatGroupMode::kChunks;
    groups.num_groups = d.Lc;
    SMAT_RETURN_IF_ERROR(CheckGroups(groups.num_groups, "chunks"));
    SmatTokenWeights w{F32(lam), nullptr, nullptr, nullptr, /*key_side=*/false};
    const SmatMatrixLayout lay{static_cast<int64_t>(d.Lc) * d.H, d.H, 1};
    return CudaStatus(LaunchSmatGroupedOuterSum(d, groups, 1, phi.raw(), gbar.raw(), false, w,
                                                lay, F32(S_in_bar), s),
                      "ChunkStateGradients kernel");
  }

  absl::Status ChunkScanBackward(const SmatPlan& plan, const SmatSpan& span,
                                 const Tensor& S_in_bar, const Tensor& chunk_decay,
                                 const Tensor& incoming_grad, Tensor* D_bar,
                                 Tensor* span_state_grad, Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.StateDims(plan, span, S_in_bar, "S_in_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(chunk_decay, {d.batch, d.Lc, d.H}, "chunk_decay"));
    SMAT_RETURN_IF_ERROR(
        args_.CheckOptionalF32(incoming_grad, {d.batch, 2, d.H, d.r, d.p}, "incoming_grad"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(D_bar, {d.batch, d.Lc, d.H, d.r, d.p}, "D_bar"));
    SMAT_RETURN_IF_ERROR(
        args_.CheckOut(span_state_grad, {d.batch, 2, d.H, d.r, d.p}, "span_state_grad"));
    return CudaStatus(LaunchSmatChunkScanBackward(d, F32(S_in_bar), F32(chunk_decay),
                                                  F32(incoming_grad), F32(D_bar),
                                                  F32(span_state_grad), s),
                      "ChunkScanBackward kernel");
  }

  absl::Status ChunkOutputsBackward(const SmatPlan& plan, const SmatSpan& span, const Tensor& phi,
                                    const Tensor& psi, const Tensor& v, const Tensor& lam,
                                    const Tensor& chunk_decay, const Tensor& S_in,
                                    const Tensor& gbar, const Tensor& D_bar, Tensor* phi_bar,
                                    Tensor* psi_bar, Tensor* v_bar, SmatWrite write,
                                    Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.FeatureDims(plan, span, psi, v));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, phi, "phi", d.r));
    SMAT_RETURN_IF_ERROR(args_.CheckGates(d, lam, chunk_decay));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(S_in, {d.batch, d.Lc, d.H, d.r, d.p}, "S_in"));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(gbar, {d.batch, d.L, d.H, d.p}, "gbar"));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(D_bar, {d.batch, d.Lc, d.H, d.r, d.p}, "D_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(phi_bar, {d.batch, d.L, d.H, d.r}, "phi_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(psi_bar, {d.batch, d.L, d.H, d.r}, "psi_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(v_bar, {d.batch, d.L, d.H, d.dv}, "v_bar"));
    SMAT_ASSIGN_OR_RETURN(int qtile, ChunkTile(d, false));
    SMAT_ASSIGN_OR_RETURN(int ktile, ChunkTile(d, true));
    return CudaStatus(LaunchSmatChunkOutputsBackward(
                          d, qtile, ktile, phi.raw(), psi.raw(), v.raw(), F32(lam),
                          F32(chunk_decay), F32(S_in), F32(gbar), F32(D_bar), F32(phi_bar),
                          F32(psi_bar), F32(v_bar), write == SmatWrite::kAssign, s),
                      "ChunkOutputsBackward kernel");
  }

  absl::Status LogDecayBackward(const SmatPlan& plan, const SmatSpan& span, const Tensor& psi,
                                const Tensor& psi_bar, const Tensor& dlam_row,
                                const Tensor& suffix_in, Tensor* logg_bar, Tensor* span_sum,
                                Stream* stream) override {
    SMAT_ASSIGN_OR_RETURN(cudaStream_t s, Enter(stream));
    SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args_.Dims(plan, span, psi, "psi",
                                                     psi.rank() == 4 ? psi.dim(3) : 0, 0, true));
    SMAT_RETURN_IF_ERROR(args_.CheckFeatures(d, psi, "psi", d.r));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(psi_bar, {d.batch, d.L, d.H, d.r}, "psi_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckF32(dlam_row, {d.batch, d.L, d.H}, "dlam_row"));
    SMAT_RETURN_IF_ERROR(args_.CheckOptionalF32(suffix_in, {d.batch, d.H}, "suffix_in"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(logg_bar, {d.batch, d.L, d.H}, "logg_bar"));
    SMAT_RETURN_IF_ERROR(args_.CheckOut(span_sum, {d.batch, d.H}, "span_sum"));
    CudaScratch scratch(s);
    SMAT_ASSIGN_OR_RETURN(float* dlam, scratch.Get<float>(SmatLogDecayBackwardScratch(d)));
    return CudaStatus(LaunchSmatLogDecayBackward(d, psi.raw(), F32(psi_bar), F32(dlam_row),
                                                 F32(suffix_in), dlam, F32(logg_bar),
                                                 F32(span_sum), s),
                      "LogDecayBackward kernels");
  }

 private:
  // An event, recorded now, that completes when all the work issued to the
  // side stream so far has; nullptr before the first ForkSide. The caller
  // holds side_mu_ until its stream has been told to wait for it. Every join
  // waits for everything issued to the side stream before it, whichever
  // caller issued it, so callers on several threads stay ordered.
  absl::StatusOr<cudaEvent_t> SideDone() {
    if (side_ == nullptr) return nullptr;
    SMAT_ASSIGN_OR_RETURN(cudaStream_t side, Enter(side_.get()));
    SMAT_CUDA_RETURN_IF_ERROR(cudaEventRecord(join_, side));
    return join_;
  }

  // Selects the device and resolves the stream.
  absl::StatusOr<cudaStream_t> Enter(Stream* stream) {
    SMAT_RETURN_IF_ERROR(UseDevice(device_));
    return stream_of_(stream);
  }

  // o ([batch, L, H, dv] on this GPU, phi's dtype or fp32) and den.
  absl::Status CheckNormalizedOutputs(const SmatCudaDims& d, const Tensor& phi, Tensor* o,
                                      Tensor* den) const {
    if (o == nullptr || !o->defined() || o->device() != Device::Cuda(device_) ||
        (o->dtype() != DType::kF32 && o->dtype() != phi.dtype())) {
      return absl::InvalidArgumentError(
          "smat cuda: o must be a tensor on the GPU of phi's dtype or fp32");
    }
    SMAT_RETURN_IF_ERROR(CheckShape(*o, {d.batch, d.L, d.H, d.dv}, "o"));
    return args_.CheckOut(den, {d.batch, d.L, d.H}, "den");
  }

  absl::StatusOr<int> ChunkTile(const SmatCudaDims& d, bool keys) const {
    int limit = 0;
    SMAT_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
    const int tile = SmatChunkTileRows(d, limit, keys);
    if (tile == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "smat cuda: chunk ", d.chunk, " with r = ", d.r, ", dv = ", d.dv,
          " needs more shared memory per block than the device's ", limit,
          " bytes; use a smaller chunk (e.g. 64)"));
    }
    return tile;
  }

  // Algorithm 2 (U = C F) or its adjoint (F_bar = C^T U_bar) for bh rows of W
  // floats: from the plane's geometry for d = 3 where its tile fits, else
  // from the incidence lists.
  absl::Status TabulateOnDevice(const SmatGeometry& g, bool adjoint, int64_t bh, int64_t W,
                                const float* in, float* out, cudaStream_t s) {
    SMAT_ASSIGN_OR_RETURN(const IncidenceLists* lists, incidence_.Get(g));
    const char* what = adjoint ? "TabulateBackward kernel" : "Tabulate kernel";
    if (g.D == 2 && SmatTabulatePlaneFits(g.q)) {
      return CudaStatus(LaunchSmatTabulatePlane(bh, W, g.q, lists->flat_to_type, lists->inverses,
                                                adjoint, in, out, s),
                        what);
    }
    return CudaStatus(adjoint ? LaunchSmatTabulate(bh, W, g.B, g.P, lists->point_offsets,
                                                   lists->point_types, lists->entries, in, out, s)
                              : LaunchSmatTabulate(bh, W, g.P, g.B, lists->type_offsets,
                                                   lists->type_points, lists->entries, in, out, s),
                      what);
  }

  const int device_;
  const SmatCudaArgs args_;
  CudaStreamResolver stream_of_;
  IncidenceCache incidence_;
  // ForkSide's stream (made on first use) and the events that order it
  // against the callers' streams, guarded by side_mu_.
  CudaSideStreamMaker make_side_;
  std::mutex side_mu_;
  std::unique_ptr<Stream> side_;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
};

}  // namespace

std::unique_ptr<SmatKernels> MakeCudaSmatKernels(int device, CudaStreamResolver stream_of,
                                                 CudaSideStreamMaker make_side) {
  return std::make_unique<CudaSmatKernels>(device, std::move(stream_of), std::move(make_side));
}

}  // namespace smat
