// Launchers of the CUDA SMat-Attention phase kernels (smat_*.cu), behind plain
// C++ declarations so that smat_cuda.cc (the SmatKernels implementation, which
// validates tensors and returns absl::Status) is ordinary C++ and nvcc never has
// to parse Abseil. Every launcher enqueues its kernels on `stream` and returns
// cudaGetLastError() after the last launch.
//
// Layouts follow kernels/smat_kernels.h: token tensors [batch, L, H, X], chunk
// tensors [batch, Lc, H, r, p], per-block tensors [batch, 2, H, ...], tables
// [batch, H, G, r, p]. Inputs phi, psi, v are fp32 or bf16 (`bf16` flag);
// everything else is fp32 (int32 for maps and group lists). All arithmetic,
// states and scans are fp32, every sum runs in a fixed order and no kernel uses
// floating-point atomics, so equal inputs give equal bits (ARCHITECTURE.md 5).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace smat {

// Sizes of one span of one call (SmatDims of kernels/smat.h plus the span).
struct SmatCudaDims {
  int batch = 0;
  int L = 0;      // tokens held (span length)
  int Lc = 0;     // chunks held
  int H = 0;
  int r = 0;
  int dv = 0;
  int p = 0;      // dv + 1
  int chunk = 0;  // c
  int64_t t0 = 0;  // global position of local token 0 (a multiple of c)
  int64_t n = 0;   // distant/recent boundary (global)
  bool bf16 = false;  // phi, psi, v are bf16 (else fp32)
};

// Per-token decay weights w_i of the grouped and chunk phases, all of the form
// exp(x) with x a sum of gate terms that is <= 0 (Lemma 4):
//   key side:   x = chunk_decay[k] - lam[i] + off[k] + extra[b, h]
//   query side: x = lam[i] + off[k] + extra[b, h]
// (k = chunk of local token i). lam == nullptr: ungated, w = exp(extra) (1 when
// extra is null too). off and extra may be null (0).
struct SmatTokenWeights {
  const float* lam = nullptr;          // [batch, L, H]
  const float* chunk_decay = nullptr;  // [batch, Lc, H]
  const float* off = nullptr;          // [batch, Lc, H]
  const float* extra = nullptr;        // [batch, H]
  bool key_side = false;
};

// How the tokens of a span split into groups. Chunks: group g = local chunk g.
// Progression: the tokens of [begin, end) with (i + phase) mod period = g
// (positional profiles / types). Lists: content maps grouped by
// LaunchSmatGroupByContent (group g of (b, h) is perm[bh][offsets[bh][g] ..
// offsets[bh][g + 1])), local token indices in increasing order.
enum class SmatGroupMode : int { kChunks = 0, kProgression = 1, kLists = 2 };
struct SmatTokenGroups {
  SmatGroupMode mode = SmatGroupMode::kChunks;
  int num_groups = 0;
  int64_t begin = 0, end = 0;          // local token range partitioned by the groups
  int64_t period = 1, phase = 0;       // kProgression
  const int32_t* offsets = nullptr;    // kLists: [batch * H, num_groups + 1]
  const int32_t* perm = nullptr;       // kLists: [batch * H, end - begin]
};

// Where the r x p matrix of (b, g, h) lives: element offset
// ((b * ob + g * og + h * oh) * segments + segment) * r * p.
struct SmatMatrixLayout {
  int64_t ob = 0, og = 0, oh = 0;
};

// Whether the current device has sm_80 tensor cores (mma.sync bf16) and lets
// one block opt in to `smem_bytes` of shared memory: the condition every
// tensor-core launcher checks before it is chosen (smat_chunk.cu).
bool SmatDeviceRunsMma(int64_t smem_bytes);

// ---- smat_scan.cu ---------------------------------------------------------------

// F1: lam (chunk-local inclusive prefix of logg) and chunk_decay.
cudaError_t LaunchSmatChunkLogDecay(const SmatCudaDims& dims, const float* logg, float* lam,
                                    float* chunk_decay, cudaStream_t stream);

