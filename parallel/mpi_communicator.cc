// MpiCommunicator: nonblocking Open MPI collectives polled under a deadline,
// deterministic reductions (local fixed-order sums), and the unusable-after-
// failure rule described in mpi_communicator.h.
#include "parallel/mpi_communicator.h"

#include <climits>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace smat {

namespace {
class MpiHandle;
}  // namespace

struct MpiCommunicator::State {
  MPI_Comm comm = MPI_COMM_NULL;
  // Second stages of AllReduce run on their own duplicate, posted in the order
  // the AllReduces were started (see Progress), so their matching cannot
  // depend on when each rank happened to poll.
  MPI_Comm stage2_comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  CommOptions options;
  int64_t calls = 0;
  std::string broken;  // non-empty: why the communicator is unusable
  // Requests that could not complete and the buffers they may still write:
  // kept, never freed, until the process ends (see the header).
  std::vector<MPI_Request> orphaned_requests;
  std::vector<Tensor> orphaned_buffers;
  // The stages of orphaned collectives: they own the count and displacement
  // arrays MPI may still read (MPI 3.1 section 5.12: valid until completion).
  std::vector<std::shared_ptr<void>> orphaned_stages;
  // Handles in flight, in the order they were started.
  std::vector<MpiHandle*> active;

  // Advances every handle in flight, oldest first. A handle may post a later
  // stage on stage2_comm only if no older handle still has one to post, so
  // those posts follow the start order on every rank.
  void Progress();

  ~State() {
    // A communicator with orphaned requests must not be freed (erroneous in
    // MPI); the process is about to end through AbortJob anyway.
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || !orphaned_requests.empty()) return;
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
    if (stage2_comm != MPI_COMM_NULL) MPI_Comm_free(&stage2_comm);
  }

  void MarkBroken(const std::string& why) {
    if (broken.empty()) broken = why;
  }
};

namespace {

std::string MpiErrorString(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, len);
}

MPI_Datatype MpiType(DType t) {
  switch (t) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kBF16: return MPI_UINT16_T;  // moved as bits, summed locally
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;
  }
}

// dst[0, n) = sum over k in 0..parts-1 of src[k*n, (k+1)*n), in order k = 0, 1, ...
// fp32 and bf16 accumulate in fp32 (bf16 rounded once); integers wrap.
void FixedOrderSum(DType t, const void* src, int parts, int64_t n, void* dst) {
  switch (t) {
    case DType::kF32: {
      const float* s = static_cast<const float*>(src);
      float* d = static_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) {
        float acc = s[i];
        for (int k = 1; k < parts; ++k) acc += s[k * n + i];
        d[i] = acc;
      }
      break;
    }
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) {
        float acc = Bf16ToFloat(s[i]);
        for (int k = 1; k < parts; ++k) acc += Bf16ToFloat(s[k * n + i]);
        d[i] = FloatToBf16(acc);
      }
      break;
    }
    case DType::kI32: {
      const uint32_t* s = static_cast<const uint32_t*>(src);
      uint32_t* d = static_cast<uint32_t*>(dst);
      for (int64_t i = 0; i < n; ++i) {
        uint32_t acc = s[i];
        for (int k = 1; k < parts; ++k) acc += s[k * n + i];
        d[i] = acc;
      }
      break;
    }
    case DType::kI64: {
      const uint64_t* s = static_cast<const uint64_t*>(src);
      uint64_t* d = static_cast<uint64_t*>(dst);
      for (int64_t i = 0; i < n; ++i) {
        uint64_t acc = s[i];
        for (int k = 1; k < parts; ++k) acc += s[k * n + i];
        d[i] = acc;
      }
      break;
    }
    default:
      SMAT_CHECK(false);
  }
}

// One collective in flight: a chain of stages. Each stage posts one MPI
// request (or none, for local work); when it completes, the next stage runs.
// Stages marked `ordered` post on stage2_comm and wait their turn (State::Progress).
class MpiHandle final : public CollectiveHandle {
 public:
  struct Stage {
    std::function<absl::Status(MPI_Request*)> post;
    bool ordered = false;
  };

  MpiHandle(std::shared_ptr<MpiCommunicator::State> state, std::string what,
            absl::Duration timeout, std::vector<Tensor> buffers)
      : state_(std::move(state)),
        what_(std::move(what)),
        start_(absl::Now()),
        timeout_(timeout),
        buffers_(std::move(buffers)) {}

  ~MpiHandle() override {
    Deregister();
    if (!done_ && error_.ok()) {
      Orphan(absl::StrCat(what_, " was abandoned before it completed"));
    }
  }

