// Watchdog: a thread that sleeps until the armed deadline (or a change of
// phase) and reports a phase that outlived its limit.
#include "parallel/watchdog.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace smat {

Watchdog::Watchdog(std::function<void(const std::string&)> on_expire)
    : on_expire_(std::move(on_expire)), thread_([this] { Run(); }) {}

Watchdog::~Watchdog() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void Watchdog::Arm(const std::string& what, absl::Duration limit) {
  absl::MutexLock lock(&mu_);
  armed_ = true;
  what_ = what;
  armed_at_ = absl::Now();
  deadline_ = armed_at_ + limit;
  ++generation_;
}

void Watchdog::Disarm() {
  absl::MutexLock lock(&mu_);
  armed_ = false;
  ++generation_;
}

int Watchdog::expirations() const {
  absl::MutexLock lock(&mu_);
  return expirations_;
}

void Watchdog::Run() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    const int64_t gen = generation_;
    auto changed = [this, gen]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return stop_ || generation_ != gen;
    };
    if (!armed_) {
      mu_.Await(absl::Condition(&changed));
    } else {
      // Wakes at the deadline unless the phase changes first.
      mu_.AwaitWithDeadline(absl::Condition(&changed), deadline_);
    }
    if (stop_) return;
    if (generation_ != gen || !armed_ || absl::Now() < deadline_) continue;
    armed_ = false;  // one report per phase
    ++expirations_;
    const std::string msg = absl::StrFormat(
        "watchdog: %s did not finish within %s (elapsed %.3f s): this rank is hung; end the "
        "job so the launcher restarts it",
        what_, absl::FormatDuration(deadline_ - armed_at_),
        absl::ToDoubleSeconds(absl::Now() - armed_at_));
    mu_.Unlock();  // the callback may end the process or call Arm/Disarm
    on_expire_(msg);
    mu_.Lock();
  }
}

}  // namespace smat
