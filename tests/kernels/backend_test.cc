// Tests of the CPU backend (Fill, Copy, Axpy, Gemm, streams and events, the
// argument checks), of ParseDevice, and of CreateBackend for CUDA on any
// machine: without a GPU it must fail with a message that says what is
// missing; with one it must work. The GPU backend itself is tested against
// this one in tests/gpu.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "core/tensor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/model_kernels.h"

namespace smat {
namespace {

// Whether libcublas is mapped into this process, read at static
// initialisation: after the dynamic loader mapped every library the binary
// links, before main and before any test could dlopen libsmat_cuda.so.
bool CublasMapped() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("libcublas") != std::string::npos) return true;
  }
  return false;
}
const bool kCublasMappedAtStartup = CublasMapped();

TEST(BackendLinkTest, NoCublasMappedAtStartup) {
  // PLATFORM.md: cuBLAS linked at start-up breaks prometheus-cpp's Exposer.
  EXPECT_FALSE(kCublasMappedAtStartup)
      << "libcublas is mapped before main: something in smat_kernels or its dependencies links "
         "cuBLAS; only libsmat_cuda.so (dlopened) may";
}

// --- helpers ------------------------------------------------------------------

Tensor HostF32(const Shape& shape, const std::vector<float>& values) {
  Tensor t = Tensor::Empty(shape, DType::kF32).value();
  SMAT_CHECK(static_cast<int64_t>(values.size()) == t.numel());
  std::memcpy(t.raw(), values.data(), t.nbytes());
  return t;
}

Tensor HostBf16(const Shape& shape, const std::vector<float>& values) {
  Tensor t = Tensor::Empty(shape, DType::kBF16).value();
  SMAT_CHECK(static_cast<int64_t>(values.size()) == t.numel());
  for (size_t i = 0; i < values.size(); ++i) t.data<uint16_t>()[i] = FloatToBf16(values[i]);
  return t;
}

std::vector<float> Values(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::kF32) {
    std::memcpy(v.data(), t.raw(), t.nbytes());
  } else {
    for (size_t i = 0; i < v.size(); ++i) v[i] = Bf16ToFloat(t.data<uint16_t>()[i]);
  }
  return v;
}

// Integers in [-range, range]: products and sums stay exact in fp32 (and in
// bf16 for |x| <= 256) as long as every partial sum is below 2^24.
std::vector<float> RandomIntegers(int64_t n, int range, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-range, range);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(dist(rng));
  return v;
}

std::vector<float> RandomUniform(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// Reference c = alpha op(a) op(b) + beta c in double, one batch entry, plus
// sum_k |alpha a_ik b_kj| per element for error bounds. a is (a0, a1) and b is
// (b0, b1), row-major.
struct GemmReference {
  std::vector<double> c;
  std::vector<double> magnitude;
};
GemmReference ReferenceGemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                            const float* a, const float* b, float beta, const float* c) {
  GemmReference r;
  r.c.assign(m * n, 0.0);
  r.magnitude.assign(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, mag = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = ta ? a[p * m + i] : a[i * k + p];
        const double bv = tb ? b[j * k + p] : b[p * n + j];
        s += av * bv;
        mag += std::fabs(av * bv);
      }
      r.c[i * n + j] = alpha * s + (beta == 0.f ? 0.0 : beta * static_cast<double>(c[i * n + j]));
      r.magnitude[i * n + j] = std::fabs(alpha) * mag +
                               (beta == 0.f ? 0.0 : std::fabs(beta * static_cast<double>(c[i * n + j])));
    }
  }
  return r;
}

struct GemmCase {
  int64_t batch, m, n, k;
  bool ta, tb;
};

std::string CaseName(const GemmCase& g) {
  return absl::StrCat("batch ", g.batch, " m ", g.m, " n ", g.n, " k ", g.k, " ta ", g.ta, " tb ",
                      g.tb);
}

Shape OperandShape(int64_t batch, int64_t rows, int64_t cols, bool transposed) {
  Shape s = transposed ? Shape{cols, rows} : Shape{rows, cols};
  if (batch > 1) s.insert(s.begin(), batch);
  return s;
}

