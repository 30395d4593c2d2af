// mpirun command lines and host lists (launcher/mpirun_command.h).
#include "launcher/mpirun_command.h"

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace smat {

absl::StatusOr<std::vector<HostSlots>> ParseHostList(const std::string& hosts) {
  std::vector<HostSlots> out;
  for (absl::string_view entry : absl::StrSplit(hosts, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    std::vector<std::string> parts = absl::StrSplit(entry, ':');
    HostSlots h;
    h.host = parts[0];
    const bool ok = !h.host.empty() && parts.size() <= 2 &&
                    (parts.size() == 1 || (absl::SimpleAtoi(parts[1], &h.slots) && h.slots > 0));
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--hosts: entry '", entry, "' is not HOST or HOST:SLOTS (e.g. --hosts a:4,b:4)"));
    }
    out.push_back(h);
  }
  if (out.empty()) return absl::InvalidArgumentError("--hosts: no hosts given (e.g. a:4,b:4)");
  return out;
}

absl::StatusOr<std::vector<HostSlots>> ReadHostfile(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::NotFoundError(absl::StrCat("--hostfile: cannot read '", path, "'"));
  std::vector<HostSlots> out;
  std::string line;
  for (int lineno = 1; std::getline(f, line); ++lineno) {
    absl::string_view text = line;
    if (size_t hash = text.find('#'); hash != absl::string_view::npos) text = text.substr(0, hash);
    std::vector<std::string> words = absl::StrSplit(text, ' ', absl::SkipWhitespace());
    if (words.empty()) continue;
    HostSlots h;
    h.host = words[0];
    for (size_t i = 1; i < words.size(); ++i) {
      absl::string_view w = words[i];
      if (absl::ConsumePrefix(&w, "slots=")) {
        if (!absl::SimpleAtoi(w, &h.slots) || h.slots <= 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ":", lineno, ": bad slot count '", words[i], "'"));
        }
      } else if (!absl::StartsWith(w, "max_slots=") && !absl::StartsWith(w, "max-slots=")) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ":", lineno, ": unknown hostfile field '", words[i], "' (expected slots=N)"));
      }
    }
    out.push_back(h);
  }
  if (out.empty())
    return absl::InvalidArgumentError(absl::StrCat("--hostfile '", path, "' lists no hosts"));
  return out;
}

int TotalSlots(const std::vector<HostSlots>& hosts) {
  int n = 0;
  for (const HostSlots& h : hosts) n += h.slots;
  return n;
}

std::vector<std::string> MpirunArgv(const JobCommand& job, int attempt) {
  std::vector<std::string> argv = {job.mpirun, "-np", absl::StrCat(job.np)};
  if (!job.hosts.empty()) argv.insert(argv.end(), {"--host", job.hosts});
  if (!job.hostfile.empty()) argv.insert(argv.end(), {"--hostfile", job.hostfile});
  argv.insert(argv.end(), {"-x", kRestartCountVariable});
  for (const std::string& x : job.exports) argv.insert(argv.end(), {"-x", x});
  argv.insert(argv.end(), job.mpirun_args.begin(), job.mpirun_args.end());
  argv.insert(argv.end(), {job.train, "--config", job.config});
  for (const std::string& s : job.sets) argv.insert(argv.end(), {"--set", s});
  // A restart resumes whatever the config says: the first attempt may start
  // fresh (resume: "none"), a restart never should.
  if (attempt > 0) argv.insert(argv.end(), {"--set", "checkpoint.resume=auto"});
  return argv;
}

std::string ShellJoin(const std::vector<std::string>& argv) {
  std::vector<std::string> quoted;
  for (const std::string& a : argv) {
    const bool plain = !a.empty() && a.find_first_not_of(
                                         "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                         "0123456789_-+=./:,@%") == std::string::npos;
    if (plain) {
      quoted.push_back(a);
    } else {
      quoted.push_back(absl::StrCat("'", absl::StrReplaceAll(a, {{"'", "'\\''"}}), "'"));
    }
  }
  return absl::StrJoin(quoted, " ");
}

}  // namespace smat
