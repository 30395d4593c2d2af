// Geometry of the SMat-Attention mask: the finite-field point/hyperplane tables
// (paper Section 3, eq. 5 and 8), the plan that picks n, m and q for one sequence
// length, and the implicit incidence tabulation U = C F of Algorithm 2 with its
// adjoint (Appendix E). The index conventions are documented in geometry.h.
#include "core/geometry.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace smat {
namespace {

// The largest table size we accept: type and point indices are int32 in the
// kernels, and a geometry past this would not fit in memory anyway.
constexpr int64_t kMaxTableSize = int64_t{1} << 30;

// base^exp, saturated at `cap` + 1 so callers can compare against a bound
// without overflow (q^D for a large D and a mistyped T).
int64_t PowSaturated(int64_t base, int exp, int64_t cap) {
  int64_t r = 1;
  for (int i = 0; i < exp; ++i) {
    if (r > cap / base) return cap + 1;
    r *= base;
  }
  return r;
}

int FloorLog2(int64_t x) {
  int l = -1;
  while (x > 0) {
    x >>= 1;
    ++l;
  }
  return l;
}

// Dot product a_e . x mod q, x given by its point index (big-endian digits).
int64_t DotMod(const SmatGeometry& g, int64_t e, int64_t point) {
  int64_t dot = 0;
  int64_t rest = point;
  for (int k = g.D - 1; k >= 0; --k) {
    dot += g.directions[e * g.D + k] * (rest % g.q);
    rest /= g.q;
  }
  return dot % g.q;
}

// Algorithm 2 for one element type: for each direction a (in parallel in the
// paper, in index order here so the sum order is fixed), walk the points in
// increasing index with a base-q counter, keeping a.x up to date as digits
// change (amortised O(1) field operations per point), and add F[x] to the row of
// hyperplane (a, a.x). Rows are addressed in type order through flat_to_type.
template <typename T>
void Tabulate(const SmatGeometry& g, const T* F, T* U, int64_t W) {
  if (g.d == 1) {
    std::copy(F, F + W, U);
    return;
  }
  std::fill(U, U + g.B * W, T(0));
  std::vector<int64_t> digits(g.D);
  for (int64_t e = 0; e < g.num_directions; ++e) {
    const int32_t* a = &g.directions[e * g.D];
    std::fill(digits.begin(), digits.end(), 0);
    int64_t dot = 0;  // a . x mod q for the current x
    for (int64_t x = 0; x < g.P; ++x) {
      T* u = U + static_cast<int64_t>(g.flat_to_type[e * g.q + dot]) * W;
      const T* f = F + x * W;
      for (int64_t w = 0; w < W; ++w) u[w] += f[w];
      // Base-q increment of the big-endian digits: the last coordinate moves fastest.
      for (int k = g.D - 1; k >= 0; --k) {
        ++digits[k];
        dot += a[k];
        if (digits[k] < g.q) break;
        digits[k] = 0;
        dot -= g.q * a[k];  // the digit wrapped from q-1 back to 0
      }
      dot %= g.q;
      if (dot < 0) dot += g.q;
    }
  }
}

// The adjoint F_bar = C^T U_bar (Appendix E): the same walk with the roles of
// source and destination exchanged. Directions are visited in increasing order
// for each point's accumulation, which fixes the sum order.
template <typename T>
void TabulateAdjoint(const SmatGeometry& g, const T* U_bar, T* F_bar, int64_t W) {
  if (g.d == 1) {
    std::copy(U_bar, U_bar + W, F_bar);
    return;
  }
  std::fill(F_bar, F_bar + g.P * W, T(0));
  std::vector<int64_t> digits(g.D);
  for (int64_t e = 0; e < g.num_directions; ++e) {
    const int32_t* a = &g.directions[e * g.D];
    std::fill(digits.begin(), digits.end(), 0);
    int64_t dot = 0;
    for (int64_t x = 0; x < g.P; ++x) {
      const T* u = U_bar + static_cast<int64_t>(g.flat_to_type[e * g.q + dot]) * W;
      T* f = F_bar + x * W;
      for (int64_t w = 0; w < W; ++w) f[w] += u[w];
      for (int k = g.D - 1; k >= 0; --k) {
        ++digits[k];
        dot += a[k];
        if (digits[k] < g.q) break;
        digits[k] = 0;
        dot -= g.q * a[k];
      }
      dot %= g.q;
      if (dot < 0) dot += g.q;
    }
  }
}

}  // namespace

