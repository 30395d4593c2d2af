// Tests of the SMat geometry (core/geometry.h): the index conventions pinned
// against hand-worked tables, the incidence properties of affine hyperplanes
// over F_q, Algorithm 2 (U = C F) and its adjoint against a brute-force C, the
// plan's errors and warning, and Theorem 3.1 (VC(M) = d, M^(1) = L_T) checked
// by brute-force shattering on small masks built with the positional maps.
#include "core/geometry.h"

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "gtest/gtest.h"

namespace smat {
namespace {

// Membership computed from scratch (coordinates and the direction table), so
// it does not share code with SmatGeometry::Incident or TabulateIncidence.
bool OnHyperplane(const SmatGeometry& g, int64_t type, int64_t point) {
  if (g.d == 1) return true;
  const int64_t flat = g.type_to_flat[type];
  const int64_t e = flat / g.q, b = flat % g.q;
  int64_t dot = 0;
  for (int k = 0; k < g.D; ++k) dot += g.directions[e * g.D + k] * g.Coordinate(point, k);
  return dot % g.q == b;
}

struct QD {
  int64_t q;
  int d;
};
const std::vector<QD> kGeometries = {{2, 2}, {3, 2}, {7, 2}, {2, 3}, {3, 3},
                                     {5, 3}, {2, 4}, {3, 4}, {2, 5}};

TEST(GeometryTest, PrimesAndFieldSize) {
  EXPECT_FALSE(IsPrime(0));
  EXPECT_FALSE(IsPrime(1));
  EXPECT_TRUE(IsPrime(2));
  EXPECT_TRUE(IsPrime(97));
  EXPECT_FALSE(IsPrime(91));
  EXPECT_EQ(SmallestPrimeAtLeast(0), 2);
  EXPECT_EQ(SmallestPrimeAtLeast(4), 5);
  EXPECT_EQ(SmallestPrimeAtLeast(90), 97);
}

// q = 3, d = 2 by hand: D = 1, P = 3, one direction (1), B = 3. Witness
// hyperplanes: R = {} -> x = 0 (flat 0); R = [1] -> x = 1 (flat 1); then flat 2.
TEST(GeometryTest, HandTableQ3D2) {
  auto g = MakeGeometry(2, 3);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->D, 1);
  EXPECT_EQ(g->P, 3);
  EXPECT_EQ(g->num_directions, 1);
  EXPECT_EQ(g->B, 3);
  EXPECT_EQ(g->directions, std::vector<int32_t>({1}));
  EXPECT_EQ(g->type_to_flat, std::vector<int32_t>({0, 1, 2}));
  EXPECT_EQ(g->nnz_C(), 3);
  for (int h = 0; h < 3; ++h)
    for (int x = 0; x < 3; ++x) EXPECT_EQ(g->Incident(h, x), h == x) << h << " " << x;
}

// q = 3, d = 3 by hand: D = 2, point idx = 3 x_0 + x_1. Normalized directions in
// index order: idx 1 (0,1), 3 (1,0), 4 (1,1), 5 (1,2). Witness hyperplanes (eq. 14):
// R = {}      -> x0 + x1 = 0: direction 2, b 0, flat 6
// R = {0}     -> x1 = 0:      direction 0, b 0, flat 0
// R = {1}     -> x0 = 0:      direction 1, b 0, flat 3
// R = {0, 1}  -> x0 + x1 = 1: direction 2, b 1, flat 7
// then the remaining flat indices 1, 2, 4, 5, 8, 9, 10, 11.
TEST(GeometryTest, HandTableQ3D3) {
  auto g = MakeGeometry(3, 3);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->P, 9);
  EXPECT_EQ(g->num_directions, 4);
  EXPECT_EQ(g->B, 12);
  EXPECT_EQ(g->directions, std::vector<int32_t>({0, 1, 1, 0, 1, 1, 1, 2}));
  EXPECT_EQ(g->type_to_flat, std::vector<int32_t>({6, 0, 3, 7, 1, 2, 4, 5, 8, 9, 10, 11}));
  for (int h = 0; h < 12; ++h) EXPECT_EQ(g->flat_to_type[g->type_to_flat[h]], h);
  EXPECT_EQ(g->Coordinate(5, 0), 1);
  EXPECT_EQ(g->Coordinate(5, 1), 2);
  EXPECT_EQ(g->nnz_C(), 36);
  // e_1 = (1,0) is point 3, e_2 = (0,1) is point 1: e_l lies on H_R iff l in R.
  EXPECT_FALSE(g->Incident(0, 3));
  EXPECT_FALSE(g->Incident(0, 1));
  EXPECT_TRUE(g->Incident(1, 3));
  EXPECT_FALSE(g->Incident(1, 1));
  EXPECT_FALSE(g->Incident(2, 3));
  EXPECT_TRUE(g->Incident(2, 1));
  EXPECT_TRUE(g->Incident(3, 3));
  EXPECT_TRUE(g->Incident(3, 1));
  // Type 4 is flat 1: direction (0,1), b = 1, i.e. x1 = 1: points 1, 4, 7.
  for (int x = 0; x < 9; ++x) EXPECT_EQ(g->Incident(4, x), x % 3 == 1) << x;