// off[k] for the grouped phases: for a distant chunk, the sum of chunk_decay
// over the span's later distant chunks; for a recent chunk, the sum over the
// span's earlier recent chunks.
cudaError_t LaunchSmatChunkOffsets(const SmatCudaDims& dims, const float* chunk_decay,
                                   float* off, cudaStream_t stream);

// F3 and B6 (see SmatKernels::ChunkScan / ChunkScanBackward). chunk_decay may
// be null (ungated), S_in may be null.
cudaError_t LaunchSmatChunkScan(const SmatCudaDims& dims, const float* D,
                                const float* chunk_decay, const float* incoming, float* S_in,
                                float* span_state, float* span_decay, cudaStream_t stream);
cudaError_t LaunchSmatChunkScanBackward(const SmatCudaDims& dims, const float* S_in_bar,
                                        const float* chunk_decay, const float* incoming_grad,
                                        float* D_bar, float* span_state_grad,
                                        cudaStream_t stream);

// F8 and B1. o and d_o have the dtype flagged by o_bf16 / do_bf16. With
// `reads` (else null), the rows of tokens i >= recent_begin of the span divide
// ybar_i + reads_i (SmatKernels::NormalizedOutputs).
cudaError_t LaunchSmatNormalize(const SmatCudaDims& dims, const float* ybar, float eps, void* o,
                                bool o_bf16, float* den, const float* reads, int64_t recent_begin,
                                cudaStream_t stream);
cudaError_t LaunchSmatNormalizeBackward(const SmatCudaDims& dims, const void* d_o, bool do_bf16,
                                        const void* o, bool o_bf16, const float* den, float eps,
                                        float* gbar, float* dlam_row, cudaStream_t stream);

// B8: dLambda_t = dlam_row_t - psi_t . psi_bar_t into the scratch dlam
// [batch, L, H], then logg_bar = suffix sums + suffix_in, span_sum. dlam holds
// SmatLogDecayBackwardScratch(dims) floats (the suffix sums' segment totals
// after dLambda).
int64_t SmatLogDecayBackwardScratch(const SmatCudaDims& dims);
cudaError_t LaunchSmatLogDecayBackward(const SmatCudaDims& dims, const void* psi,
                                       const float* psi_bar, const float* dlam_row,
                                       const float* suffix_in, float* dlam, float* logg_bar,
                                       float* span_sum, cudaStream_t stream);

// ---- smat_grouped.cu ------------------------------------------------------------

// out[(b, g, h), segment] = sum over the segment's tokens i of group g of
// w_i a_i b_i^T (r x p). a: phi or psi (input dtype, [batch, L, H, r]);
// b: vbar = [v, 1] from v (input dtype) when b_is_v, else gbar (fp32,
// [batch, L, H, p]). Each group's token list is cut into `segments` equal parts
// (in list order); LaunchSmatReduceSegments sums them in segment order.
cudaError_t LaunchSmatGroupedOuterSum(const SmatCudaDims& dims, const SmatTokenGroups& groups,
                                      int segments, const void* a, const void* b, bool b_is_v,
                                      const SmatTokenWeights& w, const SmatMatrixLayout& out_layout,
                                      float* out, cudaStream_t stream);
cudaError_t LaunchSmatReduceSegments(const SmatCudaDims& dims, int num_groups, int segments,
                                     const float* partial,  // [batch, H, G, segments, r, p]
                                     const SmatMatrixLayout& out_layout, float* out,
                                     cudaStream_t stream);

