// smat_launch: runs a smat_train job through mpirun and brings it back after a
// failure, from its newest intact checkpoint (docs/FAULT_TOLERANCE.md).
//
//   smat_launch --np 8 --hosts a:4,b:4 --config configs/lm_1m_gpu.textproto
//       --set run.steps=20000 -x NCCL_DEBUG --max_restarts 5 --backoff 10
//   smat_launch --hostfile hosts.txt --config c.textproto --dry_run
//
// Flags (GNU style: "--flag value" or "--flag=value"; --set and -x repeat):
//   --np N             ranks (default: the slots of --hosts / --hostfile, else 1)
//   --hosts LIST       a:4,b:4 (mpirun --host)      --hostfile FILE (mpirun --hostfile)
//   --config FILE      the run's config (required; checked before mpirun starts)
//   --set PATH=VALUE   config override, forwarded to smat_train
//   -x VAR[=VALUE]     environment variable exported to every rank (mpirun -x)
//   --max_restarts N   restarts after failures before giving up (default 3)
//   --backoff S        seconds before the first restart, doubled each time (default 10)
//   --backoff_max S    cap of the backoff (default 300)
//   --log_dir DIR      attempt_N.log per attempt and summary.txt (default run.dir/launch)
//   --mpirun PATH      mpirun to use (default "mpirun" from PATH)
//   --mpirun_arg ARG   extra argument for mpirun (repeatable), e.g. --oversubscribe
//   --train PATH       smat_train (default: next to smat_launch)
//   --stop_grace S     after SIGTERM to the launcher, seconds the job gets to
//                      checkpoint and exit before it is terminated (default 120)
//   --hang_timeout S   restart a job that prints nothing for S seconds (default 0: off;
//                      set it well above run.log_every steps' time)
//   --elastic          before each restart, probe every host with mpirun's remote
//                      shell (--mca plm_rsh_agent, else ssh) and restart on the hosts
//                      that answer, parallel.dp/sp shrunk to fit (launcher/elastic.h);
//                      back on the full grid once every host answers again
//   --probe_timeout S  seconds a host gets to answer the probe (default 10)
//   --targets_file F   the job's Prometheus file_sd targets, one per rank, host:(metrics.port
//                      + local rank), rewritten before every attempt (default
//                      run.dir/metrics/targets.json; launcher/metrics_targets.h). Stale
//                      rank_<R>.json/.port files of earlier attempts are removed first.
//                      metrics.port = 0: no file (the ranks' own files list their ports)
//   --dry_run          print the first attempt's mpirun command and exit
// Without --np/--hosts/--hostfile the launch environment gives the defaults:
// the hostfile Open MPI is told of ($OMPI_MCA_orte_default_hostfile, set by the
// Kubeflow MPI Operator), else Slurm's task count (SLURM_NTASKS, inside sbatch;
// mpirun finds the allocation's hosts itself).
// Flags are parsed by hand rather than with absl flags because --set and -x
// repeat (absl's list flags split on commas and do not accumulate).
//
// Exit code: 0 when the job finished; the job's code when it stopped for a
// reason a restart cannot cure (2 bad input, 4 NaN loss); 3 after giving up;
// 5 when stopped by SIGTERM/SIGINT; 2 for bad launcher flags or config.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/config.h"
#include "core/exit_codes.h"
#include "core/status.h"
#include "launcher/elastic.h"
#include "launcher/metrics_targets.h"
#include "launcher/mpirun_command.h"
#include "launcher/supervisor.h"
#include "parallel/launch_env.h"