  // The positional maps on a plan with this geometry: T = 40, chunk 4 gives
  // n = 4 * floor(40 / 8) = 20, k = 3 (3^3 = 27 >= 20), q = 3, m = 20 < 2B = 24.
  auto plan = MakeSmatPlan(40, 3, 4);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->n, 20);
  EXPECT_EQ(plan->m, 20);
  EXPECT_EQ(plan->geo.q, 3);
  EXPECT_EQ(plan->num_distant_chunks, 5);
  EXPECT_EQ(plan->num_chunks, 10);
  ASSERT_EQ(plan->warnings.size(), 1u);
  EXPECT_NE(plan->warnings[0].find("m < 2B"), std::string::npos);
  EXPECT_EQ(PositionalProfile(plan->geo, 13), 4);  // (1,1)
  EXPECT_EQ(PositionalType(plan->geo, plan->n, 35), 3);  // (35-20) mod 12: x0+x1 = 1
  EXPECT_EQ(PositionalType(plan->geo, plan->n, 20), 0);
  EXPECT_FALSE(plan->geo.Incident(3, PositionalProfile(plan->geo, 13)));
  EXPECT_TRUE(plan->geo.Incident(3, PositionalProfile(plan->geo, 12)));  // (1,0)
}

TEST(GeometryTest, IncidenceCounts) {
  for (const QD& c : kGeometries) {
    auto g = MakeGeometry(c.d, c.q);
    ASSERT_TRUE(g.ok()) << g.status();
    const int64_t q = c.q;
    int64_t per_plane = 1;  // q^(D-1)
    for (int i = 0; i < g->D - 1; ++i) per_plane *= q;
    EXPECT_EQ(g->B, q * (g->P - 1) / (q - 1));
    int64_t nnz = 0;
    for (int64_t h = 0; h < g->B; ++h) {
      int64_t count = 0;
      for (int64_t x = 0; x < g->P; ++x) {
        const bool on = OnHyperplane(*g, h, x);
        EXPECT_EQ(on, g->Incident(h, x));
        count += on;
      }
      EXPECT_EQ(count, per_plane) << "q=" << q << " d=" << c.d << " type " << h;
      nnz += count;
    }
    for (int64_t x = 0; x < g->P; ++x) {
      int64_t count = 0;
      for (int64_t h = 0; h < g->B; ++h) count += OnHyperplane(*g, h, x);
      EXPECT_EQ(count, g->num_directions);  // (q^D - 1)/(q - 1)
    }
    EXPECT_EQ(nnz, g->nnz_C());
    // Directions are normalized, distinct and increasing as points.
    int64_t last = -1;
    for (int64_t e = 0; e < g->num_directions; ++e) {
      int64_t idx = 0;
      int first = 0;
      for (int k = 0; k < g->D; ++k) {
        const int a = g->directions[e * g->D + k];
        idx = idx * q + a;
        if (first == 0) first = a;
      }
      EXPECT_EQ(first, 1);
      EXPECT_GT(idx, last);
      last = idx;
    }
  }
}