// --- ParseDevice / CreateBackend --------------------------------------------------

TEST(ParseDeviceTest, AcceptsCpuCudaAndIndex) {
  EXPECT_TRUE(ParseDevice("cpu").value() == Device::Cpu());
  EXPECT_TRUE(ParseDevice("cuda").value() == Device::Cuda(0));
  EXPECT_TRUE(ParseDevice("cuda:3").value() == Device::Cuda(3));
}

TEST(ParseDeviceTest, RejectsOtherNames) {
  for (const char* bad : {"", "gpu", "cuda:", "cuda:-1", "cuda:1x", "CPU", "cuda:99999999999"}) {
    absl::StatusOr<Device> d = ParseDevice(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(d.status().message(), "cuda:N")) << bad;
  }
}

TEST(CreateBackendTest, CpuIsAlwaysThere) {
  std::unique_ptr<Backend> cpu = CreateBackend(Device::Cpu()).value();
  EXPECT_EQ(cpu->name(), "cpu");
  EXPECT_TRUE(cpu->device() == Device::Cpu());
  EXPECT_TRUE(cpu->allocator().device() == Device::Cpu());
  absl::StatusOr<SmatKernels*> smat = cpu->smat();
  ASSERT_TRUE(smat.ok()) << smat.status();
  EXPECT_NE(*smat, nullptr);
}

// Without a GPU (or without libsmat_cuda.so) CreateBackend must fail cleanly
// and say what is missing; with one it must give a working CUDA backend.
TEST(CreateBackendTest, CudaEitherWorksOrSaysWhatIsMissing) {
  absl::StatusOr<std::unique_ptr<Backend>> gpu = CreateBackend(Device::Cuda(0));
  if (gpu.ok()) {
    EXPECT_TRUE((*gpu)->device() == Device::Cuda(0));
    EXPECT_TRUE(absl::StrContains((*gpu)->name(), "cuda:0")) << (*gpu)->name();
    return;
  }
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition) << gpu.status();
  const std::string msg(gpu.status().message());
  // Either the library could not be loaded (the message lists where it
  // looked) or it loaded and found no driver or device.
  const bool library_missing = absl::StrContains(msg, "libsmat_cuda.so") &&
                               absl::StrContains(msg, "SMAT_CUDA_LIBRARY");
  const bool no_device = absl::StrContains(msg, "cuda:0") &&
                         (absl::StrContains(msg, "driver") || absl::StrContains(msg, "device"));
  EXPECT_TRUE(library_missing || no_device) << msg;
  std::printf("CreateBackend(cuda:0) on this machine: %s\n", msg.c_str());
}

TEST(CreateBackendTest, CudaIndexOutOfRangeIsAnError) {
  absl::StatusOr<std::unique_ptr<Backend>> gpu = CreateBackend(Device::Cuda(4096));
  ASSERT_FALSE(gpu.ok());
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition) << gpu.status();
  const std::string msg(gpu.status().message());
  EXPECT_TRUE(absl::StrContains(msg, "cuda:4096") || absl::StrContains(msg, "libsmat_cuda.so"))
      << msg;

  absl::StatusOr<std::unique_ptr<Backend>> negative = CreateBackend(Device::Cuda(-1));
  ASSERT_FALSE(negative.ok());
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
}

// --- BLAS threads ------------------------------------------------------------

TEST(CpuBackendTest, BlasThreadsAreSetInOpenBlas) {
  const int before = CpuBlasThreads();
  ASSERT_GE(before, 1);
  SetCpuBlasThreads(1);
  EXPECT_EQ(CpuBlasThreads(), 1);
  SetCpuBlasThreads(2);
  EXPECT_EQ(CpuBlasThreads(), 2);
  SetCpuBlasThreads(0);  // at least one
  EXPECT_EQ(CpuBlasThreads(), 1);
  SetCpuBlasThreads(before);
  EXPECT_EQ(CpuBlasThreads(), before);
}

