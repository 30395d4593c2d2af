// smat_bench: speed of smat's kernels.
//
//   smat_bench smat --device cpu --T 65536 --d 2 [--batch 1 --heads 1 --r 64 --dv 64
//                   --chunk 64 --q 0 --gated --dtype fp32 --reps 5 --warmup 1]
//   smat_bench smat --device cpu --sweep           # T = 16K..256K, d = 1, 2, 3
//   mpirun -np 2 smat_bench smat --sp --device cuda --T 524288 ...   # T per rank
//                   [--comm auto|mpi|nccl --baseline_ms MS]  (tools/smat_bench_sp.h)
//
//   smat_bench decode --device cuda --T T --d D --heads 8 --r 64 --dv 64 [--window C_DC
//                     --batch --chunk --q --gated --dtype fp32|bf16 --reps N --warmup N]
//
// decode: the decoders' per-token cost (tools/smat_bench_decode.h).
//
// smat: prints the median time of the SMat op's forward and forward+backward and the
// tokens per second; --sweep prints a Markdown table showing the cost per token
// staying flat as T grows (the op is linear in T for d <= 3, Theorem 3.2).
// Exit status: 0 on success, 1 when a benchmark fails, 2 for bad usage.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "tools/smat_bench_cuda.h"
#include "tools/smat_bench_decode.h"
#include "tools/smat_bench_smat.h"
#include "tools/smat_bench_sp.h"

ABSL_FLAG(std::string, device, "cpu", "cpu, cuda or cuda:N");
ABSL_FLAG(int64_t, T, 65536, "sequence length");
ABSL_FLAG(int32_t, d, 2, "VC dimension of the mask (--sweep runs d = 1, 2, 3)");
ABSL_FLAG(int64_t, batch, 1, "sequences per batch");
ABSL_FLAG(int64_t, heads, 1, "attention heads");
ABSL_FLAG(int64_t, r, 64, "feature dimension r");
ABSL_FLAG(int64_t, dv, 64, "value dimension dv");
ABSL_FLAG(int64_t, chunk, 64, "chunk width c");
ABSL_FLAG(int64_t, q, 0, "prime field size; 0 picks it from T and d");
ABSL_FLAG(bool, gated, false, "random log-gates (gated SMat, Lemma 4)");
ABSL_FLAG(std::string, dtype, "fp32", "fp32 or bf16 (phi, psi, v)");
ABSL_FLAG(std::string, do_dtype, "",
          "fp32 or bf16: the backward's output gradient d_o (default: --dtype, the dtype of o)");
ABSL_FLAG(int32_t, reps, 5, "timed runs (the median is reported)");
ABSL_FLAG(int32_t, warmup, 1, "untimed runs first");
ABSL_FLAG(bool, sweep, false, "table over T = 16K, 32K, 64K, 128K, 256K and d = 1, 2, 3");
ABSL_FLAG(bool, backward, true, "also time forward+backward");
ABSL_FLAG(bool, sp, false,
          "sequence-parallel weak scaling under mpirun: --T is tokens per rank, the sequence has "
          "(ranks x T) tokens");
ABSL_FLAG(std::string, comm, "auto", "with --sp: auto (nccl on cuda, mpi on cpu), mpi or nccl");
ABSL_FLAG(double, baseline_ms, 0,
          "with --sp: forward+backward ms of the 1-rank run; prints efficiency = baseline / time");
ABSL_FLAG(double, baseline_fwd_ms, 0, "with --sp: forward ms of the 1-rank run");
ABSL_FLAG(int64_t, window, 0,
          "decode: stepped-window block length c_dc (a multiple of --chunk; the geometry is "
          "planned for T_max = --T); 0: the fixed-horizon decoder over --T tokens");

