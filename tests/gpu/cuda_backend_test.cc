// The CUDA backend (libsmat_cuda.so, loaded through CreateBackend) against the
// CPU backend: copies between every host/device pair, Fill for every dtype,
// Axpy, and Gemm for fp32 and bf16 inputs at odd sizes and all transposes,
// batched too; outputs poisoned with NaN first so unwritten elements show;
// bitwise repeatability; streams and events. Skips loudly without a GPU.
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/gpu/gpu_test_util.h"

namespace smat {
namespace gpu_test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

TEST_F(GpuTest, NameAndDevice) {
  std::printf("CUDA backend: %s\n", gpu_->name().c_str());
  EXPECT_TRUE(gpu_->device() == Device::Cuda(0));
  EXPECT_TRUE(absl::StrContains(gpu_->name(), "cuda:0")) << gpu_->name();
  EXPECT_TRUE(gpu_->allocator().device() == Device::Cuda(0));
  // Loading the backend brought cuBLAS in (through dlopen, not at start-up).
  EXPECT_TRUE(CublasMapped());
}

TEST_F(GpuTest, OutOfRangeDeviceIsAClearError) {
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend(Device::Cuda(64));
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(b.status().message(), "cuda:64")) << b.status();
  EXPECT_TRUE(absl::StrContains(b.status().message(), "visible")) << b.status();
}

TEST_F(GpuTest, CopyRoundTripEveryPair) {
  for (int64_t n : {int64_t{1}, int64_t{1031}, int64_t{(1 << 20) + 3}}) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kI64, DType::kU16}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dt), " n ", n));
      SMAT_ASSERT_OK_AND_ASSIGN(Tensor src, Tensor::Empty({n}, dt));
      std::mt19937 rng(static_cast<uint32_t>(n));
      for (size_t i = 0; i < src.nbytes(); ++i) static_cast<uint8_t*>(src.raw())[i] = rng() & 0xff;
      SMAT_ASSERT_OK_AND_ASSIGN(Tensor d1, Tensor::Empty({n}, dt, gpu_->allocator()));
      SMAT_ASSERT_OK_AND_ASSIGN(Tensor d2, Tensor::Empty({n}, dt, gpu_->allocator()));
      SMAT_ASSERT_OK_AND_ASSIGN(Tensor h1, Tensor::Zeros({n}, dt));
      SMAT_ASSERT_OK_AND_ASSIGN(Tensor h2, Tensor::Zeros({n}, dt));
      SMAT_ASSERT_OK(gpu_->Copy(src, d1));  // host -> device
      SMAT_ASSERT_OK(gpu_->Copy(d1, d2));   // device -> device
      SMAT_ASSERT_OK(gpu_->Copy(d2, h1));   // device -> host
      SMAT_ASSERT_OK(gpu_->Copy(h1, h2));   // host -> host, through the CUDA backend
      SMAT_ASSERT_OK(gpu_->Synchronize(nullptr));
      EXPECT_EQ(std::memcmp(src.raw(), h1.raw(), src.nbytes()), 0);
      EXPECT_EQ(std::memcmp(src.raw(), h2.raw(), src.nbytes()), 0);
    }
  }
}

TEST_F(GpuTest, CopyRejectsMismatches) {
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor d, Tensor::Empty({8}, DType::kF32, gpu_->allocator()));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor h, Tensor::Empty({8}, DType::kBF16));
  absl::Status s = gpu_->Copy(d, h);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "dtype")) << s;
  float fake[8];
  Tensor other = Tensor::Wrap(fake, {8}, DType::kF32, Device::Cuda(7));
  s = gpu_->Copy(other, d);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "cuda:7")) << s;
}

