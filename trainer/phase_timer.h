// Where a training step's time goes, per phase, when SMAT_PHASE_TIMES=1 is in
// the environment: each PhaseScope synchronises the backend when it opens and
// when it closes and adds the wall time between to its phase. The
// synchronisation serialises host and device (a step gets slower), so it is a
// measuring mode only; without the variable a scope costs one branch.
// Nested scopes count in both ("backward" includes "backward.smat").
//
//   { PhaseScope scope(backend, "forward.smat"); ... }
//   std::string table = PhaseTimes().Report(steps);
#pragma once

#include <chrono>
#include <map>
#include <mutex>
#include <string>

#include "kernels/backend.h"

namespace smat {

class PhaseTimes {
 public:
  bool enabled() const { return enabled_; }
  void Add(const std::string& phase, double seconds);
  // "phase  ms/step  share" lines, phases sorted by name, over `steps` steps;
  // shares against the phase "step". Empty when disabled or nothing was timed.
  std::string Report(int64_t steps) const;
  void Reset();

 private:
  friend PhaseTimes& GlobalPhaseTimes();
  PhaseTimes();
  bool enabled_ = false;
  mutable std::mutex mu_;
  std::map<std::string, double> seconds_;
};

// The process's timer (SMAT_PHASE_TIMES read once).
PhaseTimes& GlobalPhaseTimes();

class PhaseScope {
 public:
  PhaseScope(Backend& backend, const char* phase);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  Backend* backend_ = nullptr;  // null: timing off
  const char* phase_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace smat
