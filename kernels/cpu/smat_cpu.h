// The CPU implementation of the SMat-Attention phases (kernels/smat_kernels.h).
//
// Storage fp32. Dense tile products (chunk score tiles, summaries, grouped
// pooling and per-type reads) go through cblas_sgemm with fp32 accumulation,
// the arithmetic a GPU kernel does, so this backend is a faithful fp32
// implementation while kernels/cpu/smat_reference.h is the double-precision
// truth; short scalar sums (the chunk-local log-decay prefix, span decays,
// the gate-gradient suffix sums) accumulate in double because they sit in an
// exponent, where absolute error becomes relative error. Every reduction runs
// in a fixed order (tokens in increasing position within a group, groups and
// chunks in increasing index, phases in a fixed order), so results are
// bitwise repeatable for a given OpenBLAS thread count.
//
//   std::unique_ptr<SmatKernels> k = MakeCpuSmatKernels();
//   SMAT_RETURN_IF_ERROR(k->ChunkLogDecay(plan, SmatSpan::Whole(plan), logg, &lam, &cd, nullptr));
#pragma once

#include <memory>

#include "kernels/smat_kernels.h"

namespace smat {

std::unique_ptr<SmatKernels> MakeCpuSmatKernels();

}  // namespace smat