// Per-token products with the group's r x p matrix M (layout `m_layout`, one
// segment), += into fp32 outputs (= into each output the kind writes when
// assign, for SmatWrite::kAssign); the product with w_i is rounded before it
// is added, so that = and then += of another term give the bits of += :
//   kVecMat (F7):  out_p[i] += w_i a_i^T M       (a = phi, out_p [batch, L, H, p])
//   kMatVec (B2):  out_r[i] += w_i M g_i         (g = gbar fp32, out_r [batch, L, H, r])
//   kBoth   (B4):  out_r[i] += w_i M vbar_i, out_v[i] += w_i (M^T a_i)[0:dv]
//                  (a = psi, vbar from v)
enum class SmatReadKind : int { kVecMat = 0, kMatVec = 1, kBoth = 2 };
cudaError_t LaunchSmatGroupedReads(const SmatCudaDims& dims, const SmatTokenGroups& groups,
                                   int segments, SmatReadKind kind, const float* M,
                                   const SmatMatrixLayout& m_layout, const void* a, const void* v,
                                   const float* g, const SmatTokenWeights& w, float* out_p,
                                   float* out_r, float* out_v, bool assign, cudaStream_t stream);

// Stable counting sort of the span's tokens [begin, end) of each (b, h) by
// map[b, i, h] in [0, G) (content maps): offsets [batch * H, G + 1], perm
// [batch * H, end - begin]; counts is scratch [batch * H, G]. Tokens whose id
// is out of range are left out of every group.
cudaError_t LaunchSmatGroupByContent(const SmatCudaDims& dims, const int32_t* map, int64_t begin,
                                     int64_t end, int num_groups, int32_t* counts, int32_t* offsets,
                                     int32_t* perm, cudaStream_t stream);

// ---- smat_tabulate.cu ------------------------------------------------------------

// out[bh, g] = sum_{j in list[g]} in[bh, items[j]] for W-wide rows, lists in
// CSR form (offsets [G_out + 1], items: `entries` in all), summed in list
// order: Algorithm 2 (U = C F, lists = points of each type) and its adjoint
// (F_bar = C^T U_bar, lists = types through each point).
cudaError_t LaunchSmatTabulate(int64_t batch_heads, int64_t W, int64_t g_in, int64_t g_out,
                               const int32_t* offsets, const int32_t* items, int64_t entries,
                               const float* in, float* out, cudaStream_t stream);

// The same sums for d = 3 from the geometry: the points
// of F_q^2 (index x0 q + x1) and its lines as types, line (e, b) = type
// flat_to_type[e q + b] with direction e = 0: (0, 1), e = 1 + m: (1, m)
// (SmatGeometry with D = 2); inverses[m] = 1 / m mod q (m = 1 .. q - 1).
// adjoint false: out = U [bh, B, W] from in = F [bh, P, W]; true: out = F_bar
// from U_bar. SmatTabulatePlaneFits: whether its tile (4 columns of every
// row) fits the device's shared memory (else the lists serve), and
// SMAT_CUDA_GROUPED is not "general" (which keeps the lists).
bool SmatTabulatePlaneFits(int64_t q);
cudaError_t LaunchSmatTabulatePlane(int64_t batch_heads, int64_t W, int64_t q,
                                    const int32_t* flat_to_type, const int32_t* inverses,
                                    bool adjoint, const float* in, float* out, cudaStream_t stream);

// ---- smat_tabulate_slopes.cu ---------------------------------------------------

// U = C F for d = 3 (adjoint: F_bar = C^T U_bar) as LaunchSmatTabulatePlane
// computes it (the same bits), each loaded point (line) added to four lines
// (points) held in registers. Serves the field sizes
// SmatTabulateSlopesServes(q, adjoint) names (31 and 47 .. 113, where the
// staged rows fit the device's shared memory) with W a multiple of 4 and in,
// out 16-byte aligned; LaunchSmatTabulatePlane takes it there unless
// SMAT_CUDA_TABULATE=lines.
bool SmatTabulateSlopesServes(int64_t q, bool adjoint);
cudaError_t LaunchSmatTabulateSlopes(int64_t batch_heads, int64_t W, int64_t q,
                                     const int32_t* flat_to_type, const int32_t* inverses,
                                     bool adjoint, const float* in, float* out,
                                     cudaStream_t stream);

// ---- smat_chunk.cu --------------------------------------------------------------

