// Communication accounting of the training loop under mpirun -np 2: one step's
// StepStats::comm (what smat_comm_bytes_total{op} and smat_comm_seconds_total{op}
// add up) against the sizes the formulas predict for every collective the
// step issues (parallel/comm_stats.h defines bytes as the tensor each
// collective fills on the rank):
//   sp = 2: per SMat layer the forward scan all-gather (SequenceParallelVolume
//           scan_words) and table all-reduce (table_words), the backward
//           U_bar all-reduce (batch H B r p), state-gradient all-gather
//           (sp batch 2 H r p) and gate-sum all-gather (sp batch H), the short
//           conv halo both ways (sp batch 3 (2 H r + H dv)); plus the loop's
//           loss all-gather (world x 2 doubles) and gradient all-reduce (every
//           parameter, fp32);
//   dp = 2, sp = 1: the one-rank sequence group counts nothing, so only the
//           loop's two collectives;
//   one process: nothing at all.
// Seconds: positive wherever bytes are, never more than the step.
#include <string>

#include <mpi.h>

#include "absl/strings/str_cat.h"
#include "core/config.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "parallel/comm_stats.h"
#include "parallel/process_group.h"
#include "parallel/sequence_parallel_smat.h"
#include "tests/parallel/mpi_test_util.h"
#include "trainer/train_loop.h"

namespace smat {
namespace {

constexpr int64_t kLayers = 2, kHeads = 2, kR = 8, kDv = 12, kT = 128, kChunk = 16, kBatch = 2;

TrainConfig MakeConfig(int dp, int sp) {
  const std::string text = absl::StrCat(R"(
run { steps: 1 eval_every: 0 seed: 3 }
model { vocab_size: 64 width: 32 layers: )", kLayers, " heads: ", kHeads,
                                        " head_dim_qk: ", kR, " head_dim_v: ", kDv, R"(
        short_conv: true gated: true routing: TOKEN_HASH }
smat { d: 2 chunk: )", kChunk, R"( }
data { kind: MQAR seq_len: )", kT, R"( num_pairs: 8 vocab: 64 seed: 5 batch_size: )",
                                        kBatch, R"( }
optimizer { lr: 3e-3 }
metrics { enabled: false }
parallel { dp: )", dp, " sp: ", sp, " }\n");
  absl::StatusOr<TrainConfig> cfg = ParseConfigText(text, "<test>");
  SMAT_CHECK(cfg.ok());
  ApplyDefaults(*cfg);
  absl::Status valid = ValidateConfig(*cfg);
  EXPECT_TRUE(valid.ok()) << valid;
  return *cfg;
}

struct StepResult {
  StepStats stats;
  int64_t parameters = 0;  // elements
  absl::Status status;
};

StepResult OneStep(MPI_Comm comm, int dp, int sp) {
  StepResult out;
  out.status = [&]() -> absl::Status {
    ProcessGroupOptions opts;
    opts.sp = sp;
    SMAT_ASSIGN_OR_RETURN(auto pg, ProcessGroup::Create(comm, opts));
    SMAT_ASSIGN_OR_RETURN(auto backend, CreateBackend(Device::Cpu()));
    SMAT_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(MakeConfig(dp, sp), *pg, *backend));
    SMAT_ASSIGN_OR_RETURN(out.stats, trainer->Step());
    out.parameters = trainer->model().NumParameterElements();
    return absl::OkStatus();
  }();
  return out;
}

void ExpectOnly(const StepStats& st, int64_t all_reduce, int64_t all_gather) {
  const CommStats& c = st.comm;
  EXPECT_EQ(c[CollectiveOp::kAllReduce].bytes, all_reduce);
  EXPECT_EQ(c[CollectiveOp::kAllGather].bytes, all_gather);
  for (CollectiveOp op : {CollectiveOp::kReduceScatter, CollectiveOp::kBroadcast,
                          CollectiveOp::kBarrier}) {
    EXPECT_EQ(c[op].bytes, 0) << CollectiveOpLabel(op);
    EXPECT_EQ(c[op].calls, 0) << CollectiveOpLabel(op);
    EXPECT_EQ(c[op].seconds, 0) << CollectiveOpLabel(op);
  }
  for (CollectiveOp op : {CollectiveOp::kAllReduce, CollectiveOp::kAllGather}) {
    if (c[op].bytes > 0) {
      EXPECT_GT(c[op].seconds, 0) << CollectiveOpLabel(op);
    } else {
      EXPECT_EQ(c[op].seconds, 0) << CollectiveOpLabel(op);
    }
  }
  EXPECT_LE(c.seconds(), st.step_seconds);
}

TEST(CommAccountingTest, SequenceParallelStepMatchesTheFormulas) {
  ASSERT_EQ(WorldSize(), 2) << "run under mpirun -np 2";
  const StepResult r = OneStep(MPI_COMM_WORLD, 1, 2);
  ASSERT_TRUE(AllRanks(r.status.ok())) << r.status;

  const int64_t sp = 2, world = 2, p = kDv + 1;
  absl::StatusOr<SmatPlan> plan = MakeSmatPlan(kT, 2, kChunk);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const SpSmatVolume vol = SequenceParallelVolume(*plan, sp, kBatch, kHeads, kR, p);
  const int64_t u_bar_words = kBatch * kHeads * plan->geo.B * kR * p;
  const int64_t state_grad_words = sp * kBatch * 2 * kHeads * kR * p;
  const int64_t gate_sum_words = sp * kBatch * kHeads;
  const int64_t halo_words = sp * kBatch * 3 * (2 * kHeads * kR + kHeads * kDv);
  const int64_t loss_gather_bytes = world * 2 * 8;

  const int64_t all_reduce =
      kLayers * (vol.table_words + u_bar_words) * 4 + r.parameters * 4;
  const int64_t all_gather =
      kLayers * (vol.scan_words + state_grad_words + gate_sum_words + 2 * halo_words) * 4 +
      loss_gather_bytes;
  ExpectOnly(r.stats, all_reduce, all_gather);
  // Calls: per layer 2 all-reduces and 5 all-gathers (scan, state gradients,
  // gate sums, halo both ways), plus the loop's one of each.
  EXPECT_EQ(r.stats.comm[CollectiveOp::kAllReduce].calls, kLayers * 2 + 1);
  EXPECT_EQ(r.stats.comm[CollectiveOp::kAllGather].calls, kLayers * 5 + 1);
}

TEST(CommAccountingTest, DataParallelOnlyCountsTheLoop) {
  const StepResult r = OneStep(MPI_COMM_WORLD, 2, 1);
  ASSERT_TRUE(AllRanks(r.status.ok())) << r.status;
  ExpectOnly(r.stats, r.parameters * 4, 2 * 2 * 8);
  EXPECT_EQ(r.stats.comm[CollectiveOp::kAllReduce].calls, 1);
  EXPECT_EQ(r.stats.comm[CollectiveOp::kAllGather].calls, 1);
}

TEST(CommAccountingTest, OneProcessCountsNothing) {
  const StepResult r = OneStep(MPI_COMM_SELF, 1, 1);
  ASSERT_TRUE(AllRanks(r.status.ok())) << r.status;
  ExpectOnly(r.stats, 0, 0);
}

}  // namespace
}  // namespace smat
