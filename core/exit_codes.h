// Process exit codes of smat's binaries (smat_train first), in one place so the
// launcher that supervises a job (smat_launch) and the scripts around it can
// decide what to do from the code alone:
//
//   code  meaning                                         launcher action
//      0  finished                                        done
//      1  anything not classified below                   restart (bounded)
//      2  bad config, data file or shape (not retryable)  stop: a restart fails again
//      3  retryable failure: collective deadline, peer    restart from the newest
//         died, transport error                           intact checkpoint
//      4  loss became NaN or inf                          stop: same data, same result
//      5  preempted: SIGTERM, checkpoint written, exited  restart (the launcher itself
//         (trainer/preemption.h)                          stops when it got SIGTERM)
//
// ExitCodeForStatus maps the absl::Status a run ends with to one of these, by
// its code (see STYLE.md for what each status code tells the caller).
// Under mpirun the job's exit code is that of the first rank that failed.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/cord.h"

namespace smat {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitBadInput = 2;
inline constexpr int kExitRetryable = 3;
inline constexpr int kExitNonFiniteLoss = 4;
inline constexpr int kExitPreempted = 5;

// No status code means "the loss was not finite", so the loss check marks its
// status with this payload (MarkNonFiniteLoss). Annotate (core/status.h) builds
// a new status and drops payloads: pass a marked status up unannotated.
inline constexpr char kNonFiniteLossPayload[] = "smat.non_finite_loss";

inline absl::Status MarkNonFiniteLoss(absl::Status s) {
  s.SetPayload(kNonFiniteLossPayload, absl::Cord("1"));
  return s;
}

inline int ExitCodeForStatus(const absl::Status& s) {
  if (s.ok()) return kExitOk;
  if (s.GetPayload(kNonFiniteLossPayload).has_value()) return kExitNonFiniteLoss;
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kPermissionDenied:
      return kExitBadInput;
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
      return kExitRetryable;
    default:
      return kExitFailure;
  }
}

}  // namespace smat