  // Posts the first stage (never ordered) and registers with the progress engine.
  absl::Status Begin(std::vector<Stage> stages) {
    stages_ = std::move(stages);
    absl::Status s = stages_[next_stage_++].post(&request_);
    if (!s.ok()) return Fail(s);
    state_->active.push_back(this);
    return absl::OkStatus();
  }

  // One step of progress: tests the current request; posts the next stage when
  // it completed (ordered stages only when `may_post_ordered`).
  void Step(bool may_post_ordered) {
    if (done_ || !error_.ok()) return;
    if (!stage_complete_) {
      int flag = 0;
      int rc = MPI_Test(&request_, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        Fail(absl::UnavailableError(
                 absl::StrCat(what_, " failed on rank ", state_->rank, ": ", MpiErrorString(rc))))
            .IgnoreError();  // recorded in error_, returned by Poll/Wait
        return;
      }
      if (!flag) return;
      request_ = MPI_REQUEST_NULL;
      stage_complete_ = true;
    }
    if (next_stage_ == stages_.size()) {
      done_ = true;
      Deregister();
      return;
    }
    if (stages_[next_stage_].ordered && !may_post_ordered) return;
    absl::Status s = stages_[next_stage_++].post(&request_);
    if (!s.ok()) {
      Fail(s).IgnoreError();  // recorded in error_, returned by Poll/Wait
      return;
    }
    stage_complete_ = false;
  }

  bool HasUnpostedOrderedStage() const {
    if (done_ || !error_.ok()) return false;
    for (size_t i = next_stage_; i < stages_.size(); ++i) {
      if (stages_[i].ordered) return true;
    }
    return false;
  }

  absl::StatusOr<bool> Poll() override {
    if (done_) return true;
    if (!error_.ok()) return error_;
    if (!state_->broken.empty()) {
      return Fail(absl::AbortedError(absl::StrCat(what_, ": communicator was aborted: ",
                                                  state_->broken)));
    }
    state_->Progress();
    if (!error_.ok()) return error_;
    return done_;
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
        return Fail(absl::DeadlineExceededError(absl::StrFormat(
            "%s on rank %d of %d did not complete within %s (elapsed %.3f s): a peer rank "
            "is dead or stalled; the communicator is now unusable, so end the process "
            "non-zero and let the launcher restart the job",
            what_, state_->rank, state_->size, absl::FormatDuration(timeout_),
            absl::ToDoubleSeconds(now - start_))));
      }
      // Spin briefly for latency, then sleep so oversubscribed ranks (more
      // ranks than cores) let the peer they wait for run.
      if (++polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  void Deregister() {
    auto& a = state_->active;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i] == this) {
        a.erase(a.begin() + i);
        break;
      }
    }
  }

  void Orphan(const std::string& why) {
    if (request_ != MPI_REQUEST_NULL) {
      state_->orphaned_requests.push_back(request_);
      request_ = MPI_REQUEST_NULL;
    }
    for (Tensor& t : buffers_) state_->orphaned_buffers.push_back(t);
    state_->orphaned_stages.push_back(std::make_shared<std::vector<Stage>>(std::move(stages_)));
    stages_.clear();
    next_stage_ = 0;
    state_->MarkBroken(why);
  }

  absl::Status Fail(absl::Status s) {
    error_ = s;
    Deregister();
    Orphan(std::string(s.message()));
    return s;
  }

  std::shared_ptr<MpiCommunicator::State> state_;
  std::string what_;
  absl::Time start_;
  absl::Duration timeout_;
  std::vector<Tensor> buffers_;  // user tensors and scratch, alive until done
  std::vector<Stage> stages_;
  size_t next_stage_ = 0;
  MPI_Request request_ = MPI_REQUEST_NULL;
  bool stage_complete_ = false;
  bool done_ = false;
  absl::Status error_;
};

absl::Status CheckMpi(int rc, const std::string& what) {
  if (rc == MPI_SUCCESS) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", MpiErrorString(rc)));
}

absl::Status CheckHostTensor(const Tensor& t, const char* role, const std::string& what) {
  if (!t.defined() && t.numel() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", role, " is undefined"));
  }
  if (!t.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", role, " is on ", t.device().ToString(),
        "; MpiCommunicator moves host tensors (use NcclCommunicator for device memory)"));
  }
  if (!IsCollectiveDType(t.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", role, " has dtype ",
                                                   DTypeName(t.dtype()),
                                                   "; expected fp32, bf16, int32 or int64"));
  }
  if (t.numel() > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", role, " has ", t.numel(), " elements; MPI counts are int, split it into "
        "pieces of at most ", INT_MAX));
  }
  return absl::OkStatus();
}

