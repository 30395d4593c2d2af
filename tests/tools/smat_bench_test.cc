// smat_bench run end to end on small sizes: it times the op and reports the
// numbers it promises, and refuses bad usage with the documented exit codes.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace smat {
namespace {

#ifdef SMAT_BENCH_BINARY
struct BenchRun {
  int rc = -1;
  std::string output;
};

// env: "NAME=value ..." set for the run only.
BenchRun RunBench(const std::string& args, const std::string& env = "") {
  BenchRun res;
  FILE* p = popen(absl::StrCat(env, " ", SMAT_BENCH_BINARY, " ", args, " 2>&1").c_str(), "r");
  if (p == nullptr) return res;
  char buf[4096];
  size_t got;
  while ((got = fread(buf, 1, sizeof(buf), p)) > 0) res.output.append(buf, got);
  const int status = pclose(p);
  res.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return res;
}

TEST(SmatBenchToolTest, TimesForwardAndBackward) {
  BenchRun res = RunBench("smat --device cpu --T 4099 --d 2 --chunk 16 --r 8 --dv 5 --reps 3 "
                          "--warmup 1 --gated");
  ASSERT_EQ(res.rc, 0) << res.output;
  EXPECT_NE(res.output.find("smat forward "), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("smat forward+backward"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("T=4099 d=2"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("median of 3"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("tokens/s"), std::string::npos) << res.output;
}

// The host allocator's cache size (core/host_allocator.h) from the
// environment: a bad value is reported and the default kept; 0 (no cache) and
// a size run quietly. Each run's numbers are the op's, whatever the cache.
TEST(SmatBenchToolTest, HostCacheSizeFromTheEnvironment) {
  const std::string args = "smat --device cpu --T 1000 --d 2 --chunk 16 --r 8 --dv 5 --reps 2";
  BenchRun bad = RunBench(args, "SMAT_HOST_ALLOCATOR_CACHE=lots");
  ASSERT_EQ(bad.rc, 0) << bad.output;
  EXPECT_NE(bad.output.find("SMAT_HOST_ALLOCATOR_CACHE=lots is not a size in MiB"),
            std::string::npos)
      << bad.output;
  EXPECT_NE(bad.output.find("smat forward+backward"), std::string::npos) << bad.output;
  for (const char* env : {"SMAT_HOST_ALLOCATOR_CACHE=0", "SMAT_HOST_ALLOCATOR_CACHE=64"}) {
    BenchRun ok = RunBench(args, env);
    ASSERT_EQ(ok.rc, 0) << env << "\n" << ok.output;
    EXPECT_EQ(ok.output.find("SMAT_HOST_ALLOCATOR_CACHE"), std::string::npos) << ok.output;
    EXPECT_NE(ok.output.find("smat forward+backward"), std::string::npos) << ok.output;
  }
}

// On the GPU (tools_gpu_test): the phases, then the op itself, keeping what
// backward needs and for inference, in the table and the SUMMARY line.
// Without a usable device it skips, saying why (fails under
// SMAT_REQUIRE_GPU=1).
TEST(SmatBenchToolTest, TimesTheOpOnCuda) {
  BenchRun res = RunBench(
      "smat --device cuda --T 4096 --d 2 --heads 2 --r 64 --dv 64 --chunk 128 "
      "--dtype bf16 --reps 3 --warmup 1");
  if (res.rc != 0 && res.output.find("no usable CUDA") != std::string::npos) {
    const char* req = std::getenv("SMAT_REQUIRE_GPU");
    if (req != nullptr && std::string(req) == "1") FAIL() << res.output;
    GTEST_SKIP() << "no CUDA device here, smat_bench --device cuda not checked: " << res.output;
  }
  ASSERT_EQ(res.rc, 0) << res.output;
  EXPECT_NE(res.output.find("| ChunkStatesAndOutputs"), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("SmatForward: "), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("for inference (SmatKeep::kNothing)"), std::string::npos) << res.output;
  const size_t summary = res.output.find("SUMMARY d=2 bf16 ungated T=4096: forward ");
  ASSERT_NE(summary, std::string::npos) << res.output;
  EXPECT_NE(res.output.find("forward+backward", summary), std::string::npos) << res.output;
  EXPECT_NE(res.output.find("SmatForward ", summary), std::string::npos) << res.output;
}

TEST(SmatBenchToolTest, BadUsage) {
  BenchRun res = RunBench("smat --T 100 --d 3 --chunk 64");
  EXPECT_EQ(res.rc, 1);
  EXPECT_NE(res.output.find("T is too small for d = 3"), std::string::npos) << res.output;
  EXPECT_EQ(RunBench("attention --T 4096").rc, 2);
  EXPECT_EQ(RunBench("smat --T 4096 --dtype int8").rc, 2);
  EXPECT_EQ(RunBench("smat --T 4096 --do_dtype int8").rc, 2);
  EXPECT_EQ(RunBench("smat --T 4096 --reps 0").rc, 1);
}
#endif

}  // namespace
}  // namespace smat
