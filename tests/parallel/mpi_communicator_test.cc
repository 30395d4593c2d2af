// MpiCommunicator under mpirun (-np 1..4): every collective for every dtype on
// integer-valued data (checked exactly), odd sizes, overlapping asynchronous
// collectives, determinism of floating-point sums, argument errors, Abort, and
// deadlines with a fault-injected stalled rank.
#include "parallel/mpi_communicator.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/config.pb.h"
#include "gtest/gtest.h"
#include "tests/parallel/mpi_test_util.h"

namespace smat {
namespace {

// Deadline for healthy collectives: generous, since 4 ranks share 2 cores.
constexpr absl::Duration kTimeout = absl::Seconds(20);

std::unique_ptr<MpiCommunicator> World(CommOptions opts = {}) {
  opts.timeout = kTimeout;
  auto c = MpiCommunicator::Create(MPI_COMM_WORLD, opts);
  SMAT_CHECK(c.ok());
  return std::move(c).value();
}

// Integer value of element i on rank r: small enough that every sum over <= 4
// ranks is exact in bf16 (|sum| <= 4 * 12 < 256) and never all zero.
double Value(int r, int64_t i) { return static_cast<double>((r + 1) * ((i * 7 + r) % 5) - 2 * (i % 3)); }

Tensor Fill(DType dt, int64_t n, int r, int64_t offset = 0) {
  Tensor t = Tensor::Empty({n}, dt).value();
  for (int64_t i = 0; i < n; ++i) {
    double v = Value(r, i + offset);
    switch (dt) {
      case DType::kF32: t.data<float>()[i] = static_cast<float>(v); break;
      case DType::kBF16: t.data<uint16_t>()[i] = FloatToBf16(static_cast<float>(v)); break;
      case DType::kI32: t.data<int32_t>()[i] = static_cast<int32_t>(v); break;
      case DType::kI64: t.data<int64_t>()[i] = static_cast<int64_t>(v) * (int64_t{1} << 33); break;
      default: SMAT_CHECK(false);
    }
  }
  return t;
}

double Get(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kF32: return t.data<float>()[i];
    case DType::kBF16: return Bf16ToFloat(t.data<uint16_t>()[i]);
    case DType::kI32: return t.data<int32_t>()[i];
    case DType::kI64: return static_cast<double>(t.data<int64_t>()[i] / (int64_t{1} << 33));
    default: SMAT_CHECK(false);
  }
  return 0;
}

const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kI32, DType::kI64};
// Sizes below, at and off the rank count and block boundaries.
const int64_t kSizes[] = {1, 3, 7, 1000, 4099};

TEST(MpiCommunicator, AllReduceEveryDTypeExact) {
  auto comm = World();
  const int P = comm->size();
  bool ok = true;
  int64_t nonzero = 0;
  for (DType dt : kDTypes) {
    for (int64_t n : kSizes) {
      Tensor t = Fill(dt, n, comm->rank());
      absl::Status s = comm->AllReduce(t);
      EXPECT_TRUE(s.ok()) << s;
      ok &= s.ok();
      for (int64_t i = 0; i < n; ++i) {
        double want = 0;
        for (int r = 0; r < P; ++r) want += Value(r, i);
        if (Get(t, i) != want) {
          ADD_FAILURE() << DTypeName(dt) << " n=" << n << " i=" << i << ": " << Get(t, i)
                        << " != " << want;
          ok = false;
          break;
        }
        nonzero += want != 0;
      }
    }
  }
  EXPECT_GT(nonzero, 0) << "all expected sums were zero: the test proves nothing";
  EXPECT_TRUE(AllRanks(ok && nonzero > 0));
}

TEST(MpiCommunicator, AllGatherEveryDTypeExact) {
  auto comm = World();
  const int P = comm->size();
  bool ok = true;
  for (DType dt : kDTypes) {
    for (int64_t n : kSizes) {
      Tensor send = Fill(dt, n, comm->rank());
      Tensor recv = Tensor::Empty({P * n}, dt).value();
      std::memset(recv.raw(), 0xff, recv.nbytes());  // poison
      absl::Status s = comm->AllGather(send, recv);
      EXPECT_TRUE(s.ok()) << s;
      ok &= s.ok();
      for (int r = 0; r < P && ok; ++r) {
        for (int64_t i = 0; i < n; ++i) {
          if (Get(recv, r * n + i) != Value(r, i)) {
            ADD_FAILURE() << DTypeName(dt) << " n=" << n << " from rank " << r << " i=" << i;
            ok = false;
            break;
          }
        }
      }
    }
  }
  EXPECT_TRUE(AllRanks(ok));
}

