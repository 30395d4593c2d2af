// Elastic restarts for smat_launch --elastic: before each restart the hosts of
// the job are probed through mpirun's own remote shell (the rsh agent: ssh,
// or whatever --mca plm_rsh_agent names), and the job restarts on the hosts
// that answer, with a grid that fits them. When every host answers again the
// job is back on its full grid. The checkpoint loads on any grid
// (docs/FAULT_TOLERANCE.md, "Resume rules"), so shrinking and growing cost
// only the steps since the newest checkpoint.
//
// Grid rule, from the configured dp x sp and the live ranks W (the slots of
// the answering hosts, at most the configured world):
//   W >= sp:  sp stays, dp = floor(W / sp)     (a sequence keeps its split)
//   W <  sp:  sp = the largest divisor of sp that is <= W, dp = 1
//             (a divisor keeps the spans chunk-aligned wherever sp's were)
//
//   ElasticPlan plan = PlanElasticGrid(hosts, live, /*dp=*/2, /*sp=*/2);
//   // hosts a:2,b:2, b down -> plan.np = 2, dp 1 x sp 2 on "a:2"
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "launcher/mpirun_command.h"

namespace smat {

struct ElasticPlan {
  std::vector<HostSlots> hosts;  // the hosts that answered, slots as given
  int np = 0, dp = 0, sp = 0;    // np = dp * sp <= the answering slots
  bool full = false;             // every host answered: the configured job
};

// `live[i]` says whether hosts[i] answered. FailedPrecondition (retry later)
// when no host answered.
absl::StatusOr<ElasticPlan> PlanElasticGrid(const std::vector<HostSlots>& hosts,
                                            const std::vector<bool>& live, int dp, int sp);

// The remote shell mpirun uses, as argv: the value of `--mca plm_rsh_agent X`
// among `mpirun_args`, else $OMPI_MCA_plm_rsh_agent (`env_agent`, may be
// empty), else ssh; split at spaces ("ssh -p 2222"). ssh gets BatchMode (no
// password prompt) and a connect timeout, so a dead host fails fast.
std::vector<std::string> RshAgentArgv(const std::vector<std::string>& mpirun_args,
                                      const std::string& env_agent, double timeout_s);

// Runs `agent host true`; OK when it exits 0 within timeout_s, else
// Unavailable with the agent's exit and the first line it printed.
absl::Status ProbeHost(const std::vector<std::string>& agent, const std::string& host,
                       double timeout_s);

// The job of one elastic attempt: `job` itself when plan.full, else on
// plan.hosts (--host, replacing --host/--hostfile) with plan.np ranks and
// parallel.dp / parallel.sp overrides after the user's --set values.
JobCommand ElasticJob(const JobCommand& job, const ElasticPlan& plan);

// "a:2,b:2" for --host.
std::string HostListString(const std::vector<HostSlots>& hosts);

}  // namespace smat