// Splits n elements into `parts` blocks as even as possible (first blocks one
// larger): the reduce-scatter stage of AllReduce.
void EvenBlocks(int64_t n, int parts, std::vector<int>* counts, std::vector<int>* displs) {
  counts->assign(parts, 0);
  displs->assign(parts, 0);
  int64_t off = 0;
  for (int i = 0; i < parts; ++i) {
    int64_t c = n / parts + (i < n % parts ? 1 : 0);
    (*counts)[i] = static_cast<int>(c);
    (*displs)[i] = static_cast<int>(off);
    off += c;
  }
}

}  // namespace

void MpiCommunicator::State::Progress() {
  std::vector<MpiHandle*> snapshot = active;  // Step may deregister
  bool may_post_ordered = true;
  for (MpiHandle* h : snapshot) {
    h->Step(may_post_ordered);
    if (h->HasUnpostedOrderedStage()) may_post_ordered = false;
  }
}

// --- MpiSession ------------------------------------------------------------------

absl::StatusOr<MpiSession> MpiSession::Init(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return MpiSession(false);
  int provided = 0;
  int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
  if (rc != MPI_SUCCESS) {
    return absl::UnavailableError(absl::StrCat("MPI_Init_thread failed: ", MpiErrorString(rc),
                                               "; run under mpirun"));
  }
  return MpiSession(true);
}