// --- streams and events ------------------------------------------------------

TEST(CpuBackendTest, EventsMeasureHostTime) {
  CpuBackend cpu;
  std::unique_ptr<Stream> stream = cpu.CreateStream().value();
  std::unique_ptr<Event> start = cpu.CreateEvent().value();
  std::unique_ptr<Event> stop = cpu.CreateEvent().value();
  EXPECT_EQ(cpu.ElapsedMs(*start, *stop).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(cpu.Record(*start, stream.get()).ok());
  volatile double sink = 0;
  for (int i = 0; i < 200000; ++i) sink = sink + std::sqrt(static_cast<double>(i));
  ASSERT_TRUE(cpu.Record(*stop, stream.get()).ok());
  ASSERT_TRUE(cpu.Wait(nullptr, *stop).ok());
  ASSERT_TRUE(cpu.Synchronize(stream.get()).ok());
  const float ms = cpu.ElapsedMs(*start, *stop).value();
  EXPECT_GT(ms, 0.f);
  EXPECT_LT(ms, 10000.f);
}

TEST(CpuBackendTest, RejectsForeignStreamsAndEvents) {
  CpuBackend cpu;
  class OtherStream : public Stream {} other_stream;
  class OtherEvent : public Event {} other_event;
  EXPECT_EQ(cpu.Synchronize(&other_stream).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu.Record(other_event, nullptr).code(), absl::StatusCode::kInvalidArgument);
  Tensor t = Tensor::Empty({4}, DType::kF32).value();
  absl::Status s = cpu.Fill(t, 1.0, &other_stream);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "stream")) << s.message();
}

// --- Fill and Copy -----------------------------------------------------------------

