// smat_bench run end to end on small sizes: it times the op and reports the
// numbers it promises, and refuses bad usage with the documented exit codes.
#include <cstdio>
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

BenchRun RunBench(const std::string& args) {
  BenchRun res;
  FILE* p = popen(absl::StrCat(SMAT_BENCH_BINARY, " ", args, " 2>&1").c_str(), "r");
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
