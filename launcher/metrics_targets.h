// The Prometheus file_sd target file of a job that smat_launch starts: one
// target per rank, host:(metrics.port + local rank), written before each
// attempt so Prometheus knows every rank of the job before any of them is up
// and keeps scraping (and alerting on `up == 0` for) a rank that died, which
// the ranks' own files cannot do: a rank writes <run.dir>/metrics/rank_<R>.json
// only once it listens and removes it when it ends (trainer/metrics.h).
//
// Placement follows mpirun's default by-slot mapping, which smat_launch's
// command leaves in place: ranks fill the first host's slots, then the
// next host's (rank 0..3 on a:4, 4..7 on b:4), so a rank's local rank is its
// index among its host's ranks. Each group carries the same labels as the
// rank's own file ({"rank": "R"}), so a Prometheus that reads both files sees
// one target per rank (identical targets are merged).
//
// With metrics.port = 0 every rank picks its port at run time and only its
// own rank_<R>.json knows it: no launcher file is written then (a stale one of
// an earlier launch is removed), and Prometheus reads the rank files.
//
// Before every attempt the launcher also removes the rank_<R>.json and
// rank_<R>.port files a previous attempt left behind (a killed rank cannot
// remove its own), so no target of a rank that no longer exists lingers (a
// smaller elastic grid, or ports that moved). The files are removed in the
// launcher host's view of run.dir: the shared run folder of a multi-host job.
//
//   SMAT_ASSIGN_OR_RETURN(std::vector<HostSlots> hosts, ParseHostList("a:4,b:4"));
//   std::vector<MetricsTarget> t = RankMetricsTargets(hosts, 8, 9400);
//   // t[5] = {rank 5, host "b", port 9401}
//   SMAT_RETURN_IF_ERROR(WriteMetricsTargetsFile("runs/x/metrics/targets.json", t));
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "launcher/mpirun_command.h"

namespace smat {

struct MetricsTarget {
  int rank = 0;
  std::string host;
  int port = 0;
};

// Rank -> host:port for `np` ranks placed by slot on `hosts` (see above).
// InvalidArgument when np exceeds the slots or base_port + local rank leaves
// 1..65535.
absl::StatusOr<std::vector<MetricsTarget>> RankMetricsTargets(const std::vector<HostSlots>& hosts,
                                                              int np, int base_port);

// The file_sd JSON: one group per rank,
//   [{"targets": ["a:9400"], "labels": {"rank": "0"}}, ...]
std::string MetricsTargetsJson(const std::vector<MetricsTarget>& targets);

// Writes the JSON atomically (a temporary beside it, then rename), creating
// the folder. kUnavailable when it cannot be written.
absl::Status WriteMetricsTargetsFile(const std::string& path,
                                     const std::vector<MetricsTarget>& targets);

// Removes rank_<R>.json and rank_<R>.port under `metrics_dir` (a missing
// folder is fine); returns how many files went.
absl::StatusOr<int> RemoveStaleRankTargetFiles(const std::string& metrics_dir);

// What smat_launch does before attempt N: removes stale rank files under
// metrics_dir, then writes `targets_file` for `job` (its --host list or
// hostfile; no hosts: every rank on this machine) when base_port > 0, or
// removes `targets_file` when base_port is 0. `advertise_host` is
// metrics.host: when it is not a wildcard (0.0.0.0, ::, empty) every rank
// advertises it and so does the file. An empty targets_file: only the stale
// rank files are removed (the hosts are not known, e.g. a Slurm allocation).
absl::Status PrepareMetricsTargets(const JobCommand& job, int base_port,
                                   const std::string& advertise_host,
                                   const std::string& metrics_dir,
                                   const std::string& targets_file);

}  // namespace smat