bool IsPrime(int64_t x) {
  if (x < 2) return false;
  for (int64_t f = 2; f * f <= x; ++f) {
    if (x % f == 0) return false;
  }
  return true;
}

int64_t SmallestPrimeAtLeast(int64_t x) {
  int64_t p = std::max<int64_t>(x, 2);
  while (!IsPrime(p)) ++p;
  return p;
}

int64_t SmatGeometry::nnz_C() const {
  if (d == 1) return 1;
  // Every hyperplane holds q^(D-1) points.
  int64_t per = 1;
  for (int i = 0; i < D - 1; ++i) per *= q;
  return B * per;
}

int32_t SmatGeometry::Coordinate(int64_t point, int k) const {
  SMAT_CHECK(k >= 0 && k < D && point >= 0 && point < P);
  int64_t div = 1;
  for (int i = 0; i < D - 1 - k; ++i) div *= q;
  return static_cast<int32_t>((point / div) % q);
}

bool SmatGeometry::Incident(int64_t type, int64_t point) const {
  SMAT_CHECK(type >= 0 && type < B && point >= 0 && point < P);
  if (d == 1) return true;
  const int64_t flat = type_to_flat[type];
  return DotMod(*this, flat / q, point) == flat % q;
}

absl::StatusOr<SmatGeometry> MakeGeometry(int d, int64_t q) {
  if (d < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat: VC dimension d must be >= 1; got d = ", d));
  }
  SmatGeometry g;
  g.d = d;
  g.D = d - 1;
  if (d == 1) {
    // Eq. 5 with d = 1: F_q^0 is one point, one type (the whole space); M = L_T.
    g.q = 1;
    g.P = 1;
    g.num_directions = 1;
    g.B = 1;
    g.type_to_flat = {0};
    g.flat_to_type = {0};
    return g;
  }
  if (!IsPrime(q)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat: field size q = ", q, " is not prime; use a prime such as ",
        SmallestPrimeAtLeast(q), " (or leave q unset to pick it from T and d)"));
  }
  g.q = q;
  g.P = PowSaturated(q, g.D, kMaxTableSize);
  if (g.P > kMaxTableSize || q * g.P > kMaxTableSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat: geometry q = ", q, ", d = ", d,
                     " has more than 2^30 points or types; use a smaller d or q"));
  }
  g.num_directions = (g.P - 1) / (q - 1);
  g.B = q * g.num_directions;

  // Normalized directions: nonzero points whose first nonzero coordinate is 1,
  // in increasing point index.
  g.directions.reserve(g.num_directions * g.D);
  for (int64_t idx = 1; idx < g.P; ++idx) {
    int first = -1;
    for (int k = 0; k < g.D; ++k) {
      const int32_t c = g.Coordinate(idx, k);
      if (c != 0) {
        first = c;
        break;
      }
    }
    if (first != 1) continue;
    for (int k = 0; k < g.D; ++k) g.directions.push_back(g.Coordinate(idx, k));
  }
  SMAT_CHECK(static_cast<int64_t>(g.directions.size()) == g.num_directions * g.D);

  // Type order: the 2^D witness hyperplanes H_R of Lemma 3 (eq. 14) first, in
  // bitmask order of R, then every other flat index in increasing order.
  // Index of the direction with 0/1 coordinates: its point index is the
  // big-endian number with digit 1 where the coordinate is 1; look it up.
  auto direction_index = [&g](const std::vector<int32_t>& a) -> int64_t {
    for (int64_t e = 0; e < g.num_directions; ++e) {
      if (std::equal(a.begin(), a.end(), g.directions.begin() + e * g.D)) return e;
    }
    return -1;
  };
  g.flat_to_type.assign(g.B, -1);
  int32_t next_type = 0;
  const int64_t num_witness = int64_t{1} << g.D;
  for (int64_t R = 0; R < num_witness; ++R) {
    std::vector<int32_t> a(g.D);
    int64_t b;
    if (R == num_witness - 1) {
      std::fill(a.begin(), a.end(), 1);  // R = [D]: sum of all coordinates = 1
      b = 1;
    } else {
      for (int k = 0; k < g.D; ++k) a[k] = (R >> k) & 1 ? 0 : 1;  // sum over l not in R = 0
      b = 0;
    }
    const int64_t e = direction_index(a);
    SMAT_CHECK(e >= 0);
    const int64_t flat = e * q + b;
    SMAT_CHECK(g.flat_to_type[flat] == -1);
    g.flat_to_type[flat] = next_type++;
  }
  for (int64_t flat = 0; flat < g.B; ++flat) {
    if (g.flat_to_type[flat] == -1) g.flat_to_type[flat] = next_type++;
  }
  g.type_to_flat.assign(g.B, -1);
  for (int64_t flat = 0; flat < g.B; ++flat) g.type_to_flat[g.flat_to_type[flat]] = flat;
  return g;
}

