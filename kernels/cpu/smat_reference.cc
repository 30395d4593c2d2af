// Double-precision references for SMat-Attention: the dense masked formula,
// the token-by-token recurrence, and the dense backward (see the header).
#include "kernels/cpu/smat_reference.h"

#include <cmath>
#include <vector>

#include "core/status.h"

namespace smat {
namespace {

// Flat index of (b, t, h) in a [batch, T, H] tensor.
int64_t Row(const SmatReferenceProblem& pr, int64_t b, int64_t t, int64_t h) {
  return (b * pr.T + t) * pr.H + h;
}

void CheckSizes(const SmatPlan& plan, const SmatReferenceProblem& pr) {
  SMAT_CHECK(plan.T == pr.T);
  const int64_t rows = pr.batch * pr.T * pr.H;
  SMAT_CHECK(static_cast<int64_t>(pr.phi.size()) == rows * pr.r);
  SMAT_CHECK(static_cast<int64_t>(pr.psi.size()) == rows * pr.r);
  SMAT_CHECK(static_cast<int64_t>(pr.v.size()) == rows * pr.dv);
  SMAT_CHECK(pr.logg.empty() || static_cast<int64_t>(pr.logg.size()) == rows);
  SMAT_CHECK(pr.prof.empty() || static_cast<int64_t>(pr.prof.size()) == rows);
  SMAT_CHECK(pr.type.empty() || static_cast<int64_t>(pr.type.size()) == rows);
}

// Lambda_t = sum_{s <= t} logg_s of (b, h); zeros when ungated.
std::vector<double> PrefixLogDecay(const SmatReferenceProblem& pr, int64_t b, int64_t h) {
  std::vector<double> Lambda(pr.T, 0.0);
  if (!pr.gated()) return Lambda;
  double acc = 0.0;
  for (int64_t t = 0; t < pr.T; ++t) {
    acc += pr.logg[Row(pr, b, t, h)];
    Lambda[t] = acc;
  }
  return Lambda;
}

double Dot(const double* a, const double* b, int64_t k) {
  double s = 0.0;
  for (int64_t i = 0; i < k; ++i) s += a[i] * b[i];
  return s;
}

// vbar_s . g with vbar_s = [v_s, 1].
double DotVbar(const SmatReferenceProblem& pr, int64_t row, const double* g) {
  return Dot(&pr.v[row * pr.dv], g, pr.dv) + g[pr.dv];
}

void Normalise(const SmatReferenceProblem& pr, SmatReferenceOutputs* out) {
  const int64_t rows = pr.batch * pr.T * pr.H, p = pr.p();
  out->o.assign(rows * pr.dv, 0.0);
  for (int64_t i = 0; i < rows; ++i) {
    const double den = out->ybar[i * p + pr.dv] + pr.eps;
    for (int64_t k = 0; k < pr.dv; ++k) out->o[i * pr.dv + k] = out->ybar[i * p + k] / den;
  }
}

}  // namespace

int64_t SmatReferenceProblem::Profile(const SmatPlan& plan, int64_t b, int64_t h,
                                      int64_t s) const {
  if (prof.empty()) return PositionalProfile(plan.geo, s);
  const int64_t x = prof[Row(*this, b, s, h)];
  SMAT_CHECK(x >= 0 && x < plan.geo.P);
  return x;
}

int64_t SmatReferenceProblem::Type(const SmatPlan& plan, int64_t b, int64_t h,
                                   int64_t t) const {
  if (type.empty()) return PositionalType(plan.geo, plan.n, t);
  const int64_t y = type[Row(*this, b, t, h)];
  SMAT_CHECK(y >= 0 && y < plan.geo.B);
  return y;
}

double SmatMaskWeight(const SmatPlan& plan, const SmatReferenceProblem& pr, int64_t b,
                      int64_t h, const std::vector<double>& Lambda, int64_t t, int64_t s) {
  if (s > t) return 0.0;
  bool visible;
  if (t < plan.n) {
    visible = true;  // distant row: L_n (eq. 4)
  } else if (s >= plan.n) {
    visible = true;  // recent row, recent key: L_m
  } else {
    // Recent row, distant key: G_ts = C[type(t)][prof(s)] (eq. 6, 8).
    visible = plan.geo.Incident(pr.Type(plan, b, h, t), pr.Profile(plan, b, h, s));
  }
  if (!visible) return 0.0;
  // Eq. 13; t >= s, so the exponent is <= 0 (Lemma 4).
  return pr.gated() ? std::exp(Lambda[t] - Lambda[s]) : 1.0;
}

SmatReferenceOutputs SmatDenseReference(const SmatPlan& plan, const SmatReferenceProblem& pr) {
  CheckSizes(plan, pr);
  const int64_t p = pr.p(), r = pr.r;
  SmatReferenceOutputs out;
  out.ybar.assign(pr.batch * pr.T * pr.H * p, 0.0);
  for (int64_t b = 0; b < pr.batch; ++b) {
    for (int64_t h = 0; h < pr.H; ++h) {
      const std::vector<double> Lambda = PrefixLogDecay(pr, b, h);
      for (int64_t t = 0; t < pr.T; ++t) {
        const int64_t rt = Row(pr, b, t, h);
        double* y = &out.ybar[rt * p];
        for (int64_t s = 0; s <= t; ++s) {
          const double w = SmatMaskWeight(plan, pr, b, h, Lambda, t, s);
          if (w == 0.0) continue;
          const int64_t rs = Row(pr, b, s, h);
          // ybar_t += M~_ts (phi_t . psi_s) vbar_s   (eq. 3 with Z_s = psi_s vbar_s^T)
          const double a = w * Dot(&pr.phi[rt * r], &pr.psi[rs * r], r);
          for (int64_t k = 0; k < pr.dv; ++k) y[k] += a * pr.v[rs * pr.dv + k];
          y[pr.dv] += a;
        }
      }
    }
  }
  Normalise(pr, &out);
  return out;
}

SmatReferenceOutputs SmatRecurrentReference(const SmatPlan& plan,
                                            const SmatReferenceProblem& pr) {
  CheckSizes(plan, pr);
  const int64_t p = pr.p(), r = pr.r, n = plan.n;
  const SmatGeometry& geo = plan.geo;
  SmatReferenceOutputs out;
  out.ybar.assign(pr.batch * pr.T * pr.H * p, 0.0);
  std::vector<double> S(r * p);           // running state (distant, then recent)
  std::vector<double> F(geo.P * r * p);   // profile table, referred to Lambda_{n-1}
  std::vector<double> U(geo.B * r * p);   // type table
  std::vector<double> tail(n + 1);        // tail[s] = sum of logg over (s, n)
  auto gate = [&](int64_t b, int64_t h, int64_t t) {
    return pr.gated() ? pr.logg[Row(pr, b, t, h)] : 0.0;
  };
  // y += scale * phi^T M for a state M [r, p]; M += scale * Z_s.
  auto read = [&](int64_t rt, const double* M, double scale, double* y) {
    const double* phi = &pr.phi[rt * r];
    for (int64_t i = 0; i < r; ++i) {
      const double f = phi[i] * scale;
      for (int64_t k = 0; k < p; ++k) y[k] += f * M[i * p + k];
    }
  };
  auto accumulate = [&](int64_t rs, double scale, double* M) {
    const double* psi = &pr.psi[rs * r];
    const double* v = &pr.v[rs * pr.dv];
    for (int64_t i = 0; i < r; ++i) {
      const double f = psi[i] * scale;
      for (int64_t k = 0; k < pr.dv; ++k) M[i * p + k] += f * v[k];
      M[i * p + pr.dv] += f;
    }
  };
  for (int64_t b = 0; b < pr.batch; ++b) {
    for (int64_t h = 0; h < pr.H; ++h) {
      // Key-side scalars of Lemma 4: exp(Lambda_{n-1} - Lambda_s) = exp(tail[s]),
      // a sum of gates after s, so no long prefix is ever differenced.
      tail[n] = 0.0;
      if (n > 0) tail[n - 1] = 0.0;
      for (int64_t s = n - 2; s >= 0; --s) tail[s] = tail[s + 1] + gate(b, h, s + 1);
      std::fill(S.begin(), S.end(), 0.0);
      std::fill(F.begin(), F.end(), 0.0);
      // Distant block: causal running state, and the profile table as tokens arrive.
      for (int64_t t = 0; t < n; ++t) {
        const int64_t rt = Row(pr, b, t, h);
        const double a = std::exp(gate(b, h, t));
        for (double& x : S) x *= a;
        accumulate(rt, 1.0, S.data());
        read(rt, S.data(), 1.0, &out.ybar[rt * p]);
        accumulate(rt, std::exp(tail[t]), &F[pr.Profile(plan, b, h, t) * r * p]);
      }
      // Boundary: U = C F (Algorithm 2), F discarded afterwards (Section 3.3).
      TabulateIncidence(geo, F.data(), U.data(), r * p);
      // Recent block: S restarts from 0; read gate g_t = exp(Lambda_t - Lambda_{n-1}).
      std::fill(S.begin(), S.end(), 0.0);
      double log_read_gate = 0.0;
      for (int64_t t = n; t < pr.T; ++t) {
        const int64_t rt = Row(pr, b, t, h);
        const double a = std::exp(gate(b, h, t));
        log_read_gate += gate(b, h, t);
        for (double& x : S) x *= a;
        accumulate(rt, 1.0, S.data());
        double* y = &out.ybar[rt * p];
        read(rt, S.data(), 1.0, y);
        if (n > 0) {
          read(rt, &U[pr.Type(plan, b, h, t) * r * p], std::exp(log_read_gate), y);
        }
      }
    }
  }
  Normalise(pr, &out);
  return out;
}

SmatReferenceGradients SmatDenseReferenceBackward(const SmatPlan& plan,
                                                  const SmatReferenceProblem& pr,
                                                  const std::vector<double>& d_o) {
  CheckSizes(plan, pr);
  const int64_t p = pr.p(), r = pr.r, dv = pr.dv;
  const int64_t rows = pr.batch * pr.T * pr.H;
  SMAT_CHECK(static_cast<int64_t>(d_o.size()) == rows * dv);
  const SmatReferenceOutputs fwd = SmatDenseReference(plan, pr);

  // The division's Jacobian (Appendix E): gbar = dL/dybar.
  std::vector<double> gbar(rows * p);
  for (int64_t i = 0; i < rows; ++i) {
    const double den = fwd.ybar[i * p + dv] + pr.eps;
    const double* go = &d_o[i * dv];
    gbar[i * p + dv] = -Dot(go, &fwd.o[i * dv], dv) / den;
    for (int64_t k = 0; k < dv; ++k) gbar[i * p + k] = go[k] / den;
  }

  SmatReferenceGradients g;
  g.phi.assign(rows * r, 0.0);
  g.psi.assign(rows * r, 0.0);
  g.v.assign(rows * dv, 0.0);
  if (pr.gated()) g.logg.assign(rows, 0.0);
  std::vector<double> edge_sum(pr.T + 1);  // difference array for dL/dlogg
  for (int64_t b = 0; b < pr.batch; ++b) {
    for (int64_t h = 0; h < pr.H; ++h) {
      const std::vector<double> Lambda = PrefixLogDecay(pr, b, h);
      std::fill(edge_sum.begin(), edge_sum.end(), 0.0);
      for (int64_t t = 0; t < pr.T; ++t) {
        const int64_t rt = Row(pr, b, t, h);
        const double* phi_t = &pr.phi[rt * r];
        const double* g_t = &gbar[rt * p];
        for (int64_t s = 0; s <= t; ++s) {
          const double w = SmatMaskWeight(plan, pr, b, h, Lambda, t, s);
          if (w == 0.0) continue;
          const int64_t rs = Row(pr, b, s, h);
          const double* psi_s = &pr.psi[rs * r];
          // L depends on this edge through c_ts = w (phi_t . psi_s)(vbar_s . gbar_t).
          const double kernel = Dot(phi_t, psi_s, r);
          const double vg = DotVbar(pr, rs, g_t);
          for (int64_t i = 0; i < r; ++i) {
            g.phi[rt * r + i] += w * vg * psi_s[i];
            g.psi[rs * r + i] += w * vg * phi_t[i];
          }
          for (int64_t k = 0; k < dv; ++k) g.v[rs * dv + k] += w * kernel * g_t[k];
          // Lambda_t - Lambda_s = sum of logg over (s, t]: each of those gates
          // receives dc_ts/dlogg = c_ts.
          if (pr.gated() && s < t) {
            const double c = w * kernel * vg;
            edge_sum[s + 1] += c;
            edge_sum[t + 1] -= c;
          }
        }
      }
      if (pr.gated()) {
        double acc = 0.0;
        for (int64_t u = 0; u < pr.T; ++u) {
          acc += edge_sum[u];
          g.logg[Row(pr, b, u, h)] = acc;
        }
      }
    }
  }
  return g;
}

}  // namespace smat
