// Tests for core/rng.h: Philox4x32-10 known answers, the span property of the
// fill helpers (a span of a fill equals the fill of that span), and the moments
// of the uniform and normal conversions.
#include "core/rng.h"

#include <cmath>
#include <cstring>
#include <set>

#include "gtest/gtest.h"

namespace smat {
namespace {

void ExpectBlock(PhiloxCounter c, PhiloxKey k, uint32_t e0, uint32_t e1, uint32_t e2, uint32_t e3) {
  const PhiloxCounter out = Philox4x32(c, k);
  EXPECT_EQ(out.w[0], e0);
  EXPECT_EQ(out.w[1], e1);
  EXPECT_EQ(out.w[2], e2);
  EXPECT_EQ(out.w[3], e3);
}

// Random123 kat_vectors, philox4x32 with 10 rounds.
TEST(PhiloxTest, KnownAnswerVectors) {
  ExpectBlock({{0, 0, 0, 0}}, {{0, 0}}, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8);
  ExpectBlock({{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}}, {{0xffffffff, 0xffffffff}},
              0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd);
  ExpectBlock({{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, {{0xa4093822, 0x299f31d0}},
              0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1);
}

TEST(PhiloxTest, WordUsesTheDocumentedCounterLayout) {
  const uint64_t seed = 0x0123456789abcdefull, stream = 7;
  const uint64_t index = (uint64_t{5} << 32) * 4 + 4 * 3 + 2;  // block (5 << 32) + 3, lane 2
  PhiloxCounter c{{3, 5, 7, 0}};
  PhiloxKey k{{0x89abcdef, 0x01234567}};
  EXPECT_EQ(PhiloxWord(seed, stream, index), Philox4x32(c, k).w[2]);
}

TEST(PhiloxTest, UniformConversionIsExactAtTheEnds) {
  EXPECT_EQ(UniformFromWord(0), 0.0f);
  EXPECT_EQ(UniformFromWord(0xffffffffu), 1.0f - 5.9604644775390625e-08f);  // 1 - 2^-24 < 1
  EXPECT_LT(UniformFromWord(0xffffffffu), 1.0f);
  EXPECT_EQ(UniformOpenZeroFromWord(0), 5.9604644775390625e-08f);
  EXPECT_EQ(UniformOpenZeroFromWord(0xffffffffu), 1.0f);
  EXPECT_EQ(UniformFromWord(0x80000000u), 0.5f);
}

// Filling a view of elements [start, start + len) with offset `start` must give
// exactly the numbers at [start, start + len) of a full fill: spans at unaligned
// starts exercise the lane handling of a partial Philox block.
TEST(PhiloxTest, SpanOfFillEqualsFillOfSpan) {
  const int64_t n = 1031;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF64}) {
    for (int kind = 0; kind < 2; ++kind) {
      auto full = Tensor::Empty({n}, dt);
      ASSERT_TRUE(full.ok());
      auto fill = [&](Tensor& t, uint64_t off) {
        return kind == 0 ? FillUniform(t, 42, off, -1.f, 3.f, 9)
                         : FillNormal(t, 42, off, 0.5f, 2.f, 9);
      };
      ASSERT_TRUE(fill(*full, 0).ok());
      for (int64_t start : {0, 1, 2, 3, 5, 63, 1000}) {
        for (int64_t len : {1, 2, 3, 4, 7, 31}) {
          if (start + len > n) continue;
          auto part = Tensor::Empty({len}, dt);
          ASSERT_TRUE(part.ok());
          ASSERT_TRUE(fill(*part, start).ok());
          const size_t es = DTypeSize(dt);
          EXPECT_EQ(
              std::memcmp(part->raw(), static_cast<char*>(full->raw()) + start * es, len * es), 0)
              << DTypeName(dt) << " kind " << kind << " start " << start << " len " << len;
        }
      }
    }
  }
}

TEST(PhiloxTest, FillMatchesThePerElementFunctions) {
  auto u = Tensor::Empty({37}, DType::kF32);
  auto z = Tensor::Empty({37}, DType::kF32);
  ASSERT_TRUE(u.ok() && z.ok());
  ASSERT_TRUE(FillUniform(*u, 3, 11, 0.f, 1.f, 2).ok());
  ASSERT_TRUE(FillNormal(*z, 3, 11, 0.f, 1.f, 2).ok());
  for (int i = 0; i < 37; ++i) {
    EXPECT_EQ(u->data<float>()[i], PhiloxUniform(3, 2, 11 + i));
    EXPECT_EQ(z->data<float>()[i], PhiloxNormal(3, 2, 11 + i));
  }
}

TEST(PhiloxTest, SeedsAndStreamsGiveDifferentNumbers) {
  std::set<uint32_t> words;
  for (uint64_t seed : {0, 1}) {
    for (uint64_t stream : {0, 1}) {
      for (uint64_t i = 0; i < 8; ++i) words.insert(PhiloxWord(seed, stream, i));
    }
  }
  // 32 draws of 32-bit words: a collision has probability ~1e-7.
  EXPECT_EQ(words.size(), 32u);
}

TEST(PhiloxTest, UniformMoments) {
  const int64_t n = 1 << 18;
  auto t = Tensor::Empty({n}, DType::kF64);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(FillUniform(*t, 1234, 0).ok());
  double sum = 0, sq = 0, lo = 1, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = t->data<double>()[i];
    sum += v;
    sq += v * v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  const double mean = sum / n, var = sq / n - mean * mean;
  // U[0,1): mean 1/2, variance 1/12. Standard error of the mean is
  // sqrt(1/12/n) = 5.6e-4; 5e-3 is about 9 standard errors.
  EXPECT_NEAR(mean, 0.5, 5e-3);
  EXPECT_NEAR(var, 1.0 / 12, 2e-3);  // s.e. of the variance ~1.5e-4
  EXPECT_GE(lo, 0.0);
  EXPECT_LT(hi, 1.0);
}

TEST(PhiloxTest, NormalMoments) {
  const int64_t n = 1 << 18;
  auto t = Tensor::Empty({n}, DType::kF32);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(FillNormal(*t, 99, 5, 1.f, 3.f).ok());
  double sum = 0, sq = 0, cube = 0;
  int beyond_3sigma = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = (t->data<float>()[i] - 1.0) / 3.0;
    ASSERT_TRUE(std::isfinite(v)) << i;
    sum += v;
    sq += v * v;
    cube += v * v * v;
    beyond_3sigma += std::abs(v) > 3.0;
  }
  const double mean = sum / n, var = sq / n - mean * mean;
  // N(0,1): s.e. of the mean 1/sqrt(n) = 2e-3, of the variance sqrt(2/n) = 2.8e-3.
  EXPECT_NEAR(mean, 0.0, 1e-2);
  EXPECT_NEAR(var, 1.0, 1.5e-2);
  EXPECT_NEAR(cube / n, 0.0, 3e-2);  // skewness s.e. sqrt(15/n) = 7.6e-3
  // P(|z| > 3) = 0.0027 -> 708 expected of 2^18, s.d. ~27.
  EXPECT_NEAR(beyond_3sigma, 708, 150);
}

TEST(PhiloxTest, UniformIntCoversRangeAndRejectsBadInput) {
  auto t = Tensor::Empty({4000}, DType::kI32);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(FillUniformInt(*t, 5, 0, -3, 4).ok());
  int counts[7] = {0};
  for (int i = 0; i < 4000; ++i) {
    const int v = t->data<int32_t>()[i];
    ASSERT_GE(v, -3);
    ASSERT_LT(v, 4);
    counts[v + 3]++;
  }
  // Each value expected 571 times, s.d. ~22.
  for (int c : counts) EXPECT_NEAR(c, 4000 / 7.0, 120);

  EXPECT_EQ(FillUniformInt(*t, 5, 0, 4, 4).code(), absl::StatusCode::kInvalidArgument);
  auto f = Tensor::Empty({3}, DType::kF32);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(FillUniformInt(*f, 5, 0, 0, 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FillNormal(*t, 5, 0).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace smat
