// launcher/child_process.h: the child's side of the launcher's fork-and-exec.
// A real fork and exec each time: the command's output reaches the parent's
// pipe, and a command that cannot run says why and exits 127.
#include "launcher/child_process.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace smat {
namespace {

struct Outcome {
  std::string output;
  int status = -1;
};

// Forks, runs argv in the child with ExecWithOutput, and collects the pipe
// and the exit status.
Outcome ForkAndExec(const std::vector<std::string>& argv, const char* who) {
  Outcome out;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return out;
  const pid_t child = ::fork();
  if (child == 0) ExecWithOutput(argv, fds[1], who);
  ::close(fds[1]);
  char buf[256];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) out.output.append(buf, n);
  ::close(fds[0]);
  if (child > 0) ::waitpid(child, &out.status, 0);
  return out;
}

TEST(ChildProcessTest, OutputAndErrorsReachThePipe) {
  const Outcome o = ForkAndExec({"sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 3"}, "x: ");
  ASSERT_TRUE(WIFEXITED(o.status)) << o.status;
  EXPECT_EQ(WEXITSTATUS(o.status), 3);
  EXPECT_EQ(o.output, "to-stdout\nto-stderr\n");
}

TEST(ChildProcessTest, ACommandThatCannotRunSaysWhyAndExits127) {
  const Outcome o = ForkAndExec({"/nonexistent/smat-no-such-program", "arg"}, "smat_launch: ");
  ASSERT_TRUE(WIFEXITED(o.status)) << o.status;
  EXPECT_EQ(WEXITSTATUS(o.status), 127);
  EXPECT_EQ(o.output,
            "smat_launch: cannot run '/nonexistent/smat-no-such-program': No such file or "
            "directory\n");
}

}  // namespace
}  // namespace smat
