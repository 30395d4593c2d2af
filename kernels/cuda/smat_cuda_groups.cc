// The span geometry of the CUDA SMat phases (smat_cuda_groups.h).
#include "kernels/cuda/smat_cuda_groups.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace smat {
namespace cuda_groups {
namespace {

// t's fp32 data, or null when t is undefined (as in smat_cuda.cc).
const float* F32(const Tensor& t) {
  return t.defined() ? static_cast<const float*>(t.raw()) : nullptr;
}
float* F32(Tensor* t) { return t != nullptr ? static_cast<float*>(t->raw()) : nullptr; }

}  // namespace

IncidenceCache::~IncidenceCache() {
  for (auto& [key, lists] : lists_) {
    cudaFree(lists.type_offsets);
    cudaFree(lists.type_points);
    cudaFree(lists.point_offsets);
    cudaFree(lists.point_types);
    cudaFree(lists.flat_to_type);
    cudaFree(lists.inverses);
  }
}

absl::StatusOr<const IncidenceLists*> IncidenceCache::Get(const SmatGeometry& g) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::pair<int, int64_t> key(g.d, g.q);
  auto it = lists_.find(key);
  if (it != lists_.end()) return &it->second;
  std::vector<std::vector<int32_t>> points(g.B), types(g.P);
  if (g.d == 1) {
    points[0].push_back(0);
    types[0].push_back(0);
  } else {
    for (int64_t e = 0; e < g.num_directions; ++e) {
      for (int64_t x = 0; x < g.P; ++x) {
        int64_t dot = 0;
        for (int k = 0; k < g.D; ++k) dot += g.directions[e * g.D + k] * g.Coordinate(x, k);
        const int32_t h = g.flat_to_type[e * g.q + dot % g.q];
        points[h].push_back(static_cast<int32_t>(x));
        types[x].push_back(h);
      }
    }
  }
  auto flatten = [](const std::vector<std::vector<int32_t>>& lists, std::vector<int32_t>* off,
                    std::vector<int32_t>* items) {
    off->assign(1, 0);
    for (const auto& l : lists) {
      items->insert(items->end(), l.begin(), l.end());
      off->push_back(static_cast<int32_t>(items->size()));
    }
  };
  std::vector<int32_t> to, ti, po, pi;
  flatten(points, &to, &ti);
  flatten(types, &po, &pi);
  IncidenceLists lists;
  lists.entries = static_cast<int64_t>(ti.size());
  auto upload = [](const std::vector<int32_t>& host, int32_t** dev) -> absl::Status {
    SMAT_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(dev),
                                         std::max<size_t>(1, host.size()) * sizeof(int32_t)));
    SMAT_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(*dev, host.data(), host.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    return absl::OkStatus();
  };
  SMAT_RETURN_IF_ERROR(upload(to, &lists.type_offsets));
  SMAT_RETURN_IF_ERROR(upload(ti, &lists.type_points));
  SMAT_RETURN_IF_ERROR(upload(po, &lists.point_offsets));
  SMAT_RETURN_IF_ERROR(upload(pi, &lists.point_types));
  if (g.D == 2) {
    // The plane's tabulation (LaunchSmatTabulatePlane): the type order, and
    // 1 / m mod q for q prime by 1 / m = -(q / m) (1 / (q mod m)).
    std::vector<int32_t> inverses(g.q, 0);
    if (g.q > 1) inverses[1] = 1;
    for (int64_t m = 2; m < g.q; ++m) {
      inverses[m] = static_cast<int32_t>((g.q - (g.q / m) * inverses[g.q % m] % g.q) % g.q);
    }
    SMAT_RETURN_IF_ERROR(upload(g.flat_to_type, &lists.flat_to_type));
    SMAT_RETURN_IF_ERROR(upload(inverses, &lists.inverses));
  }
  return &lists_.emplace(key, lists).first->second;
}

absl::Status CheckGroups(int64_t groups, const char* what) {
  if (groups > kMaxGridY) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat cuda: ", groups, " ", what, " exceed the ", kMaxGridY,
                     " groups one launch handles; use a larger chunk or a smaller d / q"));
  }
  return absl::OkStatus();
}

int SegmentsFor(int64_t len, int64_t groups, int64_t tokens) {
  const int64_t per_group = (len + std::max<int64_t>(groups, 1) - 1) / std::max<int64_t>(groups, 1);
  return static_cast<int>(std::clamp<int64_t>((per_group + tokens - 1) / tokens, 1, kMaxSegments));
}