namespace smat {
namespace {

std::atomic<int> stop_signal{0};
void OnStopSignal(int sig) { stop_signal.store(sig); }

struct Flags {
  int np = 0;
  std::string hosts, hostfile, config, log_dir, mpirun = "mpirun", train, targets_file;
  std::vector<std::string> sets, exports, mpirun_args;
  int max_restarts = 3;
  double backoff = 10, backoff_max = 300, stop_grace = 120, hang_timeout = 0;
  double probe_timeout = 10;
  bool dry_run = false, elastic = false;
};

constexpr char kUsage[] =
    "usage: smat_launch --config FILE [--np N] [--hosts a:4,b:4 | --hostfile FILE]\n"
    "         [--set PATH=VALUE]... [-x VAR[=VALUE]]... [--max_restarts N] [--backoff S]\n"
    "         [--backoff_max S] [--log_dir DIR] [--mpirun PATH] [--mpirun_arg ARG]...\n"
    "         [--train PATH] [--stop_grace S] [--hang_timeout S]\n"
    "         [--elastic] [--probe_timeout S] [--targets_file FILE] [--dry_run]\n";

absl::StatusOr<Flags> ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    std::string value;
    bool has_value = false;
    if (absl::StartsWith(arg, "--") && arg.find('=') != std::string::npos) {
      value = arg.substr(arg.find('=') + 1);
      arg = arg.substr(0, arg.find('='));
      has_value = true;
    }
    auto take = [&]() -> absl::StatusOr<std::string> {
      if (has_value) return value;
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(arg, " needs a value"));
      return std::string(argv[++i]);
    };
    auto take_int = [&](int* out) -> absl::Status {
      SMAT_ASSIGN_OR_RETURN(std::string v, take());
      if (!absl::SimpleAtoi(v, out) || *out < 0) {
        return absl::InvalidArgumentError(absl::StrCat(arg, " ", v, ": expected an integer >= 0"));
      }
      return absl::OkStatus();
    };
    auto take_double = [&](double* out) -> absl::Status {
      SMAT_ASSIGN_OR_RETURN(std::string v, take());
      if (!absl::SimpleAtod(v, out) || *out < 0) {
        return absl::InvalidArgumentError(absl::StrCat(arg, " ", v, ": expected seconds >= 0"));
      }
      return absl::OkStatus();
    };
    if (arg == "--np") {
      SMAT_RETURN_IF_ERROR(take_int(&f.np));
    } else if (arg == "--hosts") {
      SMAT_ASSIGN_OR_RETURN(f.hosts, take());
    } else if (arg == "--hostfile") {
      SMAT_ASSIGN_OR_RETURN(f.hostfile, take());
    } else if (arg == "--config") {
      SMAT_ASSIGN_OR_RETURN(f.config, take());
    } else if (arg == "--set") {
      SMAT_ASSIGN_OR_RETURN(std::string s, take());
      f.sets.push_back(s);
    } else if (arg == "-x") {
      SMAT_ASSIGN_OR_RETURN(std::string x, take());
      f.exports.push_back(x);
    } else if (arg == "--mpirun_arg") {
      SMAT_ASSIGN_OR_RETURN(std::string a, take());
      f.mpirun_args.push_back(a);
    } else if (arg == "--max_restarts") {
      SMAT_RETURN_IF_ERROR(take_int(&f.max_restarts));
    } else if (arg == "--backoff") {
      SMAT_RETURN_IF_ERROR(take_double(&f.backoff));
    } else if (arg == "--backoff_max") {
      SMAT_RETURN_IF_ERROR(take_double(&f.backoff_max));
    } else if (arg == "--hang_timeout") {
      SMAT_RETURN_IF_ERROR(take_double(&f.hang_timeout));
    } else if (arg == "--stop_grace") {
      SMAT_RETURN_IF_ERROR(take_double(&f.stop_grace));
    } else if (arg == "--log_dir") {
      SMAT_ASSIGN_OR_RETURN(f.log_dir, take());
    } else if (arg == "--mpirun") {
      SMAT_ASSIGN_OR_RETURN(f.mpirun, take());
    } else if (arg == "--train") {
      SMAT_ASSIGN_OR_RETURN(f.train, take());
    } else if (arg == "--targets_file") {
      SMAT_ASSIGN_OR_RETURN(f.targets_file, take());
    } else if (arg == "--probe_timeout") {
      SMAT_RETURN_IF_ERROR(take_double(&f.probe_timeout));
    } else if (arg == "--elastic") {
      f.elastic = !has_value || value == "true" || value == "1";
    } else if (arg == "--dry_run") {
      f.dry_run = !has_value || value == "true" || value == "1";
    } else if (arg == "--help" || arg == "-h") {
      return absl::InvalidArgumentError("");
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown argument '", argv[i], "'"));
    }
  }
  if (f.config.empty()) return absl::InvalidArgumentError("--config is required");
  if (!f.hosts.empty() && !f.hostfile.empty()) {
    return absl::InvalidArgumentError("give --hosts or --hostfile, not both");
  }
  return f;
}

