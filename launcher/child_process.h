// The child's side of the launcher's fork-and-exec: the supervised job
// (supervisor.cc) and the elastic probes of the hosts (elastic.cc) both run
// a command with its output on a pipe the parent reads.

#pragma once

#include <string>
#include <vector>

namespace smat {

// In a child just forked: standard output and error to `out_fd`, then `argv`
// in place of the child (argv[0] searched on PATH). If it cannot be run, the
// child writes "<who>cannot run '<argv[0]>': <reason>" there and exits with
// 127, as a shell does.
[[noreturn]] void ExecWithOutput(const std::vector<std::string>& argv, int out_fd, const char* who);

}  // namespace smat
