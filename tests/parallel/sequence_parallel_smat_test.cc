// Sequence-parallel SMat under mpirun (-np 1..4) against the single-process op
// (kernels/smat.h) on the CPU backend: forward outputs and every gradient,
// gated and not, positional and content maps, with default splits and with
// requested splits on both sides of n and straddling n; two runs on the same
// ranks bitwise equal; splits that cut a chunk or leave a rank without a
// chunk are clear errors.
#include "parallel/sequence_parallel_smat.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "parallel/mpi_communicator.h"
#include "tests/parallel/mpi_test_util.h"

namespace smat {
namespace {

// fp32 SP vs fp32 single process: the two differ only in how sums over chunks
// and ranks associate (the fold over ranks vs the chunk scan, the table
// all-reduce vs one pooling pass), a few ulps per addition over <= 10 chunks
// and 4 ranks: ~1e-6 relative; 1e-5 (ARCHITECTURE.md section 4) has margin.
// Measured relative to the tensor's largest magnitude, since gradient
// elements can cancel to near zero.
constexpr double kRelTol = 1e-5;

struct Problem {
  SmatPlan plan;
  Tensor phi, psi, v, logg, prof, type, d_o;  // full sequence, host
  float eps = 1e-3f;
};

// Same bits on every rank: a fixed seed, no rank in it.
Problem MakeProblem(int64_t T, int d, int64_t chunk, bool gated, bool content, uint32_t seed) {
  Problem pr;
  pr.plan = MakeSmatPlan(T, d, chunk).value();
  const int64_t b = 2, H = 2, r = 5, dv = 3;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> pos(0.1f, 1.f), sym(-1.f, 1.f), gate(-0.3f, 0.f);
  auto fill = [&](Shape s, auto& dist) {
    Tensor t = Tensor::Empty(s, DType::kF32).value();
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = dist(rng);
    return t;
  };
  pr.phi = fill({b, T, H, r}, pos);
  pr.psi = fill({b, T, H, r}, pos);
  pr.v = fill({b, T, H, dv}, sym);
  pr.d_o = fill({b, T, H, dv}, sym);
  if (gated) pr.logg = fill({b, T, H}, gate);
  if (content) {
    pr.prof = Tensor::Empty({b, T, H}, DType::kI32).value();
    pr.type = Tensor::Empty({b, T, H}, DType::kI32).value();
    for (int64_t i = 0; i < pr.prof.numel(); ++i) {
      pr.prof.data<int32_t>()[i] = static_cast<int32_t>(rng() % pr.plan.geo.P);
      pr.type.data<int32_t>()[i] = static_cast<int32_t>(rng() % pr.plan.geo.B);
    }
  }
  return pr;
}

SmatInputs Inputs(const Problem& pr, const SmatSpan& span) {
  auto slice = [&](const Tensor& t) { return t.defined() ? SliceSpan(t, span).value() : Tensor(); };
  SmatInputs in;
  in.phi = slice(pr.phi);
  in.psi = slice(pr.psi);
  in.v = slice(pr.v);
  in.logg = slice(pr.logg);
  in.prof = slice(pr.prof);
  in.type = slice(pr.type);
  in.eps = pr.eps;
  return in;
}

// max |got - want[span]| / max |want| over the span; `what` for messages.
double RelErr(const Tensor& got, const Tensor& want_full, const SmatSpan& span) {
  Tensor want = SliceSpan(want_full, span).value();
  double max_ref = 0, max_diff = 0;
  for (int64_t i = 0; i < want_full.numel(); ++i) {
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(want_full.data<float>()[i])));
  }
  for (int64_t i = 0; i < want.numel(); ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got.data<float>()[i]) -
                                            want.data<float>()[i]));
  }
  return max_ref == 0 ? INFINITY : max_diff / max_ref;  // all-zero reference proves nothing
}

