// NcclCommunicator: the Communicator over NCCL for device tensors, built into
// libsmat_cuda.so (see nccl_communicator.h for the entry points and how MPI
// bootstraps it).
//
// Every communicator is non-blocking (config.blocking = 0): an NCCL call may
// return ncclInProgress, and then the communicator's state is polled with
// ncclCommGetAsyncError until it settles. A collective is enqueued on the
// communicator's own stream and an event recorded after it; Wait polls the
// event and the async error until the deadline. On an error or a timeout the
// communicator is aborted (ncclCommAbort, which also tears down its kernels so
// the GPU is not left spinning) and later calls return kAborted: as with MPI,
// the process must then end non-zero (AbortJob in main).
#include "parallel/cuda/nccl_communicator.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "parallel/communicator.h"
#include "parallel/nccl_features.h"

static_assert(smat::kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES,
              "kNcclUniqueIdBytes must match nccl.h");

namespace smat {
namespace {

void CopyError(const std::string& msg, char* error, size_t error_len) {
  if (error == nullptr || error_len == 0) return;
  std::snprintf(error, error_len, "%s", msg.c_str());
}

absl::Status CudaStatus(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": CUDA error ", cudaGetErrorName(e), " (",
                                             cudaGetErrorString(e), ")"));
}

std::string NcclText(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
#if SMAT_NCCL_HAS_LAST_ERROR
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&s, ": ", last);
#endif
  return s;
}

bool DTypeToNccl(DType t, ncclDataType_t* out) {
  switch (t) {
    case DType::kF32: *out = ncclFloat32; return true;
#if SMAT_NCCL_HAS_BF16
    case DType::kBF16: *out = ncclBfloat16; return true;
#endif
    case DType::kI32: *out = ncclInt32; return true;
    case DType::kI64: *out = ncclInt64; return true;
    default: return false;
  }
}

// State shared by a communicator and its handles.
struct NcclState {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0;
  int rank = 0;
  int size = 1;
  CommOptions options;
  int64_t calls = 0;
  bool nccl_aborted = false;
  std::string broken;  // non-empty: unusable, and why
  Tensor barrier_buf;  // [1] fp32 on the device, for Barrier (memory: barrier_owner)
  std::shared_ptr<void> barrier_owner;

  void AbortNccl(const std::string& why) {
    if (broken.empty()) broken = why;
    if (!nccl_aborted && comm != nullptr) {
      nccl_aborted = true;
      ncclCommAbort(comm);  // tears down in-flight kernels; never blocks on peers
    }
  }

