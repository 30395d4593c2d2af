// What the NCCL we compile against can do, decided once from
// NCCL_VERSION_CODE (STYLE.md: feature checks against the NCCL version live in
// one header). Included only by code built into libsmat_cuda.so.
//
//   2.14  ncclConfig_t, non-blocking communicators (config.blocking = 0,
//         ncclInProgress, polled with ncclCommGetAsyncError), ncclCommFinalize
//   2.18  ncclCommSplit
//   2.10  ncclBfloat16 (with CUDA 11+)
// smat needs non-blocking communicators (a stuck collective must become an
// error, never a hang), so anything older is refused at compile time.
#pragma once

#include <nccl.h>

#if !defined(NCCL_VERSION_CODE) || !defined(NCCL_VERSION)
#error "nccl.h without NCCL_VERSION_CODE: NCCL >= 2.14 is required"
#endif

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "smat needs NCCL >= 2.14 (non-blocking communicators with ncclConfig_t)"
#endif

#define SMAT_NCCL_HAS_NONBLOCKING 1
#define SMAT_NCCL_HAS_FINALIZE 1
#define SMAT_NCCL_HAS_COMM_SPLIT (NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0))
#define SMAT_NCCL_HAS_BF16 (NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0))
// ncclGetLastError(comm) gives the reason behind an error code.
#define SMAT_NCCL_HAS_LAST_ERROR (NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0))

namespace smat {
// The version this code was compiled against, e.g. 22809 for 2.28.9; the
// library loaded at run time is checked against it (ncclGetVersion): an older
// major.minor library may lack the symbols above.
inline constexpr int kNcclCompiledVersion = NCCL_VERSION_CODE;
}  // namespace smat
