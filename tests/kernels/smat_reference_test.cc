// The double references against each other (dense mask vs token recurrence)
// and the dense backward against central finite differences.
#include "kernels/cpu/smat_reference.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/smat_test_util.h"

namespace smat {
namespace {

using testing_util::MaxAbs;
using testing_util::MaxRelError;
using testing_util::ProblemSpec;
using testing_util::RandomProblem;
using testing_util::RandomVector;

// Both references are double and sum the same terms in different orders (and
// the recurrence routes distant keys through F and U): agreement to ~1e-13.
constexpr double kRefTol = 1e-11;

void CheckDenseEqualsRecurrent(const ProblemSpec& s) {
  SCOPED_TRACE(s.Name());
  auto plan = MakeSmatPlan(s.T, s.d, s.chunk);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const SmatReferenceProblem pr = RandomProblem(*plan, s);
  const SmatReferenceOutputs dense = SmatDenseReference(*plan, pr);
  const SmatReferenceOutputs rec = SmatRecurrentReference(*plan, pr);
  ASSERT_GT(MaxAbs(dense.o), 0.0);
  EXPECT_LT(MaxRelError(rec.ybar, dense.ybar), kRefTol);
  EXPECT_LT(MaxRelError(rec.o, dense.o), kRefTol);
}

TEST(SmatReferenceTest, DenseEqualsRecurrence) {
  for (bool gated : {false, true}) {
    for (bool content : {false, true}) {
      CheckDenseEqualsRecurrent({.T = 1, .d = 1, .chunk = 16, .gated = gated, .content = content});
      CheckDenseEqualsRecurrent({.T = 63, .d = 1, .chunk = 16, .gated = gated, .content = content});
      CheckDenseEqualsRecurrent({.T = 63, .d = 2, .chunk = 8, .gated = gated, .content = content});
      CheckDenseEqualsRecurrent({.batch = 2, .T = 127, .H = 2, .r = 60, .dv = 5, .d = 3,
                                 .chunk = 16, .gated = gated, .content = content,
                                 .eps = 0.5});
      CheckDenseEqualsRecurrent({.T = 1031, .H = 1, .r = 4, .dv = 2, .d = 4, .chunk = 16,
                                 .gated = gated, .content = content});
    }
  }
}

// The mask itself (eq. 4, 6): causal, diagonal one, recent rows see exactly
// the distant keys on their hyperplane (checked against an explicit dot
// product over F_q, independent of SmatGeometry::Incident).
TEST(SmatReferenceTest, MaskSupportMatchesHyperplaneIncidence) {
  auto plan = MakeSmatPlan(127, 3, 8);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const ProblemSpec s{.T = 127, .d = 3, .chunk = 8};
  const SmatReferenceProblem pr = RandomProblem(*plan, s);
  const SmatGeometry& g = plan->geo;
  std::vector<double> Lambda(pr.T, 0.0);
  int64_t long_range = 0;
  for (int64_t t = 0; t < pr.T; ++t) {
    EXPECT_EQ(SmatMaskWeight(*plan, pr, 0, 0, Lambda, t, t), 1.0);
    for (int64_t s2 = 0; s2 < pr.T; ++s2) {
      const double w = SmatMaskWeight(*plan, pr, 0, 0, Lambda, t, s2);
      bool expect;
      if (s2 > t) {
        expect = false;
      } else if (t < plan->n || s2 >= plan->n) {
        expect = true;
      } else {
        const int64_t flat = g.type_to_flat[PositionalType(g, plan->n, t)];
        const int64_t e = flat / g.q, b = flat % g.q, x = PositionalProfile(g, s2);
        int64_t dot = 0;
        for (int k = 0; k < g.D; ++k) dot += g.directions[e * g.D + k] * g.Coordinate(x, k);
        expect = dot % g.q == b;
        long_range += expect;
      }
      EXPECT_EQ(w, expect ? 1.0 : 0.0) << "t=" << t << " s=" << s2;
    }
  }
  EXPECT_GT(long_range, 0);
}

// Central differences of L = sum(d_o * o) in double, every input element.
void CheckFiniteDifferences(const ProblemSpec& s) {
  SCOPED_TRACE(s.Name());
  auto plan = MakeSmatPlan(s.T, s.d, s.chunk);
  ASSERT_TRUE(plan.ok()) << plan.status();
  SmatReferenceProblem pr = RandomProblem(*plan, s);
  const std::vector<double> d_o = RandomVector(pr.batch * pr.T * pr.H * pr.dv, s.seed + 7);
  const SmatReferenceGradients g = SmatDenseReferenceBackward(*plan, pr, d_o);
  auto loss = [&]() {
    const SmatReferenceOutputs out = SmatDenseReference(*plan, pr);
    double l = 0.0;
    for (size_t i = 0; i < d_o.size(); ++i) l += d_o[i] * out.o[i];
    return l;
  };
  // Step 1e-5: truncation error O(h^2 L''') ~ 1e-10, rounding ~ 1e-16 / h ~ 1e-11.
  constexpr double kStep = 1e-5, kTol = 1e-7;
  auto check = [&](std::vector<double>* x, const std::vector<double>& grad, const char* name) {
    ASSERT_EQ(x->size(), grad.size()) << name;
    ASSERT_GT(MaxAbs(grad), 0.0) << name;
    for (size_t i = 0; i < x->size(); ++i) {
      const double keep = (*x)[i];
      (*x)[i] = keep + kStep;
      const double lp = loss();
      (*x)[i] = keep - kStep;
      const double lm = loss();
      (*x)[i] = keep;
      const double fd = (lp - lm) / (2 * kStep);
      EXPECT_NEAR(grad[i], fd, kTol * (1.0 + std::abs(fd))) << name << "[" << i << "]";
    }
  };
  check(&pr.phi, g.phi, "phi");
  check(&pr.psi, g.psi, "psi");
  check(&pr.v, g.v, "v");
  if (s.gated) {
    check(&pr.logg, g.logg, "logg");
    // logg_0 shifts every Lambda equally and no weight depends on it.
    EXPECT_NEAR(g.logg[0], 0.0, 1e-12);
  }
}

TEST(SmatReferenceTest, BackwardMatchesFiniteDifferences) {
  CheckFiniteDifferences({.T = 21, .H = 2, .r = 3, .dv = 2, .d = 1, .chunk = 4});
  CheckFiniteDifferences({.T = 21, .H = 2, .r = 3, .dv = 2, .d = 1, .chunk = 4, .gated = true,
                          .eps = 0.3});
  CheckFiniteDifferences({.T = 37, .H = 1, .r = 3, .dv = 2, .d = 2, .chunk = 4, .gated = true});
  CheckFiniteDifferences({.T = 37, .H = 1, .r = 3, .dv = 2, .d = 2, .chunk = 4, .gated = true,
                          .content = true, .eps = 0.2});
}

}  // namespace
}  // namespace smat
