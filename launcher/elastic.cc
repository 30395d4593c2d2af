// Elastic restarts: host probes and the shrunken grid (launcher/elastic.h).
#include "launcher/elastic.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "launcher/child_process.h"

namespace smat {
namespace {

double MonotonicSeconds() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

}  // namespace

absl::StatusOr<ElasticPlan> PlanElasticGrid(const std::vector<HostSlots>& hosts,
                                            const std::vector<bool>& live, int dp, int sp) {
  ElasticPlan plan;
  int slots = 0;
  for (size_t i = 0; i < hosts.size(); ++i) {
    if (i < live.size() && live[i]) {
      plan.hosts.push_back(hosts[i]);
      slots += hosts[i].slots;
    }
  }
  if (plan.hosts.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("elastic: none of the ", hosts.size(),
                     " hosts answered the probe; retrying after the backoff"));
  }
  const int world = std::min(slots, dp * sp);
  if (world >= sp) {
    plan.sp = sp;
    plan.dp = world / sp;
  } else {
    plan.dp = 1;
    plan.sp = 1;
    for (int d = world; d >= 1; --d) {
      if (sp % d == 0) {
        plan.sp = d;
        break;
      }
    }
  }
  plan.np = plan.dp * plan.sp;
  plan.full = plan.hosts.size() == hosts.size() && plan.dp == dp && plan.sp == sp;
  return plan;
}

std::vector<std::string> RshAgentArgv(const std::vector<std::string>& mpirun_args,
                                      const std::string& env_agent, double timeout_s) {
  std::string agent = env_agent;
  for (size_t i = 0; i + 2 < mpirun_args.size(); ++i) {
    const std::string& a = mpirun_args[i];
    if ((a == "--mca" || a == "-mca") && mpirun_args[i + 1] == "plm_rsh_agent") {
      agent = mpirun_args[i + 2];
    }
  }
  // Open MPI accepts a colon-separated list of candidates ("ssh : rsh"); the
  // first is the one it uses when it exists.
  agent = std::string(absl::StripAsciiWhitespace(agent.substr(0, agent.find(':'))));
  if (agent.empty()) agent = "ssh";
  std::vector<std::string> argv = absl::StrSplit(agent, ' ', absl::SkipWhitespace());
  const std::string base = argv[0].substr(argv[0].rfind('/') + 1);
  if (base == "ssh") {
    argv.insert(argv.end(), {"-o", "BatchMode=yes", "-o",
                             absl::StrCat("ConnectTimeout=", std::max(1, static_cast<int>(timeout_s)))});
  }
  return argv;
}

absl::Status ProbeHost(const std::vector<std::string>& agent, const std::string& host,
                       double timeout_s) {
  std::vector<std::string> argv = agent;
  argv.insert(argv.end(), {host, "true"});
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    return absl::UnavailableError(absl::StrCat("elastic: cannot create a pipe to probe ", host,
                                               ": ", std::strerror(errno)));
  }
  const pid_t child = ::fork();
  if (child == 0) {
    ::setpgid(0, 0);  // its own group: a timeout kills the agent and its children
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, STDIN_FILENO);
    ExecWithOutput(argv, fds[1], "");
  }
  ::close(fds[1]);
  if (child < 0) {
    ::close(fds[0]);
    return absl::UnavailableError(absl::StrCat("elastic: fork failed probing ", host));
  }
  std::string output;
  int status = 0;
  bool exited = false, timed_out = false;
  const double deadline = MonotonicSeconds() + timeout_s;
  while (!exited) {
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, 50) > 0) {
      char buf[512];
      const ssize_t n = ::read(fds[0], buf, sizeof(buf));
      if (n > 0 && output.size() < 4096) output.append(buf, n);
    }
    if (::waitpid(child, &status, WNOHANG) == child) exited = true;
    if (!exited && MonotonicSeconds() > deadline) {
      ::kill(-child, SIGKILL);
      ::waitpid(child, &status, 0);
      exited = timed_out = true;
    }
  }
  ::close(fds[0]);
  const std::string first_line(
      absl::StripAsciiWhitespace(output.substr(0, output.find('\n'))));
  if (timed_out) {
    return absl::UnavailableError(absl::StrCat("no answer within ", timeout_s, " s"));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      WIFEXITED(status) ? absl::StrCat("exit ", WEXITSTATUS(status))
                        : absl::StrCat("signal ", WTERMSIG(status)),
      first_line.empty() ? "" : ": ", first_line));
}

std::string HostListString(const std::vector<HostSlots>& hosts) {
  std::vector<std::string> parts;
  for (const HostSlots& h : hosts) parts.push_back(absl::StrCat(h.host, ":", h.slots));
  return absl::StrJoin(parts, ",");
}

JobCommand ElasticJob(const JobCommand& job, const ElasticPlan& plan) {
  if (plan.full) return job;
  JobCommand out = job;
  out.hosts = HostListString(plan.hosts);
  out.hostfile.clear();
  out.np = plan.np;
  out.sets.push_back(absl::StrCat("parallel.dp=", plan.dp));
  out.sets.push_back(absl::StrCat("parallel.sp=", plan.sp));
  return out;
}

}  // namespace smat
