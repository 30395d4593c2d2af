// A small MPI job for the fault-tolerance test (fault_tolerance_test.cc): every
// rank writes its pid to $SMAT_PID_DIR/rank<R>.pid, then runs 20 AllReduces
// under the deadline $SMAT_COLLECTIVE_TIMEOUT_S with the fault $SMAT_FAULT.
// A failed collective is printed ("rank R: DEADLINE_EXCEEDED: ...") and the job
// aborted non-zero (AbortJob), as smat_train does; success prints "rank R: done".
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "parallel/mpi_communicator.h"

int main(int argc, char** argv) {
  using namespace smat;
  absl::StatusOr<MpiSession> mpi = MpiSession::Init(&argc, &argv);
  if (!mpi.ok()) {
    std::fprintf(stderr, "%s\n", mpi.status().ToString().c_str());
    return 2;
  }
  const int rank = mpi->world_rank();
  if (const char* dir = std::getenv("SMAT_PID_DIR"); dir != nullptr) {
    std::string path = std::string(dir) + "/rank" + std::to_string(rank) + ".pid";
    if (FILE* f = std::fopen(path.c_str(), "w"); f != nullptr) {
      std::fprintf(f, "%d\n", static_cast<int>(getpid()));
      std::fclose(f);
    }
  }
  absl::StatusOr<CommOptions> opts = CommOptions::FromEnvironment();
  if (!opts.ok()) AbortJob(opts.status());
  absl::StatusOr<std::unique_ptr<MpiCommunicator>> comm =
      MpiCommunicator::Create(MPI_COMM_WORLD, *opts);
  if (!comm.ok()) AbortJob(comm.status());
  absl::StatusOr<Tensor> t = Tensor::Zeros({1000}, DType::kF32);
  if (!t.ok()) AbortJob(t.status());
  for (int i = 0; i < 20; ++i) {
    absl::Status s = (*comm)->AllReduce(*t);
    if (!s.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
      std::fflush(stderr);
      AbortJob(s);
    }
  }
  std::printf("rank %d: done\n", rank);
  return 0;
}