std::string EnvOr(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

// smat_train beside this executable (both are built into one folder).
std::string DefaultTrainPath() {
  char self[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return "smat_train";
  std::string path(self, n);
  return path.substr(0, path.rfind('/') + 1) + "smat_train";
}

absl::Status MakeDirectories(const std::string& path) {
  std::string prefix;
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    prefix += prefix.empty() && path[0] != '/' ? std::string(part) : absl::StrCat("/", part);
    if (part.empty()) continue;
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::UnavailableError(
          absl::StrCat("--log_dir: cannot create '", prefix, "': ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

// Builds the job from the flags and the config; kInvalidArgument/kNotFound
// for anything the user must fix. *before_first: what to run before attempt 0
// (later attempts run it inside job_for_attempt).
absl::StatusOr<SupervisorOptions> Prepare(
    const Flags& f, std::function<void(const JobCommand&)>* before_first) {
  SMAT_ASSIGN_OR_RETURN(TrainConfig config, LoadConfig(f.config, f.sets));
  SupervisorOptions o;
  JobCommand& job = o.job;
  job.mpirun = f.mpirun;
  job.hosts = f.hosts;
  job.hostfile = f.hostfile;
  SMAT_ASSIGN_OR_RETURN(LaunchEnvironment env, ReadLaunchEnvironment(std::getenv));
  if (job.hosts.empty() && job.hostfile.empty()) {
    // The MPI Operator's launcher pod: mpirun reads this hostfile by itself;
    // reading it here gives --np and the hosts --elastic probes.
    if (const char* h = std::getenv("OMPI_MCA_orte_default_hostfile"); h != nullptr && *h) {
      job.hostfile = h;
    }
  }
  job.exports = f.exports;
  job.mpirun_args = f.mpirun_args;
  job.train = f.train.empty() ? DefaultTrainPath() : f.train;
  job.config = f.config;
  job.sets = f.sets;
  std::vector<HostSlots> hosts;
  if (!job.hosts.empty()) {
    SMAT_ASSIGN_OR_RETURN(hosts, ParseHostList(job.hosts));
  } else if (!job.hostfile.empty()) {
    SMAT_ASSIGN_OR_RETURN(hosts, ReadHostfile(job.hostfile));
  }
  const int slots = TotalSlots(hosts);
  // Inside a Slurm allocation (sbatch script) the task count is the job's
  // size; mpirun takes the hosts from the allocation.
  const int slurm_tasks = env.launcher == "Slurm" ? env.size : -1;
  job.np = f.np > 0 ? f.np : (slots > 0 ? slots : (slurm_tasks > 0 ? slurm_tasks : 1));
  if (slots > 0 && job.np > slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("--np ", job.np, " exceeds the ", slots, " slots of the hosts given"));
  }
  const int grid = config.parallel().dp() * config.parallel().sp();
  if (grid != job.np) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--np ", job.np, " but the config's grid is parallel.dp x sp = ", config.parallel().dp(),
        " x ", config.parallel().sp(), " = ", grid, ": change --np or --set parallel.dp=..."));
  }
  o.max_restarts = f.max_restarts;
  o.backoff_seconds = f.backoff;
  o.backoff_max_seconds = f.backoff_max;
  o.stop_grace_seconds = f.stop_grace;
  o.hang_timeout_seconds = f.hang_timeout;
  o.log_dir = f.log_dir.empty() ? config.run().dir() + "/launch" : f.log_dir;
  o.checkpoint_dir = config.checkpoint().dir();
  if (f.elastic) {
    if (hosts.empty()) {
      return absl::InvalidArgumentError(
          "--elastic needs the hosts to probe: give --hosts or --hostfile");
    }
    std::vector<std::string> agent =
        RshAgentArgv(job.mpirun_args, EnvOr("OMPI_MCA_plm_rsh_agent"), f.probe_timeout);
    const int dp = config.parallel().dp(), sp = config.parallel().sp();
    const double timeout = f.probe_timeout;
    o.job_for_attempt = [job, hosts, agent, dp, sp,
                         timeout](int attempt) -> absl::StatusOr<JobCommand> {
      std::vector<bool> live;
      for (const HostSlots& h : hosts) {
        absl::Status probe = ProbeHost(agent, h.host, timeout);
        if (!probe.ok()) {
          std::fprintf(stderr, "smat_launch: elastic: host %s does not answer (%s)\n",
                       h.host.c_str(), std::string(probe.message()).c_str());
        }
        live.push_back(probe.ok());
      }
      SMAT_ASSIGN_OR_RETURN(ElasticPlan plan, PlanElasticGrid(hosts, live, dp, sp));
      std::fprintf(stderr,
                   "smat_launch: elastic: attempt %d on %d of %zu hosts (%s): --np %d, "
                   "parallel.dp=%d parallel.sp=%d%s\n",
                   attempt, static_cast<int>(plan.hosts.size()), hosts.size(),
                   HostListString(plan.hosts).c_str(), plan.np, plan.dp, plan.sp,
                   plan.full ? " (the full grid)" : "");
      return ElasticJob(job, plan);
    };
  }
  if (config.metrics().enabled()) {
    // Prometheus targets of the attempt's ranks (launcher/metrics_targets.h).
    // Inside a Slurm allocation without hosts the placement is mpirun's to
    // find: only the stale rank files are removed then. A failure is a
    // warning: metrics are not worth a failed attempt.
    const std::string metrics_dir = config.run().dir() + "/metrics";
    std::string targets_file =
        f.targets_file.empty() ? metrics_dir + "/targets.json" : f.targets_file;
    if (job.hosts.empty() && job.hostfile.empty() && slurm_tasks > 0) targets_file.clear();
    const int port = config.metrics().port();
    const std::string host = config.metrics().host();
    *before_first = [=](const JobCommand& attempt_job) {
      absl::Status s =
          PrepareMetricsTargets(attempt_job, port, host, metrics_dir, targets_file);
      if (!s.ok()) {
        std::fprintf(stderr, "smat_launch: warning: %s\n", std::string(s.message()).c_str());
      }
    };
    auto next_job = o.job_for_attempt;
    o.job_for_attempt = [next_job, base = o.job,
                         prepare = *before_first](int attempt) -> absl::StatusOr<JobCommand> {
      JobCommand j = base;
      if (next_job) {
        SMAT_ASSIGN_OR_RETURN(j, next_job(attempt));
      }
      prepare(j);
      return j;
    };
  }
  return o;
}

int Main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = ParseFlags(argc, argv);
  if (!flags.ok()) {
    if (!flags.status().message().empty()) {
      std::fprintf(stderr, "smat_launch: %s\n", std::string(flags.status().message()).c_str());
    }
    std::fputs(kUsage, stderr);
    return kExitBadInput;
  }
  std::function<void(const JobCommand&)> before_first;
  absl::StatusOr<SupervisorOptions> options = Prepare(*flags, &before_first);
  if (!options.ok()) {
    std::fprintf(stderr, "smat_launch: %s\n", std::string(options.status().message()).c_str());
    return ExitCodeForStatus(options.status());
  }
  if (flags->dry_run) {
    std::printf("%s\n", ShellJoin(MpirunArgv(options->job, 0)).c_str());
    return kExitOk;
  }
  if (absl::Status s = MakeDirectories(options->log_dir); !s.ok()) {
    std::fprintf(stderr, "smat_launch: %s\n", std::string(s.message()).c_str());
    return kExitBadInput;
  }
  // No SA_RESTART: a signal interrupts the supervisor's waits, which then
  // forward it at once.
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  if (before_first) before_first(options->job);
  Supervisor supervisor(*options, &stop_signal);
  const int code = supervisor.Run();
  const std::string summary = supervisor.Summary();
  std::fputs(summary.c_str(), stderr);
  std::ofstream(options->log_dir + "/summary.txt") << summary;
  return code;
}

}  // namespace
}  // namespace smat

int main(int argc, char** argv) { return smat::Main(argc, argv); }
