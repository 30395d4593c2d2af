// FaultPlan parsing and CommOptions from the environment (the parts of
// communicator.h that the NCCL plugin does not need).
#include "parallel/communicator.h"

#include <cstdlib>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "core/config.pb.h"

namespace smat {

absl::StatusOr<FaultPlan> ParseFaultPlan(const std::string& spec) {
  FaultPlan plan;
  if (spec.empty()) return plan;
  const std::string usage =
      "expected KIND:rank=R:call=C[:seconds=S] with KIND one of stall_in_collective, "
      "fail_collective, kill_in_collective, stop_in_collective";
  std::vector<std::string> parts = absl::StrSplit(spec, ':');
  const std::string& kind = parts[0];
  if (kind == "stall_in_collective") {
    plan.kind = FaultPlan::Kind::kStall;
  } else if (kind == "fail_collective") {
    plan.kind = FaultPlan::Kind::kFail;
  } else if (kind == "kill_in_collective") {
    plan.kind = FaultPlan::Kind::kKill;
  } else if (kind == "stop_in_collective") {
    plan.kind = FaultPlan::Kind::kStop;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("fault spec '", spec, "': unknown kind '", kind, "'; ", usage));
  }
  bool have_rank = false, have_call = false;
  for (size_t i = 1; i < parts.size(); ++i) {
    std::vector<std::string> kv = absl::StrSplit(parts[i], absl::MaxSplits('=', 1));
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("fault spec '", spec, "': '", parts[i], "' is not key=value; ", usage));
    }
    double value = 0;
    if (!absl::SimpleAtod(kv[1], &value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("fault spec '", spec, "': '", kv[1], "' is not a number"));
    }
    if (kv[0] == "rank") {
      plan.rank = static_cast<int>(value);
      have_rank = true;
    } else if (kv[0] == "call") {
      plan.call = static_cast<int64_t>(value);
      have_call = true;
    } else if (kv[0] == "seconds" && plan.kind == FaultPlan::Kind::kStall) {
      plan.stall = absl::Seconds(value);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("fault spec '", spec, "': unknown key '", kv[0], "'; ", usage));
    }
  }
  if (!have_rank || !have_call || plan.rank < 0 || plan.call < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("fault spec '", spec, "': needs rank >= 0 and call >= 1; ", usage));
  }
  return plan;
}

absl::StatusOr<CommOptions> CommOptions::FromEnvironment() {
  CommOptions options;
  if (const char* fault = std::getenv("SMAT_FAULT"); fault != nullptr) {
    SMAT_ASSIGN_OR_RETURN(options.fault, ParseFaultPlan(fault));
  }
  if (const char* t = std::getenv("SMAT_COLLECTIVE_TIMEOUT_S"); t != nullptr) {
    double seconds = 0;
    if (!absl::SimpleAtod(t, &seconds) || seconds <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SMAT_COLLECTIVE_TIMEOUT_S='", t, "' is not a positive number of seconds"));
    }
    options.timeout = absl::Seconds(seconds);
  }
  return options;
}

absl::StatusOr<CommOptions> CommOptions::FromConfig(const ParallelConfig& config) {
  SMAT_ASSIGN_OR_RETURN(CommOptions options, FromEnvironment());
  if (std::getenv("SMAT_COLLECTIVE_TIMEOUT_S") == nullptr && config.collective_timeout_seconds() > 0) {
    options.timeout = absl::Seconds(config.collective_timeout_seconds());
  }
  return options;
}

}  // namespace smat
