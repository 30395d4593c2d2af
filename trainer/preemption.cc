// Signal handlers for preemption and on-demand checkpoints (trainer/preemption.h).
//
// The flags are process-wide statics: a signal handler receives no context
// pointer, so this is the one place smat keeps global state on purpose.
#include "trainer/preemption.h"

#include <signal.h>

#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "parallel/communicator.h"

namespace smat {
namespace {

std::atomic<int> preempt_requested{0};
std::atomic<int> checkpoint_requested{0};
static_assert(std::atomic<int>::is_always_lock_free, "signal handlers need lock-free atomics");

void OnSignal(int sig) {
  if (sig == SIGTERM || sig == SIGUSR2) preempt_requested.store(1, std::memory_order_relaxed);
  if (sig == SIGUSR1) checkpoint_requested.store(1, std::memory_order_relaxed);
}

}  // namespace

absl::Status InstallPreemptionHandlers() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a write or read in flight continues after the handler
  for (int sig : {SIGTERM, SIGUSR1, SIGUSR2}) {
    if (::sigaction(sig, &sa, nullptr) != 0) {
      return absl::InternalError(
          absl::StrCat("sigaction(", strsignal(sig), ") failed: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

StopRequest TakeLocalStopRequest() {
  if (preempt_requested.load(std::memory_order_relaxed) != 0) return StopRequest::kPreempt;
  if (checkpoint_requested.exchange(0, std::memory_order_relaxed) != 0) {
    return StopRequest::kCheckpoint;
  }
  return StopRequest::kNone;
}

absl::StatusOr<StopRequest> AgreeOnStopRequest(Communicator& comm) {
  // Sum of one-hot counts: [checkpoint requests, preempt requests].
  int32_t counts[2] = {0, 0};
  const StopRequest local = TakeLocalStopRequest();
  if (local == StopRequest::kCheckpoint) counts[0] = 1;
  if (local == StopRequest::kPreempt) counts[1] = 1;
  Tensor t = Tensor::Wrap(counts, {2}, DType::kI32);
  SMAT_RETURN_IF_ERROR(Annotate(comm.AllReduce(t), "agreeing on a stop request"));
  if (counts[1] > 0) return StopRequest::kPreempt;
  if (counts[0] > 0) return StopRequest::kCheckpoint;
  return StopRequest::kNone;
}

void ClearStopRequests() {
  preempt_requested.store(0);
  checkpoint_requested.store(0);
}

}  // namespace smat