MpiSession::~MpiSession() {
  if (!owns_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

int MpiSession::world_rank() const {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int MpiSession::world_size() const {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

void AbortJob(const absl::Status& status) {
  int initialized = 0, finalized = 0, rank = -1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "smat: rank %d: %s\nsmat: rank %d: aborting the MPI job (exit 3) so the "
               "launcher can restart it\n", rank, status.ToString().c_str(), rank);
  std::fflush(stderr);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 3);
  std::_Exit(3);  // MPI_Abort does not return; this is for a process without MPI.
}

// --- MpiCommunicator ---------------------------------------------------------------

absl::StatusOr<std::unique_ptr<MpiCommunicator>> MpiCommunicator::Create(MPI_Comm parent,
                                                                         CommOptions options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    return absl::FailedPreconditionError(
        "MpiCommunicator::Create: MPI is not initialised; create an MpiSession in main first");
  }
  auto state = std::make_shared<State>();
  state->options = std::move(options);
  SMAT_RETURN_IF_ERROR(CheckMpi(MPI_Comm_dup(parent, &state->comm), "MPI_Comm_dup"));
  MPI_Comm_set_errhandler(state->comm, MPI_ERRORS_RETURN);
  SMAT_RETURN_IF_ERROR(CheckMpi(MPI_Comm_dup(parent, &state->stage2_comm), "MPI_Comm_dup"));
  MPI_Comm_set_errhandler(state->stage2_comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(state->comm, &state->rank);
  MPI_Comm_size(state->comm, &state->size);
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(std::move(state)));
}

MpiCommunicator::~MpiCommunicator() = default;

int MpiCommunicator::rank() const { return state_->rank; }
int MpiCommunicator::size() const { return state_->size; }
absl::Duration MpiCommunicator::default_timeout() const { return state_->options.timeout; }
MPI_Comm MpiCommunicator::comm() const { return state_->comm; }
bool MpiCommunicator::aborted() const { return !state_->broken.empty(); }

void MpiCommunicator::Abort(const std::string& reason) {
  state_->MarkBroken(absl::StrCat("aborted on rank ", state_->rank, ": ", reason));
}

namespace {

// The common prologue of every Start*: refuses a broken communicator, counts
// the call and fires an injected fault.
absl::Status BeginCall(MpiCommunicator::State& st, std::string* what, const std::string& op) {
  ++st.calls;
  *what = absl::StrCat("MpiCommunicator ", op, " (call ", st.calls, ")");
  if (!st.broken.empty()) {
    return absl::AbortedError(absl::StrCat(*what, ": communicator is unusable: ", st.broken));
  }
  if (st.options.fault.Fires(st.rank, st.calls)) {
    absl::Status s = InjectFault(st.options.fault, *what);
    if (!s.ok()) {
      st.MarkBroken(std::string(s.message()));
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CollectiveHandle>> MpiCommunicator::StartAllReduce(
    Tensor& data, absl::Duration timeout) {
  std::string what;
  const std::string op = absl::StrCat("AllReduce(", DTypeName(data.dtype()), ", ", data.numel(),
                                      " elements)");
  SMAT_RETURN_IF_ERROR(CheckHostTensor(data, "data", op));
  SMAT_RETURN_IF_ERROR(BeginCall(*state_, &what, op));
  State* st = state_.get();
  const int P = st->size;
  const DType dt = data.dtype();
  auto counts = std::make_shared<std::vector<int>>();
  auto displs = std::make_shared<std::vector<int>>();
  EvenBlocks(data.numel(), P, counts.get(), displs.get());
  const int mine = (*counts)[st->rank];
  // gathered: (P, mine) blocks received from every rank; block: (mine) the sum.
  SMAT_ASSIGN_OR_RETURN(Tensor gathered, Tensor::Empty({std::max<int64_t>(1, int64_t{P} * mine)}, dt));
  SMAT_ASSIGN_OR_RETURN(Tensor block, Tensor::Empty({std::max(1, mine)}, dt));
  auto handle = std::make_unique<MpiHandle>(state_, what, timeout,
                                            std::vector<Tensor>{data, gathered, block});
  MPI_Datatype type = MpiType(dt);
  MPI_Comm comm = st->comm;
  MPI_Comm comm2 = st->stage2_comm;
  auto recv_counts = std::make_shared<std::vector<int>>(P, mine);
  auto recv_displs = std::make_shared<std::vector<int>>(P);
  for (int i = 0; i < P; ++i) (*recv_displs)[i] = i * mine;
  std::vector<MpiHandle::Stage> stages;
  // Stage 1: every rank sends block j of its data to rank j.
  stages.push_back({[=](MPI_Request* req) {
    return CheckMpi(MPI_Ialltoallv(data.raw(), counts->data(), displs->data(), type,
                                   gathered.raw(), recv_counts->data(), recv_displs->data(),
                                   type, comm, req),
                    "MPI_Ialltoallv");
  }});
  // Stage 2: sum this rank's block over ranks in order, then share it.
  stages.push_back({[=](MPI_Request* req) {
    FixedOrderSum(dt, gathered.raw(), P, mine, block.raw());
    return CheckMpi(MPI_Iallgatherv(block.raw(), mine, type, data.raw(), counts->data(),
                                    displs->data(), type, comm2, req),
                    "MPI_Iallgatherv");
  }, /*ordered=*/true});
  SMAT_RETURN_IF_ERROR(handle->Begin(std::move(stages)));
  return std::unique_ptr<CollectiveHandle>(std::move(handle));
}

absl::StatusOr<std::unique_ptr<CollectiveHandle>> MpiCommunicator::StartAllGather(
    const Tensor& send, Tensor& recv, absl::Duration timeout) {
  std::string what;
  const std::string op = absl::StrCat("AllGather(", DTypeName(send.dtype()), ", ", send.numel(),
                                      " elements per rank)");
  SMAT_RETURN_IF_ERROR(CheckHostTensor(send, "send", op));
  SMAT_RETURN_IF_ERROR(CheckHostTensor(recv, "recv", op));
  if (recv.dtype() != send.dtype() || recv.numel() != send.numel() * state_->size) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": recv must be ", DTypeName(send.dtype()), " with size * ", send.numel(), " = ",
        send.numel() * state_->size, " elements; got ", recv.DebugString()));
  }
  SMAT_RETURN_IF_ERROR(BeginCall(*state_, &what, op));
  auto handle = std::make_unique<MpiHandle>(state_, what, timeout, std::vector<Tensor>{send, recv});
  MPI_Datatype type = MpiType(send.dtype());
  MPI_Comm comm = state_->comm;
  const int n = static_cast<int>(send.numel());
  SMAT_RETURN_IF_ERROR(handle->Begin({{[=](MPI_Request* req) {
    return CheckMpi(MPI_Iallgather(send.raw(), n, type, recv.raw(), n, type, comm, req),
                    "MPI_Iallgather");
  }}}));
  return std::unique_ptr<CollectiveHandle>(std::move(handle));
}

absl::StatusOr<std::unique_ptr<CollectiveHandle>> MpiCommunicator::StartReduceScatter(
    const Tensor& send, Tensor& recv, absl::Duration timeout) {
  std::string what;
  const std::string op = absl::StrCat("ReduceScatter(", DTypeName(send.dtype()), ", ",
                                      recv.numel(), " elements per rank)");
  SMAT_RETURN_IF_ERROR(CheckHostTensor(send, "send", op));
  SMAT_RETURN_IF_ERROR(CheckHostTensor(recv, "recv", op));
  const int P = state_->size;
  if (recv.dtype() != send.dtype() || send.numel() != recv.numel() * P) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": send must be ", DTypeName(recv.dtype()), " with size * ", recv.numel(), " = ",
        recv.numel() * P, " elements; got ", send.DebugString()));
  }
  SMAT_RETURN_IF_ERROR(BeginCall(*state_, &what, op));
  const DType dt = send.dtype();
  const int n = static_cast<int>(recv.numel());
  // gathered: (P, n) the blocks every rank holds for this rank.
  SMAT_ASSIGN_OR_RETURN(Tensor gathered, Tensor::Empty({std::max<int64_t>(1, int64_t{P} * n)}, dt));
  auto handle = std::make_unique<MpiHandle>(state_, what, timeout,
                                            std::vector<Tensor>{send, recv, gathered});
  MPI_Datatype type = MpiType(dt);
  MPI_Comm comm = state_->comm;
  std::vector<MpiHandle::Stage> stages;
  stages.push_back({[=](MPI_Request* req) {
    return CheckMpi(MPI_Ialltoall(send.raw(), n, type, gathered.raw(), n, type, comm, req),
                    "MPI_Ialltoall");
  }});
  // The sum is a last stage with no message (a null request tests complete at
  // once), so Wait returns only once recv holds the result.
  stages.push_back({[=](MPI_Request* req) {
    FixedOrderSum(dt, gathered.raw(), P, n, recv.raw());
    *req = MPI_REQUEST_NULL;  // MPI_Test on a null request completes at once
    return absl::OkStatus();
  }});
  SMAT_RETURN_IF_ERROR(handle->Begin(std::move(stages)));
  return std::unique_ptr<CollectiveHandle>(std::move(handle));
}