TEST(CpuBackendTest, FillEveryDtype) {
  CpuBackend cpu;
  const int64_t n = 1031;
  {
    Tensor t = Tensor::Empty({n}, DType::kF32).value();
    ASSERT_TRUE(cpu.Fill(t, -2.5).ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(t.data<float>()[i], -2.5f);
    ASSERT_TRUE(cpu.Fill(t, std::numeric_limits<double>::quiet_NaN()).ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(std::isnan(t.data<float>()[i]));
  }
  {
    Tensor t = Tensor::Empty({n}, DType::kF64).value();
    ASSERT_TRUE(cpu.Fill(t, 0.1).ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(t.data<double>()[i], 0.1);
  }
  {
    Tensor t = Tensor::Empty({n}, DType::kBF16).value();
    ASSERT_TRUE(cpu.Fill(t, 1.0 / 3.0).ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(t.data<uint16_t>()[i], FloatToBf16(1.f / 3.f));
  }
  {
    Tensor t = Tensor::Empty({n}, DType::kI32).value();
    ASSERT_TRUE(cpu.Fill(t, -7).ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(t.data<int32_t>()[i], -7);
  }
  {
    Tensor t = Tensor::Empty({n}, DType::kI64).value();
    ASSERT_TRUE(cpu.Fill(t, 1e15).ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(t.data<int64_t>()[i], int64_t{1000000000000000});
  }
  {
    Tensor t = Tensor::Empty({n}, DType::kU16).value();
    ASSERT_TRUE(cpu.Fill(t, 65535).ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(t.data<uint16_t>()[i], 65535);
  }
}

TEST(CpuBackendTest, FillRejectsValuesTheDtypeCannotHold) {
  CpuBackend cpu;
  Tensor i32 = Tensor::Empty({3}, DType::kI32).value();
  Tensor u16 = Tensor::Empty({3}, DType::kU16).value();
  Tensor i64 = Tensor::Empty({3}, DType::kI64).value();
  for (auto [t, v] : {std::pair<Tensor*, double>{&i32, 2.5}, {&i32, 3e9}, {&u16, -1},
                      {&i32, std::numeric_limits<double>::quiet_NaN()}, {&i64, 1e19}}) {
    absl::Status s = cpu.Fill(*t, v);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << v;
    EXPECT_TRUE(absl::StrContains(s.message(), DTypeName(t->dtype()))) << s.message();
  }
}

TEST(CpuBackendTest, CopyHostToHost) {
  CpuBackend cpu;
  const std::vector<float> v = RandomUniform(509, 1);
  Tensor src = HostF32({509}, v);
  Tensor dst = Tensor::Empty({509}, DType::kF32).value();
  ASSERT_TRUE(cpu.Copy(src, dst).ok());
  EXPECT_EQ(std::memcmp(src.raw(), dst.raw(), src.nbytes()), 0);

  // Same element count, other shape: allowed.
  Tensor reshaped = Tensor::Empty({509, 1}, DType::kF32).value();
  EXPECT_TRUE(cpu.Copy(src, reshaped).ok());
}

TEST(CpuBackendTest, CopyRejectsMismatches) {
  CpuBackend cpu;
  Tensor f32 = Tensor::Empty({8}, DType::kF32).value();
  Tensor bf16 = Tensor::Empty({8}, DType::kBF16).value();
  Tensor small = Tensor::Empty({7}, DType::kF32).value();
  absl::Status s = cpu.Copy(f32, bf16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "dtype")) << s.message();
  s = cpu.Copy(f32, small);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "element counts")) << s.message();
  float fake[8];
  Tensor on_gpu = Tensor::Wrap(fake, {8}, DType::kF32, Device::Cuda(0));
  s = cpu.Copy(on_gpu, f32);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "src")) << s.message();
  EXPECT_TRUE(absl::StrContains(s.message(), "cuda:0")) << s.message();
}

// --- Axpy ----------------------------------------------------------------------------

TEST(CpuBackendTest, AxpyFp32AndBf16AreExactOnIntegers) {
  CpuBackend cpu;
  const int64_t n = 1023;
  const std::vector<float> x = RandomIntegers(n, 100, 2), y0 = RandomIntegers(n, 1000, 3);
  for (DType xt : {DType::kF32, DType::kBF16}) {
    Tensor xs = xt == DType::kF32 ? HostF32({n}, x) : HostBf16({n}, x);
    Tensor y = HostF32({n}, y0);
    ASSERT_TRUE(cpu.Axpy(-3.f, xs, y).ok());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y.data<float>()[i], y0[i] - 3.f * x[i]) << i;
  }
}

TEST(CpuBackendTest, AxpyRejectsBadOperands) {
  CpuBackend cpu;
  Tensor x = Tensor::Empty({4, 3}, DType::kF32).value();
  Tensor y = Tensor::Empty({3, 4}, DType::kF32).value();
  absl::Status s = cpu.Axpy(1.f, x, y);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "[4, 3]")) << s.message();
  Tensor y16 = Tensor::Empty({4, 3}, DType::kBF16).value();
  s = cpu.Axpy(1.f, x, y16);
  EXPECT_TRUE(absl::StrContains(s.message(), "y must be fp32")) << s.message();
  Tensor xi = Tensor::Empty({4, 3}, DType::kI32).value();
  Tensor y32 = Tensor::Empty({4, 3}, DType::kF32).value();
  s = cpu.Axpy(1.f, xi, y32);
  EXPECT_TRUE(absl::StrContains(s.message(), "x must be fp32 or bf16")) << s.message();
}

// --- Gemm ------------------------------------------------------------------------------

