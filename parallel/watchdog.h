// Watchdog: fails a phase of work that outlives its limit, for hangs that no
// collective deadline can see (a rank stuck in a blocking MPI call such as
// MPI_Comm_split or MPI_Finalize, in NCCL initialisation, or in a kernel that
// never returns). Collectives themselves already fail by their own deadline
// (communicator.h); the watchdog is the backstop around a whole step.
//
// One background thread per Watchdog. Arm(what, limit) starts the clock for a
// phase; Disarm() stops it. If the limit passes while armed, `on_expire`
// runs once on the watchdog's thread with a message naming the phase and the
// elapsed time. What it does is the owner's choice: smat_train prints the
// message and ends the job (AbortJob), which is what a launcher needs, since a
// hung rank can only be recovered by a restart.
//
//   Watchdog dog([](const std::string& msg) { AbortJob(absl::DeadlineExceededError(msg)); });
//   dog.Arm("training step 1200", absl::Seconds(300));
//   ... the step ...
//   dog.Disarm();
#pragma once

#include <functional>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace smat {

class Watchdog {
 public:
  explicit Watchdog(std::function<void(const std::string&)> on_expire);
  ~Watchdog();  // stops the thread; an armed phase is abandoned silently
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Starts (or restarts) the clock for `what`.
  void Arm(const std::string& what, absl::Duration limit);
  void Disarm();
  // Phases that expired so far.
  int expirations() const;

 private:
  void Run();

  std::function<void(const std::string&)> on_expire_;
  mutable absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::string what_ ABSL_GUARDED_BY(mu_);
  absl::Time armed_at_ ABSL_GUARDED_BY(mu_);
  absl::Time deadline_ ABSL_GUARDED_BY(mu_);
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumps on every Arm/Disarm
  int expirations_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace smat