TEST_F(GpuTest, FillEveryDtypeMatchesCpu) {
  struct Case {
    DType dtype;
    double value;
  };
  const std::vector<Case> cases = {{DType::kF32, -2.75}, {DType::kF32, kNaN}, {DType::kF64, 0.1},
                                   {DType::kBF16, 1.0 / 3.0}, {DType::kI32, -123456},
                                   {DType::kI64, 1e15}, {DType::kU16, 65535}};
  // 3e6 elements: more than one pass of the grid-stride loop.
  for (int64_t n : {int64_t{1}, int64_t{1031}, int64_t{3000007}}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat(DTypeName(c.dtype), " ", c.value, " n ", n));
      SMAT_ASSERT_OK_AND_ASSIGN(Tensor want, Tensor::Empty({n}, c.dtype));
      SMAT_ASSERT_OK(cpu_->Fill(want, c.value));
      SMAT_ASSERT_OK_AND_ASSIGN(Tensor d, Tensor::Empty({n}, c.dtype, gpu_->allocator()));
      SMAT_ASSERT_OK(gpu_->Fill(d, c.value));
      SMAT_ASSERT_OK_AND_ASSIGN(Tensor got, ToHost(*gpu_, d));
      EXPECT_EQ(std::memcmp(want.raw(), got.raw(), want.nbytes()), 0);
    }
  }
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor i32, Tensor::Empty({4}, DType::kI32, gpu_->allocator()));
  EXPECT_EQ(gpu_->Fill(i32, 0.5).code(), absl::StatusCode::kInvalidArgument);
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor host, Tensor::Empty({4}, DType::kF32));
  absl::Status s = gpu_->Fill(host, 1.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "on cpu")) << s;
}

// Both backends compute fmaf(alpha, x, y): one rounding, so equal bits.
TEST_F(GpuTest, AxpyMatchesCpuBitwise) {
  const int64_t n = 1000003;
  for (DType xt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(xt));
    Tensor x = HostTensor({n}, xt, RandomUniform(n, 1));
    Tensor y = HostTensor({n}, DType::kF32, RandomUniform(n, 2));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor dx, ToDevice(*gpu_, x));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor dy, ToDevice(*gpu_, y));
    SMAT_ASSERT_OK(cpu_->Axpy(-0.37f, x, y));
    SMAT_ASSERT_OK(gpu_->Axpy(-0.37f, dx, dy));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor got, ToHost(*gpu_, dy));
    EXPECT_EQ(std::memcmp(y.raw(), got.raw(), y.nbytes()), 0);
  }
}

struct GemmCase {
  int64_t batch, m, n, k;
  bool ta, tb;
};

std::string CaseName(const GemmCase& g, DType dt) {
  return absl::StrCat(DTypeName(dt), " batch ", g.batch, " m ", g.m, " n ", g.n, " k ", g.k,
                      g.ta ? " a^T" : "", g.tb ? " b^T" : "");
}

Shape OperandShape(int64_t batch, int64_t rows, int64_t cols, bool transposed) {
  Shape s = transposed ? Shape{cols, rows} : Shape{rows, cols};
  if (batch > 1) s.insert(s.begin(), batch);
  return s;
}

std::vector<GemmCase> OddCases() {
  std::vector<GemmCase> cases;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      cases.push_back({1, 63, 127, 31, ta, tb});
      cases.push_back({1, 509, 1023, 67, ta, tb});
      cases.push_back({1, 33, 65, 1023, ta, tb});
      cases.push_back({3, 65, 33, 129, ta, tb});
    }
  }
  cases.push_back({1, 1, 1, 1, false, false});
  return cases;
}

// Runs op on both backends: c = alpha op(a) op(b) + beta c0 with inputs from
// `gen`. The GPU output is poisoned with NaN first when beta = 0. Returns the
// CPU result, the GPU result, and sum_k |alpha a b| + |beta c0| per element
// (the scale of the rounding error of an fp32 sum).
struct GemmOutputs {
  std::vector<float> cpu, gpu;
  std::vector<double> magnitude;
};
void RunBoth(Backend& cpu, Backend& gpu, const GemmCase& g, DType dt, float alpha, float beta,
             const std::vector<float>& av, const std::vector<float>& bv,
             const std::vector<float>& cv, GemmOutputs* out) {
  const Transpose ta = g.ta ? Transpose::kYes : Transpose::kNo;
  const Transpose tb = g.tb ? Transpose::kYes : Transpose::kNo;
  Tensor a = HostTensor(OperandShape(g.batch, g.m, g.k, g.ta), dt, av);
  Tensor b = HostTensor(OperandShape(g.batch, g.k, g.n, g.tb), dt, bv);
  Tensor c = HostTensor(OperandShape(g.batch, g.m, g.n, false), DType::kF32, cv);
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor da, ToDevice(gpu, a));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor db, ToDevice(gpu, b));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor dc, ToDevice(gpu, c));
  if (beta == 0.f) SMAT_ASSERT_OK(gpu.Fill(dc, kNaN));
  SMAT_ASSERT_OK(gpu.Gemm(ta, tb, alpha, da, db, beta, dc));
  SMAT_ASSERT_OK(cpu.Gemm(ta, tb, alpha, a, b, beta, c));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor got, ToHost(gpu, dc));
  out->cpu = FloatValues(c);
  out->gpu = FloatValues(got);
  // |alpha| sum_k |a b| + |beta c0| with the operand values the backends saw.
  const std::vector<float> ar = FloatValues(a), br = FloatValues(b);
  out->magnitude.assign(out->cpu.size(), 0.0);
  for (int64_t e = 0; e < g.batch; ++e) {
    const float* ap = ar.data() + e * g.m * g.k;
    const float* bp = br.data() + e * g.k * g.n;
    for (int64_t i = 0; i < g.m; ++i) {
      for (int64_t j = 0; j < g.n; ++j) {
        double mag = 0;
        for (int64_t p = 0; p < g.k; ++p) {
          const double x = g.ta ? ap[p * g.m + i] : ap[i * g.k + p];
          const double y = g.tb ? bp[j * g.k + p] : bp[p * g.n + j];
          mag += std::fabs(x * y);
        }
        const int64_t idx = e * g.m * g.n + i * g.n + j;
        out->magnitude[idx] = std::fabs(alpha) * mag + std::fabs(beta * cv[idx]);
      }
    }
  }
}

