// main() for the MPI GoogleTest binaries: initialises MPI, runs the tests on
// every rank and combines the verdict, so every rank (and mpirun) fails when
// any rank fails.
#include <cstdio>

#include <mpi.h>

#include "gtest/gtest.h"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // Ranks other than 0 report failures only, so the log stays readable (set
  // before InitGoogleTest, which picks the printer).
  if (rank != 0) GTEST_FLAG_SET(brief, true);
  ::testing::InitGoogleTest(&argc, argv);
  int local = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&local, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any != 0 && local == 0) {
    std::fprintf(stderr, "rank %d: passed locally, failing because another rank failed\n", rank);
  }
  MPI_Finalize();
  return any;
}
