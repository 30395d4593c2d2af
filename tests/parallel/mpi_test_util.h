// Helpers for tests that run under mpirun: a verdict combined over ranks.
#pragma once

#include <mpi.h>

namespace smat {

// True on every rank iff `ok` is true on every rank of MPI_COMM_WORLD, so a
// test fails together on all ranks (and no rank waits in a later collective
// for one that returned early).
inline bool AllRanks(bool ok) {
  int mine = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

inline int WorldRank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int WorldSize() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

}  // namespace smat
