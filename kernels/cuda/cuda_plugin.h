// The entry points of libsmat_cuda.so, shared by the library and the loader in
// kernels/backend.cc (which includes this header, never a CUDA one).
//
// The loader dlopens the library, checks smat_cuda_plugin_abi_version()
// against kSmatCudaPluginAbiVersion, then calls smat_create_cuda_backend.
// Both sides are built from the same tree with the same compiler, so the
// returned object is a plain C++ Backend; the version guards against a stale
// library from another build (bump it whenever backend.h or the Tensor layout
// changes, or the entry points below do).
#pragma once

#include <cstddef>

namespace smat {
class Backend;
inline constexpr int kSmatCudaPluginAbiVersion = 1;
}  // namespace smat

extern "C" {

// Returns the kSmatCudaPluginAbiVersion the library was built with.
typedef int (*SmatCudaPluginAbiVersionFn)();
int smat_cuda_plugin_abi_version();

// Creates the backend for CUDA device `device`, owned by the caller (delete it
// through Backend's virtual destructor). On failure returns nullptr, stores an
// absl::StatusCode in *code and a NUL-terminated message in error[0, error_len).
typedef smat::Backend* (*SmatCreateCudaBackendFn)(int device, int* code, char* error,
                                                  size_t error_len);
smat::Backend* smat_create_cuda_backend(int device, int* code, char* error, size_t error_len);

}  // extern "C"
