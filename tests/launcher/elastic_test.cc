// smat_launch --elastic's pure parts (launcher/elastic.h): the grid that fits
// the hosts still answering, the remote shell it probes them with, the probe
// against fake agents (answers, refuses, hangs) and the attempt's command.
#include "launcher/elastic.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace smat {
namespace {

std::vector<HostSlots> Hosts(std::vector<std::pair<std::string, int>> hs) {
  std::vector<HostSlots> out;
  for (auto& [h, s] : hs) out.push_back({h, s});
  return out;
}

TEST(ElasticTest, EveryHostAnsweringIsTheFullJob) {
  absl::StatusOr<ElasticPlan> p =
      PlanElasticGrid(Hosts({{"a", 1}, {"b", 1}}), {true, true}, /*dp=*/1, /*sp=*/2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->full);
  EXPECT_EQ(p->np, 2);
  JobCommand job;
  job.np = 2;
  job.hostfile = "hosts.txt";
  job.sets = {"run.steps=9"};
  JobCommand same = ElasticJob(job, *p);
  EXPECT_EQ(same.hostfile, "hosts.txt");
  EXPECT_EQ(same.sets, job.sets);
}

TEST(ElasticTest, OneHostOfTwoLeftShrinksSequenceParallelism) {
  absl::StatusOr<ElasticPlan> p =
      PlanElasticGrid(Hosts({{"a", 1}, {"b", 1}}), {true, false}, /*dp=*/1, /*sp=*/2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->full);
  EXPECT_EQ(p->np, 1);
  EXPECT_EQ(p->dp, 1);
  EXPECT_EQ(p->sp, 1);
  ASSERT_EQ(p->hosts.size(), 1u);
  EXPECT_EQ(p->hosts[0].host, "a");

  JobCommand job;
  job.np = 2;
  job.hostfile = "hosts.txt";
  job.sets = {"run.steps=9", "parallel.sp=2"};
  JobCommand shrunk = ElasticJob(job, *p);
  EXPECT_EQ(shrunk.np, 1);
  EXPECT_EQ(shrunk.hosts, "a:1");
  EXPECT_EQ(shrunk.hostfile, "");
  // The grid overrides come after the user's, so they win.
  EXPECT_EQ(shrunk.sets, (std::vector<std::string>{"run.steps=9", "parallel.sp=2",
                                                   "parallel.dp=1", "parallel.sp=1"}));
}

TEST(ElasticTest, DataParallelismShrinksFirst) {
  // 4 hosts x 2 slots, dp 4 x sp 2; one host down: 6 slots -> dp 3 x sp 2.
  std::vector<HostSlots> hosts = Hosts({{"a", 2}, {"b", 2}, {"c", 2}, {"d", 2}});
  absl::StatusOr<ElasticPlan> p = PlanElasticGrid(hosts, {true, true, false, true}, 4, 2);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->dp, 3);
  EXPECT_EQ(p->sp, 2);
  EXPECT_EQ(HostListString(p->hosts), "a:2,b:2,d:2");
  // sp 4 on 3 live ranks: the largest divisor of 4 that fits is 2 (spans of
  // sp = 2 are unions of sp = 4 spans, so still chunk-aligned); one slot idles.
  p = PlanElasticGrid(Hosts({{"a", 1}, {"b", 1}, {"c", 1}, {"d", 1}}),
                      {true, true, true, false}, 1, 4);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->np, 2);
  EXPECT_EQ(p->sp, 2);
  EXPECT_EQ(p->dp, 1);
  // More live slots than the configured world: the world does not grow.
  p = PlanElasticGrid(Hosts({{"a", 8}, {"b", 8}}), {true, false}, 2, 2);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->np, 4);
  EXPECT_TRUE(p->full == false);
}

TEST(ElasticTest, NoHostAnsweringIsRetriedLater) {
  absl::StatusOr<ElasticPlan> p = PlanElasticGrid(Hosts({{"a", 1}}), {false}, 1, 1);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(p.status().message().find("none of the 1 hosts"), std::string::npos);
}

TEST(ElasticTest, RshAgentFromMpirunArgsEnvironmentOrSsh) {
  EXPECT_EQ(RshAgentArgv({}, "", 7),
            (std::vector<std::string>{"ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=7"}));
  EXPECT_EQ(RshAgentArgv({}, "/usr/bin/rsh", 7), (std::vector<std::string>{"/usr/bin/rsh"}));
  EXPECT_EQ(RshAgentArgv({"--bind-to", "none", "--mca", "plm_rsh_agent", "/t/netns_rsh.sh"},
                         "/usr/bin/rsh", 7),
            (std::vector<std::string>{"/t/netns_rsh.sh"}));
  EXPECT_EQ(RshAgentArgv({}, "ssh -p 2222 : rsh", 3),
            (std::vector<std::string>{"ssh", "-p", "2222", "-o", "BatchMode=yes", "-o",
                                      "ConnectTimeout=3"}));
}

class ProbeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/smat_elastic_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }
  // An agent that answers for host "up", refuses "down", hangs for "stuck".
  std::string Agent() {
    const std::string path = dir_ + "/agent.sh";
    std::ofstream(path) << "#!/bin/sh\n"
                           "case \"$1\" in\n"
                           "  up) shift; exec \"$@\" ;;\n"
                           "  stuck) exec sleep 30 ;;\n"
                           "  *) echo \"ssh: connect to host $1: No route to host\" >&2; exit 255 ;;\n"
                           "esac\n";
    chmod(path.c_str(), 0755);
    return path;
  }
  std::string dir_;
};

TEST_F(ProbeTest, AnswersRefusalsAndTimeouts) {
  const std::vector<std::string> agent = {Agent()};
  EXPECT_TRUE(ProbeHost(agent, "up", 5).ok());
  absl::Status s = ProbeHost(agent, "down", 5);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("exit 255: ssh: connect to host down: No route to host"),
            std::string::npos)
      << s;
  const auto t0 = std::chrono::steady_clock::now();
  s = ProbeHost(agent, "stuck", 0.5);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("no answer within 0.5 s"), std::string::npos) << s;
  EXPECT_LT(took, 5.0);  // killed at the timeout, not after the agent's 30 s
  s = ProbeHost({dir_ + "/no_such_agent"}, "up", 5);
  EXPECT_FALSE(s.ok());
}

}  // namespace
}  // namespace smat
