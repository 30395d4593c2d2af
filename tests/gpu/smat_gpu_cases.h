// The cases and host helpers the SMat GPU tests share: the phase-by-phase
// comparison (smat_gpu_test.cc) and the whole op's (smat_op_gpu_test.cc).
//
// Tolerances. fp32: 1e-5 of the largest reference magnitude (the CPU phases
// are fp32 too; the two differ only in summation order and expf vs std::exp,
// a few ulp per term, well under 1e-6 for these sums: see smat_cpu_test.cc).
// bf16: the device reads bf16 inputs and widens them exactly to fp32, and the
// CPU runs on the same bf16-rounded values in fp32, so the same 1e-5 holds for
// every fp32 result of a phase; only o itself is rounded to bf16 (relative
// half-ulp 2^-9), checked at 2^-8. The tensor-core tiles keep the 1e-5: bf16
// inputs enter the bf16 MMAs exactly, and every fp32 operand (fp32 inputs,
// gbar, S_in, D_bar, the score tile) is split into three bf16 parts whose
// products down to 2^-16 relative are summed in fp32 (gpu_smat_parts2_test
// runs the fused bf16 tiles with two parts, SMAT_CUDA_BF16_PARTS=2: see
// kBf16TwoPartsTol). The whole op's gradients with bf16 inputs
// are computed from that bf16 o (kBf16OpGradTol below says how much that costs).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/tensor.h"
#include "tests/kernels/smat_test_util.h"