TEST(GeometryTest, TabulationMatchesBruteForce) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  const int64_t W = 7;  // odd width so a row-stride mix-up cannot hide
  for (const QD& c : kGeometries) {
    auto g = MakeGeometry(c.d, c.q);
    ASSERT_TRUE(g.ok()) << g.status();
    std::vector<double> F(g->P * W), U_bar(g->B * W);
    for (double& f : F) f = u(rng);
    for (double& v : U_bar) v = u(rng);
    std::vector<double> U(g->B * W, 99.0), F_bar(g->P * W, 99.0);  // poisoned
    TabulateIncidence(*g, F.data(), U.data(), W);
    TabulateIncidenceAdjoint(*g, U_bar.data(), F_bar.data(), W);
    std::vector<double> U_ref(g->B * W, 0.0), F_bar_ref(g->P * W, 0.0);
    for (int64_t h = 0; h < g->B; ++h)
      for (int64_t x = 0; x < g->P; ++x)
        if (OnHyperplane(*g, h, x))
          for (int64_t w = 0; w < W; ++w) {
            U_ref[h * W + w] += F[x * W + w];
            F_bar_ref[x * W + w] += U_bar[h * W + w];
          }
    // Double sums of at most P terms in (-1, 1): 1e-12 absolute is far above the
    // rounding error (~P * 2^-53) and far below any wrong term (O(1)).
    double norm = 0;
    for (int64_t i = 0; i < g->B * W; ++i) {
      EXPECT_NEAR(U[i], U_ref[i], 1e-12) << "q=" << c.q << " d=" << c.d << " i=" << i;
      norm += U[i] * U[i];
    }
    for (int64_t i = 0; i < g->P * W; ++i) EXPECT_NEAR(F_bar[i], F_bar_ref[i], 1e-12);
    EXPECT_GT(norm, 0.0);

    // fp32 overload: integer-valued inputs make every sum exact.
    std::vector<float> Ff(g->P * W), Uf(g->B * W), Ubf(g->B * W), Fbf(g->P * W);
    for (int64_t i = 0; i < g->P * W; ++i) Ff[i] = static_cast<float>(static_cast<int>(rng() % 9) - 4);
    for (int64_t i = 0; i < g->B * W; ++i) Ubf[i] = static_cast<float>(static_cast<int>(rng() % 9) - 4);
    TabulateIncidence(*g, Ff.data(), Uf.data(), W);
    TabulateIncidenceAdjoint(*g, Ubf.data(), Fbf.data(), W);
    for (int64_t h = 0; h < g->B; ++h)
      for (int64_t w = 0; w < W; ++w) {
        float ref = 0;
        for (int64_t x = 0; x < g->P; ++x)
          if (OnHyperplane(*g, h, x)) ref += Ff[x * W + w];
        ASSERT_EQ(Uf[h * W + w], ref);
      }
    for (int64_t x = 0; x < g->P; ++x)
      for (int64_t w = 0; w < W; ++w) {
        float ref = 0;
        for (int64_t h = 0; h < g->B; ++h)
          if (OnHyperplane(*g, h, x)) ref += Ubf[h * W + w];
        ASSERT_EQ(Fbf[x * W + w], ref);
      }
  }
}

TEST(GeometryTest, DOneIsOnePointOneType) {
  auto g = MakeGeometry(1, 0);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->P, 1);
  EXPECT_EQ(g->B, 1);
  EXPECT_EQ(g->nnz_C(), 1);
  double F[3] = {1.5, -2.0, 3.25}, U[3] = {0, 0, 0};
  TabulateIncidence(*g, F, U, 3);
  EXPECT_EQ(U[0], 1.5);
  EXPECT_EQ(U[2], 3.25);
  for (int64_t T : {1, 2, 3, 17, 1000}) {
    auto plan = MakeSmatPlan(T, 1, 64);
    ASSERT_TRUE(plan.ok()) << "T=" << T << " " << plan.status();
    EXPECT_EQ(plan->n + plan->m, T);
    EXPECT_TRUE(plan->warnings.empty());
  }
  EXPECT_EQ(MakeSmatPlan(3, 1, 64)->n, 0);
}

