// Preemption and on-demand checkpoints through signals.
//
//   SIGTERM  (a scheduler preempting the ranks directly) or
//   SIGUSR2  (smat_launch's request, through mpirun, which forwards SIGUSR1/2
//            to every rank but answers SIGTERM itself by killing the job
//            within a second)
//            -> the loop checkpoints at the next step boundary and the process
//               exits with kExitPreempted (5, core/exit_codes.h).
//   SIGUSR1  -> the loop checkpoints at the next step boundary and goes on.
//
// The handlers only set an atomic flag (the one thing a handler may safely
// do); the loop polls it between steps. Ranks receive a signal at different
// moments, possibly in different steps, so the loop must agree before acting:
// AgreeOnStopRequest combines the flags of all ranks (one small AllReduce)
// and every rank then takes the same decision at the same step.
//
//   SMAT_RETURN_IF_ERROR(InstallPreemptionHandlers());
//   ... after each step:
//   SMAT_ASSIGN_OR_RETURN(StopRequest r, AgreeOnStopRequest(pg->host_world()));
//   if (r != StopRequest::kNone) save a checkpoint;
//   if (r == StopRequest::kPreempt) return a status that main maps to kExitPreempted;
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace smat {

class Communicator;

enum class StopRequest : int {
  kNone = 0,
  kCheckpoint = 1,  // SIGUSR1: checkpoint, continue
  kPreempt = 2,     // SIGTERM, SIGUSR2: checkpoint, exit kExitPreempted
};

// Installs the SIGTERM, SIGUSR1 and SIGUSR2 handlers (process-wide, as signal
// dispositions are; call once from main). kInternal if sigaction fails.
absl::Status InstallPreemptionHandlers();

// This process's pending request; kPreempt wins over kCheckpoint. Reading
// clears a kCheckpoint request (it is served once), never kPreempt.
StopRequest TakeLocalStopRequest();

// The strongest request of any rank of `comm` (AllReduce of one int32 over a
// host communicator); collective, called at the same step on every rank.
absl::StatusOr<StopRequest> AgreeOnStopRequest(Communicator& comm);

// For tests and for the loop's own bookkeeping: forget a served kPreempt.
void ClearStopRequests();

}  // namespace smat
