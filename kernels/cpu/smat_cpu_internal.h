// Internals of the CPU SMat phases (kernels/cpu/smat_cpu.h), shared by
// smat_cpu.cc (validation, grouping, scalar phases), smat_cpu_chunks.cc (chunk
// summaries, scan and tiles) and smat_cpu_tables.cc (profile pooling, per-type
// reads and their adjoints). Not part of any public interface.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/smat_kernels.h"

namespace smat {
namespace smat_cpu {

// Sizes of one phase call on a span, and flat-index helpers for the layouts
// of kernels/smat_kernels.h.
struct SpanDims {
  int64_t batch = 0, L = 0, Lc = 0, H = 0;
  int64_t r = 0, dv = 0, p = 0;
  int64_t c = 0;     // chunk width
  int64_t t0 = 0;    // global position of local token 0
  int64_t n = 0;     // global boundary
  int64_t jd = 0;    // local chunks [0, jd) are distant, [jd, Lc) recent
  int64_t id = 0;    // local tokens [0, id) are distant, [id, L) recent

  // Row of token i of (b, h) in [batch, L, H, *]; of chunk j in [batch, Lc, H, *].
  int64_t Tok(int64_t b, int64_t i, int64_t h) const { return (b * L + i) * H + h; }
  int64_t Chk(int64_t b, int64_t j, int64_t h) const { return (b * Lc + j) * H + h; }
  // Row of block blk of (b, h) in [batch, 2, H, *]; of (b, h) in [batch, H, *].
  int64_t Blk(int64_t b, int blk, int64_t h) const { return (b * 2 + blk) * H + h; }
  int64_t BH(int64_t b, int64_t h) const { return b * H + h; }
  int64_t ChunkBegin(int64_t j) const { return j * c; }
  int64_t ChunkEnd(int64_t j) const { return std::min((j + 1) * c, L); }
  int64_t ChunkOf(int64_t i) const { return i / c; }
};

// Span sizes from the plan (batch, H and feature sizes left 0 for the caller).
absl::StatusOr<SpanDims> MakeSpanDims(const SmatPlan& plan, const SmatSpan& span);
// Same, plus batch and H from the leading dims [batch, L, H] of `tokens`.
absl::StatusOr<SpanDims> MakeSpanDims(const SmatPlan& plan, const SmatSpan& span,
                                      const Tensor& tokens, const char* name);

// InvalidArgument unless t is a defined fp32 host tensor of exactly `shape`.
absl::Status CheckF32(const Tensor& t, const Shape& shape, const char* name);
// Same, but an undefined tensor is accepted (an optional input).
absl::Status CheckOptionalF32(const Tensor& t, const Shape& shape, const char* name);
absl::Status CheckOutF32(const Tensor* t, const Shape& shape, const char* name);
absl::Status CheckOptionalI32(const Tensor& t, const Shape& shape, const char* name);

// The gates of one (b, h) on the span, all in log space: lam (chunk-local
// inclusive prefix) and chunk decays; zeros when ungated.
struct HeadGates {
  std::vector<double> lam;  // [L]
  std::vector<double> cd;   // [Lc]
  bool gated = false;
};
void LoadHeadGates(const SpanDims& s, const Tensor& lam, const Tensor& chunk_decay, int64_t b,
                   int64_t h, HeadGates* g);

// Tokens of one (b, h) grouped by profile (distant part) or type (recent
// part): group x holds local token indices idx[off[x] .. off[x+1]) in
// increasing position. Positional maps give arithmetic progressions; content
// maps are grouped by a stable counting sort. InvalidArgument for an id out
// of range.
struct TokenGroups {
  std::vector<int64_t> off;  // [num_groups + 1]
  std::vector<int64_t> idx;
};
absl::Status GroupByProfile(const SmatPlan& plan, const SpanDims& s, const Tensor& prof,
                            int64_t b, int64_t h, TokenGroups* groups);
absl::Status GroupByType(const SmatPlan& plan, const SpanDims& s, const Tensor& type,
                         int64_t b, int64_t h, TokenGroups* groups);

// Log-decays used by the tables, for one (b, h), from HeadGates:
//  * DistantTailLog(i): sum of logg over (i, id) (local distant token i to
//    the end of the span's distant part), summed chunk by chunk.
//  * RecentHeadLog(i): sum of logg over [id, i] (span's recent start to i).
std::vector<double> DistantTailLog(const SpanDims& s, const HeadGates& g);
std::vector<double> RecentHeadLog(const SpanDims& s, const HeadGates& g);

// Reads a [batch, H] scalar (0 when the tensor is undefined).
double HeadScalar(const Tensor& t, const SpanDims& s, int64_t b, int64_t h);

// Row-major C[M x N] = alpha op(A) op(B) + beta C with leading dimensions.
void Sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

class CpuSmatKernels final : public SmatKernels {
 public:
  absl::Status ChunkLogDecay(const SmatPlan& plan, const SmatSpan& span, const Tensor& logg,
                             Tensor* lam, Tensor* chunk_decay, Stream* stream) override;
  absl::Status ChunkSummaries(const SmatPlan& plan, const SmatSpan& span, const Tensor& psi,
                              const Tensor& v, const Tensor& lam, const Tensor& chunk_decay,
                              Tensor* D, Stream* stream) override;
  absl::Status ChunkScan(const SmatPlan& plan, const SmatSpan& span, const Tensor& D,
                         const Tensor& chunk_decay, const Tensor& incoming, Tensor* S_in,
                         Tensor* span_state, Tensor* span_decay, Stream* stream) override;
  absl::Status ProfilePooling(const SmatPlan& plan, const SmatSpan& span, const Tensor& psi,
                              const Tensor& v, const Tensor& lam, const Tensor& chunk_decay,
                              const Tensor& prof, Tensor* F, Stream* stream) override;
  absl::Status Tabulate(const SmatPlan& plan, const Tensor& F, Tensor* U,
                        Stream* stream) override;
  absl::Status ChunkOutputs(const SmatPlan& plan, const SmatSpan& span, const Tensor& phi,
                            const Tensor& psi, const Tensor& v, const Tensor& lam,
                            const Tensor& S_in, Tensor* ybar, Stream* stream) override;
  absl::Status TypeReads(const SmatPlan& plan, const SmatSpan& span, const Tensor& phi,
                         const Tensor& U, const Tensor& lam, const Tensor& chunk_decay,
                         const Tensor& recent_offset, const Tensor& type, Tensor* ybar,
                         SmatWrite write, Stream* stream) override;
  absl::Status Normalize(const Tensor& ybar, float eps, Tensor* o, Tensor* den,
                         Stream* stream) override;
  absl::Status NormalizedOutputs(const SmatPlan& plan, const SmatSpan& span, const Tensor& phi,
                                 const Tensor& psi, const Tensor& v, const Tensor& lam,
                                 const Tensor& S_in, const Tensor& reads, float eps, Tensor* o,
                                 Tensor* den, Stream* stream) override;

