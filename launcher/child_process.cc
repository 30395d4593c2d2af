#include "launcher/child_process.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace smat {

void ExecWithOutput(const std::vector<std::string>& argv, int out_fd, const char* who) {
  ::dup2(out_fd, STDOUT_FILENO);
  ::dup2(out_fd, STDERR_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  ::execvp(args[0], args.data());
  std::fprintf(stderr, "%scannot run '%s': %s\n", who, args[0], std::strerror(errno));
  ::_exit(127);
}

}  // namespace smat
