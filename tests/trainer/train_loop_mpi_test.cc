// The training loop on 4 MPI ranks against itself on fewer (run under mpirun -np 4;
// main in tests/parallel/mpi_test_main.cc combines the verdict over ranks).
//
// One config, 20 steps, trained as
//   A. dp 1 x sp 1 on each rank alone (MPI_COMM_SELF), batch 2;
//   B. dp 1 x sp 2 on each pair of ranks, batch 2;
//   C. dp 1 x sp 4 on all ranks, batch 2;
//   D. dp 2 x sp 2 on all ranks, batch 1 per group: the sampler hands group r
//      sequence 2 * step + r (trainer/data.h), exactly the 2 sequences of A's
//      batch, so D sees the same data split over the grid.
// Every loss must equal A's to 1e-5 relative (ARCHITECTURE.md section 4: only
// the order of fp32 sums differs), and identical runs (the 4 copies of A, the 2
// of B) must agree bit for bit. The evaluation agrees in the same way.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <mpi.h>

#include "absl/strings/str_cat.h"
#include "core/config.h"
#include "core/exit_codes.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "parallel/process_group.h"
#include "tests/parallel/mpi_test_util.h"
#include "trainer/train_loop.h"

namespace smat {
namespace {

constexpr int kSteps = 20;
// Relative agreement of sp / dp splits with the single rank: fp32 sums in
// another order, compounded over 20 AdamW steps (the tolerance of
// ARCHITECTURE.md section 4).
constexpr double kRelTol = 1e-5;

// Small enough for 4 oversubscribed ranks on 2 cores; every feature whose state
// crosses a span boundary is on (gates, short conv, token-hash routing), and
// T = 256 with chunk 16 gives sp = 4 spans of 4 chunks that straddle n.
std::string ConfigText(int dp, int sp, int batch) {
  return absl::StrCat(R"(
run { steps: 20 eval_every: 10 seed: 3 }
model { vocab_size: 64 width: 32 layers: 2 heads: 2 short_conv: true gated: true
        routing: TOKEN_HASH }
smat { d: 2 chunk: 16 }
data { kind: MQAR seq_len: 256 num_pairs: 8 vocab: 64 seed: 5 batch_size: )",
                      batch, R"( }
optimizer { lr: 3e-3 warmup_steps: 5 }
metrics { enabled: false }
parallel { dp: )",
                      dp, " sp: ", sp, " }\n");
}

TrainConfig MakeConfig(int dp, int sp, int batch) {
  absl::StatusOr<TrainConfig> cfg = ParseConfigText(ConfigText(dp, sp, batch), "<test>");
  SMAT_CHECK(cfg.ok());
  ApplyDefaults(*cfg);
  absl::Status valid = ValidateConfig(*cfg);
  EXPECT_TRUE(valid.ok()) << valid;
  return *cfg;
}

struct RunResult {
  std::vector<double> losses;
  double eval_loss = 0, eval_accuracy = -1;
  absl::Status status;
};

// Trains kSteps on `comm` (collective over it) and evaluates once.
RunResult Train(MPI_Comm comm, int dp, int sp, int batch) {
  RunResult out;
  out.status = [&]() -> absl::Status {
    TrainConfig cfg = MakeConfig(dp, sp, batch);
    ProcessGroupOptions opts;
    opts.sp = sp;
    SMAT_ASSIGN_OR_RETURN(auto pg, ProcessGroup::Create(comm, opts));
    SMAT_ASSIGN_OR_RETURN(auto backend, CreateBackend(Device::Cpu()));
    SMAT_ASSIGN_OR_RETURN(auto trainer, Trainer::Create(cfg, *pg, *backend));
    for (int s = 0; s < kSteps; ++s) {
      SMAT_ASSIGN_OR_RETURN(StepStats st, trainer->Step());
      if (st.step != s + 1) return absl::InternalError("step count did not advance");
      out.losses.push_back(st.loss);
    }
    SMAT_ASSIGN_OR_RETURN(EvalStats ev, trainer->Evaluate());
    out.eval_loss = ev.loss;
    out.eval_accuracy = ev.accuracy;
    // The checkpoint seam: parameters, then both moments of each, as host
    // tensors; the data cursor counts the job's sequences.
    const TrainState& ts = trainer->state();
    const auto tensors = ts.Tensors();
    const size_t np = trainer->model().parameters().size();
    if (tensors.size() != 3 * np || tensors[np].first.rfind("adam_m/", 0) != 0 ||
        tensors[2 * np].first.rfind("adam_v/", 0) != 0) {
      return absl::InternalError("TrainState::Tensors: unexpected names or count");
    }
    if (ts.sampler_cursor() != int64_t{kSteps} * dp * batch ||
        trainer->optimizer().step_count() != kSteps) {
      return absl::InternalError("sampler cursor or optimizer step count is off");
    }
    return absl::OkStatus();
  }();
  return out;
}

// Rank 0's vector on every rank.
std::vector<double> FromRankZero(std::vector<double> v) {
  int n = static_cast<int>(v.size());
  MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
  v.resize(n);
  MPI_Bcast(v.data(), n, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return v;
}

bool BitwiseEqual(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

TEST(TrainLoopMultiRank, SequenceAndDataSplitsMatchOneRank) {
  ASSERT_EQ(WorldSize(), 4) << "run under mpirun -np 4";
  const int rank = WorldRank();

  RunResult a = Train(MPI_COMM_SELF, 1, 1, 2);
  ASSERT_TRUE(AllRanks(a.status.ok())) << a.status;
  ASSERT_EQ(a.losses.size(), static_cast<size_t>(kSteps));
  // It trains: a test whose loss never moves would prove nothing.
  EXPECT_LT(a.losses.back(), a.losses.front());
  std::vector<double> ref = a.losses;
  ref.push_back(a.eval_loss);
  ref.push_back(a.eval_accuracy);
  const std::vector<double> ref0 = FromRankZero(ref);
  // Four identical single-rank runs: bit for bit.
  EXPECT_TRUE(AllRanks(BitwiseEqual(ref, ref0))) << "rank " << rank;

  MPI_Comm pair;
  MPI_Comm_split(MPI_COMM_WORLD, rank / 2, rank, &pair);
  RunResult b = Train(pair, 1, 2, 2);
  MPI_Comm_free(&pair);
  ASSERT_TRUE(AllRanks(b.status.ok())) << b.status;
  RunResult c = Train(MPI_COMM_WORLD, 1, 4, 2);
  ASSERT_TRUE(AllRanks(c.status.ok())) << c.status;
  RunResult d = Train(MPI_COMM_WORLD, 2, 2, 1);
  ASSERT_TRUE(AllRanks(d.status.ok())) << d.status;

  std::vector<double> b_all = b.losses;
  b_all.push_back(b.eval_loss);
  b_all.push_back(b.eval_accuracy);
  // Two identical sp = 2 runs (ranks 0-1 and 2-3): bit for bit.
  EXPECT_TRUE(AllRanks(BitwiseEqual(b_all, FromRankZero(b_all))));

  for (const auto& [name, run] : {std::pair<const char*, const RunResult*>{"sp2", &b},
                                  {"sp4", &c}, {"dp2xsp2", &d}}) {
    ASSERT_EQ(run->losses.size(), static_cast<size_t>(kSteps)) << name;
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(run->losses[s], ref0[s], kRelTol * std::fabs(ref0[s]))
          << name << " step " << s + 1 << " rank " << rank;
    }
    EXPECT_NEAR(run->eval_loss, ref0[kSteps], kRelTol * std::fabs(ref0[kSteps])) << name;
    // Accuracy counts argmax hits: a 1e-5 change in logits could flip a near
    // tie, so allow one answer's worth (the eval set has >= 1000 answers).
    EXPECT_NEAR(run->eval_accuracy, ref0[kSteps + 1], 1e-3) << name;
  }
}

TEST(TrainLoopMultiRank, NonFiniteLossStopsEveryRankWithItsExitCode) {
  // A learning rate of 1e20 blows the weights up on the first update, so a
  // later forward overflows; every rank must stop at the same step with the
  // non-finite-loss code, none left waiting in a collective.
  TrainConfig cfg = MakeConfig(1, 4, 2);
  cfg.mutable_optimizer()->set_lr(1e20f);
  cfg.mutable_optimizer()->set_warmup_steps(0);
  cfg.mutable_optimizer()->set_grad_clip(0.f);
  ProcessGroupOptions opts;
  opts.sp = 4;
  auto pg = ProcessGroup::Create(MPI_COMM_WORLD, opts);
  ASSERT_TRUE(pg.ok());
  auto backend = CreateBackend(Device::Cpu());
  ASSERT_TRUE(backend.ok());
  auto trainer = Trainer::Create(cfg, **pg, **backend);
  ASSERT_TRUE(AllRanks(trainer.ok())) << trainer.status();
  absl::Status status;
  int steps = 0;
  for (; steps < 10 && status.ok(); ++steps) status = (*trainer)->Step().status();
  ASSERT_TRUE(AllRanks(!status.ok())) << "the loss stayed finite at lr 1e20";
  EXPECT_EQ(ExitCodeForStatus(status), kExitNonFiniteLoss) << status;
  // Every rank stopped at the same step.
  int mine = steps, lo = 0, hi = 0;
  MPI_Allreduce(&mine, &lo, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&mine, &hi, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_EQ(lo, hi);
  EXPECT_EQ((*trainer)->state().step, steps - 1);  // the failed step made no update
}

}  // namespace
}  // namespace smat
