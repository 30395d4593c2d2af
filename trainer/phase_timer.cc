// Per-phase step timing (phase_timer.h).
#include "trainer/phase_timer.h"

#include <cstdlib>

#include "absl/strings/str_format.h"

namespace smat {

PhaseTimes::PhaseTimes() {
  const char* v = std::getenv("SMAT_PHASE_TIMES");
  enabled_ = v != nullptr && std::string(v) == "1";
}

PhaseTimes& GlobalPhaseTimes() {
  static PhaseTimes* t = new PhaseTimes();
  return *t;
}

void PhaseTimes::Add(const std::string& phase, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  seconds_[phase] += seconds;
}

void PhaseTimes::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  seconds_.clear();
}

std::string PhaseTimes::Report(int64_t steps) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!enabled_ || seconds_.empty() || steps <= 0) return "";
  auto it = seconds_.find("step");
  const double step = it == seconds_.end() ? 0.0 : it->second;
  std::string out = absl::StrFormat("phase times over %d steps (SMAT_PHASE_TIMES=1, synchronised):\n",
                                    steps);
  for (const auto& [phase, s] : seconds_) {
    absl::StrAppendFormat(&out, "  %-28s %9.2f ms/step %6.1f%%\n", phase, 1e3 * s / steps,
                          step > 0 ? 100.0 * s / step : 0.0);
  }
  return out;
}

PhaseScope::PhaseScope(Backend& backend, const char* phase) : phase_(phase) {
  if (!GlobalPhaseTimes().enabled()) return;
  backend_ = &backend;
  (void)backend_->Synchronize(nullptr);
  start_ = std::chrono::steady_clock::now();
}

PhaseScope::~PhaseScope() {
  if (backend_ == nullptr) return;
  (void)backend_->Synchronize(nullptr);
  GlobalPhaseTimes().Add(
      phase_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
}

}  // namespace smat