// The op skips the tabulation where C is the identity: d = 1 and d = 2 at
// several q (C checked entry by entry), and not from d = 3 on.
TEST(GeometryTest, IncidenceIsIdentityExactlyForDUpToTwo) {
  for (auto [d, q] : std::vector<std::pair<int, int64_t>>{
           {1, 0}, {2, 2}, {2, 3}, {2, 7}, {2, 31}, {2, 521}, {3, 3}, {3, 5}, {4, 3}}) {
    auto g = MakeGeometry(d, q);
    ASSERT_TRUE(g.ok()) << g.status();
    bool identity = g->B == g->P;
    for (int64_t h = 0; h < g->B && identity; ++h)
      for (int64_t x = 0; x < g->P && identity; ++x) identity = g->Incident(h, x) == (h == x);
    EXPECT_EQ(g->IncidenceIsIdentity(), identity) << "d=" << d << " q=" << q;
    EXPECT_EQ(g->IncidenceIsIdentity(), d <= 2) << "d=" << d << " q=" << q;
    if (identity) {
      // TabulateIncidence then copies F: U = F exactly.
      std::vector<double> F(g->P * 2), U(g->B * 2, 0.0);
      for (size_t i = 0; i < F.size(); ++i) F[i] = 0.5 + 1.25 * static_cast<double>(i);
      TabulateIncidence(*g, F.data(), U.data(), 2);
      EXPECT_EQ(U, F) << "d=" << d << " q=" << q;
    }
  }
}

TEST(GeometryTest, PlanPicksQ) {
  // T = 1000, chunk 64: n = 64 * floor(1000/128) = 448. d = 2: k = 22 (22^2 = 484),
  // q = 23, P = 23, B = 23. d = 3: k = 8 (512 >= 448), q = 11, P = 121, B = 11*12 = 132.
  auto p2 = MakeSmatPlan(1000, 2, 64);
  ASSERT_TRUE(p2.ok()) << p2.status();
  EXPECT_EQ(p2->n, 448);
  EXPECT_EQ(p2->m, 552);
  EXPECT_EQ(p2->geo.q, 23);
  EXPECT_EQ(p2->geo.B, 23);
  EXPECT_TRUE(p2->warnings.empty());
  auto p3 = MakeSmatPlan(1000, 3, 64);
  ASSERT_TRUE(p3.ok()) << p3.status();
  EXPECT_EQ(p3->geo.q, 11);
  EXPECT_EQ(p3->geo.P, 121);
  EXPECT_EQ(p3->geo.B, 132);
  EXPECT_TRUE(p3->warnings.empty());  // m = 552 >= 264
  EXPECT_EQ(p3->num_chunks, 7 + 9);   // 448/64 + ceil(552/64)
  auto p3q = MakeSmatPlan(1000, 3, 64, 13);
  ASSERT_TRUE(p3q.ok());
  EXPECT_EQ(p3q->geo.q, 13);
}

TEST(GeometryTest, PlanErrors) {
  // P > n: T = 200, chunk 64 -> n = 64; q = 11 forces P = 121.
  auto small = MakeSmatPlan(200, 3, 64, 11);
  ASSERT_FALSE(small.ok());
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("T is too small for d = 3"), std::string::npos)
      << small.status();
  EXPECT_NE(small.status().message().find("n = 64"), std::string::npos);
  // T = 100, chunk 64: n = 0 < P.
  EXPECT_FALSE(MakeSmatPlan(100, 2, 64).ok());
  // d >= floor(log2 T): T = 31 -> floor(log2) = 4.
  auto big_d = MakeSmatPlan(31, 4, 1);
  ASSERT_FALSE(big_d.ok());
  EXPECT_NE(big_d.status().message().find("floor(log2 T)"), std::string::npos) << big_d.status();
  // q not prime.
  auto bad_q = MakeSmatPlan(1000, 2, 64, 9);
  ASSERT_FALSE(bad_q.ok());
  EXPECT_NE(bad_q.status().message().find("not prime"), std::string::npos);
  EXPECT_FALSE(MakeGeometry(2, 4).ok());
  EXPECT_FALSE(MakeGeometry(0, 2).ok());
  EXPECT_FALSE(MakeSmatPlan(0, 1, 64).ok());
  EXPECT_FALSE(MakeSmatPlan(10, 1, 0).ok());
  EXPECT_FALSE(MakeSmatPlan(10, 0, 4).ok());
}

// ---- Theorem 3.1 by brute force ------------------------------------------------