// Integer-valued inputs in [-8, 8] and k <= 1023: every partial sum is an
// integer below 2^16 in magnitude, so any summation order gives the exact
// result, and alpha = 2, beta = 0.5 (powers of two) keep it exact.
TEST(CpuBackendTest, GemmExactOnIntegersAllTransposesOddSizes) {
  CpuBackend cpu;
  const std::vector<GemmCase> cases = {
      {1, 63, 127, 31, false, false}, {1, 63, 127, 31, true, false}, {1, 63, 127, 31, false, true},
      {1, 63, 127, 31, true, true},   {1, 509, 67, 1023, false, true}, {1, 509, 1023, 13, true, false},
      {3, 17, 29, 65, false, false},  {3, 17, 29, 65, true, true},    {1, 1, 1, 1, false, false},
  };
  uint32_t seed = 10;
  for (const GemmCase& g : cases) {
    SCOPED_TRACE(CaseName(g));
    for (DType dt : {DType::kF32, DType::kBF16}) {
      const std::vector<float> av = RandomIntegers(g.batch * g.m * g.k, 8, seed++);
      const std::vector<float> bv = RandomIntegers(g.batch * g.k * g.n, 8, seed++);
      const std::vector<float> cv = RandomIntegers(g.batch * g.m * g.n, 64, seed++);
      const Shape as = OperandShape(g.batch, g.m, g.k, g.ta);
      const Shape bs = OperandShape(g.batch, g.k, g.n, g.tb);
      const Shape cs = OperandShape(g.batch, g.m, g.n, false);
      Tensor a = dt == DType::kF32 ? HostF32(as, av) : HostBf16(as, av);
      Tensor b = dt == DType::kF32 ? HostF32(bs, bv) : HostBf16(bs, bv);
      for (float beta : {0.f, 0.5f}) {
        Tensor c = HostF32(cs, cv);
        ASSERT_TRUE(cpu.Gemm(g.ta ? Transpose::kYes : Transpose::kNo,
                             g.tb ? Transpose::kYes : Transpose::kNo, 2.f, a, b, beta, c)
                        .ok());
        const std::vector<float> got = Values(c);
        bool nonzero = false;
        for (int64_t e = 0; e < g.batch; ++e) {
          GemmReference ref = ReferenceGemm(g.ta, g.tb, g.m, g.n, g.k, 2.f,
                                            av.data() + e * g.m * g.k, bv.data() + e * g.k * g.n,
                                            beta, cv.data() + e * g.m * g.n);
          for (int64_t i = 0; i < g.m * g.n; ++i) {
            ASSERT_EQ(got[e * g.m * g.n + i], static_cast<float>(ref.c[i]))
                << "batch " << e << " element " << i << " beta " << beta << " " << DTypeName(dt);
            nonzero |= ref.c[i] != 0;
          }
        }
        EXPECT_TRUE(nonzero) << "all-zero result proves nothing";
      }
    }
  }
}

// Random real inputs: fp32 accumulation of k products differs from the exact
// sum by at most gamma_k sum|a b| with gamma_k = k u / (1 - k u), u = 2^-24
// (Higham, Accuracy and Stability, eq. 3.5); products of bf16 values are exact
// in fp32, so the same bound holds for bf16 inputs against the reference built
// from the bf16-rounded values. A wrong transpose or stride breaks it by
// orders of magnitude.
TEST(CpuBackendTest, GemmRandomWithinFp32ErrorBound) {
  CpuBackend cpu;
  const std::vector<GemmCase> cases = {
      {1, 63, 127, 31, false, false}, {1, 63, 127, 31, true, true},
      {1, 509, 1023, 64, false, true}, {2, 65, 33, 1023, true, false}};
  uint32_t seed = 100;
  for (const GemmCase& g : cases) {
    SCOPED_TRACE(CaseName(g));
    for (DType dt : {DType::kF32, DType::kBF16}) {
      std::vector<float> av = RandomUniform(g.batch * g.m * g.k, seed++);
      std::vector<float> bv = RandomUniform(g.batch * g.k * g.n, seed++);
      const std::vector<float> cv = RandomUniform(g.batch * g.m * g.n, seed++);
      Tensor a = dt == DType::kF32 ? HostF32(OperandShape(g.batch, g.m, g.k, g.ta), av)
                                   : HostBf16(OperandShape(g.batch, g.m, g.k, g.ta), av);
      Tensor b = dt == DType::kF32 ? HostF32(OperandShape(g.batch, g.k, g.n, g.tb), bv)
                                   : HostBf16(OperandShape(g.batch, g.k, g.n, g.tb), bv);
      av = Values(a);  // the values the backend sees (bf16-rounded)
      bv = Values(b);
      Tensor c = HostF32(OperandShape(g.batch, g.m, g.n, false), cv);
      ASSERT_TRUE(cpu.Gemm(g.ta ? Transpose::kYes : Transpose::kNo,
                           g.tb ? Transpose::kYes : Transpose::kNo, 0.75f, a, b, -1.5f, c)
                      .ok());
      const double u = std::ldexp(1.0, -24);
      const double gamma = (g.k + 2) * u / (1 - (g.k + 2) * u);  // + alpha and beta roundings
      for (int64_t e = 0; e < g.batch; ++e) {
        GemmReference ref = ReferenceGemm(g.ta, g.tb, g.m, g.n, g.k, 0.75f,
                                          av.data() + e * g.m * g.k, bv.data() + e * g.k * g.n,
                                          -1.5f, cv.data() + e * g.m * g.n);
        for (int64_t i = 0; i < g.m * g.n; ++i) {
          const double got = c.data<float>()[e * g.m * g.n + i];
          ASSERT_LE(std::fabs(got - ref.c[i]), gamma * ref.magnitude[i] + 1e-30)
              << "batch " << e << " element " << i << " " << DTypeName(dt);
        }
      }
    }
  }
}

