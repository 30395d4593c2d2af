// ProcessGroup: the dp x sp grid, MPI sub-communicators and the MPI bootstrap
// of the NCCL communicators that live in libsmat_cuda.so.
#include "parallel/process_group.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "parallel/cuda/nccl_communicator.h"
#include "parallel/launch_env.h"

namespace smat {

absl::StatusOr<CommBackend> ParseCommBackend(const std::string& name) {
  if (name == "mpi") return CommBackend::kMpi;
  if (name == "nccl") return CommBackend::kNccl;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown communicator backend '", name, "'; expected mpi or nccl"));
}

std::string ProcessGroup::DebugString() const {
  return absl::StrCat("rank ", world_rank_, " of ", world_size_, ": dp ", dp(), " x sp ", sp_,
                      ", sequence rank ", sp_rank(), ", data rank ", dp_rank(), ", local rank ",
                      local_rank_, " of ", local_size_,
                      device_ >= 0 ? absl::StrCat(", cuda:", device_) : std::string());
}

namespace {

// The NCCL entry points of the already-loaded libsmat_cuda.so.
struct NcclPlugin {
  SmatNcclVersionFn version = nullptr;
  SmatNcclDeviceCountFn device_count = nullptr;
  SmatNcclGetUniqueIdFn get_unique_id = nullptr;
  SmatNcclCreateFn create = nullptr;
};

absl::StatusOr<NcclPlugin> FindNcclPlugin(int device) {
  // Loading the CUDA backend loads libsmat_cuda.so (and reports a missing GPU,
  // driver or library clearly); the library then stays loaded, so a second
  // dlopen with RTLD_NOLOAD finds it by its soname without loading anything.
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Backend> probe, CreateBackend(Device::Cuda(device)));
  probe.reset();
  void* handle = dlopen("libsmat_cuda.so", RTLD_NOW | RTLD_NOLOAD);
  if (handle == nullptr) {
    return absl::FailedPreconditionError(
        "NCCL process group: libsmat_cuda.so is not loaded after creating the CUDA backend");
  }
  NcclPlugin p;
  p.version = reinterpret_cast<SmatNcclVersionFn>(dlsym(handle, "smat_nccl_version"));
  p.device_count = reinterpret_cast<SmatNcclDeviceCountFn>(dlsym(handle, "smat_nccl_device_count"));
  p.get_unique_id = reinterpret_cast<SmatNcclGetUniqueIdFn>(dlsym(handle, "smat_nccl_get_unique_id"));
  p.create = reinterpret_cast<SmatNcclCreateFn>(dlsym(handle, "smat_nccl_create"));
  dlclose(handle);  // drops the reference NOLOAD added; the loader's stays
  if (!p.version || !p.device_count || !p.get_unique_id || !p.create) {
    return absl::FailedPreconditionError(
        "NCCL process group: libsmat_cuda.so was built without NCCL (no smat_nccl_* entry "
        "points); rebuild with NCCL installed or use --comm=mpi");
  }
  return p;
}

absl::Status PluginStatus(int code, const char* error) {
  if (code == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(code), error);
}

// Every rank's NCCL communicator over `host` (the world), bootstrapped by MPI.
absl::StatusOr<std::unique_ptr<Communicator>> BootstrapNccl(const NcclPlugin& plugin,
                                                           MpiCommunicator& host, int device,
                                                           const CommOptions& options) {
  char error[512] = {0};
  int version = 0;
  SMAT_RETURN_IF_ERROR(PluginStatus(plugin.version(&version, error, sizeof(error)), error));
  // The id travels as int32 words through the host communicator's Broadcast
  // (under its deadline, so a missing rank 0 is an error, not a hang).
  static_assert(kNcclUniqueIdBytes % 4 == 0);
  SMAT_ASSIGN_OR_RETURN(Tensor id, Tensor::Zeros({kNcclUniqueIdBytes / 4}, DType::kI32));
  if (host.rank() == 0) {
    SMAT_RETURN_IF_ERROR(PluginStatus(
        plugin.get_unique_id(static_cast<char*>(id.raw()), error, sizeof(error)), error));
  }
  SMAT_RETURN_IF_ERROR(Annotate(host.Broadcast(id, 0), "broadcasting the ncclUniqueId"));
  int code = 0;
  Communicator* comm = plugin.create(static_cast<const char*>(id.raw()), host.size(), host.rank(),
                                     device, &options, &code, error, sizeof(error));
  if (comm == nullptr) {
    return PluginStatus(code == 0 ? static_cast<int>(absl::StatusCode::kUnavailable) : code, error);
  }
  return std::unique_ptr<Communicator>(comm);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Create(
    MPI_Comm world, const ProcessGroupOptions& options) {
  std::unique_ptr<ProcessGroup> pg(new ProcessGroup());
  SMAT_ASSIGN_OR_RETURN(pg->host_world_, MpiCommunicator::Create(world, options.comm));
  pg->world_rank_ = pg->host_world_->rank();
  pg->world_size_ = pg->host_world_->size();
  if (options.sp < 1 || pg->world_size_ % options.sp != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "process grid: sp = ", options.sp, " must be >= 1 and divide the world size ",
        pg->world_size_, " (world = dp x sp); launch a multiple of ", options.sp,
        " ranks or change parallel.sp"));
  }
  pg->sp_ = options.sp;