// Largest query/key tile (64, 32 or 16 rows) whose shared memory fits in
// `smem_limit` bytes for the chunk kernels, or 0 when none does.
int SmatChunkTileRows(const SmatCudaDims& dims, int64_t smem_limit, bool backward_keys);

// Whether LaunchSmatChunkOutputs runs the fused bf16 tile (smat_chunk_fwd_mma.cu)
// for `dims` and LaunchSmatNormalizedOutputsFused can stand in for it with the
// reads and the division (SmatKernels::NormalizedOutputs).
bool SmatNormalizedOutputsFused(const SmatCudaDims& dims);

// F6: ybar (written in full for every token of the span).
cudaError_t LaunchSmatChunkOutputs(const SmatCudaDims& dims, int tile, const void* phi,
                                   const void* psi, const void* v, const float* lam,
                                   const float* S_in, float* ybar, cudaStream_t stream);

// B7 (eq. 19): phi_bar += (query tiles), then psi_bar, v_bar += (key tiles);
// assign: = in place of += (SmatWrite::kAssign).
cudaError_t LaunchSmatChunkOutputsBackward(const SmatCudaDims& dims, int query_tile, int key_tile,
                                           const void* phi, const void* psi, const void* v,
                                           const float* lam, const float* chunk_decay,
                                           const float* S_in, const float* gbar,
                                           const float* D_bar, float* phi_bar, float* psi_bar,
                                           float* v_bar, bool assign, cudaStream_t stream);
// B7's three outputs set to 0 on `stream`: how the tiles that only add
// implement assign.
cudaError_t ZeroSmatChunkOutputsBackward(const SmatCudaDims& dims, float* phi_bar, float* psi_bar,
                                         float* v_bar, cudaStream_t stream);

// ---- smat_chunk_fast.cu ---------------------------------------------------------

// The fast tiles (chunk tiles: one block per chunk and head, the whole chunk in
// shared memory; grouped products: 128 tokens at a time; 16-byte staging and
// register-blocked FFMA throughout) apply when c <= 128 and r, dv <= 64; the
// chunk-tile, outer-sum and read launchers above use them then, unless the
// environment variable SMAT_CUDA_CHUNK_TILES is "general" (the general
// kernels, kept as the reference and for larger sizes).
bool SmatChunkFastTilesFit(const SmatCudaDims& dims);
// SmatChunkFastTilesFit and not overridden by SMAT_CUDA_CHUNK_TILES (smat_chunk.cu).
bool SmatUseFastChunkTiles(const SmatCudaDims& dims);
int64_t SmatChunkFastTilesSmemBytes();
// LaunchSmatGroupedOuterSum and LaunchSmatGroupedReads with 128 tokens of a
// group at a time as one tile product (r, dv <= 64); used by those launchers
// when SmatUseFastChunkTiles.
cudaError_t LaunchSmatGroupedOuterSumFast(const SmatCudaDims& dims, const SmatTokenGroups& groups,
                                          int segments, const void* a, const void* b,
                                          bool b_is_v, const SmatTokenWeights& w,
                                          const SmatMatrixLayout& out_layout, float* out,
                                          cudaStream_t stream);
cudaError_t LaunchSmatGroupedReadsFast(const SmatCudaDims& dims, const SmatTokenGroups& groups,
                                       int segments, SmatReadKind kind, const float* M,
                                       const SmatMatrixLayout& m_layout, const void* a,
                                       const void* v, const float* g, const SmatTokenWeights& w,
                                       float* out_p, float* out_r, float* out_v, bool assign,
                                       cudaStream_t stream);
cudaError_t LaunchSmatChunkOutputsFast(const SmatCudaDims& dims, const void* phi, const void* psi,
                                       const void* v, const float* lam, const float* S_in,
                                       float* ybar, cudaStream_t stream);
cudaError_t LaunchSmatChunkOutputsBackwardFast(const SmatCudaDims& dims, const void* phi,
                                               const void* psi, const void* v, const float* lam,
                                               const float* chunk_decay, const float* S_in,
                                               const float* gbar, const float* D_bar,
                                               float* phi_bar, float* psi_bar, float* v_bar,
                                               bool assign, cudaStream_t stream);