// Random inputs in [-1, 1]. Tolerance: |gpu - cpu| <= 1e-5 (sum_k |alpha a b|
// + |beta c0|). Both sides accumulate in fp32 (u = 6e-8) in different orders;
// rounding errors of random sign grow like sqrt(k) u |a b| per term, so their
// difference stays below ~3e-6 of that scale at k = 1023 (and far below at
// small k). bf16 inputs: both backends read the same bf16-rounded values and a
// product of two bf16 numbers is exact in fp32, so the same bound holds. TF32
// (10-bit mantissa, u = 2^-11 on every input) would miss it by 10x at k = 31;
// NoTf32 below checks that directly.
TEST_F(GpuTest, GemmRandomMatchesCpu) {
  uint32_t seed = 1000;
  for (const GemmCase& g : OddCases()) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      for (float beta : {0.f, 0.5f}) {
        SCOPED_TRACE(absl::StrCat(CaseName(g, dt), " beta ", beta));
        const std::vector<float> av = RandomUniform(g.batch * g.m * g.k, seed++);
        const std::vector<float> bv = RandomUniform(g.batch * g.k * g.n, seed++);
        const std::vector<float> cv = RandomUniform(g.batch * g.m * g.n, seed++);
        GemmOutputs out;
        RunBoth(*cpu_, *gpu_, g, dt, 1.25f, beta, av, bv, cv, &out);
        if (HasFatalFailure()) return;
        double worst = 0;
        int64_t nonzero = 0;
        for (size_t i = 0; i < out.cpu.size(); ++i) {
          ASSERT_TRUE(std::isfinite(out.gpu[i])) << "element " << i << " not written (NaN poison)";
          const double err = std::fabs(static_cast<double>(out.gpu[i]) - out.cpu[i]);
          ASSERT_LE(err, 1e-5 * out.magnitude[i] + 1e-30)
              << "element " << i << " gpu " << out.gpu[i] << " cpu " << out.cpu[i];
          worst = std::max(worst, err / (out.magnitude[i] + 1e-30));
          nonzero += out.cpu[i] != 0.f;
        }
        EXPECT_GT(nonzero, 0) << "all-zero result proves nothing";
        if (g.k == 1023 && beta == 0.f && !g.ta && !g.tb) {
          std::printf("%s: worst |gpu - cpu| / sum|ab| = %.3g\n", CaseName(g, dt).c_str(), worst);
        }
      }
    }
  }
}

// Integer inputs in [-8, 8]: every partial sum is an integer below 2^24, so
// any order of summation is exact and the two backends agree bit for bit.
TEST_F(GpuTest, GemmIntegersMatchCpuBitwise) {
  uint32_t seed = 5000;
  for (const GemmCase& g : OddCases()) {
    for (DType dt : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(CaseName(g, dt));
      GemmOutputs out;
      RunBoth(*cpu_, *gpu_, g, dt, 2.f, 0.f, RandomIntegers(g.batch * g.m * g.k, 8, seed),
              RandomIntegers(g.batch * g.k * g.n, 8, seed + 1),
              RandomIntegers(g.batch * g.m * g.n, 8, seed + 2), &out);
      seed += 3;
      if (HasFatalFailure()) return;
      ASSERT_EQ(std::memcmp(out.cpu.data(), out.gpu.data(), out.cpu.size() * sizeof(float)), 0);
    }
  }
}