TEST(MpiCommunicator, ReduceScatterEveryDTypeExact) {
  auto comm = World();
  const int P = comm->size();
  const int me = comm->rank();
  bool ok = true;
  for (DType dt : kDTypes) {
    for (int64_t n : kSizes) {
      Tensor send = Fill(dt, P * n, me);
      Tensor recv = Tensor::Empty({n}, dt).value();
      std::memset(recv.raw(), 0xff, recv.nbytes());
      absl::Status s = comm->ReduceScatter(send, recv);
      EXPECT_TRUE(s.ok()) << s;
      ok &= s.ok();
      for (int64_t i = 0; i < n && ok; ++i) {
        double want = 0;
        for (int r = 0; r < P; ++r) want += Value(r, me * n + i);
        if (Get(recv, i) != want) {
          ADD_FAILURE() << DTypeName(dt) << " n=" << n << " i=" << i << ": " << Get(recv, i)
                        << " != " << want;
          ok = false;
        }
      }
    }
  }
  EXPECT_TRUE(AllRanks(ok));
}

TEST(MpiCommunicator, BroadcastAndBarrier) {
  auto comm = World();
  const int root = comm->size() - 1;
  bool ok = true;
  for (DType dt : kDTypes) {
    Tensor t = Fill(dt, 1000, comm->rank() == root ? 7 : comm->rank());
    absl::Status s = comm->Broadcast(t, root);
    ok &= s.ok();
    EXPECT_TRUE(s.ok()) << s;
    for (int64_t i = 0; i < 1000 && ok; ++i) ok &= Get(t, i) == Value(7, i);
  }
  absl::Status b = comm->Barrier();
  EXPECT_TRUE(b.ok()) << b;
  EXPECT_TRUE(AllRanks(ok && b.ok()));
}

TEST(MpiCommunicator, AsyncCollectivesOverlapAndCompleteInAnyOrder) {
  auto comm = World();
  const int P = comm->size();
  Tensor a = Fill(DType::kF32, 513, comm->rank());
  Tensor g_send = Fill(DType::kI32, 9, comm->rank());
  Tensor g_recv = Tensor::Empty({P * 9}, DType::kI32).value();
  auto h1 = comm->StartAllReduce(a, kTimeout);
  auto h2 = comm->StartAllGather(g_send, g_recv, kTimeout);
  ASSERT_TRUE(h1.ok() && h2.ok());
  // Local work would go here; then wait in the opposite order.
  absl::Status s2 = (*h2)->Wait();
  absl::Status s1 = (*h1)->Wait();
  bool ok = s1.ok() && s2.ok();
  for (int64_t i = 0; i < 513 && ok; ++i) {
    double want = 0;
    for (int r = 0; r < P; ++r) want += Value(r, i);
    ok &= Get(a, i) == want;
  }
  for (int r = 0; r < P && ok; ++r) ok &= Get(g_recv, r * 9 + 4) == Value(r, 4);
  EXPECT_TRUE(AllRanks(ok));
}

// AllReduce has two stages; the second is posted when a rank polls. Ranks that
// wait in different orders must still match the right stages with each other.
TEST(MpiCommunicator, TwoAllReducesWaitedInRankDependentOrder) {
  auto comm = World();
  const int P = comm->size();
  Tensor a = Fill(DType::kF32, 301, comm->rank());
  Tensor b = Fill(DType::kI64, 77, comm->rank(), /*offset=*/5);
  auto ha = comm->StartAllReduce(a, kTimeout);
  auto hb = comm->StartAllReduce(b, kTimeout);
  ASSERT_TRUE(ha.ok() && hb.ok());
  absl::Status sa, sb;
  if (comm->rank() % 2 == 0) {
    sb = (*hb)->Wait();
    sa = (*ha)->Wait();
  } else {
    sa = (*ha)->Wait();
    sb = (*hb)->Wait();
  }
  EXPECT_TRUE(sa.ok()) << sa;
  EXPECT_TRUE(sb.ok()) << sb;
  bool ok = sa.ok() && sb.ok();
  for (int64_t i = 0; i < 301 && ok; ++i) {
    double want = 0;
    for (int r = 0; r < P; ++r) want += Value(r, i);
    ok &= Get(a, i) == want;
  }
  for (int64_t i = 0; i < 77 && ok; ++i) {
    double want = 0;
    for (int r = 0; r < P; ++r) want += Value(r, i + 5);
    ok &= Get(b, i) == want;
  }
  EXPECT_TRUE(AllRanks(ok));
}