// ---- smat_chunk_mma.cu ----------------------------------------------------------

// The chunk tiles of the fast path on tensor cores (mma.sync bf16, fp32
// accumulation; fp32 operands split into three bf16 parts, so results stay at
// fp32 accuracy). LaunchSmatChunkOutputs(Backward)Fast use them when
// SmatUseMmaChunkTiles: the sizes fit the fast tiles, the device has them
// (sm_80 or later, SmatChunkMmaTilesSmemBytes of shared memory per block), and
// SMAT_CUDA_CHUNK_TILES is "mma", or unset and the tile runs faster on them
// (today the forward tile and B7 of bf16 inputs; "ffma" keeps the FFMA tiles).
// B7 of bf16 inputs runs there as one kernel for all three outputs
// (smat_chunk_bwd_mma.cu), fp32 inputs as three tiles.
bool SmatChunkMmaTilesFit(const SmatCudaDims& dims);
bool SmatUseMmaChunkTiles(const SmatCudaDims& dims, bool backward);
// The bf16 parts of every fp32 operand (S_in, gbar, D_bar, the score tiles) in
// the fused tiles of bf16 inputs (smat_chunk_fwd_mma.cu, smat_chunk_bwd_mma.cu,
// the walk of smat_chunk_walk.cu): 3 (24 significant bits, the scheme of fp32
// inputs) unless SMAT_CUDA_BF16_PARTS is "2" (16 bits: fewer MMAs, errors up
// to about 2^-16 relative per product) or "1" (each operand rounded to bf16
// once, as flash-linear-attention's kernels do: up to 2^-8 relative per
// product; the fewest MMAs and shared-memory loads). Read on every launch; any
// other value is reported once on stderr and the default kept.
int SmatBf16SplitParts();
// SmatUseMmaChunkTiles (forward) and LaunchSmatChunkOutputsMma runs the fused
// bf16 kernel of smat_chunk_fwd_mma.cu.
bool SmatChunkMmaForwardFused(const SmatCudaDims& dims);
int64_t SmatChunkMmaTilesSmemBytes();
cudaError_t LaunchSmatChunkOutputsMma(const SmatCudaDims& dims, const void* phi, const void* psi,
                                      const void* v, const float* lam, const float* S_in,
                                      float* ybar, cudaStream_t stream);
cudaError_t LaunchSmatChunkOutputsBackwardMma(const SmatCudaDims& dims, const void* phi,
                                              const void* psi, const void* v, const float* lam,
                                              const float* chunk_decay, const float* S_in,
                                              const float* gbar, const float* D_bar,
                                              float* phi_bar, float* psi_bar, float* v_bar,
                                              bool assign, cudaStream_t stream);

// ---- smat_chunk_fwd_mma.cu ------------------------------------------------------

// F6 for bf16 inputs as one tensor-core kernel in the style of the fused B7;
// fits where the fast tiles do, on sm_80 or later with its shared memory.
// LaunchSmatChunkOutputsMma uses it then.
bool SmatChunkForwardFusedFits(const SmatCudaDims& dims);
cudaError_t LaunchSmatChunkOutputsForwardFused(const SmatCudaDims& dims, const void* phi,
                                               const void* psi, const void* v, const float* lam,
                                               const float* S_in, float* ybar,
                                               cudaStream_t stream);
// The same kernel finishing the outputs (SmatKernels::NormalizedOutputs), for
// SmatChunkForwardFusedFits and dv >= 32 (the normaliser's column in the
// right halves of the rows):
// ybar_t + reads_t for t >= recent_begin (local tokens), then den and bf16 o,
// with the arithmetic of LaunchSmatNormalize, so the bits are those of the
// three phases.
cudaError_t LaunchSmatNormalizedOutputsFused(const SmatCudaDims& dims, const void* phi,
                                             const void* psi, const void* v, const float* lam,
                                             const float* S_in, const float* reads,
                                             int64_t recent_begin, float eps, void* o, float* den,
                                             cudaStream_t stream);
