// Shared pieces of smat_bench (see smat_bench_util.h).
#include "tools/smat_bench_util.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <utility>

#include "core/convert.h"
#include "core/rng.h"
#include "core/status.h"

namespace smat {
namespace {

// Values generated on the host for one RandomOnDevice call, at most (256 MiB
// of fp32).
constexpr int64_t kRandomBlockElements = int64_t{1} << 26;

}  // namespace

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t k = v.size() / 2;
  return v.size() % 2 ? v[k] : 0.5 * (v[k - 1] + v[k]);
}

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::StatusOr<Tensor> RandomOnDevice(Backend& backend, Shape shape, DType dtype, uint64_t seed,
                                      float lo, float hi) {
  const int64_t numel = NumElements(shape);
  const bool tiled = !backend.device().is_cpu() && numel > kRandomBlockElements;
  SMAT_ASSIGN_OR_RETURN(Tensor host,
                        Tensor::Empty({tiled ? kRandomBlockElements : numel}, DType::kF32));
  SMAT_RETURN_IF_ERROR(FillUniform(host, seed, 0, lo, hi));
  if (dtype != DType::kF32) {
    SMAT_ASSIGN_OR_RETURN(host, ConvertDType(host, dtype));
  }
  if (backend.device().is_cpu()) return host.View(0, shape);
  SMAT_ASSIGN_OR_RETURN(Tensor dev, Tensor::Empty(std::move(shape), dtype, backend.allocator()));
  // Above one block the device tensor repeats the block: generating billions
  // of values on one host core took minutes at T = 4M, and the timings do not
  // depend on the values.
  Tensor flat = dev.View(0, {numel});
  for (int64_t at = 0; at < numel; at += host.numel()) {
    const int64_t n = std::min(host.numel(), numel - at);
    Tensor dst = flat.View(at, {n});
    SMAT_RETURN_IF_ERROR(backend.Copy(host.View(0, {n}), dst));
  }
  SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  return dev;
}

absl::StatusOr<double> CopyBandwidth(Backend& backend) {
  constexpr int64_t kFloats = int64_t{64} << 20;  // 256 MiB each way
  SMAT_ASSIGN_OR_RETURN(Tensor src, Tensor::Empty({kFloats}, DType::kF32, backend.allocator()));
  SMAT_ASSIGN_OR_RETURN(Tensor dst, Tensor::Empty({kFloats}, DType::kF32, backend.allocator()));
  SMAT_RETURN_IF_ERROR(backend.Fill(src, 1.0));
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> a, backend.CreateEvent());
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> b, backend.CreateEvent());
  std::vector<double> ms;
  for (int i = 0; i < 6; ++i) {
    SMAT_RETURN_IF_ERROR(backend.Record(*a, nullptr));
    SMAT_RETURN_IF_ERROR(backend.Copy(src, dst));
    SMAT_RETURN_IF_ERROR(backend.Record(*b, nullptr));
    SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
    SMAT_ASSIGN_OR_RETURN(float t, backend.ElapsedMs(*a, *b));
    if (i > 0) ms.push_back(t);
  }
  return 2.0 * static_cast<double>(src.nbytes()) / (Median(ms) * 1e-3);
}

}  // namespace smat