int SegmentsFor(const SmatTokenGroups& g) { return SegmentsFor(g.end - g.begin, g.num_groups); }

int ReadSegmentsFor(const SmatTokenGroups& g, SmatReadKind kind) {
  return SegmentsFor(g.end - g.begin, g.num_groups,
                     kind == SmatReadKind::kVecMat ? kTokensPerSegment : kTokensPerReadSegment);
}

absl::StatusOr<SmatTokenGroups> GroupTokens(const SmatCudaDims& d, const Tensor& map, int64_t begin,
                                            int64_t end, int64_t G, int64_t phase,
                                            CudaScratch* scratch, cudaStream_t s) {
  SmatTokenGroups g;
  g.num_groups = static_cast<int>(G);
  g.begin = begin;
  g.end = std::max(begin, end);
  if (!map.defined()) {
    g.mode = SmatGroupMode::kProgression;
    g.period = G;
    g.phase = ((phase % G) + G) % G;
    return g;
  }
  g.mode = SmatGroupMode::kLists;
  const int64_t bh = static_cast<int64_t>(d.batch) * d.H;
  SMAT_ASSIGN_OR_RETURN(int32_t* counts, scratch->Get<int32_t>(bh * G));
  SMAT_ASSIGN_OR_RETURN(int32_t* offsets, scratch->Get<int32_t>(bh * (G + 1)));
  SMAT_ASSIGN_OR_RETURN(int32_t* perm, scratch->Get<int32_t>(bh * (g.end - g.begin)));
  SMAT_CUDA_RETURN_IF_ERROR(LaunchSmatGroupByContent(d, static_cast<const int32_t*>(map.raw()),
                                                     g.begin, g.end, g.num_groups, counts, offsets,
                                                     perm, s));
  g.offsets = offsets;
  g.perm = perm;
  return g;
}

absl::Status RecentGroups(const SmatPlan& plan, const SmatSpan& span, const SmatCudaDims& d,
                          const Tensor& lam, const Tensor& chunk_decay, const Tensor& recent_offset,
                          const Tensor& type, CudaScratch* scratch, cudaStream_t s,
                          SmatTokenGroups* groups, SmatTokenWeights* w) {
  const int64_t B = plan.geo.B;
  SMAT_RETURN_IF_ERROR(CheckGroups(B, "types (B)"));
  const int64_t begin = span.recent_begin(plan) - span.t0;
  const int64_t end = span.t1 - span.t0;
  SMAT_ASSIGN_OR_RETURN(*groups, GroupTokens(d, type, begin, end, B, span.t0 - plan.n, scratch, s));
  *w = SmatTokenWeights{F32(lam), F32(chunk_decay), nullptr, F32(recent_offset), false};
  if (lam.defined()) {
    SMAT_ASSIGN_OR_RETURN(w->off, ChunkOffsets(d, F32(chunk_decay), scratch, s));
  }
  return absl::OkStatus();
}

absl::StatusOr<const float*> ChunkOffsets(const SmatCudaDims& d, const float* chunk_decay,
                                          CudaScratch* scratch, cudaStream_t s) {
  SMAT_ASSIGN_OR_RETURN(float* off,
                        scratch->Get<float>(static_cast<int64_t>(d.batch) * d.Lc * d.H));
  SMAT_CUDA_RETURN_IF_ERROR(LaunchSmatChunkOffsets(d, chunk_decay, off, s));
  return off;
}

absl::Status GroupedSum(const SmatCudaDims& d, const SmatTokenGroups& groups, int64_t len,
                        const void* a, const void* b, bool b_is_v, const SmatTokenWeights& w,
                        const SmatMatrixLayout& lay, float* out, CudaScratch* scratch,
                        cudaStream_t s, const char* what, int64_t tokens) {
  const int segments = SegmentsFor(len, groups.num_groups, tokens);
  if (segments == 1) {
    return CudaStatus(LaunchSmatGroupedOuterSum(d, groups, 1, a, b, b_is_v, w, lay, out, s), what);
  }
  const int64_t G = groups.num_groups;
  SMAT_ASSIGN_OR_RETURN(float* partial, scratch->Get<float>(static_cast<int64_t>(d.batch) * d.H *
                                                            G * segments * d.r * d.p));
  const SmatMatrixLayout part{static_cast<int64_t>(d.H) * G, 1, G};
  SMAT_CUDA_RETURN_IF_ERROR(
      LaunchSmatGroupedOuterSum(d, groups, segments, a, b, b_is_v, w, part, partial, s));
  return CudaStatus(LaunchSmatReduceSegments(d, groups.num_groups, segments, partial, lay, out, s),
                    what);
}

