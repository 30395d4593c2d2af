// smat_op: runs one SMat-Attention operation on .npy files, for checking smat
// against other implementations (numpy, PyTorch) and for debugging.
//
//   smat_op forward  --in DIR --out DIR --d 2 [--q Q] [--chunk 64] [--eps 0]
//                    [--device cpu|cuda] [--dtype fp32|bf16]
//   smat_op backward --in DIR --out DIR --d 2 ...       (also reads do.npy)
//   smat_op decode   --in DIR --out DIR --d 2 [--window C_DC [--tmax T_MAX]]
//   smat_op plan     --T 4096 --d 2 [--chunk 64] [--q Q]  (prints the geometry as JSON)
//
// Inputs and outputs are described in tools/smat_op_run.h. Exit status: 0 on
// success, 1 when the operation fails (bad files, shapes, plan), 2 for bad usage.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "tools/smat_op_parallel.h"
#include "tools/smat_op_run.h"

ABSL_FLAG(std::string, in, "", "directory holding phi.npy, psi.npy, v.npy (+ logg, prof, type, do)");
ABSL_FLAG(std::string, out, "", "directory to write o.npy (+ dphi, dpsi, dv, dlogg) into");
ABSL_FLAG(int32_t, d, 0, "VC dimension d >= 1 of the SMat mask (required)");
ABSL_FLAG(int64_t, q, 0, "prime field size q; 0 picks it from T and d");
ABSL_FLAG(int64_t, chunk, 64, "chunk width c");
ABSL_FLAG(double, eps, 0.0, "o = ybar[:dv] / (ybar[dv] + eps) (default 0, as the op)");
ABSL_FLAG(int64_t, window, 0, "decode: stepped-window block length c_dc (0: fixed horizon)");
ABSL_FLAG(int64_t, tmax, 0, "decode --window: T_max the geometry is planned for (0: T of the inputs)");
ABSL_FLAG(std::string, device, "cpu", "cpu, cuda or cuda:N");
ABSL_FLAG(std::string, dtype, "fp32", "fp32 or bf16 (phi, psi, v)");
ABSL_FLAG(int64_t, T, 0, "plan: sequence length");

namespace smat {
namespace {

constexpr char kUsage[] =
    "runs one SMat-Attention operation on .npy files.\n"
    "  smat_op forward|backward|decode --in DIR --out DIR --d D [--q Q] [--chunk C] [--eps E]\n"
    "          [--window C_DC] [--tmax T_MAX] [--device cpu|cuda] [--dtype fp32|bf16]\n"
    "  smat_op plan --T T --d D [--chunk C] [--q Q]";

absl::Status RunPlan() {
  if (absl::GetFlag(FLAGS_T) < 1) {
    return absl::InvalidArgumentError("plan needs --T, the sequence length (>= 1)");
  }
  absl::StatusOr<SmatPlan> plan = MakeSmatPlan(absl::GetFlag(FLAGS_T), absl::GetFlag(FLAGS_d),
                                               absl::GetFlag(FLAGS_chunk), absl::GetFlag(FLAGS_q));
  if (!plan.ok()) return plan.status();
  std::printf("%s\n", SmatPlanJson(*plan).c_str());
  return absl::OkStatus();
}

absl::StatusOr<SmatOpConfig> ConfigFromFlags(const std::string& op) {
  SmatOpConfig cfg;
  SMAT_ASSIGN_OR_RETURN(cfg.mode, ParseSmatOpMode(op));
  cfg.d = absl::GetFlag(FLAGS_d);
  cfg.q = absl::GetFlag(FLAGS_q);
  cfg.chunk = absl::GetFlag(FLAGS_chunk);
  cfg.eps = static_cast<float>(absl::GetFlag(FLAGS_eps));
  cfg.window = absl::GetFlag(FLAGS_window);
  cfg.tmax = absl::GetFlag(FLAGS_tmax);
  SMAT_ASSIGN_OR_RETURN(cfg.device, ParseDevice(absl::GetFlag(FLAGS_device)));
  SMAT_ASSIGN_OR_RETURN(cfg.dtype, ParseDType(absl::GetFlag(FLAGS_dtype)));
  if (cfg.dtype != DType::kF32 && cfg.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype ", absl::GetFlag(FLAGS_dtype), ": use fp32 or bf16"));
  }
  if (cfg.d < 1) return absl::InvalidArgumentError("--d (the VC dimension, >= 1) is required");
  if (cfg.eps < 0) return absl::InvalidArgumentError("--eps must be >= 0");
  if (absl::GetFlag(FLAGS_in).empty() || absl::GetFlag(FLAGS_out).empty()) {
    return absl::InvalidArgumentError(absl::StrCat(op, " needs --in DIR and --out DIR"));
  }
  return cfg;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "smat_op: expected one operation (forward, backward, decode, plan)\n%s\n",
                 kUsage);
    return 2;
  }
  const std::string op = args[1];
  absl::Status status;
  if (op == "plan") {
    status = RunPlan();
  } else {
    absl::StatusOr<SmatOpConfig> cfg = ConfigFromFlags(op);
    if (!cfg.ok()) {
      std::fprintf(stderr, "smat_op: %s\n", std::string(cfg.status().message()).c_str());
      return 2;
    }
    // Under mpirun with several ranks: sequence-parallel (tools/smat_op_parallel.h).
    if (SmatOpLaunchedWorldSize() > 1) {
      return RunSmatOpUnderMpi(*cfg, absl::GetFlag(FLAGS_in), absl::GetFlag(FLAGS_out));
    }
    status = RunSmatOp(*cfg, absl::GetFlag(FLAGS_in), absl::GetFlag(FLAGS_out));
  }
  if (!status.ok()) {
    std::fprintf(stderr, "smat_op %s: %s\n", op.c_str(), std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace smat

int main(int argc, char** argv) { return smat::Main(argc, argv); }