// fp32 products must be fp32, not TF32: (1 + 2^-20) * 1 is exact in fp32 and
// rounds to 1 in TF32 (10 mantissa bits).
TEST_F(GpuTest, GemmFp32IsNotTf32) {
  const float x = 1.f + std::ldexp(1.f, -20);
  const int64_t m = 64, k = 64, n = 64;
  std::vector<float> av(m * k, x), bv(k * n, 0.f);
  for (int64_t i = 0; i < k; ++i) bv[i * n + i] = 1.f;  // identity
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor a, ToDevice(*gpu_, HostTensor({m, k}, DType::kF32, av)));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor b, ToDevice(*gpu_, HostTensor({k, n}, DType::kF32, bv)));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor c, Tensor::Empty({m, n}, DType::kF32, gpu_->allocator()));
  SMAT_ASSERT_OK(gpu_->Gemm(Transpose::kNo, Transpose::kNo, 1.f, a, b, 0.f, c));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor h, ToHost(*gpu_, c));
  for (float v : FloatValues(h)) ASSERT_EQ(v, x) << "cuBLAS rounded fp32 inputs (TF32?)";
}

// The same product twice, on the default stream and on a created one, into
// different buffers: equal bits (fixed workspace, no atomics).
TEST_F(GpuTest, GemmIsBitwiseRepeatable) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dt));
    const int64_t m = 1023, n = 509, k = 2047;
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor a,
                              ToDevice(*gpu_, HostTensor({m, k}, dt, RandomUniform(m * k, 11))));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor b,
                              ToDevice(*gpu_, HostTensor({n, k}, dt, RandomUniform(n * k, 12))));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor c1, Tensor::Empty({m, n}, DType::kF32, gpu_->allocator()));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor c2, Tensor::Empty({m, n}, DType::kF32, gpu_->allocator()));
    SMAT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, gpu_->CreateStream());
    SMAT_ASSERT_OK(gpu_->Fill(c1, kNaN));
    SMAT_ASSERT_OK(gpu_->Fill(c2, kNaN, stream.get()));
    SMAT_ASSERT_OK(gpu_->Synchronize(nullptr));
    SMAT_ASSERT_OK(gpu_->Gemm(Transpose::kNo, Transpose::kYes, 1.f, a, b, 0.f, c1));
    SMAT_ASSERT_OK(gpu_->Gemm(Transpose::kNo, Transpose::kYes, 1.f, a, b, 0.f, c2, stream.get()));
    SMAT_ASSERT_OK(gpu_->Synchronize(stream.get()));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor h1, ToHost(*gpu_, c1));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor h2, ToHost(*gpu_, c2));
    for (float v : FloatValues(h1)) ASSERT_TRUE(std::isfinite(v));
    EXPECT_EQ(std::memcmp(h1.raw(), h2.raw(), h1.nbytes()), 0);
  }
}

TEST_F(GpuTest, GemmEmptyInnerDimensionWritesBetaC) {
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::Empty({5, 0}, DType::kF32, gpu_->allocator()));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor b, Tensor::Empty({0, 7}, DType::kF32, gpu_->allocator()));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor c, Tensor::Empty({5, 7}, DType::kF32, gpu_->allocator()));
  SMAT_ASSERT_OK(gpu_->Fill(c, kNaN));
  SMAT_ASSERT_OK(gpu_->Gemm(Transpose::kNo, Transpose::kNo, 1.f, a, b, 0.f, c));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor h, ToHost(*gpu_, c));
  for (float v : FloatValues(h)) ASSERT_EQ(v, 0.f);
}

TEST_F(GpuTest, GemmRejectsHostOperands) {
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor a, Tensor::Empty({4, 5}, DType::kF32, gpu_->allocator()));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor b, Tensor::Empty({5, 3}, DType::kF32));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor c, Tensor::Empty({4, 3}, DType::kF32, gpu_->allocator()));
  absl::Status s = gpu_->Gemm(Transpose::kNo, Transpose::kNo, 1.f, a, b, 0.f, c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "b is fp32[5, 3] on cpu")) << s;
}

