// The mpirun command line smat_launch runs for each attempt of a job, and the
// host lists it is built from (docs/FAULT_TOLERANCE.md, "Launcher").
//
//   mpirun -np 8 --host a:4,b:4 -x SMAT_RESTART_COUNT -x NCCL_DEBUG
//       build/smat_train --config c.textproto --set run.steps=100
//       [--set checkpoint.resume=auto]                  (restarts only)
//
// SMAT_RESTART_COUNT (the attempt number, 0 for the first) is set in the
// launcher's environment and exported to every rank with -x, so the trainer
// can report smat_restarts_total (trainer/metrics.h) and name its checkpoint
// temporaries after the attempt (trainer/checkpoint_writer.h).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace smat {

inline constexpr char kRestartCountVariable[] = "SMAT_RESTART_COUNT";

struct HostSlots {
  std::string host;
  int slots = 1;
};

// "a:4,b:4" (":slots" optional, default 1). InvalidArgument names the entry.
absl::StatusOr<std::vector<HostSlots>> ParseHostList(const std::string& hosts);
// An Open MPI hostfile: "host [slots=N] [max_slots=M]" per line, '#' comments.
absl::StatusOr<std::vector<HostSlots>> ReadHostfile(const std::string& path);
int TotalSlots(const std::vector<HostSlots>& hosts);

struct JobCommand {
  std::string mpirun = "mpirun";
  int np = 1;
  std::string hosts;                     // --host value, or empty
  std::string hostfile;                  // --hostfile value, or empty
  std::vector<std::string> exports;      // -x values: "VAR" or "VAR=value"
  std::vector<std::string> mpirun_args;  // passed to mpirun as they are
  std::string train;                     // smat_train
  std::string config;
  std::vector<std::string> sets;  // --set values, forwarded in order
};

// argv of attempt `attempt` (restarts add --set checkpoint.resume=auto).
std::vector<std::string> MpirunArgv(const JobCommand& job, int attempt);
// argv as one line a POSIX shell reads back to the same argv.
std::string ShellJoin(const std::vector<std::string>& argv);

}  // namespace smat
