// Helpers shared by the launcher tests: temporary directories, reading files,
// and running the smat_launch binary (SMAT_LAUNCH_BINARY, a compile definition)
// bounded in time, in its own process group so a test never leaves it behind.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace smat {
namespace launch_test {

inline std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A fresh directory under /tmp, removed with everything in it at destruction.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/smat_launch_test_XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct LaunchResult {
  bool finished = false;  // false: killed after the bound
  int status = 0;         // waitpid status
  std::string output;     // stdout and stderr
};

// Runs smat_launch with `args`, its output to `out_path`, bounded by `bound_s`
// (then its process group is killed); `while_running` (if set) is called with
// the launcher's pid once it started.
inline LaunchResult RunLauncher(const std::vector<std::string>& args, const std::string& out_path,
                                double bound_s,
                                const std::function<void(pid_t)>& while_running = nullptr) {
  LaunchResult r;
  const pid_t child = fork();
  if (child == 0) {
    setpgid(0, 0);
    FILE* out = std::freopen(out_path.c_str(), "w", stdout);
    (void)out;
    dup2(fileno(stdout), fileno(stderr));
    std::vector<char*> argv = {const_cast<char*>(SMAT_LAUNCH_BINARY)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(SMAT_LAUNCH_BINARY, argv.data());
    std::_Exit(127);
  }
  setpgid(child, child);
  if (while_running) while_running(child);
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    if (waitpid(child, &r.status, WNOHANG) == child) {
      r.finished = true;
      break;
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > bound_s) {
      kill(-child, SIGKILL);
      waitpid(child, &r.status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  r.output = ReadFile(out_path);
  return r;
}

inline int ExitCode(const LaunchResult& r) {
  return WIFEXITED(r.status) ? WEXITSTATUS(r.status) : -1;
}

}  // namespace launch_test
}  // namespace smat