bool SmatNormalizedOutputsFusedFits(const SmatCudaDims& dims);

// ---- smat_chunk_walk.cu ---------------------------------------------------------

// F2 + F3 + NormalizedOutputs in one walk over the chunks
// (SmatKernels::ChunkStatesAndOutputs), for ungated bf16 inputs wherever
// SmatNormalizedOutputsFused holds: the states entering the chunks from
// `incoming` ([batch, 2, H, r, p] or null: zero) and the summaries of the
// span's tokens, written to S_in (if not null) as ChunkScan writes them, and
// o and den as LaunchSmatNormalizedOutputsFused writes them from those states.
// scratch: SmatChunkWalkScratchFloats(dims, reads != null) floats (the
// segments' totals and entering states). reads_ready (or null): an event the
// walk waits for after the totals and the starts, before anything reads
// `reads`. With reads and chunks on both sides of n, the walk on mma.sync
// (where it writes S_in) runs the distant part (which reads none) before
// that wait and the recent part after it, each part cut into a wave of
// segments of its own; the walks on warpgroup MMAs run both in one launch
// after the wait. SMAT_CUDA_WALK_SPLIT = "1" or "0" takes one way for all.
int64_t SmatChunkWalkScratchFloats(const SmatCudaDims& dims, bool has_reads);
cudaError_t LaunchSmatChunkWalk(const SmatCudaDims& dims, const void* phi, const void* psi,
                                const void* v, const float* incoming, const float* reads,
                                int64_t recent_begin, float eps, float* S_in, void* o, float* den,
                                float* scratch, cudaEvent_t reads_ready, cudaStream_t stream);

// ---- smat_chunk_bwd_mma.cu ------------------------------------------------------

// How a span's chunks split into runs of consecutive chunks, each taken by
// one block (the forward walk's segments, ChunkBackward's runs): the distant
// chunks [0, N) in seg_d runs of len chunks, the recent [N, Lc) in seg_r
// runs of len_r (the last of each part may hold fewer).
// cuda_detail::RunChunks gives a run's chunks, ChunkRunsOfLength(s) cuts a
// span (smat_device.cuh).
struct SmatChunkRuns {
  int N = 0, seg_d = 0, seg_r = 0, len = 0, len_r = 0;
};

// D_bar in two pieces (SmatKernels::ChunkBackward, smat_state_grads.cu): for
// chunk k of run s of (b, h) (bh = b H + h),
//   D_bar[k] = local[k] + scale[k] carry[bh, s]
// local[k] = the suffix sum over the later chunks of the run, as D_bar,
// carry[bh, s] = D_bar of the run's last chunk ([batch * H, runs, r, p]),
// scale[k] the decays between ([batch, Lc, H]; null: 1, ungated).
struct SmatDBarCarry {
  const float* carry = nullptr;
  const float* scale = nullptr;
  SmatChunkRuns runs;
};

// The rows B7 of ChunkBackward adds to instead of writing (where the
// long-range branch wrote them first, SmatKernels::ChunkBackward): phi_bar's
// rows of tokens >= query_from, psi_bar's and v_bar's of tokens < key_before
// (span-local token indices). The default adds to none.
struct SmatChunkBackwardAdds {
  int64_t query_from = INT64_MAX;
  int64_t key_before = 0;
};

// gbar's columns < dv by their factors, gbar_t[0:dv] = d_o_t / den_t (B1):
// d_o's bf16 rows [batch, L, H, dv] and den [batch, L, H]. B7 then takes d_o
// as one exact bf16 part where it took gbar in kP, and divides by den_t in
// fp32 (LaunchSmatChunkBackward passes them where d_o is bf16).
// gden (not null): gbar's column dv as its own [batch, L, H] tensor, read
// there instead of from gbar (which then need not exist; LaunchSmatChunkBackward
// with gbar_column_only, TypeReadsBackward by factors).
struct SmatGbarFactors {
  const void* d_o = nullptr;
  const float* den = nullptr;
  const float* gden = nullptr;
};

