// The GPU path of `smat_bench smat --device cuda`: the SMat phases timed one by
// one with device events on buffers allocated once (so allocation never lands
// in the timings), warm-up first, median of at least 20 runs, next to the two
// ceilings measured in the same run (device-to-device copy bandwidth; bf16 and
// fp32 GEMM rates through Backend::Gemm), with each phase's byte and FLOP
// counts, GB/s, TFLOP/s and the fraction of the roofline it reaches.
//
//   smat_bench smat --device cuda --T 524288 --d 2 --heads 8 --r 64 --dv 64
//       --chunk 128 --dtype bf16 --backward
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "tools/smat_bench_smat.h"

namespace smat {

// Prints the ceilings, a per-phase table (forward; with `backward`, backward
// too) and one summary line per pass to stdout.
absl::Status RunSmatBenchCuda(Backend& gpu, const SmatBenchConfig& cfg, int64_t T, int d,
                              bool backward);

}  // namespace smat
