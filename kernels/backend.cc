// CreateBackend and ParseDevice (backend.h): the CPU backend directly, the CUDA
// backend through dlopen of libsmat_cuda.so, so no binary links cuBLAS at
// start-up (PLATFORM.md: cuBLAS TLS breaks prometheus-cpp's civetweb threads).
#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_plugin.h"

namespace smat {
namespace {

constexpr char kCudaLibraryName[] = "libsmat_cuda.so";

// The directory of the running executable, or "" if /proc is unreadable.
std::string ExecutableDir() {
  std::error_code ec;
  std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  return exe.parent_path().string();
}

// Opens libsmat_cuda.so, trying in order: next to the executable, the path in
// $SMAT_CUDA_LIBRARY, the dynamic loader's search path. The handle is never
// closed: the backends and the device memory they hand out point into the
// library until the process ends (dlopen of an open library only bumps its
// reference count, so repeated calls are cheap).
absl::StatusOr<void*> OpenCudaLibrary() {
  std::vector<std::string> tried;
  auto try_open = [&](const std::string& path) -> void* {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      tried.push_back(absl::StrCat(path, ": ", why != nullptr ? why : "dlopen failed"));
    }
    return handle;
  };
  const std::string dir = ExecutableDir();
  if (!dir.empty()) {
    const std::string path = absl::StrCat(dir, "/", kCudaLibraryName);
    std::error_code ec;
    if (std::filesystem::exists(path, ec)) {
      if (void* h = try_open(path)) return h;
    } else {
      tried.push_back(absl::StrCat(path, ": no such file"));
    }
  }
  if (const char* env = std::getenv("SMAT_CUDA_LIBRARY"); env != nullptr && *env != '\0') {
    if (void* h = try_open(env)) return h;
  } else {
    tried.push_back("$SMAT_CUDA_LIBRARY: not set");
  }
  if (void* h = try_open(kCudaLibraryName)) return h;
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot load the CUDA backend ", kCudaLibraryName, " (tried: ", absl::StrJoin(tried, "; "),
      "). Build with CUDA (cmake -DSMAT_CUDA=on) so it sits next to the executable, or set "
      "SMAT_CUDA_LIBRARY to its path"));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  SMAT_ASSIGN_OR_RETURN(void* handle, OpenCudaLibrary());
  dlerror();
  auto version_fn =
      reinterpret_cast<SmatCudaPluginAbiVersionFn>(dlsym(handle, "smat_cuda_plugin_abi_version"));
  auto create_fn =
      reinterpret_cast<SmatCreateCudaBackendFn>(dlsym(handle, "smat_create_cuda_backend"));
  if (version_fn == nullptr || create_fn == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        kCudaLibraryName, " does not export smat_cuda_plugin_abi_version and "
        "smat_create_cuda_backend; it is not an smat CUDA backend or comes from an old build: "
        "rebuild it (target smat_cuda)"));
  }
  const int version = version_fn();
  if (version != kSmatCudaPluginAbiVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        kCudaLibraryName, " has plugin ABI version ", version, " but this program expects ",
        kSmatCudaPluginAbiVersion, "; it comes from another build: rebuild target smat_cuda"));
  }
  char error[1024] = {0};
  int code = static_cast<int>(absl::StatusCode::kUnknown);
  Backend* backend = create_fn(device, &code, error, sizeof(error));
  if (backend == nullptr) {
    error[sizeof(error) - 1] = '\0';
    if (code == static_cast<int>(absl::StatusCode::kOk)) code = static_cast<int>(absl::StatusCode::kUnknown);
    return absl::Status(static_cast<absl::StatusCode>(code), error);
  }
  return std::unique_ptr<Backend>(backend);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(Device device) {
  switch (device.kind) {
    case DeviceKind::kCpu:
      return std::unique_ptr<Backend>(new CpuBackend());
    case DeviceKind::kCuda:
      if (device.index < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("CreateBackend: CUDA device index must be >= 0, got ", device.index));
      }
      return CreateCudaBackend(device.index);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("CreateBackend: unknown device kind ", static_cast<int>(device.kind)));
}

absl::StatusOr<Device> ParseDevice(const std::string& name) {
  if (name == "cpu") return Device::Cpu();
  if (name == "cuda") return Device::Cuda(0);
  constexpr char kPrefix[] = "cuda:";
  if (name.rfind(kPrefix, 0) == 0) {
    const std::string index = name.substr(sizeof(kPrefix) - 1);
    int i = -1;
    if (!index.empty() && index.find_first_not_of("0123456789") == std::string::npos &&
        absl::SimpleAtoi(index, &i) && i >= 0) {
      return Device::Cuda(i);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device '", name, "'; expected cpu, cuda or cuda:N (N >= 0)"));
}

}  // namespace smat
