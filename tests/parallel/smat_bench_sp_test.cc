// `smat_bench smat --sp` under mpirun on the CPU (MPI communicator, CPU
// backend), the way the GPU weak-scaling run is launched: the volumes it
// prints for every collective are the words the op really sent and equal
// SequenceParallelVolume's formulas (recomputed here from the same plan), the
// times are positive, one rank also times the single-process op and prints the
// efficiency against a given baseline, and bad usage exits with status 2.
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/geometry.h"
#include "gtest/gtest.h"
#include "parallel/sequence_parallel_smat.h"

namespace smat {
namespace {

int RunCommand(const std::string& cmd, std::string* output) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  SMAT_CHECK(p != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

std::string Mpirun(int np) {
  // One BLAS thread per rank: two ranks on a 2-core machine.
  return std::string("OPENBLAS_NUM_THREADS=1 ") + SMAT_MPIEXEC + " -np " + std::to_string(np) +
         " --oversubscribe --bind-to none " + SMAT_BENCH_BINARY;
}

// The key=value pairs of the SUMMARY line (empty when there is none).
std::map<std::string, std::string> Summary(const std::string& out) {
  std::map<std::string, std::string> kv;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::ConsumePrefix(&line, "SUMMARY ")) continue;
    for (absl::string_view field : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      std::vector<std::string> parts = absl::StrSplit(field, absl::MaxSplits('=', 1));
      if (parts.size() == 2) kv[parts[0]] = parts[1];
    }
  }
  return kv;
}

double Number(const std::map<std::string, std::string>& kv, const std::string& key) {
  double x = -1;
  auto it = kv.find(key);
  if (it == kv.end() || !absl::SimpleAtod(it->second, &x)) return -1;
  return x;
}

// The cells of the table row starting "| <name> |" (trimmed), empty if absent.
std::vector<std::string> Row(const std::string& out, const std::string& name) {
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::StartsWith(line, "| " + name + " |")) continue;
    std::vector<std::string> cells;
    for (absl::string_view c : absl::StrSplit(line, '|')) {
      cells.push_back(std::string(absl::StripAsciiWhitespace(c)));
    }
    // "| a | b |" splits into "", "a", "b", "".
    return std::vector<std::string>(cells.begin() + 1, cells.end() - 1);
  }
  return {};
}

// Leading integer of a "words per rank" cell: "520 (0.00 MB)" -> 520.
int64_t LeadingInt(const std::string& cell) {
  int64_t x = -1;
  std::vector<std::string> parts = absl::StrSplit(cell, ' ');
  if (parts.empty() || !absl::SimpleAtoi(parts[0], &x)) return -1;
  return x;
}