// Events time device work; a stream that waits on an event sees the work
// recorded before it.
TEST_F(GpuTest, StreamsAndEvents) {
  SMAT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> s1, gpu_->CreateStream());
  SMAT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> s2, gpu_->CreateStream());
  SMAT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> start, gpu_->CreateEvent());
  SMAT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> stop, gpu_->CreateEvent());
  EXPECT_EQ(gpu_->ElapsedMs(*start, *stop).status().code(), absl::StatusCode::kFailedPrecondition);
  const int64_t n = 1 << 26;  // 256 MB of fp32: long enough to time
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor d, Tensor::Empty({n}, DType::kF32, gpu_->allocator()));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor h, Tensor::Zeros({n}, DType::kF32));
  SMAT_ASSERT_OK(gpu_->Record(*start, s1.get()));
  SMAT_ASSERT_OK(gpu_->Fill(d, 3.0, s1.get()));
  SMAT_ASSERT_OK(gpu_->Record(*stop, s1.get()));
  SMAT_ASSERT_OK(gpu_->Wait(s2.get(), *stop));
  SMAT_ASSERT_OK(gpu_->Copy(d, h, s2.get()));
  SMAT_ASSERT_OK(gpu_->Synchronize(s2.get()));
  for (int64_t i = 0; i < n; i += 4099) ASSERT_EQ(h.data<float>()[i], 3.f) << i;
  ASSERT_EQ(h.data<float>()[n - 1], 3.f);
  SMAT_ASSERT_OK_AND_ASSIGN(float ms, gpu_->ElapsedMs(*start, *stop));
  std::printf("Fill of %lld MB: %.3f ms (%.0f GB/s)\n", static_cast<long long>(n * 4 >> 20), ms,
              n * 4.0 / (ms * 1e6));
  EXPECT_GT(ms, 0.f);

  // Streams and events of another backend are refused.
  class OtherStream : public Stream {} other;
  EXPECT_EQ(gpu_->Synchronize(&other).code(), absl::StatusCode::kInvalidArgument);
  SMAT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> cpu_event, cpu_->CreateEvent());
  EXPECT_EQ(gpu_->Record(*cpu_event, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

// Tensors outlive the backend that allocated them (the allocator lives as
// long as the process).
TEST_F(GpuTest, TensorOutlivesBackend) {
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor d, Tensor::Empty({1031}, DType::kF32, gpu_->allocator()));
  SMAT_ASSERT_OK(gpu_->Fill(d, 7.0));
  SMAT_ASSERT_OK(gpu_->Synchronize(nullptr));
  gpu_.reset();
  SMAT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> again, CreateBackend(Device::Cuda(0)));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor h, ToHost(*again, d));
  for (float v : FloatValues(h)) ASSERT_EQ(v, 7.f);
}

TEST_F(GpuTest, SmatKernelsAvailableOrClearlyMissing) {
  absl::StatusOr<SmatKernels*> k = gpu_->smat();
  if (k.ok()) {
    EXPECT_NE(*k, nullptr);
  } else {
    EXPECT_EQ(k.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(absl::StrContains(k.status().message(), "cuda:0")) << k.status();
  }
}

// With two GPUs: a second backend works, and tensors of one device are
// refused by the other.
TEST_F(GpuTest, SecondDeviceIfPresent) {
  absl::StatusOr<std::unique_ptr<Backend>> second = CreateBackend(Device::Cuda(1));
  if (!second.ok()) {
    GTEST_SKIP() << "one GPU only: " << second.status();
  }
  std::printf("second backend: %s\n", (*second)->name().c_str());
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor d1, Tensor::Empty({64}, DType::kF32, (*second)->allocator()));
  SMAT_ASSERT_OK(( *second)->Fill(d1, 2.0));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor h, ToHost(**second, d1));
  for (float v : FloatValues(h)) ASSERT_EQ(v, 2.f);
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor d0, Tensor::Empty({64}, DType::kF32, gpu_->allocator()));
  absl::Status s = (*second)->Copy(d0, d1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "cuda:0")) << s;
  // The first backend's device stays current for its own calls.
  SMAT_ASSERT_OK(gpu_->Fill(d0, 1.0));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor h0, ToHost(*gpu_, d0));
  for (float v : FloatValues(h0)) ASSERT_EQ(v, 1.f);
}

}  // namespace
}  // namespace gpu_test
}  // namespace smat
