// Pieces every smat_bench benchmark uses: the median of a sample, a wall
// clock, reproducible random inputs on a backend's device, and the device's
// copy bandwidth (the memory ceiling the GPU benchmarks compare against).
//
//   SMAT_ASSIGN_OR_RETURN(Tensor phi, RandomOnDevice(gpu, {T, H, r}, DType::kBF16, 1, 0.f, 1.f));
//   SMAT_ASSIGN_OR_RETURN(double bytes_per_s, CopyBandwidth(gpu));
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tensor.h"
#include "kernels/backend.h"

namespace smat {

// Median of v (the mean of the two middle values for an even count); 0 when empty.
double Median(std::vector<double> v);

// Seconds on a monotonic clock.
double NowSeconds();

// Uniform random values in [lo, hi) from Philox (seed, so a run is
// reproducible), made on the host in fp32, converted to `dtype` and moved to
// the backend's device (returned as is on the CPU backend). On a device, a
// tensor of more than 2^26 elements repeats its first 2^26 values.
absl::StatusOr<Tensor> RandomOnDevice(Backend& backend, Shape shape, DType dtype, uint64_t seed,
                                      float lo, float hi);

// Device-to-device copy of 256 MiB: bytes read + written per second, median of
// 5 timed copies after one warm-up, timed with the backend's events.
absl::StatusOr<double> CopyBandwidth(Backend& backend);

}  // namespace smat
