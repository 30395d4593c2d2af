// smat_bench decode: the per-token cost of the backend's decoders.
//
// Steps the device's decoder (Backend::CreateDecoder; fixed horizon, or
// the stepped window with --window) through every position up to the end of T
// (the fast-forward: untimed except its tabulation steps), then times the last
// positions with device events: back-to-back steps (the decode loop's rate) and
// isolated steps (the stream idle before each). Prints us/token, the state
// traffic's GB/s against the device copy bandwidth measured in the same run,
// the tabulation steps, and peak device memory.
//
//   smat_bench decode --device cuda --T 1048576 --d 2 --heads 8 --r 64 --dv 64 [--window C_DC]
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "core/tensor.h"
#include "tools/smat_bench_smat.h"

namespace smat {

struct DecodeBenchOptions {
  Device device = Device::Cpu();
  int64_t T = 0;       // the decoders' horizon (fixed) or T_max (stepped window)
  int d = 2;
  int64_t window = 0;  // stepped-window block length c_dc; 0: the fixed-horizon decoder
};

// Runs the benchmark and prints its report (batch, heads, r, dv, chunk, q,
// gated, dtype, reps and warmup from cfg; at least 30 reps and 10 warm-up steps).
absl::Status RunDecodeBenchmark(const SmatBenchConfig& cfg, const DecodeBenchOptions& opt);

}  // namespace smat
