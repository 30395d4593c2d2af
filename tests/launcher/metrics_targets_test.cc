// The launcher's Prometheus file_sd targets (launcher/metrics_targets.h): the
// by-slot placement of ranks on a two-host hostfile, the file's exact content,
// the removal of an earlier attempt's rank files, metrics.port = 0, and
// smat_launch writing the file before it starts the job (a fake mpirun that
// only records that it ran).
#include "launcher/metrics_targets.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace smat {
namespace {

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/smat_targets_XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

constexpr char kTwoHostJson[] =
    "[\n"
    "  {\"targets\": [\"node-a:9400\"], \"labels\": {\"rank\": \"0\"}},\n"
    "  {\"targets\": [\"node-a:9401\"], \"labels\": {\"rank\": \"1\"}},\n"
    "  {\"targets\": [\"node-b:9400\"], \"labels\": {\"rank\": \"2\"}},\n"
    "  {\"targets\": [\"node-b:9401\"], \"labels\": {\"rank\": \"3\"}}\n"
    "]\n";

TEST(MetricsTargets, RanksFillEachHostsSlotsInOrder) {
  auto hosts = ParseHostList("a:3,b:2");
  ASSERT_TRUE(hosts.ok()) << hosts.status();
  auto t = RankMetricsTargets(*hosts, 4, 9400);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 4u);
  EXPECT_EQ((*t)[2].host, "a");
  EXPECT_EQ((*t)[2].port, 9402);
  EXPECT_EQ((*t)[3].rank, 3);
  EXPECT_EQ((*t)[3].host, "b");
  EXPECT_EQ((*t)[3].port, 9400);
  EXPECT_FALSE(RankMetricsTargets(*hosts, 6, 9400).ok());     // more ranks than slots
  EXPECT_FALSE(RankMetricsTargets(*hosts, 5, 65534).ok());    // 65534 + 2 is no port
}

TEST(MetricsTargets, TwoHostHostfileGivesOneTargetPerRankAndRemovesStaleRankFiles) {
  TempDir dir;
  const std::string hostfile = dir.path() + "/hosts";
  WriteFile(hostfile, "# two nodes\nnode-a slots=2\nnode-b slots=2\n");
  const std::string metrics = dir.path() + "/run/metrics";
  std::filesystem::create_directories(metrics);
  WriteFile(metrics + "/rank_7.json", "[]\n");  // a rank of a larger earlier grid
  WriteFile(metrics + "/rank_7.port", "40001\n");
  WriteFile(metrics + "/other.json", "[]\n");   // not ours: stays
  JobCommand job;
  job.np = 4;
  job.hostfile = hostfile;
  ASSERT_TRUE(PrepareMetricsTargets(job, 9400, "0.0.0.0", metrics, metrics + "/targets.json").ok());
  EXPECT_EQ(ReadFile(metrics + "/targets.json"), kTwoHostJson);
  EXPECT_FALSE(std::filesystem::exists(metrics + "/rank_7.json"));
  EXPECT_FALSE(std::filesystem::exists(metrics + "/rank_7.port"));
  EXPECT_TRUE(std::filesystem::exists(metrics + "/other.json"));

  // A fixed metrics.host is what every rank advertises.
  ASSERT_TRUE(PrepareMetricsTargets(job, 9400, "10.0.0.5", metrics, metrics + "/targets.json").ok());
  EXPECT_NE(ReadFile(metrics + "/targets.json").find("\"10.0.0.5:9401\"], \"labels\": {\"rank\": \"3\"}"),
            std::string::npos);

  // metrics.port = 0: the ranks' own files are the targets; the launcher's goes.
  ASSERT_TRUE(PrepareMetricsTargets(job, 0, "0.0.0.0", metrics, metrics + "/targets.json").ok());
  EXPECT_FALSE(std::filesystem::exists(metrics + "/targets.json"));
}

#ifdef SMAT_LAUNCH_BINARY
TEST(MetricsTargets, SmatLaunchWritesTheTargetsBeforeTheJobStarts) {
  TempDir dir;
  const std::string hostfile = dir.path() + "/hosts";
  WriteFile(hostfile, "node-a slots=2\nnode-b slots=2\n");
  const std::string run = dir.path() + "/run";
  std::filesystem::create_directories(run + "/metrics");
  WriteFile(run + "/metrics/rank_5.json", "[]\n");
  // The fake mpirun copies the targets file as the job sees it at start.
  const std::string fake = dir.path() + "/mpirun";
  WriteFile(fake, absl::StrCat("#!/bin/sh\ncp ", run, "/metrics/targets.json ", dir.path(),
                               "/seen.json\nexit 0\n"));
  ::chmod(fake.c_str(), 0755);
  const std::string cmd = absl::StrCat(
      "timeout 60 ", SMAT_LAUNCH_BINARY, " --hostfile ", hostfile, " --config ", SMAT_SOURCE_DIR,
      "/configs/tiny_cpu.textproto --set parallel.dp=4 --set parallel.sp=1 --set run.dir=", run,
      " --set metrics.enabled=true --set metrics.port=9400 --mpirun ", fake, " --train /bin/true --max_restarts 0 > ",
      dir.path(), "/out 2>&1");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << ReadFile(dir.path() + "/out");
  EXPECT_EQ(ReadFile(dir.path() + "/seen.json"), kTwoHostJson);
  EXPECT_FALSE(std::filesystem::exists(run + "/metrics/rank_5.json"));
}
#endif

}  // namespace
}  // namespace smat