absl::StatusOr<SmatPlan> MakeSmatPlan(int64_t T, int d, int64_t chunk, int64_t q_override) {
  if (T < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat: sequence length T must be >= 1; got T = ", T));
  }
  if (chunk < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat: chunk width must be >= 1; got chunk = ", chunk));
  }
  if (d < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat: VC dimension d must be >= 1; got d = ", d));
  }
  if (q_override < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat: field size q must be a prime (or 0 to pick it from T and d); got q = ",
        q_override));
  }
  SmatPlan plan;
  plan.T = T;
  plan.chunk = chunk;
  plan.n = chunk * (T / (2 * chunk));  // no chunk crosses the boundary (Section 3.1)
  plan.m = T - plan.n;
  plan.num_distant_chunks = plan.n / chunk;
  plan.num_chunks = plan.num_distant_chunks + (plan.m + chunk - 1) / chunk;

  if (d == 1) {
    SMAT_ASSIGN_OR_RETURN(plan.geo, MakeGeometry(1, 1));
    return plan;
  }
  const int log2_T = FloorLog2(T);
  if (d >= log2_T) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat: d = ", d, " needs d < floor(log2 T) (Theorem 3.1); T = ", T,
        " allows d <= ", std::max(1, log2_T - 1), "; use a longer sequence or smaller d"));
  }
  int64_t q = q_override;
  if (q == 0) {
    // The smallest k with k^d >= n, then the smallest prime >= k (q = Theta(n^(1/d))).
    int64_t k = 1;
    while (PowSaturated(k, d, plan.n) < plan.n) ++k;
    q = SmallestPrimeAtLeast(k);
  } else if (!IsPrime(q)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat: q = ", q, " is not prime; use a prime such as ", SmallestPrimeAtLeast(q),
        " or leave q unset to pick it from T and d"));
  }
  const int64_t P = PowSaturated(q, d - 1, std::max<int64_t>(plan.n, kMaxTableSize));
  if (P > plan.n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "smat: T is too small for d = ", d, ": d = ", d, " with q = ", q,
        " needs n >= P = q^(d-1) = ", P, " distant tokens; T = ", T, " with chunk ", chunk,
        " gives n = ", plan.n, "; use a longer sequence, a smaller chunk or a smaller d"));
  }
  SMAT_ASSIGN_OR_RETURN(plan.geo, MakeGeometry(d, q));
  if (plan.m < 2 * plan.geo.B) {
    plan.warnings.push_back(absl::StrCat(
        "m < 2B: only m = ", plan.m, " recent tokens for B = ", plan.geo.B,
        " types, so not every type is read twice and the mask may have VC dimension "
        "below d = ", d, " (Theorem 3.1 assumes 2B <= m); use a longer sequence or a smaller d"));
  }
  return plan;
}

void TabulateIncidence(const SmatGeometry& g, const float* F, float* U, int64_t W) {
  Tabulate(g, F, U, W);
}
void TabulateIncidence(const SmatGeometry& g, const double* F, double* U, int64_t W) {
  Tabulate(g, F, U, W);
}
void TabulateIncidenceAdjoint(const SmatGeometry& g, const float* U_bar, float* F_bar,
                              int64_t W) {
  TabulateAdjoint(g, U_bar, F_bar, W);
}
void TabulateIncidenceAdjoint(const SmatGeometry& g, const double* U_bar, double* F_bar,
                              int64_t W) {
  TabulateAdjoint(g, U_bar, F_bar, W);
}

}  // namespace smat
