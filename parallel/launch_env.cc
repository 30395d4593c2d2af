// Launch environment of a rank (parallel/launch_env.h). Pure: no MPI here, so
// smat_launch compiles this file without linking MPI.
#include "parallel/launch_env.h"

#include <algorithm>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace smat {
namespace {

// The launchers in the order they are trusted (see the header for why Open
// MPI comes first). local_size has no plain variable under Slurm.
struct LauncherVariables {
  const char* name;
  const char* rank;
  const char* size;
  const char* local_rank;
  const char* local_size;  // nullptr: none
};
constexpr LauncherVariables kLaunchers[] = {
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
    {"MPICH/PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
};

// -1 when unset; InvalidArgument when set to anything but an integer >= 0.
absl::StatusOr<int> ReadInt(const EnvironmentLookup& lookup, const char* name) {
  if (name == nullptr) return -1;
  const char* v = lookup(name);
  if (v == nullptr) return -1;
  int out = -1;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(v), &out) || out < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("launch environment: ", name, "='", v,
                     "' is not a non-negative integer; unset it or start the job with mpirun/srun"));
  }
  return out;
}

}  // namespace

absl::StatusOr<LaunchEnvironment> ReadLaunchEnvironment(const EnvironmentLookup& lookup) {
  LaunchEnvironment env;
  if (const char* v = lookup("CUDA_VISIBLE_DEVICES"); v != nullptr) env.visible_devices = v;
  for (const LauncherVariables& l : kLaunchers) {
    if (lookup(l.rank) == nullptr) continue;
    env.launcher = l.name;
    absl::StatusOr<int> v = ReadInt(lookup, l.rank);
    if (!v.ok()) return v.status();
    env.rank = *v;
    if (v = ReadInt(lookup, l.size); !v.ok()) return v.status();
    env.size = *v;
    if (v = ReadInt(lookup, l.local_rank); !v.ok()) return v.status();
    env.local_rank = *v;
    if (v = ReadInt(lookup, l.local_size); !v.ok()) return v.status();
    env.local_size = *v;
    if (env.size >= 0 && env.rank >= env.size) {
      return absl::InvalidArgumentError(absl::StrCat("launch environment (", l.name, "): ", l.rank,
                                                     "=", env.rank, " is not below ", l.size, "=",
                                                     env.size));
    }
    if (env.local_size >= 0 && env.local_rank >= env.local_size) {
      return absl::InvalidArgumentError(absl::StrCat("launch environment (", l.name, "): ",
                                                     l.local_rank, "=", env.local_rank,
                                                     " is not below ", l.local_size, "=",
                                                     env.local_size));
    }
    break;
  }
  if (const char* node = lookup("SLURMD_NODENAME"); node != nullptr) env.node = node;
  return env;
}

absl::Status CheckAgainstMpi(const LaunchEnvironment& env, int world_rank, int world_size) {
  if (!env.found()) return absl::OkStatus();
  if (env.size >= 0 && env.size != world_size) {
    std::string hint = env.launcher == "Slurm"
                           ? "srun did not wire its tasks into one MPI job: run `srun --mpi=pmix` "
                             "(or the PMI your MPI was built with; `srun --mpi=list` shows them) "
                             "or mpirun inside the allocation"
                           : "the variables come from another launch than this MPI job: unset "
                             "them or start smat_train with one launcher";
    return absl::FailedPreconditionError(absl::StrCat("launch environment: ", env.launcher,
                                                      " started ", env.size, " task(s) but MPI "
                                                      "sees a world of ", world_size, "; ", hint));
  }
  if (env.rank >= 0 && env.rank != world_rank) {
    return absl::FailedPreconditionError(
        absl::StrCat("launch environment: ", env.launcher, " says rank ", env.rank,
                     " but MPI says rank ", world_rank,
                     "; unset the stale variables or start smat_train with one launcher"));
  }
  return absl::OkStatus();
}

int GpuForLocalRank(int local_rank, const std::string& visible_devices) {
  std::vector<std::string> ids =
      absl::StrSplit(visible_devices, ',', absl::SkipWhitespace());
  if (ids.size() == 1) return 0;
  return std::max(local_rank, 0);
}

std::string PhysicalGpu(int device, const std::string& visible_devices) {
  std::vector<std::string> ids =
      absl::StrSplit(visible_devices, ',', absl::SkipWhitespace());
  if (device >= 0 && device < static_cast<int>(ids.size())) {
    return std::string(absl::StripAsciiWhitespace(ids[device]));
  }
  return absl::StrCat(device);
}

int CpuThreadsPerRank(const EnvironmentLookup& lookup, int ranks_sharing_cpus, int allowed_cpus) {
  for (const char* name : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (lookup(name) != nullptr) return 0;
  }
  if (ranks_sharing_cpus <= 1 || allowed_cpus <= 0) return 0;
  return std::max(1, allowed_cpus / ranks_sharing_cpus);
}

std::string FormatCpuList(const std::vector<int>& cpus) {
  std::string s;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!s.empty()) s += ",";
    absl::StrAppend(&s, cpus[i]);
    if (j > i) absl::StrAppend(&s, "-", cpus[j]);
    i = j + 1;
  }
  return s.empty() ? "-" : s;
}

std::string FormatPlacementTable(const std::vector<RankPlacement>& ranks,
                                 const std::string& launcher) {
  std::set<std::string> hosts;
  size_t host_width = 4, cpus_width = 4;
  for (const RankPlacement& r : ranks) {
    hosts.insert(r.host);
    host_width = std::max(host_width, r.host.size());
    cpus_width = std::max(cpus_width, r.cpus.size());
  }
  std::string s = absl::StrCat(
      "smat: ", ranks.size(), ranks.size() == 1 ? " rank" : " ranks", " launched by ",
      launcher.empty() ? "MPI (local ranks from MPI_Comm_split_type)" : launcher, " on ",
      hosts.size(), hosts.size() == 1 ? " host" : " hosts", "\n");
  absl::StrAppendFormat(&s, "  %4s  %-*s  %5s  %-*s  %s", "rank", host_width, "host", "local",
                        cpus_width, "cpus", "gpu");
  for (const RankPlacement& r : ranks) {
    std::string gpu = "cpu";
    if (r.gpu >= 0) {
      gpu = absl::StrCat("cuda:", r.gpu);
      if (!r.physical_gpu.empty() && r.physical_gpu != absl::StrCat(r.gpu)) {
        absl::StrAppend(&gpu, " (physical ", r.physical_gpu, ")");
      }
    }
    absl::StrAppendFormat(&s, "\n  %4d  %-*s  %5d  %-*s  %s", r.rank, host_width, r.host,
                          r.local_rank, cpus_width, r.cpus, gpu);
  }
  return s;
}

}  // namespace smat