absl::Status ZeroTokenRows(const SmatCudaDims& d, int64_t i0, int64_t i1, int width, Tensor* t,
                           cudaStream_t s, const char* what) {
  if (i0 >= i1 || d.batch == 0) return absl::OkStatus();
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(d.H) * width;
  return CudaStatus(cudaMemset2DAsync(static_cast<float*>(t->raw()) + i0 * d.H * width,
                                      row_bytes * d.L, 0, row_bytes * (i1 - i0), d.batch, s),
                    absl::StrCat(what, " cudaMemset2DAsync").c_str());
}

absl::Status RecentTypeReadsBackward(const SmatPlan& plan, const SmatSpan& span,
                                     const SmatCudaDims& d, const Tensor& phi, const Tensor& U,
                                     const float* gbar, const SmatGbarFactors* factors,
                                     const Tensor& lam, const Tensor& chunk_decay,
                                     const Tensor& recent_offset, const Tensor& type,
                                     Tensor* phi_bar, Tensor* U_bar, SmatWrite write,
                                     cudaStream_t s) {
  const int64_t begin = span.recent_begin(plan) - span.t0;
  bool assign = write == SmatWrite::kAssign;
  // n = 0: no recent token reads U (see TypeReads), so U_bar = 0 and phi_bar
  // keeps its value, or its recent rows are 0 with =. Content types out of
  // range read nothing either: with =, those rows are zeroed first.
  if (assign && (plan.n == 0 || type.defined())) {
    SMAT_RETURN_IF_ERROR(ZeroTokenRows(d, begin, d.L, d.r, phi_bar, s, "TypeReadsBackward"));
    assign = false;
  }
  if (plan.n == 0) {
    return CudaStatus(cudaMemsetAsync(U_bar->raw(), 0, U_bar->nbytes(), s),
                      "TypeReadsBackward cudaMemsetAsync");
  }
  const int64_t B = plan.geo.B;
  CudaScratch scratch(s);
  SmatTokenGroups groups;
  SmatTokenWeights w;
  SMAT_RETURN_IF_ERROR(
      RecentGroups(plan, span, d, lam, chunk_decay, recent_offset, type, &scratch, s, &groups, &w));
  const SmatMatrixLayout lay{static_cast<int64_t>(d.H) * B, 1, B};
  if (factors != nullptr || SmatTypeReadsBackwardBf16Fits(d, phi.raw())) {
    // U_bar and phi_bar in one pass over the recent tokens
    // (LaunchSmatTypeReadsBackwardBf16); U_bar's segments summed after it.
    const int64_t G = groups.num_groups;
    const int segments = SegmentsFor(groups.end - groups.begin, G, kTokensPerTableSegment);
    float* out = F32(U_bar);
    SmatMatrixLayout out_lay = lay;
    if (segments > 1) {
      SMAT_ASSIGN_OR_RETURN(
          out, scratch.Get<float>(static_cast<int64_t>(d.batch) * d.H * G * segments * d.r * d.p));
      out_lay = SmatMatrixLayout{static_cast<int64_t>(d.H) * G, 1, G};
    }
    SMAT_CUDA_RETURN_IF_ERROR(LaunchSmatTypeReadsBackwardBf16(d, groups, segments, F32(U), lay,
                                                              phi.raw(), gbar, w, out_lay, out,
                                                              F32(phi_bar), assign, s, factors));
    if (segments == 1) return absl::OkStatus();
    return CudaStatus(
        LaunchSmatReduceSegments(d, groups.num_groups, segments, out, lay, F32(U_bar), s),
        "TypeReadsBackward kernel");
  }
  // U_bar[h] = sum_t gate_t phi_t gbar_t^T (written in full, zeros when the
  // span has no recent tokens), then phi_bar_t += gate_t U[type(t)] gbar_t.
  SMAT_RETURN_IF_ERROR(GroupedSum(d, groups, groups.end - groups.begin, phi.raw(), gbar, false, w,
                                  lay, F32(U_bar), &scratch, s, "TypeReadsBackward"));
  if (groups.begin >= groups.end) return absl::OkStatus();
  return CudaStatus(
      LaunchSmatGroupedReads(d, groups, ReadSegmentsFor(groups, SmatReadKind::kMatVec),
                             SmatReadKind::kMatVec, F32(U), lay, nullptr, nullptr, gbar, w, nullptr,
                             F32(phi_bar), nullptr, assign, s),
      "TypeReadsBackward kernel");
}

}  // namespace cuda_groups
}  // namespace smat