  ~NcclState() {
    cudaSetDevice(device);
    if (comm != nullptr && !nccl_aborted) {
      // Finalize flushes outstanding work; it is non-blocking, so poll it
      // briefly and abort if a peer never answers.
      ncclResult_t r = ncclCommFinalize(comm);
      absl::Time deadline = absl::Now() + absl::Seconds(10);
      ncclResult_t state = r;
      while (r == ncclSuccess || r == ncclInProgress) {
        ncclCommGetAsyncError(comm, &state);
        if (state != ncclInProgress || absl::Now() > deadline) break;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      if (state == ncclSuccess) {
        ncclCommDestroy(comm);
      } else {
        ncclCommAbort(comm);
      }
    }
    // An aborted communicator was freed by ncclCommAbort.
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

// Polls comm's async state until it leaves ncclInProgress or the deadline.
absl::Status SettleNccl(NcclState& st, ncclComm_t comm, ncclResult_t first,
                        absl::Time deadline, const std::string& what) {
  ncclResult_t state = first;
  while (state == ncclInProgress) {
    if (absl::Now() > deadline) {
      st.AbortNccl(absl::StrCat(what, ": NCCL did not finish enqueueing before the deadline"));
      return absl::DeadlineExceededError(absl::StrCat(
          what, " on rank ", st.rank, ": NCCL stayed in progress past the deadline; the "
          "communicator was aborted"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    ncclCommGetAsyncError(comm, &state);
  }
  if (state != ncclSuccess) {
    std::string text = NcclText(state, comm);
    st.AbortNccl(absl::StrCat(what, ": ", text));
    return absl::UnavailableError(
        absl::StrCat(what, " on rank ", st.rank, " failed: ", text, "; the communicator was aborted"));
  }
  return absl::OkStatus();
}

class NcclHandle final : public CollectiveHandle {
 public:
  NcclHandle(std::shared_ptr<NcclState> st, std::string what, absl::Time start,
             absl::Duration timeout, cudaEvent_t done, std::vector<Tensor> buffers)
      : st_(std::move(st)), what_(std::move(what)), start_(start), timeout_(timeout),
        done_event_(done), buffers_(std::move(buffers)) {}

  ~NcclHandle() override {
    if (!complete_ && error_.ok() && st_->broken.empty()) {
      // Abandoned while in flight: the kernels may still write its buffers, and
      // the ranks no longer agree on what comes next.
      st_->AbortNccl(absl::StrCat(what_, " was abandoned before it completed"));
    }
    if (done_event_ != nullptr) cudaEventDestroy(done_event_);
  }

  absl::StatusOr<bool> Poll() override {
    if (complete_) return true;
    if (!error_.ok()) return error_;
    if (!st_->broken.empty()) {
      error_ = absl::AbortedError(absl::StrCat(what_, ": communicator was aborted: ", st_->broken));
      return error_;
    }
    cudaError_t e = cudaEventQuery(done_event_);
    if (e == cudaSuccess) {
      complete_ = true;
      return true;
    }
    if (e != cudaErrorNotReady) {
      error_ = CudaStatus(e, what_);
      st_->AbortNccl(std::string(error_.message()));
      return error_;
    }
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(st_->comm, &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      std::string text = NcclText(state, st_->comm);
      st_->AbortNccl(absl::StrCat(what_, ": ", text));
      error_ = absl::UnavailableError(absl::StrCat(what_, " on rank ", st_->rank, " failed: ",
                                                   text, "; the communicator was aborted"));
      return error_;
    }
    return false;
  }

  absl::Status Wait() override {
    const absl::Time deadline = start_ + timeout_;
    int polls = 0;
    for (;;) {
      absl::StatusOr<bool> done = Poll();
      if (!done.ok()) return done.status();
      if (*done) return absl::OkStatus();
      absl::Time now = absl::Now();
      if (now >= deadline) {
        error_ = absl::DeadlineExceededError(absl::StrFormat(
            "%s on rank %d of %d did not complete within %s (elapsed %.3f s): a peer rank is "
            "dead or stalled; the NCCL communicator was aborted, so end the process non-zero "
            "and let the launcher restart the job",
            what_, st_->rank, st_->size, absl::FormatDuration(timeout_),
            absl::ToDoubleSeconds(now - start_)));
        st_->AbortNccl(std::string(error_.message()));
        return error_;
      }
      if (++polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  std::shared_ptr<NcclState> st_;
  std::string what_;
  absl::Time start_;
  absl::Duration timeout_;
  cudaEvent_t done_event_ = nullptr;
  std::vector<Tensor> buffers_;  // alive until complete
  bool complete_ = false;
  absl::Status error_;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(std::shared_ptr<NcclState> st) : st_(std::move(st)) {}
  NcclCommunicator(NcclCommunicator&&) noexcept = default;
  NcclCommunicator& operator=(NcclCommunicator&&) noexcept = default;

  int rank() const override { return st_->rank; }
  int size() const override { return st_->size; }
  Device device() const override { return Device::Cuda(st_->device); }
  std::string name() const override { return "nccl"; }
  absl::Duration default_timeout() const override { return st_->options.timeout; }
  bool aborted() const override { return !st_->broken.empty(); }
  void Abort(const std::string& reason) override {
    st_->AbortNccl(absl::StrCat("aborted on rank ", st_->rank, ": ", reason));
  }

  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartAllReduce(
      Tensor& data, absl::Duration timeout) override {
    const std::string op = absl::StrCat("AllReduce(", DTypeName(data.dtype()), ", ", data.numel(),
                                        " elements)");
    SMAT_RETURN_IF_ERROR(CheckTensor(data, "data", op));
    ncclDataType_t t = ncclFloat32;  // set by DTypeToNccl (checked above)
    DTypeToNccl(data.dtype(), &t);
    return Launch(op, timeout, {data}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(data.raw(), data.raw(), data.numel(), t, ncclSum, c, s);
    });
  }

  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartAllGather(
      const Tensor& send, Tensor& recv, absl::Duration timeout) override {
    const std::string op = absl::StrCat("AllGather(", DTypeName(send.dtype()), ", ", send.numel(),
                                        " elements per rank)");
    SMAT_RETURN_IF_ERROR(CheckTensor(send, "send", op));
    SMAT_RETURN_IF_ERROR(CheckTensor(recv, "recv", op));
    if (recv.dtype() != send.dtype() || recv.numel() != send.numel() * st_->size) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": recv must hold size * ", send.numel(),
                                                     " elements of the send dtype; got ",
                                                     recv.DebugString()));
    }
    ncclDataType_t t = ncclFloat32;  // set by DTypeToNccl (checked above)
    DTypeToNccl(send.dtype(), &t);
    return Launch(op, timeout, {send, recv}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllGather(send.raw(), recv.raw(), send.numel(), t, c, s);
    });
  }

  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartReduceScatter(
      const Tensor& send, Tensor& recv, absl::Duration timeout) override {
    const std::string op = absl::StrCat("ReduceScatter(", DTypeName(send.dtype()), ", ",
                                        recv.numel(), " elements per rank)");
    SMAT_RETURN_IF_ERROR(CheckTensor(send, "send", op));
    SMAT_RETURN_IF_ERROR(CheckTensor(recv, "recv", op));
    if (recv.dtype() != send.dtype() || send.numel() != recv.numel() * st_->size) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": send must hold size * ", recv.numel(),
                                                     " elements of the recv dtype; got ",
                                                     send.DebugString()));
    }
    ncclDataType_t t = ncclFloat32;  // set by DTypeToNccl (checked above)
    DTypeToNccl(send.dtype(), &t);
    return Launch(op, timeout, {send, recv}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclReduceScatter(send.raw(), recv.raw(), recv.numel(), t, ncclSum, c, s);
    });
  }

  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartBroadcast(
      Tensor& data, int root, absl::Duration timeout) override {
    const std::string op = absl::StrCat("Broadcast(", DTypeName(data.dtype()), ", ", data.numel(),
                                        " elements, root ", root, ")");
    SMAT_RETURN_IF_ERROR(CheckTensor(data, "data", op));
    if (root < 0 || root >= st_->size) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": root must be in [0, ", st_->size, ")"));
    }
    ncclDataType_t t = ncclFloat32;  // set by DTypeToNccl (checked above)
    DTypeToNccl(data.dtype(), &t);
    return Launch(op, timeout, {data}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclBroadcast(data.raw(), data.raw(), data.numel(), t, root, c, s);
    });
  }

  absl::StatusOr<std::unique_ptr<CollectiveHandle>> StartBarrier(absl::Duration timeout) override {
    Tensor buf = st_->barrier_buf;
    return Launch("Barrier", timeout, {buf}, [&](ncclComm_t c, cudaStream_t s) {
      return ncclAllReduce(buf.raw(), buf.raw(), 1, ncclFloat32, ncclSum, c, s);
    });
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
#if SMAT_NCCL_HAS_COMM_SPLIT
    if (!st_->broken.empty()) {
      return absl::AbortedError(absl::StrCat("NcclCommunicator Split: communicator is unusable: ",
                                             st_->broken));
    }
    cudaSetDevice(st_->device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    const std::string what = absl::StrCat("NcclCommunicator Split(color ", color, ", key ", key, ")");
    ncclResult_t r = ncclCommSplit(st_->comm, color, key, &child, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      std::string text = NcclText(r, st_->comm);
      st_->AbortNccl(absl::StrCat(what, ": ", text));
      return absl::UnavailableError(absl::StrCat(what, " failed: ", text));
    }
    const absl::Time deadline = absl::Now() + st_->options.timeout;
    // The parent settles first (the split is a collective on it), then the child.
    SMAT_RETURN_IF_ERROR(SettleNccl(*st_, st_->comm, ncclInProgress, deadline, what));
    auto cst = std::make_shared<NcclState>();
    cst->comm = child;
    cst->device = st_->device;
    cst->options = st_->options;
    SMAT_RETURN_IF_ERROR(SettleNccl(*cst, child, ncclInProgress, deadline, what));
    SMAT_RETURN_IF_ERROR(Finish(*cst));
    return std::unique_ptr<Communicator>(new NcclCommunicator(std::move(cst)));
#else
    return absl::UnimplementedError(absl::StrCat(
        "NcclCommunicator::Split needs NCCL >= 2.18 (ncclCommSplit); compiled against ",
        kNcclCompiledVersion));
#endif
  }

  // Completes a freshly initialised state: rank, size, stream, barrier buffer.
  static absl::Status Finish(NcclState& st) {
    SMAT_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(st.device), "cudaSetDevice"));
    ncclResult_t r = ncclCommUserRank(st.comm, &st.rank);
    if (r == ncclSuccess) r = ncclCommCount(st.comm, &st.size);
    if (r != ncclSuccess) {
      return absl::UnavailableError(absl::StrCat("ncclCommUserRank/Count: ", NcclText(r, st.comm)));
    }
    SMAT_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&st.stream, cudaStreamNonBlocking),
                                    "cudaStreamCreateWithFlags"));
    void* p = nullptr;
    SMAT_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, sizeof(float)), "cudaMalloc (barrier buffer)"));
    SMAT_RETURN_IF_ERROR(CudaStatus(cudaMemset(p, 0, sizeof(float)), "cudaMemset"));
    // Freed with the state, which every handle keeps alive.
    st.barrier_owner = std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
    st.barrier_buf = Tensor::Wrap(p, {1}, DType::kF32, Device::Cuda(st.device));
    return absl::OkStatus();
  }

 private:
  absl::Status CheckTensor(const Tensor& t, const char* role, const std::string& op) const {
    if (!(t.device() == Device::Cuda(st_->device))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "NcclCommunicator ", op, ": ", role, " is on ", t.device().ToString(), "; expected cuda:",
          st_->device, " (use MpiCommunicator for host tensors)"));
    }
    ncclDataType_t nt;
    if (!DTypeToNccl(t.dtype(), &nt)) {
      return absl::InvalidArgumentError(absl::StrCat("NcclCommunicator ", op, ": ", role,
                                                     " has dtype ", DTypeName(t.dtype()),
                                                     "; expected fp32, bf16, int32 or int64"));
    }
    return absl::OkStatus();
  }

  template <typename Enqueue>
  absl::StatusOr<std::unique_ptr<CollectiveHandle>> Launch(const std::string& op,
                                                           absl::Duration timeout,
                                                           std::vector<Tensor> buffers,
                                                           Enqueue enqueue) {
    NcclState& st = *st_;
    ++st.calls;
    const std::string what = absl::StrCat("NcclCommunicator ", op, " (call ", st.calls, ")");
    if (!st.broken.empty()) {
      return absl::AbortedError(absl::StrCat(what, ": communicator is unusable: ", st.broken));
    }
    if (st.options.fault.Fires(st.rank, st.calls)) {
      absl::Status s = InjectFault(st.options.fault, what);
      if (!s.ok()) {
        st.AbortNccl(std::string(s.message()));
        return s;
      }
    }
    const absl::Time start = absl::Now();
    SMAT_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(st.device), what));
    ncclResult_t r = enqueue(st.comm, st.stream);
    if (r != ncclSuccess && r != ncclInProgress) {
      std::string text = NcclText(r, st.comm);
      st.AbortNccl(absl::StrCat(what, ": ", text));
      return absl::UnavailableError(absl::StrCat(what, " on rank ", st.rank, " failed: ", text,
                                                 "; the communicator was aborted"));
    }
    SMAT_RETURN_IF_ERROR(SettleNccl(st, st.comm, r, start + timeout, what));
    cudaEvent_t done = nullptr;
    SMAT_RETURN_IF_ERROR(
        CudaStatus(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), what));
    cudaError_t e = cudaEventRecord(done, st.stream);
    if (e != cudaSuccess) {
      cudaEventDestroy(done);
      return CudaStatus(e, what);
    }
    return std::unique_ptr<CollectiveHandle>(
        new NcclHandle(st_, what, start, timeout, done, std::move(buffers)));
  }

  std::shared_ptr<NcclState> st_;
};

}  // namespace
}  // namespace smat