TEST(CpuBackendTest, GemmBetaZeroOverwritesNaN) {
  CpuBackend cpu;
  Tensor a = HostF32({5, 3}, RandomIntegers(15, 4, 7));
  Tensor b = HostF32({3, 9}, RandomIntegers(27, 4, 8));
  Tensor c = Tensor::Empty({5, 9}, DType::kF32).value();
  ASSERT_TRUE(cpu.Fill(c, std::numeric_limits<double>::quiet_NaN()).ok());
  ASSERT_TRUE(cpu.Gemm(Transpose::kNo, Transpose::kNo, 1.f, a, b, 0.f, c).ok());
  for (float x : Values(c)) ASSERT_FALSE(std::isnan(x));

  // k = 0: c = beta c, with beta = 0 writing zeros over the NaNs.
  Tensor a0 = Tensor::Empty({5, 0}, DType::kF32).value();
  Tensor b0 = Tensor::Empty({0, 9}, DType::kF32).value();
  ASSERT_TRUE(cpu.Fill(c, std::numeric_limits<double>::quiet_NaN()).ok());
  ASSERT_TRUE(cpu.Gemm(Transpose::kNo, Transpose::kNo, 1.f, a0, b0, 0.f, c).ok());
  for (float x : Values(c)) ASSERT_EQ(x, 0.f);
}

