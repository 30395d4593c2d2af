// Span geometry of the CUDA SMat phases (smat_cuda.cc): how many segments a
// group's tokens are cut into, the token groups of a part of the span
// (content lists or a positional progression), the chunk offsets of the
// gates, and the incidence lists of Algorithm 2 on the device, built once per
// geometry and kept (IncidenceCache), and the grouped reductions built on
// them (GroupedSum, RecentTypeReadsBackward). Scratch memory: cuda_scratch.h.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_scratch.h"
#include "kernels/cuda/smat_cuda_kernels.h"
#include "kernels/smat_kernels.h"

namespace smat {
namespace cuda_groups {

// A group's token list is cut into segments of about this many tokens, so
// that a profile or type holding many tokens (d = 1: every distant token) is
// reduced by many blocks; the partial sums are then added in segment order.
constexpr int64_t kTokensPerSegment = 256;
// The per-token reads have nothing to add up across segments. Those with an
// r-wide output (kMatVec, kBoth) take longer ones, so that a block stages its
// group's matrix for more tokens; TypeReads (p-wide rows) keeps the short
// ones. H200, bf16, T = 524288, d = 2, 8 heads, 1024 against 256 tokens:
// TypeReadsBackward 1.62 -> 1.58 ms, TypeReads (=) 0.69 -> 0.78 ms.
constexpr int64_t kTokensPerReadSegment = 1024;
// The outer sums into the tables (ProfilePooling's F, TypeReadsBackward's
// U_bar on its fused path) take long segments too: at d = 2 a profile or type
// holds about sqrt(n) tokens (503 here), which one block now sums whole
// instead of two blocks writing partial matrices for a second pass to add.
// H200, bf16, T = 524288, d = 2, 8 heads, 1024 against 256 tokens:
// ProfilePooling 0.31 -> 0.18-0.20 ms, TypeReadsBackward 1.25 -> 1.08 ms
// (512: 0.19 / 1.08 ms).
constexpr int64_t kTokensPerTableSegment = 1024;
constexpr int64_t kMaxSegments = 4096;
constexpr int64_t kMaxGridY = 65535;

// Incidence lists of one geometry in CSR form (Algorithm 2 and its adjoint).
struct IncidenceLists {
  int32_t* type_offsets = nullptr;   // [B + 1]
  int32_t* type_points = nullptr;    // points of each type, increasing
  int32_t* point_offsets = nullptr;  // [P + 1]
  int32_t* point_types = nullptr;    // types through each point, by direction
  int64_t entries = 0;               // incidences: the length of either item list
  // For the tabulation from the geometry (d = 3, LaunchSmatTabulatePlane;
  // null for other d):
  int32_t* flat_to_type = nullptr;  // [B], SmatGeometry::flat_to_type
  int32_t* inverses = nullptr;      // [q]: 1 / m mod q (inverses[0] = 0)
};

// The incidence lists of every geometry asked for, on the device (cudaMalloc,
// synchronous upload), kept until the cache is destroyed. Thread-safe.
class IncidenceCache {
 public:
  IncidenceCache() = default;
  IncidenceCache(const IncidenceCache&) = delete;
  IncidenceCache& operator=(const IncidenceCache&) = delete;
  ~IncidenceCache();

  // The incidence lists of geometry g on the device, built once per (d, q).
  absl::StatusOr<const IncidenceLists*> Get(const SmatGeometry& g);

 private:
  std::mutex mu_;  // guards lists_
  std::map<std::pair<int, int64_t>, IncidenceLists> lists_;
};

// InvalidArgument when `groups` (what: e.g. "types (B)") exceed the kMaxGridY
// groups one launch handles.
absl::Status CheckGroups(int64_t groups, const char* what);

// Segments per group for a part of `len` tokens split into `groups` groups.
int SegmentsFor(int64_t len, int64_t groups, int64_t tokens = kTokensPerSegment);
int SegmentsFor(const SmatTokenGroups& g);
// The same for the per-token reads of `kind`: segments of kTokensPerSegment
// tokens for kVecMat, else of kTokensPerReadSegment.
int ReadSegmentsFor(const SmatTokenGroups& g, SmatReadKind kind);

// Groups of the local tokens [begin, end): content lists when `map` is
// defined, else the positional progression with period G and `phase`.
absl::StatusOr<SmatTokenGroups> GroupTokens(const SmatCudaDims& d, const Tensor& map, int64_t begin,
                                            int64_t end, int64_t G, int64_t phase,
                                            CudaScratch* scratch, cudaStream_t s);

// The recent part of the span grouped by type (positional when `type` is
// undefined: token t has type (t - n) mod B), with the read gates
// exp(recent_offset + (sum of logg over [recent_begin, t])).
absl::Status RecentGroups(const SmatPlan& plan, const SmatSpan& span, const SmatCudaDims& d,
                          const Tensor& lam, const Tensor& chunk_decay, const Tensor& recent_offset,
                          const Tensor& type, CudaScratch* scratch, cudaStream_t s,
                          SmatTokenGroups* groups, SmatTokenWeights* w);

// The gates' chunk offsets off [batch, Lc, H] (SmatTokenWeights::off, from
// LaunchSmatChunkOffsets) in scratch memory.
absl::StatusOr<const float*> ChunkOffsets(const SmatCudaDims& d, const float* chunk_decay,
                                          CudaScratch* scratch, cudaStream_t s);

// Segmented grouped reduction of `len` tokens into `out` (layout `lay`):
// LaunchSmatGroupedOuterSum over segments of about `tokens` tokens, the
// partial matrices (scratch) then added in segment order
// (LaunchSmatReduceSegments). Every group's matrix is written, zeros for
// empty groups. `what` names the phase in errors.
absl::Status GroupedSum(const SmatCudaDims& d, const SmatTokenGroups& groups, int64_t len,
                        const void* a, const void* b, bool b_is_v, const SmatTokenWeights& w,
                        const SmatMatrixLayout& lay, float* out, CudaScratch* scratch,
                        cudaStream_t s, const char* what, int64_t tokens = kTokensPerSegment);

// Rows [i0, i1) of every batch entry of `t` ([batch, L, H, width] fp32) set
// to 0 on `s`; `what` names the phase in errors.
absl::Status ZeroTokenRows(const SmatCudaDims& d, int64_t i0, int64_t i1, int width, Tensor* t,
                           cudaStream_t s, const char* what);

// The adjoint of TypeReads on checked tensors: U_bar (written in full) and
// phi_bar's recent rows += (or =, `write`) from gbar or, for the bf16 kernel,
// from gbar's factors (gbar is then nullptr).
absl::Status RecentTypeReadsBackward(const SmatPlan& plan, const SmatSpan& span,
                                     const SmatCudaDims& d, const Tensor& phi, const Tensor& U,
                                     const float* gbar, const SmatGbarFactors* factors,
                                     const Tensor& lam, const Tensor& chunk_decay,
                                     const Tensor& recent_offset, const Tensor& type,
                                     Tensor* phi_bar, Tensor* U_bar, SmatWrite write,
                                     cudaStream_t s);

}  // namespace cuda_groups
}  // namespace smat