absl::StatusOr<std::unique_ptr<CollectiveHandle>> MpiCommunicator::StartBroadcast(
    Tensor& data, int root, absl::Duration timeout) {
  std::string what;
  const std::string op = absl::StrCat("Broadcast(", DTypeName(data.dtype()), ", ", data.numel(),
                                      " elements, root ", root, ")");
  SMAT_RETURN_IF_ERROR(CheckHostTensor(data, "data", op));
  if (root < 0 || root >= state_->size) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": root must be in [0, ", state_->size, ")"));
  }
  SMAT_RETURN_IF_ERROR(BeginCall(*state_, &what, op));
  auto handle = std::make_unique<MpiHandle>(state_, what, timeout, std::vector<Tensor>{data});
  MPI_Datatype type = MpiType(data.dtype());
  MPI_Comm comm = state_->comm;
  const int n = static_cast<int>(data.numel());
  SMAT_RETURN_IF_ERROR(handle->Begin({{[=](MPI_Request* req) {
    return CheckMpi(MPI_Ibcast(data.raw(), n, type, root, comm, req), "MPI_Ibcast");
  }}}));
  return std::unique_ptr<CollectiveHandle>(std::move(handle));
}

absl::StatusOr<std::unique_ptr<CollectiveHandle>> MpiCommunicator::StartBarrier(
    absl::Duration timeout) {
  std::string what;
  SMAT_RETURN_IF_ERROR(BeginCall(*state_, &what, "Barrier"));
  auto handle = std::make_unique<MpiHandle>(state_, what, timeout, std::vector<Tensor>{});
  MPI_Comm comm = state_->comm;
  SMAT_RETURN_IF_ERROR(handle->Begin({{[=](MPI_Request* req) {
    return CheckMpi(MPI_Ibarrier(comm, req), "MPI_Ibarrier");
  }}}));
  return std::unique_ptr<CollectiveHandle>(std::move(handle));
}

absl::StatusOr<std::unique_ptr<MpiCommunicator>> MpiCommunicator::SplitMpi(int color, int key) {
  SMAT_RETURN_IF_ERROR(Barrier());
  MPI_Comm child = MPI_COMM_NULL;
  SMAT_RETURN_IF_ERROR(CheckMpi(MPI_Comm_split(state_->comm, color, key, &child),
                                "MpiCommunicator::Split: MPI_Comm_split"));
  auto result = Create(child, state_->options);
  MPI_Comm_free(&child);  // Create made its own duplicate
  return result;
}

absl::StatusOr<std::unique_ptr<Communicator>> MpiCommunicator::Split(int color, int key) {
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<MpiCommunicator> c, SplitMpi(color, key));
  return std::unique_ptr<Communicator>(std::move(c));
}

}  // namespace smat