namespace smat {
namespace smat_gpu_cases {

using testing_util::ProblemSpec;

inline constexpr double kF32Tol = 1e-5;
inline constexpr double kBf16OutTol = 1.0 / 256;
// The whole op's gradients with bf16 inputs: the composer stores o in bf16 and
// backward reads it back, so gbar[dv] = -(d_o . o) / den carries o's rounding
// (relative 2^-9) into d_phi, d_psi and d_logg, amplified where gbar . vbar
// cancels (for the diagonal term it is d_o . (v - o) / den). Measured on an
// H200 (2026-11-30): at most 8.8e-3 (d_logg, T = 1031, d = 2); d_v, which only
// sees gbar[0:dv] = d_o / den, stays at 7e-7. The phase test, which starts
// backward from the CPU's fp32 o, holds every phase to 1e-5 for bf16 too.
inline constexpr double kBf16OpGradTol = 1.0 / 64;
// SMAT_CUDA_BF16_PARTS=1 (gpu_smat_parts1_test): the fused tiles of bf16
// inputs round each fp32 operand (S_in, gbar, D_bar, the score tiles) to bf16
// once, the numerics of flash-linear-attention's kernels (bf16 operands, fp32
// accumulation), instead of splitting it into parts. Each product term is
// then off by at most 2^-8 relative (both operands rounded, 2^-9 each), so a
// tile's output by at most 2^-8 times the sum of its terms' magnitudes, a few
// times the output's largest magnitude for these random inputs; the roundings'
// signs vary, so the errors mostly cancel. Measured on an H200 (2026-12-01):
// at most 3.4e-3 for a phase (phi_bar of B7), 4.9e-3 for o (with o's own
// rounding to bf16), checked at 2^-6. The whole op's gradients carry that
// through several tiles into the cancellation kBf16OpGradTol describes:
// d_logg 2.4e-2, d_phi 1.2e-2, d_psi 5.6e-3, d_v 3.5e-3, checked at 2^-4.
// The per-type reads of bf16 rows (TypeReads, TypeReadsBackward,
// ProfilePoolingBackward) take one part too (U and gbar rounded to bf16 once)
// and are held to the same 2^-6; the other phases keep the 1e-5 (their
// kernels split as before).
inline bool Bf16Products() {
  const char* env = std::getenv("SMAT_CUDA_BF16_PARTS");
  return env != nullptr && std::string(env) == "1";
}
inline constexpr double kBf16ProductsTol = 1.0 / 64;
inline constexpr double kBf16ProductsOpGradTol = 1.0 / 16;
// SMAT_CUDA_BF16_PARTS=2 (gpu_smat_parts2_test): two parts keep 16
// significant bits of each split operand, so a product term is off by at most
// 2^-16 relative, a tile's output by 2^-16 times the sum of its terms'
// magnitudes (a few times the largest output, as above): checked at 2^-14.
// Measured on an H200 (2026-12-01): up to 5.8e-6 for B7 from D_bar as
// ChunkScanBackward writes it, 1.06e-5 from ChunkBackward's D_bar (summed in
// another order).
inline bool Bf16TwoParts() {
  const char* env = std::getenv("SMAT_CUDA_BF16_PARTS");
  return env != nullptr && std::string(env) == "2";
}
inline constexpr double kBf16TwoPartsTol = 1.0 / 16384;
// Whether SMAT_CUDA_CHUNK_TILES leaves the chunk tiles of bf16 inputs on
// tensor cores (unset, "mma", "wgmma", "wgmma64"), where ungated bf16 inputs
// at r, dv <= 64 and c <= 128 are walked (ChunkStatesAndOutputs); "ffma" and
// "general" run the three phases instead.
inline bool TensorCoreChunkTiles() {
  const char* env = std::getenv("SMAT_CUDA_CHUNK_TILES");
  const std::string tiles = env != nullptr ? env : "";
  return tiles.empty() || tiles == "mma" || tiles == "wgmma" || tiles == "wgmma64";
}
// The tolerance of a phase that runs the fused bf16 tiles (the forward tile,
// NormalizedOutputs, the walk, B7) or, with one part, the per-type reads of
// bf16 rows; or of the op's o.
inline double TileTol(bool bf16, double tol) {
  if (bf16 && Bf16Products()) return std::max(tol, kBf16ProductsTol);
  if (bf16 && Bf16TwoParts()) return std::max(tol, kBf16TwoPartsTol);
  return tol;
}
// Scale floor of the op-level comparison: a gradient whose entries are all far
// below the O(1) inputs is rounding noise around an exact zero (T = 1: o = v
// whatever phi and psi are, so d_phi = d_psi = 0), compared in absolute terms.
inline constexpr double kGradScaleFloor = 0.1;

struct Case {
  ProblemSpec spec;
  bool bf16 = false;
  int64_t t0 = 0;  // span start (a multiple of chunk); the span ends at T
};

inline std::string CaseName(const Case& c) {
  return absl::StrCat(c.spec.Name(), c.bf16 ? "_bf16" : "_fp32", "_t0_", c.t0);
}

inline std::vector<Case> Cases() {
  std::vector<Case> cs;
  auto add = [&](int64_t batch, int64_t T, int64_t H, int64_t r, int64_t dv, int d, int64_t c,
                 bool gated, bool content, double eps, bool bf16, int64_t t0, uint64_t seed) {
    Case k;
    k.spec.batch = batch;
    k.spec.T = T;
    k.spec.H = H;
    k.spec.r = r;
    k.spec.dv = dv;
    k.spec.d = d;
    k.spec.chunk = c;
    k.spec.gated = gated;
    k.spec.content = content;
    k.spec.eps = eps;
    k.spec.seed = seed;
    k.bf16 = bf16;
    k.t0 = t0;
    cs.push_back(k);
  };
  add(1, 1, 2, 5, 3, 1, 16, false, false, 0.0, false, 0, 1);
  add(1, 63, 2, 60, 7, 2, 16, true, false, 0.0, false, 0, 2);
  add(1, 127, 2, 8, 5, 2, 32, true, true, 1e-3, false, 0, 3);
  add(1, 1000, 2, 60, 17, 3, 64, true, false, 0.0, false, 0, 4);
  add(1, 1031, 2, 64, 64, 2, 128, true, false, 0.0, true, 0, 5);
  add(1, 1031, 3, 60, 3, 1, 16, true, false, 1e-3, true, 0, 6);
  add(2, 1000, 3, 16, 9, 2, 64, true, true, 0.0, false, 64, 7);
  add(1, 1031, 2, 12, 6, 2, 32, false, false, 0.0, false, 320, 8);
  add(1, 1000, 2, 20, 8, 3, 64, false, true, 0.0, true, 0, 9);
  // The fast chunk tiles (smat_chunk_fast.cu: c <= 128, r, dv <= 64) at the
  // benchmark's r = dv = 64 and c = 128 with a partial last chunk: fp32 over
  // several heads and batches from a span inside the sequence, and bf16 with
  // widths that fill only part of a 16-byte staging slot (24 = 3 x 8, 16).
  add(2, 1031, 3, 64, 64, 2, 128, false, false, 0.0, false, 128, 10);
  add(1, 700, 2, 24, 16, 1, 128, true, false, 0.0, true, 0, 11);
  // The hardest case for split tensor-core products: fp32 and gated (every
  // operand of every chunk product split, the score tile scaled by the gates).
  add(1, 1031, 2, 64, 64, 2, 128, true, false, 0.0, false, 0, 12);
  // The fused tensor-core B7 of bf16 inputs (smat_chunk_bwd_mma.cu): ungated
  // over several heads and batches from a span inside the sequence; widths
  // that are not multiples of 8 (rows staged one element at a time) with a
  // single 32-column half of v_bar; and c = 64 with dv between 32 and 64, so
  // that half the warps hold only the second v_bar half of an earlier block.
  add(2, 1031, 3, 64, 64, 2, 128, false, false, 0.0, true, 128, 13);
  add(1, 1000, 2, 33, 17, 2, 128, true, false, 0.0, true, 256, 14);
  add(1, 700, 2, 40, 47, 1, 64, true, false, 0.0, true, 64, 15);
  // The bf16 outer sums of ungated inputs (smat_outer_bf16.cu): content maps
  // with vbar's ones inside the staged width (dv = 40) and r < 64; a dv that
  // is not a multiple of 8 (vbar on the general kernel, gbar on the bf16 one)
  // at d = 3 from a span inside the sequence; d = 1, whose one profile is
  // pooled in several segments.
  add(1, 1031, 2, 24, 40, 2, 64, false, true, 0.0, true, 0, 16);
  add(2, 700, 2, 56, 13, 3, 32, false, false, 1e-3, true, 32, 17);
  add(1, 1031, 2, 32, 24, 1, 16, false, false, 0.0, true, 0, 18);
  // The gate gradient's suffix sums over several 2048-token segments (a
  // span of 4636 tokens: three segments, the last one partial).
  add(1, 4700, 2, 8, 5, 2, 64, true, false, 0.0, false, 64, 19);
  // TypeReads of bf16 inputs with rows of odd width p through shared memory
  // (smat_reads_bf16.cu, StoreRowsStaged: where a block's groups hold a whole
  // tile of tokens on average, as d = 1's single type does) at the
  // benchmark's widths, gated, from a span inside the sequence.
  add(1, 2000, 2, 64, 64, 1, 128, true, false, 0.0, true, 128, 20);
  // ChunkStatesAndOutputs' walk (ungated bf16): many chunks, so that each
  // part is walked in several segments with a partial last one and a partial
  // last chunk; and r, dv off the constant widths (dv = 33 staged one element
  // at a time) with incoming states from a span inside the sequence.
  add(1, 4700, 2, 64, 64, 2, 32, false, false, 0.0, true, 0, 21);
  add(2, 2000, 2, 48, 33, 1, 128, false, false, 1e-3, true, 384, 22);
  // Positional d = 1 through the whole op: one causal block (SmatOpPlan), so
  // the walk covers every chunk in one part and reads nothing.
  add(1, 2000, 2, 64, 64, 1, 128, false, false, 0.0, true, 0, 23);
  // TypeReads with the type table held in registers (smat_reads_held_bf16.cu:
  // r = dv = 64, a whole tile of tokens per block on average): d = 2 with
  // more than 128 tokens of each type (q = 137), an odd T and a span inside
  // the sequence.
  add(1, 36001, 2, 64, 64, 2, 128, false, false, 0.0, true, 384, 24);
  // ChunkBackward writes gbar's column dv alone (a bf16 d_o), but dv = 10 is
  // no multiple of 8, so TypeReadsBackwardFromFactors declines: the op forms
  // gbar in full for TypeReadsBackward (kernels/smat.cc), gated.
  add(1, 777, 2, 16, 10, 2, 64, true, false, 0.0, true, 0, 25);
  return cs;
}

// Host tensors from doubles: fp32, or bf16 (then `rounded` receives the
// bf16 values as fp32 for the CPU side).
inline Tensor HostF32(const std::vector<double>& x, const Shape& shape) {
  return testing_util::ToF32(x, shape);
}
inline Tensor HostBf16(const std::vector<double>& x, const Shape& shape, Tensor* rounded) {
  Tensor t = Tensor::Empty(shape, DType::kBF16).value();
  *rounded = Tensor::Empty(shape, DType::kF32).value();
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t b = FloatToBf16(static_cast<float>(x[i]));
    t.data<uint16_t>()[i] = b;
    rounded->data<float>()[i] = Bf16ToFloat(b);
  }
  return t;
}

// Tokens [t0, T) of a [batch, T, H, width] vector.
template <typename V>
inline std::vector<V> SliceTokens(const std::vector<V>& x, int64_t batch, int64_t T, int64_t H,
                                  int64_t width, int64_t t0) {
  std::vector<V> out;
  for (int64_t b = 0; b < batch; ++b) {
    const auto first = x.begin() + ((b * T + t0) * H) * width;
    out.insert(out.end(), first, first + (T - t0) * H * width);
  }
  return out;
}

inline std::vector<double> Values(const Tensor& host) {
  std::vector<double> out(host.numel());
  if (host.dtype() == DType::kF32) {
    for (int64_t i = 0; i < host.numel(); ++i) out[i] = host.data<float>()[i];
  } else {
    for (int64_t i = 0; i < host.numel(); ++i) out[i] = Bf16ToFloat(host.data<uint16_t>()[i]);
  }
  return out;
}

}  // namespace smat_gpu_cases
}  // namespace smat
