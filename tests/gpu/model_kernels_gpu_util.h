// The fixture and comparisons of the CUDA model-kernel tests
// (model_kernels_gpu_test.cc, model_kernels_bf16_gpu_test.cc,
// model_kernels_timing_gpu_test.cc, cuda_allocator_test.cc): both backends'
// ModelKernels, random host inputs, NaN-poisoned device outputs, and bitwise /
// close comparisons against the CPU.
// The fixture lives in a named namespace so that every file's tests share one
// test suite type.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/model_kernels.h"

namespace smat {
namespace gpu_test {

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

class ModelKernelsGpuTest : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    auto g = gpu_->model();
    ASSERT_TRUE(g.ok()) << g.status();
    gmk_ = *g;
    auto c = cpu_->model();
    ASSERT_TRUE(c.ok()) << c.status();
    cmk_ = *c;
  }

  // Host fp32 tensor of uniform values in [-scale, scale].
  static Tensor Random(const Shape& shape, uint32_t seed, float scale = 1.f) {
    std::vector<float> v = RandomUniform(NumElements(shape), seed);
    for (float& x : v) x *= scale;
    return HostTensor(shape, DType::kF32, v);
  }
  static Tensor Ids(int64_t n, int64_t V, uint32_t seed) {
    Tensor t = Tensor::Empty({n}, DType::kI32).value();
    std::mt19937 rng(seed);
    // Skewed: low ids repeat often (long runs in the scatter-add), as bytes do.
    std::uniform_int_distribution<int64_t> d(0, V - 1), small(0, 7);
    for (int64_t i = 0; i < n; ++i) t.data<int32_t>()[i] = static_cast<int32_t>(i % 3 ? d(rng) : small(rng));
    return t;
  }
  Tensor Dev(const Tensor& host) { return ToDevice(*gpu_, host).value(); }
  Tensor Host(const Tensor& dev) { return ToHost(*gpu_, dev).value(); }
  // A device tensor filled with NaN (or another value), ready to be written.
  Tensor Poisoned(const Shape& shape, double value = kNaN) {
    Tensor t = Tensor::Empty(shape, DType::kF32, gpu_->allocator()).value();
    SMAT_CHECK(gpu_->Fill(t, value).ok());
    return t;
  }
  static Tensor Clone(const Tensor& host) {
    Tensor t = Tensor::Empty(host.shape(), host.dtype()).value();
    std::memcpy(t.raw(), host.raw(), host.nbytes());
    return t;
  }

  ModelKernels* gmk_ = nullptr;
  ModelKernels* cmk_ = nullptr;
};

inline double MaxAbs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(double{t.data<float>()[i]}));
  return m;
}

// got (a host copy of the GPU result) equals want bit for bit.
inline void ExpectBitwise(const Tensor& got, const Tensor& want, const char* what) {
  ASSERT_EQ(got.nbytes(), want.nbytes()) << what;
  ASSERT_GT(got.numel(), 0) << what;
  if (want.dtype() == DType::kF32) {
    ASSERT_GT(MaxAbs(want), 0) << what << ": the reference is all zero, the test proves nothing";
  }
  const uint8_t* g = static_cast<const uint8_t*>(got.raw());
  const uint8_t* w = static_cast<const uint8_t*>(want.raw());
  if (std::memcmp(g, w, got.nbytes()) == 0) return;
  const size_t es = DTypeSize(got.dtype());
  for (size_t i = 0; i < got.nbytes(); i += es) {
    if (std::memcmp(g + i, w + i, es) != 0) {
      if (got.dtype() == DType::kF32) {
        FAIL() << what << ": element " << i / es << " is " << got.data<float>()[i / es]
               << ", CPU " << want.data<float>()[i / es];
      }
      FAIL() << what << ": element " << i / es << " differs";
    }
  }
}

// |got - want| <= rtol |want| + atol_frac max|want| for every element (NaN fails).
inline void ExpectClose(const Tensor& got, const Tensor& want, double rtol, double atol_frac,
                 const char* what) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  const double scale = MaxAbs(want);
  ASSERT_GT(scale, 0) << what << ": the reference is all zero, the test proves nothing";
  const float* g = got.data<float>();
  const float* w = want.data<float>();
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double tol = rtol * std::fabs(double{w[i]}) + atol_frac * scale;
    ASSERT_TRUE(std::fabs(double{g[i]} - w[i]) <= tol)
        << what << ": element " << i << " is " << g[i] << ", CPU " << w[i] << " (tolerance "
        << tol << ")";
  }
}

inline void ExpectSameBits(const Tensor& a, const Tensor& b, const char* what) {
  ASSERT_EQ(a.nbytes(), b.nbytes());
  EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << what << ": two runs differ";
}

}  // namespace gpu_test
}  // namespace smat