// The binary T x T mask of eq. 4 with positional maps; rows as key bitmasks (T <= 64).
std::vector<uint64_t> BuildMask(const SmatPlan& p) {
  std::vector<uint64_t> rows(p.T, 0);
  for (int64_t t = 0; t < p.T; ++t) {
    for (int64_t s = 0; s <= t; ++s) {
      bool on;
      if (t < p.n || s >= p.n) {
        on = true;  // the two causal triangles L_n, L_m
      } else {
        on = p.geo.Incident(PositionalType(p.geo, p.n, t), PositionalProfile(p.geo, s));
      }
      if (on) rows[t] |= uint64_t{1} << s;
    }
  }
  return rows;
}

// VC dimension by level-wise enumeration: every subset of a shattered set is
// shattered, so the shattered (k+1)-sets are extensions of shattered k-sets by a
// larger key. Traces are counted in a 2^(k+1)-bit bitmap (k + 1 <= 6).
int VcDimension(const std::vector<uint64_t>& rows, int64_t T, int* max_level_count) {
  std::vector<std::vector<int>> level = {{}};
  int vc = 0;
  std::vector<uint32_t> pattern(rows.size());
  while (true) {
    std::vector<std::vector<int>> next;
    for (const std::vector<int>& S : level) {
      for (size_t r = 0; r < rows.size(); ++r) {
        uint32_t pat = 0;
        for (int j : S) pat = pat * 2 + ((rows[r] >> j) & 1);
        pattern[r] = pat;
      }
      const int start = S.empty() ? 0 : S.back() + 1;
      const uint64_t need = 1u << (S.size() + 1);
      for (int j = start; j < T; ++j) {
        uint64_t seen = 0;
        for (size_t r = 0; r < rows.size(); ++r)
          seen |= uint64_t{1} << (pattern[r] * 2 + ((rows[r] >> j) & 1));
        if (static_cast<uint64_t>(__builtin_popcountll(seen)) == need) {
          std::vector<int> S2 = S;
          S2.push_back(j);
          next.push_back(std::move(S2));
        }
      }
    }
    if (next.empty()) break;
    ++vc;
    *max_level_count = static_cast<int>(next.size());
    SMAT_CHECK(vc < 6);  // bitmap width
    level = std::move(next);
  }
  return vc;
}

TEST(GeometryTest, DOneMaskIsCausal) {
  for (int64_t T : {2, 9, 31}) {
    auto p = MakeSmatPlan(T, 1, 4);
    ASSERT_TRUE(p.ok());
    std::vector<uint64_t> rows = BuildMask(*p);
    for (int64_t t = 0; t < T; ++t) EXPECT_EQ(rows[t], (uint64_t{2} << t) - 1) << t;
    int count = 0;
    EXPECT_EQ(VcDimension(rows, T, &count), 1);
  }
}

struct VcCase {
  int64_t T;
  int d;
  int64_t chunk;
  int64_t q;  // 0: picked from (T, d)
};

TEST(GeometryTest, MaskVcDimensionIsD) {
  // Sizes with m >= B + 2^D so every witness type occurs before and after some
  // recent index tau (the lower-bound construction of Appendix D).
  const std::vector<VcCase> cases = {
      {40, 2, 4, 0},  // n = 20, q = 5, B = 5
      {33, 2, 2, 3},  // n = 16, q = 3 (odd T)
      {64, 3, 4, 3},  // n = 32, P = 9, B = 12
      {45, 3, 2, 2},  // n = 22, P = 4, B = 6
      {64, 4, 8, 2},  // n = 32, P = 8, B = 14
  };
  for (const VcCase& c : cases) {
    auto p = MakeSmatPlan(c.T, c.d, c.chunk, c.q);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_GE(p->m, p->geo.B + (1 << (c.d - 1)));
    std::vector<uint64_t> rows = BuildMask(*p);
    // Causal with unit diagonal (Theorem 3.1 (i)).
    for (int64_t t = 0; t < c.T; ++t) {
      EXPECT_EQ(rows[t] >> t, 1u) << t;
    }
    int count = 0;
    EXPECT_EQ(VcDimension(rows, c.T, &count), c.d) << "T=" << c.T << " d=" << c.d;
    EXPECT_GT(count, 0);
  }
}

}  // namespace
}  // namespace smat