  absl::Status NormalizeBackward(const Tensor& d_o, const Tensor& o, const Tensor& den,
                                 float eps, Tensor* gbar, Tensor* dlam_row,
                                 Stream* stream) override;
  absl::Status NormalizeBackwardStates(const SmatPlan& plan, const SmatSpan& span,
                                       const Tensor& d_o, const Tensor& o, const Tensor& den,
                                       float eps, const Tensor& phi, const Tensor& lam,
                                       Tensor* gbar, Tensor* dlam_row, Tensor* S_in_bar,
                                       Stream* stream) override;
  absl::Status TypeReadsBackward(const SmatPlan& plan, const SmatSpan& span, const Tensor& phi,
                                 const Tensor& U, const Tensor& gbar, const Tensor& lam,
                                 const Tensor& chunk_decay, const Tensor& recent_offset,
                                 const Tensor& type, Tensor* phi_bar, Tensor* U_bar,
                                 SmatWrite write, Stream* stream) override;
  absl::Status TabulateBackward(const SmatPlan& plan, const Tensor& U_bar, Tensor* F_bar,
                                Stream* stream) override;
  absl::Status ProfilePoolingBackward(const SmatPlan& plan, const SmatSpan& span, const Tensor& psi,
                                      const Tensor& v, const Tensor& lam, const Tensor& chunk_decay,
                                      const Tensor& distant_tail_decay, const Tensor& prof,
                                      const Tensor& F_bar, Tensor* psi_bar, Tensor* v_bar,
                                      SmatWrite write, Stream* stream) override;
  absl::Status ChunkStateGradients(const SmatPlan& plan, const SmatSpan& span,
                                   const Tensor& phi, const Tensor& gbar, const Tensor& lam,
                                   Tensor* S_in_bar, Stream* stream) override;
  absl::Status ChunkScanBackward(const SmatPlan& plan, const SmatSpan& span,
                                 const Tensor& S_in_bar, const Tensor& chunk_decay,
                                 const Tensor& incoming_grad, Tensor* D_bar,
                                 Tensor* span_state_grad, Stream* stream) override;
  absl::Status ChunkOutputsBackward(const SmatPlan& plan, const SmatSpan& span, const Tensor& phi,
                                    const Tensor& psi, const Tensor& v, const Tensor& lam,
                                    const Tensor& chunk_decay, const Tensor& S_in,
                                    const Tensor& gbar, const Tensor& D_bar, Tensor* phi_bar,
                                    Tensor* psi_bar, Tensor* v_bar, SmatWrite write,
                                    Stream* stream) override;
  absl::Status LogDecayBackward(const SmatPlan& plan, const SmatSpan& span, const Tensor& psi,
                                const Tensor& psi_bar, const Tensor& dlam_row,
                                const Tensor& suffix_in, Tensor* logg_bar, Tensor* span_sum,
                                Stream* stream) override;
};

}  // namespace smat_cpu
}  // namespace smat