TEST(CpuBackendTest, GemmRejectsBadOperands) {
  CpuBackend cpu;
  auto f32 = [](Shape s) { return Tensor::Empty(std::move(s), DType::kF32).value(); };
  auto expect = [&](const Tensor& a, const Tensor& b, Tensor c, const char* needle,
                    Transpose ta = Transpose::kNo, Transpose tb = Transpose::kNo) {
    absl::Status s = cpu.Gemm(ta, tb, 1.f, a, b, 0.f, c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << needle;
    EXPECT_TRUE(absl::StrContains(s.message(), needle)) << s.message();
  };
  expect(f32({4, 5}), f32({6, 3}), f32({4, 3}), "inner dimensions");
  expect(f32({4, 5}), f32({5, 3}), f32({4, 3}), "inner dimensions", Transpose::kYes);
  expect(f32({4, 5}), f32({5, 3}), f32({3, 4}), "c must be 4 x 3");
  expect(f32({4, 5}), Tensor::Empty({5, 3}, DType::kBF16).value(), f32({4, 3}), "b must have a's dtype");
  expect(Tensor::Empty({4, 5}, DType::kI32).value(), f32({5, 3}), f32({4, 3}), "a must be fp32 or bf16");
  expect(f32({4, 5}), f32({5, 3}), Tensor::Empty({4, 3}, DType::kBF16).value(),
         "a bf16 c needs bf16 a and b");
  expect(f32({4, 5}), f32({5, 3}), Tensor::Empty({4, 3}, DType::kI32).value(), "c must be fp32");
  expect(f32({2, 4, 5}), f32({5, 3}), f32({2, 4, 3}), "same rank");
  expect(f32({2, 4, 5}), f32({3, 5, 3}), f32({2, 4, 3}), "batch dimension");
  expect(f32({1, 2, 4, 5}), f32({1, 2, 5, 3}), f32({1, 2, 4, 3}), "rank 2");
  float fake[15];
  expect(f32({3, 5}), Tensor::Wrap(fake, {5, 3}, DType::kF32, Device::Cuda(0)), f32({3, 3}),
         "b is fp32[5, 3] on cuda:0");
}

// A bf16 c (beta = 0): exactly the bf16 rounding (Cast) of the fp32 product,
// every transpose, odd sizes, batched; NaN in c is overwritten; beta != 0 and
// wrong shapes are errors.
TEST(CpuBackendTest, GemmBf16OutputIsTheCastOfTheFp32Product) {
  CpuBackend cpu;
  ModelKernels* mk = cpu.model().value();
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  auto bf16 = [&](Shape s) {
    Tensor f = Tensor::Empty(s, DType::kF32).value();
    for (int64_t i = 0; i < f.numel(); ++i) f.data<float>()[i] = nd(rng);
    Tensor h = Tensor::Empty(s, DType::kBF16).value();
    EXPECT_TRUE(mk->Cast(f, h).ok());
    return h;
  };
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (int64_t batch : {int64_t{0}, int64_t{3}}) {  // 0: rank 2
        SCOPED_TRACE(std::string("ta ") + (ta ? "T" : "N") + ", tb " + (tb ? "T" : "N") +
                     ", batch " + std::to_string(batch));
        const int64_t m = 7, n = 13, k = 29;
        auto shape = [&](int64_t r, int64_t c) {
          return batch == 0 ? Shape{r, c} : Shape{batch, r, c};
        };
        const Tensor a = bf16(ta ? shape(k, m) : shape(m, k));
        const Tensor b = bf16(tb ? shape(n, k) : shape(k, n));
        Tensor c32 = Tensor::Empty(shape(m, n), DType::kF32).value();
        Tensor c16 = Tensor::Empty(shape(m, n), DType::kBF16).value();
        ASSERT_TRUE(cpu.Fill(c16, std::numeric_limits<double>::quiet_NaN()).ok());
        const Transpose tA = ta ? Transpose::kYes : Transpose::kNo;
        const Transpose tB = tb ? Transpose::kYes : Transpose::kNo;
        ASSERT_TRUE(cpu.Gemm(tA, tB, 0.5f, a, b, 0.f, c32).ok());
        const absl::Status s = cpu.Gemm(tA, tB, 0.5f, a, b, 0.f, c16);
        ASSERT_TRUE(s.ok()) << s;
        Tensor want = Tensor::Empty(shape(m, n), DType::kBF16).value();
        ASSERT_TRUE(mk->Cast(c32, want).ok());
        EXPECT_EQ(std::memcmp(c16.raw(), want.raw(), want.nbytes()), 0);
        int nonzero = 0;
        for (int64_t i = 0; i < c16.numel(); ++i) nonzero += c16.data<uint16_t>()[i] != 0;
        EXPECT_GT(nonzero, c16.numel() / 2);
      }
    }
  }
  const Tensor a = bf16({4, 5}), b = bf16({5, 3});
  Tensor c = Tensor::Empty({4, 3}, DType::kBF16).value();
  absl::Status s = cpu.Gemm(Transpose::kNo, Transpose::kNo, 1.f, a, b, 1.f, c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "beta must be 0")) << s.message();
  Tensor wrong = Tensor::Empty({3, 4}, DType::kBF16).value();
  s = cpu.Gemm(Transpose::kNo, Transpose::kNo, 1.f, a, b, 0.f, wrong);
  EXPECT_TRUE(absl::StrContains(s.message(), "c must be 4 x 3")) << s.message();
}

}  // namespace
}  // namespace smat
