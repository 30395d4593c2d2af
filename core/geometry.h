// Geometry of the SMat-Attention mask (paper Section 3, Algorithm 2, Appendix D),
// pinned to the authors' index conventions:
//
//  * boundary n = c * floor(T / 2c) for chunk width c; m = T - n recent tokens.
//  * q = the smallest prime >= k, k the smallest integer with k^d >= n (a config
//    may fix q). D = d - 1, P = q^D points; point index idx has big-endian
//    digits: coordinate x_k = (idx / q^(D-1-k)) mod q.
//  * normalized directions: nonzero points whose first nonzero coordinate is 1,
//    in increasing index order; (q^D - 1)/(q - 1) of them. Hyperplane (e, b) =
//    {x : a_e . x = b mod q} has flat index e*q + b; B = q (q^D - 1)/(q - 1).
//  * type order: first the 2^D witness hyperplanes H_R of Lemma 3 in bitmask
//    order of R (bit k set: coordinate k in R): for R not full, a_R is 0 on R
//    and 1 elsewhere, b = 0; for R full, a = all ones, b = 1. Then every other
//    flat index in increasing order.
//  * positional maps: prof(s) = s mod P (distant s < n); type(t) = (t - n) mod B
//    (recent t >= n); 0-based positions.
//  * d = 1: one point, one type, the mask is causal; n may be 0.
//
// The incidence matrix C (B x P, C[h][x] = 1 iff x lies on hyperplane h) is never
// materialized: TabulateIncidence computes U = C F in O(q^(2d-3) W) additions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace smat {

struct SmatGeometry {
  int d = 1;               // VC dimension
  int D = 0;               // d - 1, dimension of the point space
  int64_t q = 1;           // field size (prime; 1 when d = 1)
  int64_t P = 1;           // points q^D
  int64_t num_directions = 1;  // (q^D - 1)/(q - 1); 1 when d = 1
  int64_t B = 1;           // types (hyperplanes) q * num_directions; 1 when d = 1
  // directions[e * D + k]: coordinate k of normalized direction e.
  std::vector<int32_t> directions;
  // type_to_flat[h] = e*q + b of type h; flat_to_type is its inverse.
  std::vector<int32_t> type_to_flat;
  std::vector<int32_t> flat_to_type;

  int64_t nnz_C() const;                     // B * q^(D-1) (1 when d = 1)
  int32_t Coordinate(int64_t point, int k) const;  // x_k of a point index
  bool Incident(int64_t type, int64_t point) const;  // C[type][point]
  // C is the identity (d <= 2): every hyperplane holds one point, and type h's
  // is point h (d = 2: the hyperplanes {x = b} in the type order above are
  // b = 0, 1, ..., q - 1). Then U = C F is F and F_bar = C^T U_bar is U_bar,
  // and the op runs no tabulation.
  bool IncidenceIsIdentity() const { return D <= 1; }
};

// Builds the geometry for VC dimension d over F_q (q prime; ignored when d = 1).
absl::StatusOr<SmatGeometry> MakeGeometry(int d, int64_t q);

// Every size a kernel needs for one sequence length.
struct SmatPlan {
  int64_t T = 0;
  int64_t chunk = 64;            // c
  int64_t n = 0;                 // distant tokens [0, n)
  int64_t m = 0;                 // recent tokens [n, T)
  int64_t num_chunks = 0;        // chunks of [0, n) then of [n, T); chunk k covers [k c, min((k+1) c, T))
  int64_t num_distant_chunks = 0;  // n / c
  SmatGeometry geo;
  std::vector<std::string> warnings;  // e.g. "m < 2B: ..." (the plan is still valid)
};

// Validates (T, d, chunk, q) and builds the plan. q_override = 0 picks q by the
// rule above. Errors (InvalidArgument) for d >= 2: P > n ("T is too small for d"),
// d >= floor(log2 T), a given q that is not prime, chunk < 1, T < 1.
absl::StatusOr<SmatPlan> MakeSmatPlan(int64_t T, int d, int64_t chunk, int64_t q_override = 0);

bool IsPrime(int64_t x);
int64_t SmallestPrimeAtLeast(int64_t x);

// Positional maps.
inline int64_t PositionalProfile(const SmatGeometry& g, int64_t s) { return s % g.P; }
inline int64_t PositionalType(const SmatGeometry& g, int64_t n, int64_t t) { return (t - n) % g.B; }

// U[h, :] = sum_x C[h][x] F[x, :] for F [P, W] and U [B, W] (row-major, fp32 or
// fp64). Algorithm 2: for each direction a and point x, U[(a, a.x)] += F[x].
// Accumulation order is fixed (points in increasing index), so results are
// deterministic. U is overwritten.
void TabulateIncidence(const SmatGeometry& g, const float* F, float* U, int64_t W);
void TabulateIncidence(const SmatGeometry& g, const double* F, double* U, int64_t W);
// The adjoint: F_bar[x, :] = sum_h C[h][x] U_bar[h, :] (F_bar overwritten).
void TabulateIncidenceAdjoint(const SmatGeometry& g, const float* U_bar, float* F_bar, int64_t W);
void TabulateIncidenceAdjoint(const SmatGeometry& g, const double* U_bar, double* F_bar, int64_t W);

}  // namespace smat