namespace smat {
namespace {

constexpr char kUsage[] =
    "times smat kernels.\n"
    "  smat_bench smat --device cpu --T T --d D [--batch --heads --r --dv --chunk --q --gated\n"
    "                  --dtype fp32|bf16 --do_dtype fp32|bf16 --reps N --warmup N] [--sweep]\n"
    "  mpirun -np W smat_bench smat --sp --device cuda|cpu --T T_PER_RANK --d D [...]\n"
    "                  [--comm auto|mpi|nccl --baseline_ms MS --baseline_fwd_ms MS]\n"
    "  smat_bench decode --device cuda|cpu --T T --d D [--window C_DC --batch --heads --r --dv\n"
    "                  --chunk --q --gated --dtype fp32|bf16 --reps N --warmup N]";

absl::StatusOr<SmatBenchConfig> ConfigFromFlags() {
  SmatBenchConfig cfg;
  cfg.batch = absl::GetFlag(FLAGS_batch);
  cfg.heads = absl::GetFlag(FLAGS_heads);
  cfg.r = absl::GetFlag(FLAGS_r);
  cfg.dv = absl::GetFlag(FLAGS_dv);
  cfg.chunk = absl::GetFlag(FLAGS_chunk);
  cfg.q = absl::GetFlag(FLAGS_q);
  cfg.gated = absl::GetFlag(FLAGS_gated);
  cfg.reps = absl::GetFlag(FLAGS_reps);
  cfg.warmup = absl::GetFlag(FLAGS_warmup);
  SMAT_ASSIGN_OR_RETURN(cfg.dtype, ParseDType(absl::GetFlag(FLAGS_dtype)));
  if (cfg.dtype != DType::kF32 && cfg.dtype != DType::kBF16) {
    return absl::InvalidArgumentError("--dtype: use fp32 or bf16");
  }
  cfg.do_dtype = cfg.dtype;
  if (const std::string x = absl::GetFlag(FLAGS_do_dtype); !x.empty()) {
    SMAT_ASSIGN_OR_RETURN(cfg.do_dtype, ParseDType(x));
    if (cfg.do_dtype != DType::kF32 && cfg.do_dtype != DType::kBF16) {
      return absl::InvalidArgumentError("--do_dtype: use fp32 or bf16");
    }
  }
  if (cfg.batch < 1 || cfg.heads < 1 || cfg.r < 1 || cfg.dv < 1) {
    return absl::InvalidArgumentError("--batch, --heads, --r and --dv must be >= 1");
  }
  return cfg;
}

absl::Status RunSmatBenchmarks(const SmatBenchConfig& cfg) {
  SMAT_ASSIGN_OR_RETURN(Device device, ParseDevice(absl::GetFlag(FLAGS_device)));
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateBackend(device));
  std::printf("# smat_bench on %s\n", backend->name().c_str());
  if (!device.is_cpu() && !absl::GetFlag(FLAGS_sweep)) {
    // GPU: phases timed on preallocated buffers against measured ceilings.
    return RunSmatBenchCuda(*backend, cfg, absl::GetFlag(FLAGS_T), absl::GetFlag(FLAGS_d),
                            absl::GetFlag(FLAGS_backward));
  }
  if (absl::GetFlag(FLAGS_sweep)) {
    SMAT_ASSIGN_OR_RETURN(std::string table,
                          SmatBenchSweep(*backend, cfg, {16384, 32768, 65536, 131072, 262144},
                                         {1, 2, 3}));
    std::printf("%s", table.c_str());
    return absl::OkStatus();
  }
  SMAT_ASSIGN_OR_RETURN(SmatBenchResult f,
                        BenchSmatForward(*backend, cfg, absl::GetFlag(FLAGS_T), absl::GetFlag(FLAGS_d)));
  std::printf("%s\n", FormatSmatBenchResult(f).c_str());
  if (absl::GetFlag(FLAGS_backward)) {
    SMAT_ASSIGN_OR_RETURN(SmatBenchResult fb, BenchSmatForwardBackward(*backend, cfg, absl::GetFlag(FLAGS_T),
                                                                       absl::GetFlag(FLAGS_d)));
    std::printf("%s\n", FormatSmatBenchResult(fb).c_str());
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2 ||
      (std::string(args[1]) != "smat" && std::string(args[1]) != "decode")) {
    std::fprintf(stderr, "smat_bench: expected the benchmark name \"smat\" or \"decode\"\n%s\n",
                 kUsage);
    return 2;
  }
  absl::StatusOr<SmatBenchConfig> cfg = ConfigFromFlags();
  if (!cfg.ok()) {
    std::fprintf(stderr, "smat_bench: %s\n", std::string(cfg.status().message()).c_str());
    return 2;
  }
  if (std::string(args[1]) == "decode") {
    absl::StatusOr<Device> device = ParseDevice(absl::GetFlag(FLAGS_device));
    if (!device.ok()) {
      std::fprintf(stderr, "smat_bench: %s\n", std::string(device.status().message()).c_str());
      return 2;
    }
    absl::Status s = RunDecodeBenchmark(*cfg, {.device = *device,
                                               .T = absl::GetFlag(FLAGS_T),
                                               .d = absl::GetFlag(FLAGS_d),
                                               .window = absl::GetFlag(FLAGS_window)});
    if (!s.ok()) {
      std::fprintf(stderr, "smat_bench decode: %s\n", std::string(s.message()).c_str());
      return absl::IsInvalidArgument(s) ? 2 : 1;
    }
    return 0;
  }
  if (absl::GetFlag(FLAGS_sp)) {
    absl::StatusOr<Device> device = ParseDevice(absl::GetFlag(FLAGS_device));
    if (!device.ok()) {
      std::fprintf(stderr, "smat_bench: %s\n", std::string(device.status().message()).c_str());
      return 2;
    }
    SpBenchOptions sp{.T_per_rank = absl::GetFlag(FLAGS_T),
                      .d = absl::GetFlag(FLAGS_d),
                      .device = *device,
                      .comm = absl::GetFlag(FLAGS_comm),
                      .baseline_ms = absl::GetFlag(FLAGS_baseline_ms),
                      .baseline_fwd_ms = absl::GetFlag(FLAGS_baseline_fwd_ms)};
    return RunSmatBenchSp(*cfg, sp);
  }
  absl::Status s = RunSmatBenchmarks(*cfg);
  if (!s.ok()) {
    std::fprintf(stderr, "smat_bench smat: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace smat

int main(int argc, char** argv) { return smat::Main(argc, argv); }
