// The per-type reads (SmatKernels::TypeReads) of bf16 rows at the
// benchmark's widths r = dv = 64 where a type holds fewer tokens than a tile
// of 128 on average, as at d = 3 (about 58 per type and head at T =
// 524288): the resident blocks of smat_reads_few_bf16.cu, and under
// SMAT_CUDA_READS=tiles the kernel of smat_reads_bf16.cu they replace,
// against the CPU phase within 1e-5 (TileTol: 2^-6 with one bf16 part).
// MakeSmatPlan's q is fixed so that the types hold 34 to 98 tokens: items of
// one tile and of two, a last tile of a few tokens, more items than resident
// blocks; positional and content types (lists of uneven length), gated and
// not, whole sequences and spans that start inside them, batch 2. Both
// writes (= and +=) start from the same random values on both sides, so the
// rows the phase must leave alone are checked too; (=) starts the GPU's
// recent rows from NaN, so an unwritten row fails. Two runs give the same
// bits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/smat_kernels.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/smat_gpu_cases.h"
#include "tests/kernels/smat_test_util.h"

namespace smat {
namespace {

using gpu_test::GpuTest;
using gpu_test::HostTensor;
using gpu_test::RandomUniform;
using gpu_test::ToDevice;
using gpu_test::ToHost;

class SmatReadsGpuTest : public GpuTest {};

TEST_F(SmatReadsGpuTest, TypeReadsOfFewTokensPerTypeMatchTheCpu) {
  SMAT_ASSERT_OK_AND_ASSIGN(SmatKernels * ck, cpu_->smat());
  SMAT_ASSERT_OK_AND_ASSIGN(SmatKernels * gk, gpu_->smat());
  struct Config {
    int64_t batch, T, H, q;
    bool gated, content;
    int64_t t0;
  };
  // Recent tokens per type and head, (T - n) / (q (q + 1)) at d = 3 with n =
  // 128 floor(T / 256): 81 (two tiles, the second of 17 tokens), 34, 98 over
  // 1224 items and 54 over 4416 (several items per resident block); 34 and
  // 81 on average in lists of uneven length.
  const Config configs[] = {
      {1, 9000, 3, 7, false, false, 0},   {2, 9000, 2, 11, true, false, 256},
      {1, 60000, 4, 17, false, false, 0}, {1, 60000, 8, 23, true, false, 3200},
      {1, 9000, 2, 11, true, true, 0},    {2, 9000, 3, 7, false, true, 4480},
  };
  constexpr int64_t kR = 64, kDv = 64, kP = kDv + 1, kChunk = 128;
  uint32_t seed = 1;
  for (const Config& c : configs) {
    SMAT_ASSERT_OK_AND_ASSIGN(const SmatPlan plan, MakeSmatPlan(c.T, 3, kChunk, c.q));
    const SmatSpan span{c.t0, c.T};
    const int64_t b = c.batch, L = span.length(), Lc = span.num_chunks(plan), H = c.H,
                  B = plan.geo.B;
    const std::string name =
        absl::StrCat("b", b, " T", c.T, " H", H, " q", c.q, c.gated ? " gated" : "",
                     c.content ? " content" : "", " t0 ", c.t0);
    SCOPED_TRACE(name);
    // phi in bf16 (the CPU gets the same values in fp32), U in fp32.
    const Tensor phi_bf16 =
        HostTensor({b, L, H, kR}, DType::kBF16, RandomUniform(b * L * H * kR, seed++));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor phi_cpu, Tensor::Empty({b, L, H, kR}, DType::kF32));
    for (int64_t i = 0; i < phi_cpu.numel(); ++i) {
      phi_cpu.data<float>()[i] = Bf16ToFloat(phi_bf16.data<uint16_t>()[i]);
    }
    const Tensor U =
        HostTensor({b, H, B, kR, kP}, DType::kF32, RandomUniform(b * H * B * kR * kP, seed++));
    Tensor lam, chunk_decay, recent_offset, type;
    if (c.gated) {
      std::vector<float> logg = RandomUniform(b * L * H, seed++);
      for (float& x : logg) x = -0.075f * (x + 1.f);  // in [-0.15, 0]
      std::vector<float> off = RandomUniform(b * H, seed++);
      for (float& x : off) x = -0.5f * std::abs(x);
      recent_offset = HostTensor({b, H}, DType::kF32, off);
      SMAT_ASSERT_OK_AND_ASSIGN(lam, Tensor::Empty({b, L, H}, DType::kF32));
      SMAT_ASSERT_OK_AND_ASSIGN(chunk_decay, Tensor::Empty({b, Lc, H}, DType::kF32));
      SMAT_ASSERT_OK(ck->ChunkLogDecay(plan, span, HostTensor({b, L, H}, DType::kF32, logg), &lam,
                                       &chunk_decay, nullptr));
    }
    if (c.content) {
      // Types drawn from the first half of [0, B) twice as often, so that the
      // lists' lengths differ.
      std::mt19937 rng(seed++);
      std::uniform_int_distribution<int32_t> all(0, static_cast<int32_t>(B - 1)),
          low(0, static_cast<int32_t>(B / 2));
      std::vector<int32_t> t(static_cast<size_t>(b * L * H));
      for (size_t i = 0; i < t.size(); ++i) {
        t[i] = i % 3 != 0 ? low(rng) : all(rng);
      }
      type = testing_util::ToI32(t, {b, L, H});
    }
    auto device = [&](const Tensor& host) -> Tensor {
      return host.defined() ? ToDevice(*gpu_, host).value() : Tensor();
    };
    const Tensor phi_d = device(phi_bf16), U_d = device(U), lam_d = device(lam),
                 cd_d = device(chunk_decay), off_d = device(recent_offset), type_d = device(type);

    const int64_t begin = span.recent_begin(plan) - span.t0;
    for (const SmatWrite write : {SmatWrite::kAssign, SmatWrite::kAdd}) {
      // The same random start on both sides; the GPU's rows of the recent
      // tokens NaN for (=), which must write every one of them.
      std::vector<float> start = RandomUniform(b * L * H * kP, seed++);
      Tensor out_cpu = HostTensor({b, L, H, kP}, DType::kF32, start);
      SMAT_ASSERT_OK(ck->TypeReads(plan, span, phi_cpu, U, lam, chunk_decay, recent_offset, type,
                                   &out_cpu, write, nullptr));
      const std::vector<double> ref = testing_util::ToDouble(out_cpu);
      double recent_max = 0.0;  // the largest read of a recent token
      for (int64_t bb = 0; bb < b; ++bb) {
        for (int64_t e = (bb * L + begin) * H * kP; e < (bb + 1) * L * H * kP; ++e) {
          if (write == SmatWrite::kAssign) {
            recent_max = std::max(recent_max, std::abs(ref[e]));
            start[e] = NAN;
          } else {
            recent_max = std::max(recent_max, std::abs(ref[e] - start[e]));
          }
        }
      }
      for (const char* form : {"", "tiles"}) {
        ASSERT_EQ(setenv("SMAT_CUDA_READS", form, 1), 0);
        const std::string what =
            absl::StrCat(name, write == SmatWrite::kAssign ? " (=)" : " (+=)",
                         *form ? absl::StrCat(" [", form, "]") : std::string());
        const Tensor start_host = HostTensor({b, L, H, kP}, DType::kF32, start);
        SMAT_ASSERT_OK_AND_ASSIGN(Tensor out_d, ToDevice(*gpu_, start_host));
        SMAT_ASSERT_OK_AND_ASSIGN(Tensor again_d, ToDevice(*gpu_, start_host));
        for (Tensor* o : {&out_d, &again_d}) {
          SMAT_ASSERT_OK(
              gk->TypeReads(plan, span, phi_d, U_d, lam_d, cd_d, off_d, type_d, o, write, nullptr));
        }
        SMAT_ASSERT_OK(gpu_->Synchronize(nullptr));
        SMAT_ASSERT_OK_AND_ASSIGN(const Tensor out_g, ToHost(*gpu_, out_d));
        SMAT_ASSERT_OK_AND_ASSIGN(const Tensor again_g, ToHost(*gpu_, again_d));
        const double err = testing_util::MaxRelError(testing_util::ToDouble(out_g), ref);
        std::printf("  %-56s rel err %.3g (largest read %.3g)\n", what.c_str(), err, recent_max);
        EXPECT_LE(err, smat_gpu_cases::TileTol(true, smat_gpu_cases::kF32Tol)) << what;
        EXPECT_GT(recent_max, 0.5) << what << ": the reads are too small to judge";
        EXPECT_EQ(std::memcmp(out_g.raw(), again_g.raw(), out_g.nbytes()), 0)
            << what << ": two runs differ in bits";
      }
    }
    ASSERT_EQ(unsetenv("SMAT_CUDA_READS"), 0);
  }
}

}  // namespace
}  // namespace smat
