// NcclCommunicator under mpirun -np 2 on a host with 2 GPUs (labels gpu, mpi):
// every collective for every dtype on device tensors with integer-valued
// data (checked exactly), overlapping collectives, sub-groups from
// ncclCommSplit, a stalled rank turning into DeadlineExceeded and an aborted
// communicator, and sequence-parallel SMat over NCCL against the
// single-process op on the GPU. Skipped (on every rank) without GPUs.
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "parallel/process_group.h"
#include "parallel/sequence_parallel_smat.h"
#include "tests/parallel/mpi_test_util.h"

namespace smat {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(60);  // first NCCL calls set up channels

struct Gpu {
  std::unique_ptr<ProcessGroup> pg;
  std::unique_ptr<Backend> backend;
  std::string why_not;  // non-empty: skip
};

Gpu MakeGpu(int sp, FaultPlan fault = {}) {
  Gpu g;
  ProcessGroupOptions o;
  o.sp = sp;
  o.backend = CommBackend::kNccl;
  o.comm.timeout = kTimeout;
  o.comm.fault = fault;
  auto pg = ProcessGroup::Create(MPI_COMM_WORLD, o);
  if (!pg.ok()) {
    g.why_not = pg.status().ToString();
    return g;
  }
  g.pg = std::move(pg).value();
  auto b = CreateBackend(Device::Cuda(g.pg->device()));
  if (!b.ok()) {
    g.why_not = b.status().ToString();
    return g;
  }
  g.backend = std::move(b).value();
  return g;
}

#define SKIP_WITHOUT_GPUS(g)                                                           \
  if (!AllRanks((g).why_not.empty())) {                                                \
    GTEST_SKIP() << "needs one GPU per rank with NCCL: " << (g).why_not;               \
  }

double Value(int r, int64_t i) { return static_cast<double>((r + 1) * ((i * 7 + r) % 5) - 2 * (i % 3)); }

Tensor HostFill(DType dt, int64_t n, int r) {
  Tensor t = Tensor::Empty({n}, dt).value();
  for (int64_t i = 0; i < n; ++i) {
    double v = Value(r, i);
    switch (dt) {
      case DType::kF32: t.data<float>()[i] = static_cast<float>(v); break;
      case DType::kBF16: t.data<uint16_t>()[i] = FloatToBf16(static_cast<float>(v)); break;
      case DType::kI32: t.data<int32_t>()[i] = static_cast<int32_t>(v); break;
      case DType::kI64: t.data<int64_t>()[i] = static_cast<int64_t>(v); break;
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
    case DType::kI64: return static_cast<double>(t.data<int64_t>()[i]);
    default: SMAT_CHECK(false);
  }
  return 0;
}

Tensor ToDevice(Backend& b, const Tensor& h) {
  Tensor d = Tensor::Empty(h.shape(), h.dtype(), b.allocator()).value();
  SMAT_CHECK(b.Copy(h, d).ok());
  SMAT_CHECK(b.Synchronize(nullptr).ok());
  return d;
}

Tensor ToHost(Backend& b, const Tensor& d) {
  Tensor h = Tensor::Empty(d.shape(), d.dtype()).value();
  SMAT_CHECK(b.Copy(d, h).ok());
  SMAT_CHECK(b.Synchronize(nullptr).ok());
  return h;
}

const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kI32, DType::kI64};

TEST(NcclCommunicator, EveryCollectiveEveryDTypeExact) {
  Gpu g = MakeGpu(WorldSize());
  SKIP_WITHOUT_GPUS(g);
  Communicator& c = g.pg->world();
  const int P = c.size(), me = c.rank();
  bool ok = true;
  for (DType dt : kDTypes) {
    for (int64_t n : {int64_t{1}, int64_t{1023}, int64_t{4099}}) {
      Tensor a = ToDevice(*g.backend, HostFill(dt, n, me));
      absl::Status s = c.AllReduce(a);
      EXPECT_TRUE(s.ok()) << s;
      Tensor ah = ToHost(*g.backend, a);
      for (int64_t i = 0; i < n && s.ok(); ++i) {
        double want = 0;
        for (int r = 0; r < P; ++r) want += Value(r, i);
        ok &= Get(ah, i) == want;
      }
      Tensor send = ToDevice(*g.backend, HostFill(dt, n, me));
      Tensor recv = Tensor::Empty({P * n}, dt, g.backend->allocator()).value();
      s = c.AllGather(send, recv);
      EXPECT_TRUE(s.ok()) << s;
      Tensor rh = ToHost(*g.backend, recv);
      for (int r = 0; r < P && s.ok(); ++r) ok &= Get(rh, r * n + n / 2) == Value(r, n / 2);
      Tensor big = ToDevice(*g.backend, HostFill(dt, P * n, me));
      Tensor part = Tensor::Empty({n}, dt, g.backend->allocator()).value();
      s = c.ReduceScatter(big, part);
      EXPECT_TRUE(s.ok()) << s;
      Tensor ph = ToHost(*g.backend, part);
      double want = 0;
      for (int r = 0; r < P; ++r) want += Value(r, me * n);
      ok &= s.ok() && Get(ph, 0) == want;
      Tensor bc = ToDevice(*g.backend, HostFill(dt, n, me == P - 1 ? 7 : me));
      s = c.Broadcast(bc, P - 1);
      Tensor bh = ToHost(*g.backend, bc);
      ok &= s.ok() && Get(bh, n - 1) == Value(7, n - 1);
    }
  }
  ok &= c.Barrier().ok();
  EXPECT_TRUE(ok);
  EXPECT_TRUE(AllRanks(ok));
}

TEST(NcclCommunicator, SplitGivesDataAndSequenceGroups) {
  Gpu g = MakeGpu(1);  // dp = world, sp = 1
  SKIP_WITHOUT_GPUS(g);
  Tensor t = ToDevice(*g.backend, HostFill(DType::kF32, 33, g.pg->world_rank()));
  bool ok = g.pg->sequence().size() == 1 && g.pg->data().size() == WorldSize();
  ok &= g.pg->data().AllReduce(t).ok();
  Tensor th = ToHost(*g.backend, t);
  double want = 0;
  for (int r = 0; r < WorldSize(); ++r) want += Value(r, 5);
  ok &= Get(th, 5) == want;
  Tensor u = ToDevice(*g.backend, HostFill(DType::kF32, 33, g.pg->world_rank()));
  ok &= g.pg->sequence().AllReduce(u).ok();  // one rank: unchanged
  ok &= Get(ToHost(*g.backend, u), 5) == Value(g.pg->world_rank(), 5);
  EXPECT_TRUE(AllRanks(ok));
}

TEST(NcclCommunicatorMultiRank, StalledRankBecomesDeadlineExceededAndAbort) {
  if (WorldSize() < 2) GTEST_SKIP() << "needs 2 ranks";
  // Calls 1-2 of the NCCL world are healthy, call 3 stalls on the last rank for
  // longer than the 3 s deadline (host-world calls during setup are 1-2 as well,
  // and the host world sees no call 3).
  FaultPlan fault = ParseFaultPlan(absl::StrCat("stall_in_collective:rank=", WorldSize() - 1,
                                                ":call=3:seconds=6")).value();
  Gpu g = MakeGpu(WorldSize(), fault);
  SKIP_WITHOUT_GPUS(g);
  Communicator& c = g.pg->world();
  const absl::Duration deadline = absl::Seconds(3);
  Tensor t = ToDevice(*g.backend, HostFill(DType::kF32, 1024, c.rank()));
  bool ok = c.AllReduce(t, kTimeout).ok() && c.AllReduce(t, kTimeout).ok();
  absl::Time t0 = absl::Now();
  absl::Status s = c.AllReduce(t, deadline);
  absl::Duration took = absl::Now() - t0;
  if (c.rank() != WorldSize() - 1) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    // Slack: 1.5 s for polling and the abort itself.
    EXPECT_LT(took, deadline + absl::Milliseconds(1500));
    ok &= s.code() == absl::StatusCode::kDeadlineExceeded &&
          took < deadline + absl::Milliseconds(1500);
  }
  // The stalled rank posts 3 s after its peer gave up. NCCL may fail that
  // collective or complete it: on 2 H200s over NVLink (2026-11-30) the late
  // rank's 4 KB AllReduce returned OK, its peer's data having arrived before the
  // peer aborted (an abort on one rank does not fail the other rank's
  // operations). Either way the late rank cannot get past its next collective.
  const bool late_and_completed = c.rank() == WorldSize() - 1 && s.ok();
  if (!late_and_completed) {
    EXPECT_TRUE(c.aborted());
    ok &= c.aborted();
  }
  // A rank whose communicator is aborted gets kAborted at once; the late rank
  // whose AllReduce completed waits for a peer that is gone: DeadlineExceeded
  // within the deadline (same slack), and its communicator is aborted then.
  const absl::StatusCode want =
      late_and_completed ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kAborted;
  t0 = absl::Now();
  absl::Status after = c.Barrier(deadline);
  took = absl::Now() - t0;
  EXPECT_EQ(after.code(), want) << after;
  EXPECT_LT(took, deadline + absl::Milliseconds(1500));
  EXPECT_TRUE(c.aborted());
  ok &= after.code() == want && took < deadline + absl::Milliseconds(1500) && c.aborted();
  EXPECT_TRUE(AllRanks(ok));
}

