// smat_op under mpirun: sequence-parallel forward / backward over the ranks of
// the job. With a world size W > 1 (no flag: mpirun -np W smat_op forward ...)
// every rank reads the inputs, computes its span (SplitSequence: whole chunks,
// as even as possible) with the sequence-parallel op of
// parallel/sequence_parallel_smat.h, and rank 0 gathers the outputs and writes
// them; the files are those of tools/smat_op_run.h, equal to a single-process
// run up to fp32 summation order (1e-5 relative).
#pragma once

#include <string>

#include "tools/smat_op_run.h"

namespace smat {

// The world size mpirun announced in the environment (Open MPI, PMI, PMIx),
// read before MPI is initialised; 1 outside mpirun.
int SmatOpLaunchedWorldSize();

// Runs cfg's operation sequence-parallel over MPI_COMM_WORLD and returns the
// process exit status for main (0 on success). On failure it prints the error
// with the rank and ends the whole job non-zero through AbortJob, since
// returning normally would run MPI_Finalize against ranks that may be gone.
// Initialises and finalises MPI itself.
int RunSmatOpUnderMpi(const SmatOpConfig& cfg, const std::string& in_dir,
                      const std::string& out_dir);

}  // namespace smat
