// The exported entry points of libsmat_cuda.so (cuda_plugin.h): the only
// symbols the loader in kernels/backend.cc looks up.
#include "kernels/cuda/cuda_plugin.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>

#include "kernels/cuda/cuda_backend.h"

namespace {

void WriteError(const std::string& message, char* error, size_t error_len) {
  if (error == nullptr || error_len == 0) return;
  const size_t n = std::min(message.size(), error_len - 1);
  std::memcpy(error, message.data(), n);
  error[n] = '\0';
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int smat_cuda_plugin_abi_version() {
  return smat::kSmatCudaPluginAbiVersion;
}

__attribute__((visibility("default"))) smat::Backend* smat_create_cuda_backend(
    int device, int* code, char* error, size_t error_len) {
  // No exception may cross the C boundary (std::bad_alloc, say).
  try {
    absl::StatusOr<std::unique_ptr<smat::CudaBackend>> backend = smat::CudaBackend::Create(device);
    if (!backend.ok()) {
      if (code != nullptr) *code = static_cast<int>(backend.status().code());
      WriteError(std::string(backend.status().message()), error, error_len);
      return nullptr;
    }
    return backend->release();
  } catch (const std::exception& e) {
    if (code != nullptr) *code = static_cast<int>(absl::StatusCode::kInternal);
    WriteError(std::string("creating the CUDA backend threw: ") + e.what(), error, error_len);
    return nullptr;
  }
}

}  // extern "C"
