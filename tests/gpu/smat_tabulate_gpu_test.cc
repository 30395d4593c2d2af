// The incidence tabulation of Algorithm 2 (SmatKernels::Tabulate) and its
// adjoint (TabulateBackward) on the GPU against the CPU phases, bit for bit:
// every GPU kernel sums in the CPU's order (the points of a type in
// increasing index, the types through a point by direction), so the fp32
// results must be identical, not merely close. d = 3 runs the kernels that
// work from the plane's geometry (smat_tabulate.cu), up to the benchmark's
// q = 67 (T = 524288) and q = 113, the largest plane that fits; the forward
// and the adjoint both by slopes (smat_tabulate_slopes.cu, q = 31, 53, 67,
// 113: whole aligned rows) and a line (point) per thread
// (SMAT_CUDA_TABULATE=lines, and q = 2, 13, the fields the slopes do not
// serve); d = 2 and d = 4, and every d under
// SMAT_CUDA_GROUPED=general (the gpu_smat_general_test variant), the
// incidence-list kernels. Rows of 35 floats leave the last column tile of a
// block partial, rows of 6 fill less than one, rows of 36 and 8 are whole
// aligned tiles (the plane kernels' 16-byte loads and stores); outputs are
// NaN-poisoned.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/smat_kernels.h"
#include "tests/gpu/gpu_test_util.h"

namespace smat {
namespace {

using gpu_test::GpuTest;
using gpu_test::HostTensor;
using gpu_test::RandomUniform;
using gpu_test::ToDevice;
using gpu_test::ToHost;

class SmatTabulateGpuTest : public GpuTest {
 protected:
  // Runs `run` on both backends from the same random input of `in_shape`
  // into a fresh output of `out_shape`; expects identical bits.
  template <typename Run>
  void ExpectSameBits(const char* what, const Shape& in_shape, const Shape& out_shape,
                      uint32_t seed, Run run) {
    SMAT_ASSERT_OK_AND_ASSIGN(SmatKernels * ck, cpu_->smat());
    SMAT_ASSERT_OK_AND_ASSIGN(SmatKernels * gk, gpu_->smat());
    const Tensor in = HostTensor(in_shape, DType::kF32, RandomUniform(NumElements(in_shape), seed));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor out_cpu, Tensor::Empty(out_shape, DType::kF32));
    SMAT_ASSERT_OK(run(*ck, in, &out_cpu));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor in_dev, ToDevice(*gpu_, in));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor out_dev,
                              Tensor::Empty(out_shape, DType::kF32, gpu_->allocator()));
    SMAT_ASSERT_OK(gpu_->Fill(out_dev, std::nan("")));
    SMAT_ASSERT_OK(run(*gk, in_dev, &out_dev));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor out_gpu, ToHost(*gpu_, out_dev));
    const float* c = out_cpu.data<float>();
    const float* g = out_gpu.data<float>();
    int64_t differ = 0, first = -1;
    float largest = 0.f;
    for (int64_t i = 0; i < out_cpu.numel(); ++i) {
      if (std::memcmp(&c[i], &g[i], sizeof(float)) != 0) {
        if (first < 0) first = i;
        ++differ;
      }
      largest = std::max(largest, std::abs(c[i]));
    }
    std::printf("  %-40s %lld of %lld elements differ\n", what, static_cast<long long>(differ),
                static_cast<long long>(out_cpu.numel()));
    EXPECT_EQ(differ, 0) << what << ": first at " << first << ", cpu " << c[first] << ", gpu "
                         << g[first];
    EXPECT_GT(largest, 0.f) << what << ": the CPU result is all zeros";
  }
};

TEST_F(SmatTabulateGpuTest, MatchesTheCpuBitForBit) {
  struct Geo {
    int d;
    int64_t q;
  };
  // d = 3 up to the benchmark's plane (q = 67: 4489 points, 4556 lines) and
  // beyond (q = 113: 12769 points); q = 2 has lines of two points; q = 31
  // (4 ring slots a lane, 3 in the last), 53, 83, 103 (the planes of T =
  // 262144, 1048576 and 2097152) and 113 (15) take other shapes of the slopes
  // kernel; d = 2 and d = 4 take the lists.
  for (const Geo& geo : {Geo{3, 2}, Geo{3, 13}, Geo{3, 31}, Geo{3, 53}, Geo{3, 67}, Geo{3, 83},
                         Geo{3, 103}, Geo{3, 113}, Geo{2, 31}, Geo{4, 5}}) {
    SmatPlan plan;
    SMAT_ASSERT_OK_AND_ASSIGN(plan.geo, MakeGeometry(geo.d, geo.q));
    const SmatGeometry& g = plan.geo;
    for (const auto& [r, p] : {std::pair<int64_t, int64_t>{5, 7}, {2, 3}, {4, 9}, {2, 4}}) {
      const int64_t batch = 1, H = 2;
      const std::string name = "d=" + std::to_string(geo.d) + " q=" + std::to_string(geo.q) +
                               " W=" + std::to_string(r * p);
      const uint32_t seed = static_cast<uint32_t>(31 * geo.q + r);
      for (const char* form : {"", "lines"}) {
        if (*form != '\0' && geo.d != 3) continue;
        ASSERT_EQ(setenv("SMAT_CUDA_TABULATE", form, 1), 0);
        const std::string suffix = *form ? std::string(" (") + form + ")" : std::string();
        ExpectSameBits((name + " Tabulate" + suffix).c_str(), {batch, H, g.P, r, p},
                       {batch, H, g.B, r, p}, seed,
                       [&](SmatKernels& k, const Tensor& F, Tensor* U) {
                         return k.Tabulate(plan, F, U, nullptr);
                       });
        ExpectSameBits((name + " TabulateBackward" + suffix).c_str(), {batch, H, g.B, r, p},
                       {batch, H, g.P, r, p}, seed + 1,
                       [&](SmatKernels& k, const Tensor& U_bar, Tensor* F_bar) {
                         return k.TabulateBackward(plan, U_bar, F_bar, nullptr);
                       });
      }
      ASSERT_EQ(unsetenv("SMAT_CUDA_TABULATE"), 0);
    }
  }
}

}  // namespace
}  // namespace smat