// B7 for bf16 inputs as one tensor-core kernel (phi_bar, psi_bar and v_bar
// from one staging of the chunk); fits where the fast tiles do, on sm_80 or
// later with its shared memory. LaunchSmatChunkOutputsBackwardMma uses it then.
// SmatChunkBackwardRunsFused: whether LaunchSmatChunkOutputsBackward takes it
// (the fast tiles on tensor cores, as chosen by SMAT_CUDA_CHUNK_TILES).
// With `carry` (not null) D_bar holds the local part of SmatDBarCarry; with
// `factors` (not null) and assign, gbar's column dv is read and its other
// columns come from the factors (SmatGbarFactors).
bool SmatChunkBackwardFusedFits(const SmatCudaDims& dims);
bool SmatChunkBackwardRunsFused(const SmatCudaDims& dims);
cudaError_t LaunchSmatChunkOutputsBackwardFused(
    const SmatCudaDims& dims, const void* phi, const void* psi, const void* v, const float* lam,
    const float* chunk_decay, const float* S_in, const float* gbar, const float* D_bar,
    float* phi_bar, float* psi_bar, float* v_bar, bool assign, cudaStream_t stream,
    const SmatDBarCarry* carry = nullptr, const SmatGbarFactors* factors = nullptr,
    const SmatChunkBackwardAdds* adds = nullptr);
// Whether B7 as ChunkBackward launches it (assign, from gbar's factors) runs
// on warpgroup MMAs (smat_chunk_bwd_wgmma.h) for these inputs, the one B7
// that can add to some rows (`adds` of the launcher above; with adds where
// this is false the launcher returns cudaErrorInvalidValue).
bool SmatChunkBackwardTilesAdd(const SmatCudaDims& dims, const void* phi, const void* psi,
                               const void* v, const float* lam, const void* d_o, const float* S_in,
                               const float* phi_bar, const float* psi_bar, const float* v_bar);
// Whether ChunkBackward runs the long-range branch before B7 where B7 can add
// (SmatChunkBackwardTilesAdd): SMAT_CUDA_LONG_RANGE_FIRST "1" yes, "0" no
// (the branch then adds after B7, as on every other path); unset,
// `by_default`. Read on every call; any other value is reported once on
// stderr and the default kept. The gradients are the same either way
// (SmatKernels::ChunkBackward).
bool SmatLongRangeFirst(bool by_default);

// ---- smat_reads_bwd_bf16.cu -----------------------------------------------------

// TypeReadsBackward (U_bar's outer sums over the recent tokens of each type
// and segment, and phi_bar += w U gbar) in one pass over the tokens
// (smat_reads_bf16.cu): bf16 inputs, c <= 128, r % 8 == 0, r, dv <= 64,
// phi's rows 16-byte aligned, where the grouped phases take their fast
// kernels (SmatUseFastChunkTiles) and the outer sums run on tensor cores
// (SmatUseMmaGrouped; not with SMAT_CUDA_GROUPED=ffma). U_bar's partial sums go to
// `U_bar` in `out_layout` with `segments` per type, as
// LaunchSmatGroupedOuterSum writes them. With `factors` (d_o bf16, den and
// gden; SmatTypeReadsBackwardFactorsFit: d_o's rows 16-byte aligned, dv a
// multiple of 8) gbar is not read: its rows come from their factors. assign:
// phi_bar's rows of the groups' tokens = instead of +=.
bool SmatTypeReadsBackwardBf16Fits(const SmatCudaDims& dims, const void* phi);
bool SmatTypeReadsBackwardFactorsFit(const SmatCudaDims& dims, const void* phi, const void* d_o);
cudaError_t LaunchSmatTypeReadsBackwardBf16(const SmatCudaDims& dims, const SmatTokenGroups& groups,
                                            int segments, const float* U,
                                            const SmatMatrixLayout& u_layout, const void* phi,
                                            const float* gbar, const SmatTokenWeights& w,
                                            const SmatMatrixLayout& out_layout, float* U_bar,
                                            float* phi_bar, bool assign, cudaStream_t stream,
                                            const SmatGbarFactors* factors = nullptr);

