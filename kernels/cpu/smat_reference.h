// Double-precision references for SMat-Attention, the ground truth every
// kernel (CPU phases, CUDA, sequence-parallel runs) is tested against.
//
// Two independent forward definitions, tested against each other:
//  * SmatDenseReference: builds the gated mask row by row (eq. 4, 6, 13) and
//    evaluates eq. 3 directly, O(T^2 (r + p)) per (sequence, head).
//  * SmatRecurrentReference: token by token, as a decoder would (Section 3.3,
//    Lemma 4 and the note after it): a running distant state, the profile table
//    F filled as distant tokens arrive (each Z_s pre-scaled by exp(Lambda_{n-1}
//    - Lambda_s)), U = C F tabulated at the boundary (Algorithm 2), then a
//    running recent state and a running read gate exp(Lambda_t - Lambda_{n-1}).
// and the exact gradient of L = sum(d_o * o) by differentiating the dense
// formula (SmatDenseReferenceBackward), itself checked by finite differences.
//
// Everything is a flat row-major std::vector<double> in the op's layout
// [batch, T, H, *]; these are test utilities, so inconsistent sizes are
// programmer errors (SMAT_CHECK), not Status.
#pragma once

#include <cstdint>
#include <vector>

#include "core/geometry.h"

namespace smat {

struct SmatReferenceProblem {
  int64_t batch = 1;
  int64_t T = 0;
  int64_t H = 1;
  int64_t r = 0;
  int64_t dv = 0;
  std::vector<double> phi;   // [batch, T, H, r]
  std::vector<double> psi;   // [batch, T, H, r]
  std::vector<double> v;     // [batch, T, H, dv]
  std::vector<double> logg;  // [batch, T, H], or empty: ungated
  std::vector<int32_t> prof;  // [batch, T, H] in [0, P), or empty: positional
  std::vector<int32_t> type;  // [batch, T, H] in [0, B), or empty: positional
  double eps = 0.0;

  int64_t p() const { return dv + 1; }
  bool gated() const { return !logg.empty(); }
  // Profile of distant token s / type of recent token t of (b, h), content
  // map when given, else positional (core/geometry.h).
  int64_t Profile(const SmatPlan& plan, int64_t b, int64_t h, int64_t s) const;
  int64_t Type(const SmatPlan& plan, int64_t b, int64_t h, int64_t t) const;
};

struct SmatReferenceOutputs {
  std::vector<double> ybar;  // [batch, T, H, p] augmented outputs (eq. 3)
  std::vector<double> o;     // [batch, T, H, dv] normalised outputs
};

struct SmatReferenceGradients {
  std::vector<double> phi;   // [batch, T, H, r]
  std::vector<double> psi;   // [batch, T, H, r]
  std::vector<double> v;     // [batch, T, H, dv]
  std::vector<double> logg;  // [batch, T, H] (empty when ungated)
};

// Mask weight M~_ts of (b, h) (eq. 13): 0 off the support, else exp(Lambda_t
// - Lambda_s) (1 when ungated). Lambda is (b, h)'s inclusive prefix of logg.
double SmatMaskWeight(const SmatPlan& plan, const SmatReferenceProblem& pr, int64_t b,
                      int64_t h, const std::vector<double>& Lambda, int64_t t, int64_t s);

SmatReferenceOutputs SmatDenseReference(const SmatPlan& plan, const SmatReferenceProblem& pr);
SmatReferenceOutputs SmatRecurrentReference(const SmatPlan& plan,
                                            const SmatReferenceProblem& pr);

// Gradients of L = sum(d_o * o), d_o [batch, T, H, dv], from the dense formula.
SmatReferenceGradients SmatDenseReferenceBackward(const SmatPlan& plan,
                                                  const SmatReferenceProblem& pr,
                                                  const std::vector<double>& d_o);

}  // namespace smat