struct Fixture {
  std::unique_ptr<Backend> backend = CreateBackend(Device::Cpu()).value();
  std::unique_ptr<MpiCommunicator> comm = [] {
    CommOptions o;
    o.timeout = absl::Seconds(30);  // 4 ranks on 2 cores: generous
    return MpiCommunicator::Create(MPI_COMM_WORLD, o).value();
  }();
};

// Runs SP forward + backward for `spans` and compares with the single-process
// op. Returns true when every tensor matches on this rank.
bool CheckAgainstSingleProcess(Fixture& fx, const Problem& pr, const std::vector<SmatSpan>& spans,
                               const std::string& label) {
  const SmatSpan span = spans[fx.comm->rank()];
  // Single process, whole sequence (every rank computes it: it is small).
  SmatInputs whole = Inputs(pr, SmatSpan::Whole(pr.plan));
  SmatForwardOutputs ref_fwd;
  absl::Status s = SmatForward(*fx.backend, pr.plan, whole, &ref_fwd);
  EXPECT_TRUE(s.ok()) << s;
  SmatGradients ref_g;
  s = SmatBackward(*fx.backend, pr.plan, whole, ref_fwd, pr.d_o, &ref_g);
  EXPECT_TRUE(s.ok()) << s;

  SmatInputs mine = Inputs(pr, span);
  SpSmatForwardOutputs fwd;
  absl::Status sf = SequenceParallelSmatForward(*fx.backend, *fx.comm, pr.plan, spans, mine, &fwd);
  EXPECT_TRUE(sf.ok()) << label << ": " << sf;
  if (!sf.ok()) return false;
  Tensor d_o = SliceSpan(pr.d_o, span).value();
  SmatGradients g;
  absl::Status sb =
      SequenceParallelSmatBackward(*fx.backend, *fx.comm, pr.plan, spans, mine, fwd, d_o, &g);
  EXPECT_TRUE(sb.ok()) << label << ": " << sb;
  if (!sb.ok()) return false;

  bool ok = true;
  auto check = [&](const char* name, const Tensor& got, const Tensor& want) {
    double e = RelErr(got, want, span);
    EXPECT_LE(e, kRelTol) << label << " rank " << fx.comm->rank() << " span [" << span.t0 << ", "
                          << span.t1 << "): " << name << " relative error " << e;
    ok &= e <= kRelTol;
  };
  check("o", fwd.o, ref_fwd.o);
  check("phi_bar", g.phi, ref_g.phi);
  check("psi_bar", g.psi, ref_g.psi);
  check("v_bar", g.v, ref_g.v);
  if (pr.logg.defined()) check("logg_bar", g.logg, ref_g.logg);
  return ok;
}

// Cuts for W ranks: all before n, all at or after n, or one span straddling n.
std::vector<int64_t> Cuts(const SmatPlan& plan, int W, const std::string& where) {
  const int64_t c = plan.chunk, n = plan.n;
  std::vector<int64_t> cuts;
  for (int i = 1; i < W; ++i) {
    if (where == "distant") cuts.push_back(i * c);           // spans end before n, last one straddles
    if (where == "recent") cuts.push_back(n + (i - 1) * c);  // first span is [0, n) exactly
    if (where == "straddle") cuts.push_back(i == 1 ? n - c : n + (i - 1) * c);  // [n-c, n+c) straddles
  }
  return cuts;
}

// The default split and those of Cuts, each against the single-process op
// (this rank's verdict; a split that cannot be made fails the test).
bool CheckEverySplit(Fixture& fx, const Problem& pr) {
  const int W = fx.comm->size();
  auto spans = SplitSequence(pr.plan, W);
  if (!spans.ok()) {
    ADD_FAILURE() << spans.status();
    return false;
  }
  bool ok = CheckAgainstSingleProcess(fx, pr, *spans, "default split");
  for (const char* where : {"distant", "recent", "straddle"}) {
    auto s = SpansFromCuts(pr.plan, Cuts(pr.plan, W, where));
    if (!s.ok()) {
      ADD_FAILURE() << where << ": " << s.status();
      ok = false;
      continue;
    }
    ok &= CheckAgainstSingleProcess(fx, pr, *s, where);
  }
  return ok;
}