  // Ranks on this host (shared memory), for the GPU of each rank.
  MPI_Comm local = MPI_COMM_NULL;
  if (MPI_Comm_split_type(pg->host_world_->comm(), MPI_COMM_TYPE_SHARED, pg->world_rank_,
                          MPI_INFO_NULL, &local) != MPI_SUCCESS) {
    return absl::UnavailableError("MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed");
  }
  MPI_Comm_rank(local, &pg->local_rank_);
  MPI_Comm_size(local, &pg->local_size_);
  MPI_Comm_free(&local);

  const int seq_color = pg->dp_rank(), data_color = pg->sp_rank();
  if (options.backend == CommBackend::kMpi) {
    SMAT_ASSIGN_OR_RETURN(auto w, MpiCommunicator::Create(world, options.comm));
    pg->world_ = std::move(w);
    SMAT_ASSIGN_OR_RETURN(pg->sequence_, pg->host_world_->Split(seq_color, pg->world_rank_));
    SMAT_ASSIGN_OR_RETURN(pg->data_, pg->host_world_->Split(data_color, pg->world_rank_));
    return pg;
  }

  // NCCL: one GPU per local rank. Every rank checks, then all agree before
  // anyone starts NCCL (so one rank's missing GPU does not leave the others
  // waiting in ncclCommInitRank).
  // The local rank's GPU, or device 0 when the scheduler left one visible
  // (parallel/launch_env.h).
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  pg->device_ = GpuForLocalRank(pg->local_rank_, visible != nullptr ? visible : "");
  absl::StatusOr<NcclPlugin> plugin = FindNcclPlugin(pg->device_);
  absl::Status local_ok = plugin.status();
  if (local_ok.ok()) {
    char error[512] = {0};
    int count = 0;
    local_ok = PluginStatus(plugin->device_count(&count, error, sizeof(error)), error);
    if (local_ok.ok() && count <= pg->device_) {
      local_ok = absl::FailedPreconditionError(absl::StrCat(
          "NCCL process group: ", pg->local_size_, " ranks on this host but only ", count,
          " GPUs (local rank ", pg->local_rank_, " needs GPU ", pg->device_,
          "); launch at most ", count, " ranks per host"));
    }
  }
  SMAT_ASSIGN_OR_RETURN(Tensor flag, Tensor::Zeros({1}, DType::kI32));
  flag.data<int32_t>()[0] = local_ok.ok() ? 0 : 1;
  SMAT_RETURN_IF_ERROR(pg->host_world_->AllReduce(flag));
  if (!local_ok.ok()) return local_ok;
  if (flag.data<int32_t>()[0] != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "NCCL process group: ", flag.data<int32_t>()[0],
        " rank(s) cannot use NCCL (see their messages); not starting NCCL"));
  }
  SMAT_ASSIGN_OR_RETURN(pg->world_, BootstrapNccl(*plugin, *pg->host_world_, pg->device_,
                                                  options.comm));
  SMAT_ASSIGN_OR_RETURN(pg->sequence_, pg->world_->Split(seq_color, pg->world_rank_));
  SMAT_ASSIGN_OR_RETURN(pg->data_, pg->world_->Split(data_color, pg->world_rank_));
  return pg;
}

}  // namespace smat
