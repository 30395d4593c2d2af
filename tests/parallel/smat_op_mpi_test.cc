// smat_op under mpirun: `mpirun -np 3 smat_op backward ...` (sequence
// parallel, rank 0 writes) produces the same files as a single-process
// `smat_op backward ...` to 1e-5 relative (fp32 summation order only; see
// sequence_parallel_smat_test.cc), gated, with a partial last chunk; and a
// sequence with fewer chunks than ranks fails with a clear message and a
// non-zero exit; a stalled rank ends the job non-zero with DeadlineExceeded.
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>

#include "absl/strings/match.h"
#include "core/npy.h"
#include "core/tensor.h"
#include "gtest/gtest.h"

namespace smat {
namespace {

constexpr double kRelTol = 1e-5;

std::string MakeDir(const std::string& name) {
  std::string dir = (std::filesystem::temp_directory_path() /
                     ("smat_op_mpi_" + std::to_string(getpid()) + "_" + name)).string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

void WriteOperands(const std::string& dir, int64_t T) {
  const int64_t b = 2, H = 2, r = 6, dv = 5;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> pos(0.1f, 1.f), sym(-1.f, 1.f), gate(-0.2f, 0.f);
  auto write = [&](const char* name, Shape s, auto& dist) {
    Tensor t = Tensor::Empty(s, DType::kF32).value();
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = dist(rng);
    SMAT_CHECK(WriteNpy(dir + "/" + name, t).ok());
  };
  write("phi.npy", {b, T, H, r}, pos);
  write("psi.npy", {b, T, H, r}, pos);
  write("v.npy", {b, T, H, dv}, sym);
  write("logg.npy", {b, T, H}, gate);
  write("do.npy", {b, T, H, dv}, sym);
}

// Runs a shell command, returns its exit status and (merged) output.
int RunCommand(const std::string& cmd, std::string* output) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  SMAT_CHECK(p != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output->append(buf, n);
  int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

std::string Mpirun(int np) {
  return std::string(SMAT_MPIEXEC) + " -np " + std::to_string(np) +
         " --oversubscribe --bind-to none ";
}

TEST(SmatOpUnderMpirun, ThreeRanksWriteWhatOneProcessWrites) {
  const std::string in = MakeDir("in"), single = MakeDir("single"), par = MakeDir("par");
  WriteOperands(in, 150);  // chunk 16: n = 64, 10 chunks, the last one 6 tokens
  const std::string args = " backward --d 2 --chunk 16 --eps 1e-3 --in " + in + " --out ";
  std::string out1, out3;
  ASSERT_EQ(RunCommand(std::string(SMAT_OP_BINARY) + args + single, &out1), 0) << out1;
  ASSERT_EQ(RunCommand(Mpirun(3) + SMAT_OP_BINARY + args + par, &out3), 0) << out3;
  EXPECT_TRUE(absl::StrContains(out3, "sequence-parallel over 3 ranks")) << out3;
  for (const char* name : {"o.npy", "dphi.npy", "dpsi.npy", "dv.npy", "dlogg.npy"}) {
    auto a = ReadNpy(single + "/" + name);
    auto b = ReadNpy(par + "/" + name);
    ASSERT_TRUE(a.ok() && b.ok()) << name << ": " << a.status() << " / " << b.status();
    ASSERT_EQ(a->shape(), b->shape()) << name;
    double max_ref = 0, max_diff = 0;
    for (int64_t i = 0; i < a->numel(); ++i) {
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(a->data<float>()[i])));
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(a->data<float>()[i]) -
                                              b->data<float>()[i]));
    }
    EXPECT_GT(max_ref, 0) << name << " is all zeros: the comparison proves nothing";
    EXPECT_LE(max_diff, kRelTol * max_ref) << name;
  }
}

TEST(SmatOpUnderMpirun, FewerChunksThanRanksIsAClearError) {
  const std::string in = MakeDir("in_short"), out = MakeDir("out_short");
  WriteOperands(in, 40);  // chunk 16: 3 chunks for 4 ranks
  std::string output;
  int rc = RunCommand(Mpirun(4) + SMAT_OP_BINARY + " forward --d 1 --chunk 16 --in " + in + " --out " +
                   out, &output);
  EXPECT_NE(rc, 0) << output;
  EXPECT_TRUE(absl::StrContains(output, "fewer than the 4 sequence-parallel ranks")) << output;
  EXPECT_FALSE(std::filesystem::exists(out + "/o.npy"));
}

// A rank that stalls forever in its first collective: the other rank's
// deadline (2 s) turns it into DeadlineExceeded, the job is aborted non-zero
// (the stalled rank included) and nothing is written.
TEST(SmatOpUnderMpirun, StalledRankEndsTheJobWithDeadlineExceeded) {
  const std::string in = MakeDir("in_stall"), out = MakeDir("out_stall");
  WriteOperands(in, 150);
  std::string output;
  const auto t0 = std::chrono::steady_clock::now();
  int rc = RunCommand("SMAT_FAULT=stall_in_collective:rank=1:call=1 SMAT_COLLECTIVE_TIMEOUT_S=2 " +
                          Mpirun(2) + SMAT_OP_BINARY + " forward --d 2 --chunk 16 --in " + in +
                          " --out " + out, &output);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(rc, 0) << output;
  EXPECT_TRUE(absl::StrContains(output, "rank 0: DEADLINE_EXCEEDED")) << output;
  EXPECT_TRUE(absl::StrContains(output, "AllGather")) << output;
  // 2 s deadline + MPI start-up and abort on 2 shared cores.
  EXPECT_LT(seconds, 20.0) << output;
  EXPECT_FALSE(std::filesystem::exists(out + "/o.npy"));
}

}  // namespace
}  // namespace smat
