// The launcher's Prometheus file_sd target file (metrics_targets.h).
#include "launcher/metrics_targets.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace smat {
namespace {

bool IsWildcardHost(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]" || host == "*";
}

// As the ranks write it (trainer/metrics.cc): IPv6 addresses in brackets.
std::string HostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && host.front() != '[') {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

std::string ThisHost() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') return name;
  return "localhost";
}

}  // namespace

absl::StatusOr<std::vector<MetricsTarget>> RankMetricsTargets(const std::vector<HostSlots>& hosts,
                                                              int np, int base_port) {
  if (np > TotalSlots(hosts)) {
    return absl::InvalidArgumentError(absl::StrCat("metrics targets: ", np, " ranks but the hosts have ",
                                                   TotalSlots(hosts), " slots"));
  }
  std::vector<MetricsTarget> out;
  for (const HostSlots& h : hosts) {
    for (int local = 0; local < h.slots && static_cast<int>(out.size()) < np; ++local) {
      const int port = base_port + local;
      if (base_port < 1 || port > 65535) {
        return absl::InvalidArgumentError(absl::StrCat(
            "metrics targets: metrics.port ", base_port, " + local rank ", local,
            " is not a port (1..65535); lower metrics.port"));
      }
      out.push_back({static_cast<int>(out.size()), h.host, port});
    }
  }
  return out;
}

std::string MetricsTargetsJson(const std::vector<MetricsTarget>& targets) {
  std::string json = "[";
  for (size_t i = 0; i < targets.size(); ++i) {
    absl::StrAppend(&json, i == 0 ? "\n" : ",\n", "  {\"targets\": [\"",
                    JsonEscape(HostPort(targets[i].host, targets[i].port)),
                    "\"], \"labels\": {\"rank\": \"", targets[i].rank, "\"}}");
  }
  json += targets.empty() ? "]\n" : "\n]\n";
  return json;
}

absl::Status WriteMetricsTargetsFile(const std::string& path,
                                     const std::vector<MetricsTarget>& targets) {
  std::error_code ec;
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << MetricsTargetsJson(targets);
    f.close();
    if (!f) {
      std::filesystem::remove(tmp, ec);
      return absl::UnavailableError(
          absl::StrCat("metrics targets: cannot write '", tmp, "' (check run.dir or --targets_file)"));
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    return absl::UnavailableError(
        absl::StrCat("metrics targets: cannot rename '", tmp, "' to '", path, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> RemoveStaleRankTargetFiles(const std::string& metrics_dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(metrics_dir, ec)) return 0;
  static const std::regex kRankFile(R"(rank_[0-9]+\.(json|port))");
  std::vector<std::filesystem::path> stale;
  for (const auto& entry : std::filesystem::directory_iterator(metrics_dir, ec)) {
    if (std::regex_match(entry.path().filename().string(), kRankFile)) {
      stale.push_back(entry.path());
    }
  }
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("metrics targets: cannot list '", metrics_dir, "': ", ec.message()));
  }
  int removed = 0;
  for (const auto& p : stale) removed += std::filesystem::remove(p, ec) ? 1 : 0;
  return removed;
}

absl::Status PrepareMetricsTargets(const JobCommand& job, int base_port,
                                   const std::string& advertise_host,
                                   const std::string& metrics_dir,
                                   const std::string& targets_file) {
  SMAT_RETURN_IF_ERROR(RemoveStaleRankTargetFiles(metrics_dir).status());
  if (targets_file.empty()) return absl::OkStatus();
  if (base_port == 0) {
    // Ports are picked at run time: the ranks' own files are the targets.
    std::error_code ec;
    std::filesystem::remove(targets_file, ec);
    return absl::OkStatus();
  }
  std::vector<HostSlots> hosts;
  if (!job.hosts.empty()) {
    SMAT_ASSIGN_OR_RETURN(hosts, ParseHostList(job.hosts));
  } else if (!job.hostfile.empty()) {
    SMAT_ASSIGN_OR_RETURN(hosts, ReadHostfile(job.hostfile));
  } else {
    hosts.push_back({ThisHost(), job.np});  // mpirun runs every rank here
  }
  if (!IsWildcardHost(advertise_host)) {
    for (HostSlots& h : hosts) h.host = advertise_host;
  }
  SMAT_ASSIGN_OR_RETURN(std::vector<MetricsTarget> targets,
                        RankMetricsTargets(hosts, job.np, base_port));
  return WriteMetricsTargetsFile(targets_file, targets);
}

}  // namespace smat