TEST(NcclSequenceParallelSmat, MatchesSingleProcessOnGpu) {
  Gpu g = MakeGpu(WorldSize());
  SKIP_WITHOUT_GPUS(g);
  if (!AllRanks(g.backend->smat().ok())) GTEST_SKIP() << "the CUDA backend has no SMat kernels";
  SmatPlan plan = MakeSmatPlan(1000, 2, 64).value();
  const int64_t b = 1, T = plan.T, H = 2, r = 16, dv = 15;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> pos(0.1f, 1.f), sym(-1.f, 1.f), gate(-0.05f, 0.f);
  auto fill = [&](Shape s, auto& dist) {
    Tensor t = Tensor::Empty(s, DType::kF32).value();
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = dist(rng);
    return t;
  };
  Tensor phi = fill({b, T, H, r}, pos), psi = fill({b, T, H, r}, pos), v = fill({b, T, H, dv}, sym);
  Tensor logg = fill({b, T, H}, gate);
  auto spans = SplitSequence(plan, WorldSize()).value();
  const SmatSpan span = spans[g.pg->sequence().rank()];
  auto dev = [&](const Tensor& h) { return ToDevice(*g.backend, h); };
  SmatInputs whole;
  whole.phi = dev(phi);
  whole.psi = dev(psi);
  whole.v = dev(v);
  whole.logg = dev(logg);
  SmatForwardOutputs ref;
  ASSERT_TRUE(SmatForward(*g.backend, plan, whole, &ref).ok());
  SmatInputs mine;
  mine.phi = dev(SliceSpan(phi, span).value());
  mine.psi = dev(SliceSpan(psi, span).value());
  mine.v = dev(SliceSpan(v, span).value());
  mine.logg = dev(SliceSpan(logg, span).value());
  SpSmatForwardOutputs fwd;
  absl::Status s = SequenceParallelSmatForward(*g.backend, g.pg->sequence(), plan, spans, mine, &fwd);
  ASSERT_TRUE(s.ok()) << s;
  Tensor got = ToHost(*g.backend, fwd.o);
  Tensor want = SliceSpan(ToHost(*g.backend, ref.o), span).value();
  double max_ref = 0, max_diff = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(want.data<float>()[i])));
    max_diff = std::max(max_diff, std::fabs(static_cast<double>(got.data<float>()[i]) -
                                            want.data<float>()[i]));
  }
  // Same 1e-5 relative bound as the CPU test (fp32 throughout).
  EXPECT_LE(max_diff, 1e-5 * max_ref);
  EXPECT_TRUE(AllRanks(max_ref > 0 && max_diff <= 1e-5 * max_ref));
}

}  // namespace
}  // namespace smat