// ---- smat_state_grads.cu --------------------------------------------------------

// B1 + B5 in one kernel (SmatKernels::NormalizeBackwardStates): gbar,
// dlam_row (where not null) and S_in_bar, with the bits of
// LaunchSmatNormalizeBackward and then the ChunkStateGradients outer sums
// (gated, S_in_bar to within fp32 rounding: see smat_state_grads.cu). Fits
// for bf16 phi where those two run their row-tile and tensor-core kernels:
// c <= 128, r % 8 == 0, r <= 64, dv even and <= 64, d_o and o pairs aligned,
// the outer sums on tensor cores (SmatUseMmaGrouped), sm_80 or later with the
// shared memory.
bool SmatNormalizeBackwardStatesFusedFits(const SmatCudaDims& dims, const void* d_o, bool do_bf16,
                                          const void* o, bool o_bf16, const void* phi,
                                          const float* lam, const float* gbar);
cudaError_t LaunchSmatNormalizeBackwardStatesFused(const SmatCudaDims& dims, const void* d_o,
                                                   bool do_bf16, const void* o, bool o_bf16,
                                                   const float* den, float eps, const void* phi,
                                                   const float* lam, float* gbar, float* dlam_row,
                                                   float* S_in_bar, cudaStream_t stream);

// B1 + B5 + B6 + B7 (SmatKernels::ChunkBackward, incoming_grad zero, the
// gradients written): gbar and dlam_row as above, then phi_bar, psi_bar and
// v_bar as LaunchSmatChunkOutputsBackwardFused writes them from the D_bar of
// LaunchSmatChunkScanBackward, without S_in_bar or D_bar in memory: each
// block of the first kernel walks a run of chunks from its last down, its
// state gradients summing on in the tensor cores' accumulators, and writes
// D_bar's local part (SmatDBarCarry); a scan over the runs gives the carries
// that B7 adds as it stages D_bar. Fits where both fused kernels run.
// scratch: SmatChunkBackwardScratchFloats(dims) floats. gbar_column_only
// (a bf16 d_o only): gbar is [batch, L, H], gbar's column dv alone; B7 takes
// the other columns from d_o and den (SmatGbarFactors). Two launches, in this
// order on one stream with the same scratch, so that other work can run
// between: the states (B1, B5, B6: gbar, dlam_row, D_bar's local part and the
// runs' carries, into scratch) and the tiles (B7; `adds` as
// LaunchSmatChunkOutputsBackwardFused takes it).
bool SmatChunkBackwardFits(const SmatCudaDims& dims, const void* d_o, bool do_bf16, const void* o,
                           bool o_bf16, const void* phi, const float* lam, const float* gbar);
int64_t SmatChunkBackwardScratchFloats(const SmatCudaDims& dims);
cudaError_t LaunchSmatChunkBackwardStates(const SmatCudaDims& dims, const void* d_o, bool do_bf16,
                                          const void* o, bool o_bf16, const float* den, float eps,
                                          const void* phi, const float* lam,
                                          const float* chunk_decay, float* gbar, float* dlam_row,
                                          float* scratch, cudaStream_t stream,
                                          bool gbar_column_only);
cudaError_t LaunchSmatChunkBackwardTiles(const SmatCudaDims& dims, const void* d_o, bool do_bf16,
                                         const float* den, const void* phi, const void* psi,
                                         const void* v, const float* lam, const float* chunk_decay,
                                         const float* S_in, const float* gbar, float* phi_bar,
                                         float* psi_bar, float* v_bar, const float* scratch,
                                         cudaStream_t stream, bool gbar_column_only,
                                         const SmatChunkBackwardAdds* adds);

}  // namespace smat
