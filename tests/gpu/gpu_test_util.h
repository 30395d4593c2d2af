// Helpers for the GPU tests: obtaining the CUDA backend (skipping loudly, or
// failing when SMAT_REQUIRE_GPU=1 says a GPU must be there), moving tensors
// between host and device, random inputs, and the GEMM error measure.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/status.h"
#include "core/tensor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace smat {
namespace gpu_test {

// scripts/gpu_check.sh sets SMAT_REQUIRE_GPU=1: on a GPU host a backend that
// fails to load is a failure, not a skip.
inline bool RequireGpu() {
  const char* v = std::getenv("SMAT_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

// Whether libcublas is mapped into this process (PLATFORM.md: it must not be
// at start-up; it is once the CUDA backend has been loaded).
inline bool CublasMapped() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("libcublas") != std::string::npos) return true;
  }
  return false;
}

// Host tensor <-> vector<float> (bf16 tensors round the values).
inline Tensor HostTensor(const Shape& shape, DType dtype, const std::vector<float>& values) {
  Tensor t = Tensor::Empty(shape, dtype).value();
  SMAT_CHECK(static_cast<int64_t>(values.size()) == t.numel());
  if (dtype == DType::kF32) {
    std::memcpy(t.raw(), values.data(), t.nbytes());
  } else {
    SMAT_CHECK(dtype == DType::kBF16);
    for (size_t i = 0; i < values.size(); ++i) t.data<uint16_t>()[i] = FloatToBf16(values[i]);
  }
  return t;
}

inline std::vector<float> FloatValues(const Tensor& host) {
  std::vector<float> v(static_cast<size_t>(host.numel()));
  if (host.dtype() == DType::kF32) {
    std::memcpy(v.data(), host.raw(), host.nbytes());
  } else {
    for (size_t i = 0; i < v.size(); ++i) v[i] = Bf16ToFloat(host.data<uint16_t>()[i]);
  }
  return v;
}

inline std::vector<float> RandomUniform(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// Integers in [-range, range].
inline std::vector<float> RandomIntegers(int64_t n, int range, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-range, range);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(dist(rng));
  return v;
}

// A device copy of a host tensor, and a host copy of a device tensor (both
// synchronise, so the result is ready to use).
inline absl::StatusOr<Tensor> ToDevice(Backend& gpu, const Tensor& host) {
  SMAT_ASSIGN_OR_RETURN(Tensor d, Tensor::Empty(host.shape(), host.dtype(), gpu.allocator()));
  SMAT_RETURN_IF_ERROR(gpu.Copy(host, d));
  SMAT_RETURN_IF_ERROR(gpu.Synchronize(nullptr));
  return d;
}

inline absl::StatusOr<Tensor> ToHost(Backend& gpu, const Tensor& device) {
  SMAT_ASSIGN_OR_RETURN(Tensor h, Tensor::Empty(device.shape(), device.dtype()));
  SMAT_RETURN_IF_ERROR(gpu.Copy(device, h));
  SMAT_RETURN_IF_ERROR(gpu.Synchronize(nullptr));
  return h;
}

#define SMAT_ASSERT_OK(expr)                  \
  do {                                        \
    const ::absl::Status smat_s_ = (expr);    \
    ASSERT_TRUE(smat_s_.ok()) << smat_s_;     \
  } while (0)

// Declares `lhs` from a StatusOr, failing the test on an error.
#define SMAT_ASSERT_OK_AND_ASSIGN(lhs, rexpr)                                      \
  SMAT_ASSERT_OK_AND_ASSIGN_IMPL_(SMAT_STATUS_CONCAT_(smat_assert_, __LINE__), lhs, rexpr)
#define SMAT_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                    \
  ASSERT_TRUE(tmp.ok()) << tmp.status();                 \
  lhs = std::move(tmp).value()

// The test fixture: a CPU backend (the reference) and the CUDA backend, or a
// loud skip naming why there is none.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cpu_ = CreateBackend(Device::Cpu()).value();
    absl::StatusOr<std::unique_ptr<Backend>> gpu = CreateBackend(Device::Cuda(0));
    if (!gpu.ok()) {
      if (RequireGpu()) {
        FAIL() << "SMAT_REQUIRE_GPU=1 but the CUDA backend did not load: " << gpu.status();
      }
      GTEST_SKIP() << "no CUDA backend on this machine, GPU test skipped: " << gpu.status();
    }
    gpu_ = std::move(*gpu);
  }

  std::unique_ptr<Backend> cpu_;
  std::unique_ptr<Backend> gpu_;
};

}  // namespace gpu_test
}  // namespace smat