extern "C" {

__attribute__((visibility("default"))) int smat_nccl_version(int* version, char* error,
                                                             size_t error_len) {
  ncclResult_t r = ncclGetVersion(version);
  if (r != ncclSuccess) {
    smat::CopyError(absl::StrCat("ncclGetVersion: ", ncclGetErrorString(r)), error, error_len);
    return static_cast<int>(absl::StatusCode::kUnavailable);
  }
  // The loaded library must be at least as new (major.minor) as the headers.
  if (*version / 100 < smat::kNcclCompiledVersion / 100) {
    smat::CopyError(absl::StrCat("NCCL library version ", *version, " is older than the ",
                                 smat::kNcclCompiledVersion,
                                 " smat was compiled against; install a matching libnccl"),
                    error, error_len);
    return static_cast<int>(absl::StatusCode::kFailedPrecondition);
  }
  return 0;
}

__attribute__((visibility("default"))) int smat_nccl_device_count(int* count, char* error,
                                                                  size_t error_len) {
  cudaError_t e = cudaGetDeviceCount(count);
  if (e != cudaSuccess) {
    smat::CopyError(absl::StrCat("cudaGetDeviceCount: ", cudaGetErrorString(e)), error, error_len);
    return static_cast<int>(absl::StatusCode::kFailedPrecondition);
  }
  return 0;
}

__attribute__((visibility("default"))) int smat_nccl_get_unique_id(char* id, char* error,
                                                                   size_t error_len) {
  ncclUniqueId uid;
  ncclResult_t r = ncclGetUniqueId(&uid);
  if (r != ncclSuccess) {
    smat::CopyError(absl::StrCat("ncclGetUniqueId: ", ncclGetErrorString(r)), error, error_len);
    return static_cast<int>(absl::StatusCode::kUnavailable);
  }
  std::memcpy(id, uid.internal, NCCL_UNIQUE_ID_BYTES);
  return 0;
}

__attribute__((visibility("default"))) smat::Communicator* smat_nccl_create(
    const char* id, int nranks, int rank, int device, const smat::CommOptions* options, int* code,
    char* error, size_t error_len) {
  auto fail = [&](const absl::Status& s) -> smat::Communicator* {
    *code = static_cast<int>(s.code());
    smat::CopyError(std::string(s.message()), error, error_len);
    return nullptr;
  };
  absl::Status s = smat::CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  if (!s.ok()) return fail(s);
  ncclUniqueId uid;
  std::memcpy(uid.internal, id, NCCL_UNIQUE_ID_BYTES);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call may return ncclInProgress; we poll
  auto st = std::make_shared<smat::NcclState>();
  st->device = device;
  st->rank = rank;
  st->size = nranks;
  st->options = *options;
  ncclResult_t r = ncclCommInitRankConfig(&st->comm, nranks, uid, rank, &config);
  const std::string what = absl::StrCat("ncclCommInitRankConfig(rank ", rank, " of ", nranks,
                                        ", cuda:", device, ")");
  if (r != ncclSuccess && r != ncclInProgress) {
    st->comm = nullptr;
    return fail(absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r))));
  }
  s = smat::SettleNccl(*st, st->comm, r, absl::Now() + options->timeout, what);
  if (!s.ok()) return fail(s);
  s = smat::NcclCommunicator::Finish(*st);
  if (!s.ok()) return fail(s);
  *code = 0;
  return new smat::NcclCommunicator(std::move(st));
}

}  // extern "C"