// T = 70, chunk 8: n = 32, 9 chunks (the last one partial, 6 tokens); d = 2
// gives q = 7, P = 7 points, B = 7 types.
class SpSmat : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(SpSmat, MatchesSingleProcessForEverySplit) {
  const auto [gated, content] = GetParam();
  Fixture fx;
  Problem pr = MakeProblem(70, 2, 8, gated, content, 42);
  ASSERT_EQ(pr.plan.n, 32);
  EXPECT_TRUE(AllRanks(CheckEverySplit(fx, pr)));
}

INSTANTIATE_TEST_SUITE_P(GatedAndContent, SpSmat,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

// d = 3 (T = 70, chunk 8: n = 32, q = 5, P = 25 points, B = 30 types): C is
// not the identity, so the tables go through the tabulation and its adjoint
// (d <= 2 skips them), with every split.
TEST(SpSmatTabulated, DThreeMatchesSingleProcess) {
  Fixture fx;
  for (bool gated : {false, true}) {
    SCOPED_TRACE(gated ? "gated" : "ungated");
    Problem pr = MakeProblem(70, 3, 8, gated, /*content=*/false, 13);
    ASSERT_EQ(pr.plan.geo.B, 30);
    ASSERT_FALSE(pr.plan.geo.IncidenceIsIdentity());
    EXPECT_TRUE(AllRanks(CheckEverySplit(fx, pr)));
  }
}

// d = 1 (causal, one point, one type) with a sequence that is all chunks, and
// with a partial last chunk under positional and content maps.
TEST(SpSmatCausal, MatchesSingleProcess) {
  Fixture fx;
  Problem pr = MakeProblem(64, 1, 8, /*gated=*/true, /*content=*/false, 7);
  auto spans = SplitSequence(pr.plan, fx.comm->size()).value();
  EXPECT_TRUE(AllRanks(CheckAgainstSingleProcess(fx, pr, spans, "d=1")));
  for (bool content : {false, true}) {
    Problem partial = MakeProblem(70, 1, 8, /*gated=*/true, content, 8);
    auto s = SplitSequence(partial.plan, fx.comm->size()).value();
    EXPECT_TRUE(
        AllRanks(CheckAgainstSingleProcess(fx, partial, s, content ? "d=1 content" : "d=1")));
  }
}

// d = 1 with positional maps runs as the single-process op does (SmatOpPlan):
// one causal block, no profile table to all-reduce and the zero type table;
// content maps keep the table and its all-reduce.
TEST(SpSmatCausal, PositionalD1HasNoTable) {
  Fixture fx;
  for (bool content : {false, true}) {
    SCOPED_TRACE(content ? "content maps" : "positional maps");
    Problem pr = MakeProblem(70, 1, 8, /*gated=*/false, content, 11);
    auto spans = SplitSequence(pr.plan, fx.comm->size()).value();
    SmatInputs mine = Inputs(pr, spans[fx.comm->rank()]);
    SpSmatForwardOutputs fwd;
    ASSERT_TRUE(
        SequenceParallelSmatForward(*fx.backend, *fx.comm, pr.plan, spans, mine, &fwd).ok());
    double u = 0;
    const Tensor& U = fwd.saved.local.U;
    for (int64_t i = 0; i < U.numel(); ++i) u = std::max(u, std::fabs(double{U.data<float>()[i]}));
    if (content) {
      EXPECT_GT(fwd.volume.table_words, 0);
      EXPECT_TRUE(AllRanks(u > 0));  // every rank holds the all-reduced table
    } else {
      EXPECT_EQ(fwd.volume.table_words, 0);
      EXPECT_EQ(u, 0.0);
    }
  }
}

TEST(SpSmatDeterminism, SameRanksTwiceBitwiseEqual) {
  Fixture fx;
  Problem pr = MakeProblem(70, 2, 8, /*gated=*/true, /*content=*/false, 9);
  auto spans = SpansFromCuts(pr.plan, Cuts(pr.plan, fx.comm->size(), "straddle")).value();
  const SmatSpan span = spans[fx.comm->rank()];
  SmatInputs mine = Inputs(pr, span);
  Tensor d_o = SliceSpan(pr.d_o, span).value();
  SpSmatForwardOutputs f1, f2;
  SmatGradients g1, g2;
  ASSERT_TRUE(SequenceParallelSmatForward(*fx.backend, *fx.comm, pr.plan, spans, mine, &f1).ok());
  ASSERT_TRUE(SequenceParallelSmatBackward(*fx.backend, *fx.comm, pr.plan, spans, mine, f1, d_o, &g1).ok());
  ASSERT_TRUE(SequenceParallelSmatForward(*fx.backend, *fx.comm, pr.plan, spans, mine, &f2).ok());
  ASSERT_TRUE(SequenceParallelSmatBackward(*fx.backend, *fx.comm, pr.plan, spans, mine, f2, d_o, &g2).ok());
  auto same = [](const Tensor& a, const Tensor& b) {
    return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
  };
  bool ok = same(f1.o, f2.o) && same(g1.phi, g2.phi) && same(g1.psi, g2.psi) &&
            same(g1.v, g2.v) && same(g1.logg, g2.logg);
  EXPECT_TRUE(ok);
  EXPECT_TRUE(AllRanks(ok));
}

TEST(SpSmatVolume, ScanAndTableWords) {
  SmatPlan plan = MakeSmatPlan(70, 2, 8).value();
  SpSmatVolume v = SequenceParallelVolume(plan, 4, 2, 2, 5, 4);
  EXPECT_EQ(v.scan_words, 4 * 2 * 2 * 2 * (5 * 4 + 1));
  EXPECT_EQ(v.table_words, 2 * 2 * plan.geo.P * 5 * 4);
}

TEST(SpSmatSplit, CutInsideAChunkIsAClearError) {
  SmatPlan plan = MakeSmatPlan(70, 2, 8).value();
  auto s = SpansFromCuts(plan, {13});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.status().message()).find("cuts chunk 1"), std::string::npos)
      << s.status();
  EXPECT_NE(std::string(s.status().message()).find("cut at 8 or 16"), std::string::npos)
      << s.status();
  EXPECT_EQ(SpansFromCuts(plan, {16, 8}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(SpansFromCuts(plan, {8, 64}).ok());
  // A hand-made span list that cuts a chunk is rejected too.
  std::vector<SmatSpan> bad = {{0, 13}, {13, 70}};
  EXPECT_EQ(ValidateSpans(plan, bad, 2).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SpSmatSplit, EvenChunksFirstRanksTakeOneMore) {
  SmatPlan plan = MakeSmatPlan(70, 2, 8).value();  // 9 chunks, the last partial
  auto s = SplitSequence(plan, 4).value();          // 3, 2, 2, 2 chunks
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].t0, 0);
  EXPECT_EQ(s[0].t1, 24);
  EXPECT_EQ(s[1].t1, 40);
  EXPECT_EQ(s[2].t1, 56);
  EXPECT_EQ(s[3].t1, 70);  // the partial chunk goes to the last rank
  EXPECT_TRUE(ValidateSpans(plan, s, 4).ok());
  auto too_many = SplitSequence(plan, 10);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(too_many.status().message()).find("fewer than"), std::string::npos);
}

TEST(SpSmatGather, GatherSpansRebuildsTheWholeSequence) {
  Fixture fx;
  Problem pr = MakeProblem(70, 2, 8, false, true, 3);
  auto spans = SplitSequence(pr.plan, fx.comm->size()).value();
  Tensor part = SliceSpan(pr.phi, spans[fx.comm->rank()]).value();
  auto full = GatherSpans(*fx.comm, spans, part);
  ASSERT_TRUE(full.ok()) << full.status();
  bool ok = std::memcmp(full->raw(), pr.phi.raw(), pr.phi.nbytes()) == 0;
  EXPECT_TRUE(AllRanks(ok));
}

}  // namespace
}  // namespace smat
