// ProcessGroup (MPI) under mpirun (-np 1..4): the dp x sp grid puts
// consecutive ranks in a sequence group and strided ranks in a data group, the
// sub-communicators reduce over exactly those ranks, and an sp that does not
// divide the world is a clear error on every rank.
#include "parallel/process_group.h"

#include <vector>

#include "gtest/gtest.h"
#include "tests/parallel/mpi_test_util.h"

namespace smat {
namespace {

ProcessGroupOptions Options(int sp) {
  ProcessGroupOptions o;
  o.sp = sp;
  o.comm.timeout = absl::Seconds(20);
  return o;
}

std::vector<int32_t> GatherRanks(Communicator& c, int32_t value) {
  Tensor send = Tensor::Empty({1}, DType::kI32).value();
  send.data<int32_t>()[0] = value;
  Tensor recv = Tensor::Empty({c.size()}, DType::kI32).value();
  SMAT_CHECK(c.AllGather(send, recv).ok());
  return std::vector<int32_t>(recv.data<int32_t>(), recv.data<int32_t>() + c.size());
}

TEST(ProcessGroup, GridOfConsecutiveSequenceGroups) {
  const int W = WorldSize();
  for (int sp = 1; sp <= W; ++sp) {
    if (W % sp != 0) continue;
    auto pg = ProcessGroup::Create(MPI_COMM_WORLD, Options(sp));
    ASSERT_TRUE(pg.ok()) << pg.status();
    ProcessGroup& g = **pg;
    const int w = g.world_rank();
    bool ok = g.sp() == sp && g.dp() == W / sp && g.sp_rank() == w % sp &&
              g.dp_rank() == w / sp && g.sequence().size() == sp && g.data().size() == W / sp &&
              g.sequence().rank() == w % sp && g.data().rank() == w / sp &&
              g.world().size() == W && g.device() == -1;
    // The sequence group is ranks [dp_rank * sp, (dp_rank + 1) * sp) in order.
    std::vector<int32_t> seq = GatherRanks(g.sequence(), w);
    for (int i = 0; i < sp; ++i) ok &= seq[i] == g.dp_rank() * sp + i;
    // The data group is ranks sp_rank, sp_rank + sp, ... in order.
    std::vector<int32_t> data = GatherRanks(g.data(), w);
    for (int i = 0; i < W / sp; ++i) ok &= data[i] == g.sp_rank() + i * sp;
    // A reduction over the sequence group sums exactly its members.
    Tensor t = Tensor::Empty({1}, DType::kI64).value();
    t.data<int64_t>()[0] = w + 1;
    ok &= g.sequence().AllReduce(t).ok();
    int64_t want = 0;
    for (int i = 0; i < sp; ++i) want += g.dp_rank() * sp + i + 1;
    ok &= t.data<int64_t>()[0] == want;
    EXPECT_TRUE(ok) << g.DebugString();
    EXPECT_TRUE(AllRanks(ok));
  }
}

TEST(ProcessGroup, SpThatDoesNotDivideTheWorldIsInvalidArgument) {
  const int W = WorldSize();
  auto pg = ProcessGroup::Create(MPI_COMM_WORLD, Options(W + 1));
  EXPECT_EQ(pg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(pg.status().message()).find("divide the world size"), std::string::npos)
      << pg.status();
  EXPECT_TRUE(AllRanks(pg.status().code() == absl::StatusCode::kInvalidArgument));
}

TEST(ProcessGroup, ParseCommBackend) {
  EXPECT_EQ(ParseCommBackend("nccl").value(), CommBackend::kNccl);
  EXPECT_EQ(ParseCommBackend("mpi").value(), CommBackend::kMpi);
  EXPECT_EQ(ParseCommBackend("gloo").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace smat
