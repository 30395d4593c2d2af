// The SMat-Attention benchmarks of smat_bench: one function per benchmark,
// timed with the backend's events (host time on the CPU backend; a CUDA
// backend records device events), median of `reps` runs after `warmup` runs,
// with the process CPU time of each run beside it.
//
//   SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Backend> be, CreateBackend(Device::Cpu()));
//   SMAT_ASSIGN_OR_RETURN(SmatBenchResult r, BenchSmatForward(*be, cfg, /*T=*/65536, /*d=*/2));
//   std::printf("%s\n", FormatSmatBenchResult(r).c_str());
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/backend.h"

namespace smat {

struct SmatBenchConfig {
  int64_t batch = 1;
  int64_t heads = 1;
  int64_t r = 64;
  int64_t dv = 64;
  int64_t chunk = 64;
  int64_t q = 0;       // 0: picked from (T, d)
  bool gated = false;  // random log-gates in [-0.05, 0]
  DType dtype = DType::kF32;  // phi, psi, v
  // The output gradient d_o of the backward: the op's o is in `dtype` (bf16
  // for bf16 inputs, as the trainer passes it); fp32 as an option.
  DType do_dtype = DType::kF32;
  int reps = 5;
  int warmup = 1;
  uint64_t seed = 1;
};

struct SmatBenchResult {
  std::string what;  // "forward", "forward+backward"
  SmatPlan plan;
  SmatBenchConfig cfg;
  double median_ms = 0;
  double min_ms = 0;
  double cpu_median_ms = 0;  // median process CPU time (all threads) per run
  double tokens_per_s = 0;  // batch * T / median
};

// Forward of the SMat op (kernels/smat.h) on random inputs of length T.
absl::StatusOr<SmatBenchResult> BenchSmatForward(Backend& backend, const SmatBenchConfig& cfg,
                                                 int64_t T, int d);
// Forward followed by backward (random upstream gradient).
absl::StatusOr<SmatBenchResult> BenchSmatForwardBackward(Backend& backend,
                                                         const SmatBenchConfig& cfg, int64_t T,
                                                         int d);

// "smat forward  T=65536 d=2 q=..., B=... : 12.3 ms (median of 5), 5.3e6 tokens/s"
std::string FormatSmatBenchResult(const SmatBenchResult& r);

// The linear-cost sweep: forward and forward+backward for every T in Ts and d
// in ds, as a Markdown table of median and minimum times (ns per token stays
// flat when the cost is linear).
absl::StatusOr<std::string> SmatBenchSweep(Backend& backend, const SmatBenchConfig& cfg,
                                           const std::vector<int64_t>& Ts,
                                           const std::vector<int>& ds);

}  // namespace smat