TEST(SmatBenchSp, TwoRanksPrintTheFormulaVolumesAndPositiveTimes) {
  // 2 ranks x 2048 tokens: rank 0 holds the distant block, rank 1 the recent.
  const int64_t T_rank = 2048, H = 2, r = 8, dv = 7, p = dv + 1;
  std::string out;
  const int rc = RunCommand(Mpirun(2) + " smat --sp --device cpu --T 2048 --d 2 --chunk 64 "
                                        "--heads 2 --r 8 --dv 7 --reps 3 --warmup 1 --gated",
                            &out);
  ASSERT_EQ(rc, 0) << out;
  const SmatPlan plan = MakeSmatPlan(2 * T_rank, 2, 64).value();
  const SpSmatVolume vol = SequenceParallelVolume(plan, 2, 1, H, r, p);

  std::vector<std::string> scan = Row(out, "forward AllGather");
  std::vector<std::string> table = Row(out, "forward AllReduce");
  std::vector<std::string> u_bar = Row(out, "backward AllReduce");
  ASSERT_GE(scan.size(), 9u) << out;
  ASSERT_GE(table.size(), 9u) << out;
  ASSERT_GE(u_bar.size(), 9u) << out;
  // Column 2: words the op sent; column 4: the formula's words; 5: match.
  EXPECT_EQ(LeadingInt(scan[2]), vol.scan_words) << out;
  EXPECT_EQ(LeadingInt(scan[4]), vol.scan_words) << out;
  EXPECT_EQ(LeadingInt(table[2]), vol.table_words) << out;
  EXPECT_EQ(LeadingInt(table[4]), vol.table_words) << out;
  EXPECT_EQ(LeadingInt(u_bar[2]), H * plan.geo.B * r * p) << out;
  for (const auto* row : {&scan, &table, &u_bar}) EXPECT_EQ((*row)[5], "yes") << out;
  // Ring bytes sent per rank at sp = 2: the gathered half, all of the table.
  EXPECT_EQ(LeadingInt(scan[6]), vol.scan_words / 2 * 4) << out;
  EXPECT_EQ(LeadingInt(table[6]), vol.table_words * 4) << out;
  EXPECT_TRUE(absl::StrContains(out, "SequenceParallelVolume: " + vol.ToString())) << out;

  std::vector<std::string> rank0 = Row(out, "0"), rank1 = Row(out, "1");
  ASSERT_GE(rank0.size(), 7u) << out;
  ASSERT_GE(rank1.size(), 7u) << out;
  EXPECT_EQ(rank0[1], "[0, 2048)");
  EXPECT_EQ(rank1[1], "[2048, 4096)");

  std::map<std::string, std::string> kv = Summary(out);
  ASSERT_FALSE(kv.empty()) << out;
  EXPECT_EQ(kv["sp"], "2");
  EXPECT_EQ(kv["T"], "4096");
  EXPECT_EQ(kv["comm"], "mpi");
  EXPECT_EQ(kv["volumes_match"], "1");
  EXPECT_GT(Number(kv, "fwd_ms"), 0) << out;
  EXPECT_GE(Number(kv, "fwd_bwd_ms"), Number(kv, "fwd_ms")) << out;
  EXPECT_GT(Number(kv, "comm_in_flight_ms"), 0) << out;
  EXPECT_GE(Number(kv, "comm_waited_ms"), 0) << out;
  EXPECT_GT(Number(kv, "comm_ring_bytes"), 0) << out;
}

TEST(SmatBenchSp, OneRankTimesTheSingleProcessOpAndEfficiency) {
  std::string out;
  const int rc = RunCommand(Mpirun(1) + " smat --sp --device cpu --T 2048 --d 2 --chunk 64 "
                                        "--heads 2 --r 8 --dv 7 --reps 3 --warmup 1 "
                                        "--baseline_ms 1e6",
                            &out);
  ASSERT_EQ(rc, 0) << out;
  std::map<std::string, std::string> kv = Summary(out);
  EXPECT_EQ(kv["sp"], "1");
  EXPECT_GT(Number(kv, "fwd_bwd_ms"), 0) << out;
  EXPECT_GT(Number(kv, "op_fwd_ms"), 0) << out;
  EXPECT_GE(Number(kv, "op_fwd_bwd_ms"), Number(kv, "op_fwd_ms")) << out;
  // efficiency = baseline / fwd_bwd_ms.
  const double eff = Number(kv, "efficiency");
  EXPECT_NEAR(eff, 1e6 / Number(kv, "fwd_bwd_ms"), 1e-3 * eff) << out;
  // One rank sends nothing on a ring.
  EXPECT_EQ(Number(kv, "comm_ring_bytes"), 0) << out;
}

TEST(SmatBenchSp, BadUsageExitsWithStatusTwo) {
  std::string out;
  // Tokens per rank that are not whole chunks: refused before MPI starts.
  EXPECT_EQ(RunCommand(std::string(SMAT_BENCH_BINARY) + " smat --sp --T 100 --chunk 64", &out), 2)
      << out;
  EXPECT_TRUE(absl::StrContains(out, "multiple of --chunk")) << out;
  out.clear();
  EXPECT_EQ(RunCommand(std::string(SMAT_BENCH_BINARY) + " smat --sp --device cpu --comm nccl "
                                                        "--T 128 --chunk 64",
                       &out),
            2)
      << out;
  out.clear();
  EXPECT_EQ(RunCommand(std::string(SMAT_BENCH_BINARY) + " smat --sp --comm gloo --T 128 --chunk 64",
                       &out),
            2)
      << out;
}

}  // namespace
}  // namespace smat