TEST(MpiCommunicator, FloatSumIsDeterministicAndIdenticalOnEveryRank) {
  auto comm = World();
  std::mt19937 rng(1234 + comm->rank());
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  Tensor x = Tensor::Empty({4099}, DType::kF32).value();
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = u(rng) * std::pow(10.f, i % 7 - 3);
  Tensor first = Tensor::Empty({4099}, DType::kF32).value();
  std::memcpy(first.raw(), x.raw(), x.nbytes());
  Tensor second = Tensor::Empty({4099}, DType::kF32).value();
  std::memcpy(second.raw(), x.raw(), x.nbytes());
  ASSERT_TRUE(comm->AllReduce(first).ok());
  ASSERT_TRUE(comm->AllReduce(second).ok());
  bool same_run = std::memcmp(first.raw(), second.raw(), first.nbytes()) == 0;
  // Every rank holds the same bits: compare with rank 0's copy.
  Tensor root = Tensor::Empty({4099}, DType::kF32).value();
  std::memcpy(root.raw(), first.raw(), first.nbytes());
  ASSERT_TRUE(comm->Broadcast(root, 0).ok());
  bool same_rank = std::memcmp(root.raw(), first.raw(), first.nbytes()) == 0;
  EXPECT_TRUE(same_run);
  EXPECT_TRUE(same_rank);
  EXPECT_TRUE(AllRanks(same_run && same_rank));
}

TEST(MpiCommunicator, BadArgumentsAreInvalidArgument) {
  auto comm = World();
  Tensor send = Fill(DType::kF32, 5, 0);
  Tensor wrong = Tensor::Empty({5 * comm->size() + 1}, DType::kF32).value();
  absl::Status s = comm->AllGather(send, wrong);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  Tensor f64 = Tensor::Empty({3}, DType::kF64).value();
  EXPECT_EQ(comm->AllReduce(f64).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(comm->Broadcast(send, comm->size()).code(), absl::StatusCode::kInvalidArgument);
  // Argument errors are local and leave the communicator usable.
  absl::Status b = comm->Barrier();
  EXPECT_TRUE(b.ok()) << b;
  EXPECT_TRUE(AllRanks(s.code() == absl::StatusCode::kInvalidArgument && b.ok()));
}

TEST(MpiCommunicator, AbortMakesLaterCallsFailWithTheReason) {
  auto comm = World();
  comm->Abort("test abort");
  EXPECT_TRUE(comm->aborted());
  Tensor t = Fill(DType::kF32, 4, 0);
  absl::Status s = comm->AllReduce(t);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(std::string(s.message()).find("test abort"), std::string::npos) << s;
  EXPECT_TRUE(AllRanks(s.code() == absl::StatusCode::kAborted));
}

TEST(MpiCommunicator, SplitMakesIndependentSubgroups) {
  auto comm = World();
  const int color = comm->rank() % 2;
  auto sub = comm->Split(color, comm->rank());
  ASSERT_TRUE(sub.ok()) << sub.status();
  Tensor t = Fill(DType::kI64, 10, comm->rank());
  ASSERT_TRUE((*sub)->AllReduce(t).ok());
  double want = 0;
  for (int r = color; r < comm->size(); r += 2) want += Value(r, 3);
  bool ok = Get(t, 3) == want && (*sub)->size() == (comm->size() + 1 - color) / 2;
  EXPECT_TRUE(AllRanks(ok));
}

TEST(FaultPlan, ParsesAndRejects) {
  auto p = ParseFaultPlan("stall_in_collective:rank=1:call=3:seconds=2.5");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->kind, FaultPlan::Kind::kStall);
  EXPECT_TRUE(p->Fires(1, 3));
  EXPECT_FALSE(p->Fires(0, 3));
  EXPECT_EQ(p->stall, absl::Milliseconds(2500));
  EXPECT_EQ(ParseFaultPlan("explode:rank=1:call=3").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseFaultPlan("kill_in_collective:rank=1").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ParseFaultPlan("").ok());
}

