// The extern "C" entry points of the NCCL communicator inside libsmat_cuda.so.
//
// NcclCommunicator (nccl_communicator.cc) is the Communicator for device
// tensors: non-blocking NCCL communicators (config.blocking = 0) on their own
// CUDA stream, every call polled with ncclCommGetAsyncError and a CUDA event
// under its deadline, ncclCommAbort on error or timeout, ncclCommSplit for
// sub-groups. It lives in the CUDA plugin so that no executable links NCCL or
// CUDA at start-up; MPI stays out of the plugin: the bootstrap (rank 0 gets the
// unique id here, MPI_Bcast, every rank creates its communicator here) is in
// parallel/process_group.cc, which finds these symbols with dlsym on the
// already-loaded libsmat_cuda.so.
//
// This header declares plain C entry points only (no CUDA or NCCL headers), so
// smat_parallel can include it whether or not CUDA is built.
//
// Contract differences from MpiCommunicator: tensors live on the device of
// the communicator and must be complete there when Start* is called (the
// caller synchronises its stream); NCCL sums in its own fixed order for a given
// rank count and algorithm (same bits run to run on the same machines), and
// bf16 sums round at every step of the ring, not once.
#pragma once

#include <cstddef>

namespace smat {
class Communicator;
struct CommOptions;
// NCCL_UNIQUE_ID_BYTES (checked against nccl.h in nccl_communicator.cc).
inline constexpr int kNcclUniqueIdBytes = 128;
}  // namespace smat

extern "C" {

// NCCL_VERSION_CODE of the library loaded at run time (ncclGetVersion), or a
// negative absl code with a message.
typedef int (*SmatNcclVersionFn)(int* version, char* error, size_t error_len);
// Number of CUDA devices visible to this process.
typedef int (*SmatNcclDeviceCountFn)(int* count, char* error, size_t error_len);
// Fills id[0, kNcclUniqueIdBytes) with a fresh ncclUniqueId (rank 0 only).
typedef int (*SmatNcclGetUniqueIdFn)(char* id, char* error, size_t error_len);
// Creates rank `rank` of `nranks` on CUDA device `device` from the id every
// rank received; waits (polling) until NCCL has finished initialising or
// options->timeout passes. Returns nullptr on failure with an absl::StatusCode
// in *code and a message in error. The caller owns the result.
typedef smat::Communicator* (*SmatNcclCreateFn)(const char* id, int nranks, int rank, int device,
                                                const smat::CommOptions* options, int* code,
                                                char* error, size_t error_len);
// Functions returning int return 0 (absl::StatusCode::kOk) or an absl code.

}  // extern "C"