TEST(CommOptions, TimeoutFromConfigUnlessTheEnvironmentOverridesIt) {
  ParallelConfig config;
  config.set_collective_timeout_seconds(17);
  unsetenv("SMAT_COLLECTIVE_TIMEOUT_S");
  EXPECT_EQ(CommOptions::FromConfig(config).value().timeout, absl::Seconds(17));
  setenv("SMAT_COLLECTIVE_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(CommOptions::FromConfig(config).value().timeout, absl::Milliseconds(2500));
  setenv("SMAT_COLLECTIVE_TIMEOUT_S", "soon", 1);
  EXPECT_EQ(CommOptions::FromConfig(config).status().code(), absl::StatusCode::kInvalidArgument);
  unsetenv("SMAT_COLLECTIVE_TIMEOUT_S");
}

// A stalled rank: the others must return DeadlineExceeded within the deadline
// (plus scheduling slack), naming the op and the rank; then their communicator
// refuses further calls. The stalled rank wakes later and completes its
// (late-posted) AllGather against the pending requests, so the job ends cleanly.
TEST(MpiCommunicatorMultiRank, StalledRankMakesOthersMissTheDeadline) {
  auto verdict_comm = World();  // clean communicator for the verdict
  const int P = verdict_comm->size();
  if (P < 2) GTEST_SKIP() << "needs at least 2 ranks";
  const absl::Duration deadline = absl::Seconds(3);
  const int stalled = P - 1;
  CommOptions opts;
  opts.fault = ParseFaultPlan(absl::StrCat("stall_in_collective:rank=", stalled,
                                           ":call=2:seconds=5")).value();
  auto faulty = MpiCommunicator::Create(MPI_COMM_WORLD, opts).value();
  Tensor send = Fill(DType::kF32, 16, faulty->rank());
  Tensor recv = Tensor::Empty({P * 16}, DType::kF32).value();
  bool ok = true;
  absl::Status first = faulty->AllGather(send, recv, deadline);  // call 1: healthy
  EXPECT_TRUE(first.ok()) << first;
  ok &= first.ok();
  absl::Time t0 = absl::Now();
  absl::Status second = faulty->AllGather(send, recv, deadline);  // call 2: stalled
  absl::Duration took = absl::Now() - t0;
  if (faulty->rank() == stalled) {
    EXPECT_TRUE(second.ok()) << second;
    ok &= second.ok();
  } else {
    std::string msg(second.message());
    EXPECT_EQ(second.code(), absl::StatusCode::kDeadlineExceeded) << second;
    EXPECT_NE(msg.find("AllGather"), std::string::npos) << msg;
    EXPECT_NE(msg.find(absl::StrCat("rank ", faulty->rank())), std::string::npos) << msg;
    EXPECT_NE(msg.find("elapsed"), std::string::npos) << msg;
    // Lower bound: it waited the deadline. Upper bound: 1.5 s of slack for
    // polling and an oversubscribed scheduler (2 cores, up to 4 ranks).
    EXPECT_GE(took, deadline);
    EXPECT_LT(took, deadline + absl::Milliseconds(1500));
    absl::Status after = faulty->Barrier(deadline);
    EXPECT_EQ(after.code(), absl::StatusCode::kAborted) << after;
    ok &= second.code() == absl::StatusCode::kDeadlineExceeded && took >= deadline &&
          took < deadline + absl::Milliseconds(1500) &&
          after.code() == absl::StatusCode::kAborted;
  }
  int flag = ok;
  int all = 0;
  // The verdict goes over a healthy communicator under its own deadline.
  Tensor v = Tensor::Wrap(&flag, {1}, DType::kI32);
  Tensor w = Tensor::Empty({P}, DType::kI32).value();
  ASSERT_TRUE(verdict_comm->AllGather(v, w).ok());
  all = 1;
  for (int r = 0; r < P; ++r) all &= w.data<int32_t>()[r];
  EXPECT_EQ(all, 1);
}

}  // namespace
}  // namespace smat
