#include "core/tensor.h"

#include <cmath>
#include <cstring>

#include "gtest/gtest.h"

namespace smat {
namespace {

TEST(TensorTest, EmptyHasShapeDtypeAndBytes) {
  auto t = Tensor::Empty({2, 3, 5}, DType::kBF16);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->numel(), 30);
  EXPECT_EQ(t->nbytes(), 60u);
  EXPECT_EQ(t->rank(), 3);
  EXPECT_EQ(t->dim(-1), 5);
  EXPECT_TRUE(t->device().is_cpu());
  EXPECT_EQ(t->DebugString(), "bf16[2, 3, 5] on cpu");
}

TEST(TensorTest, ViewSharesStorageAndOutlivesParent) {
  Tensor view;
  {
    auto t = Tensor::Zeros({4, 6}, DType::kF32);
    ASSERT_TRUE(t.ok());
    for (int i = 0; i < 24; ++i) t->data<float>()[i] = static_cast<float>(i);
    view = t->View(6, {2, 6});
    t->data<float>()[7] = -1.f;
  }
  ASSERT_EQ(view.numel(), 12);
  EXPECT_EQ(view.data<float>()[0], 6.f);
  EXPECT_EQ(view.data<float>()[1], -1.f);  // written through the parent
  EXPECT_EQ(view.data<float>()[11], 17.f);
}

TEST(TensorTest, ReshapeChecksElementCount) {
  auto t = Tensor::Zeros({4, 6}, DType::kI32);
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(t->Reshape({24}).ok());
  auto bad = t->Reshape({5, 5});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("cannot reshape [4, 6]"), std::string::npos);
}

TEST(TensorTest, NegativeDimensionIsAnError) {
  auto t = Tensor::Empty({3, -1}, DType::kF32);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorTest, Bf16RoundTripRoundsToNearestEven) {
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f)), 1.0f);
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(-2.5f)), -2.5f);
  // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0).
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.0f / 256)), 1.0f);
  // Slightly above the midpoint rounds up.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.0f + 1.5f / 256)), 1.0f + 1.0f / 128);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
}

TEST(TensorTest, ParseDTypeNamesTheBadValue) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBF16);
  auto bad = ParseDType("fp8");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("'fp8'"), std::string::npos);
}

}  // namespace
TEST(TensorTest, AllocatorCountsLiveBytesAndPeak) {
  Allocator& a = CpuAllocator();
  a.ResetPeak();
  const int64_t before = a.stats().in_use_bytes;
  {
    auto x = Tensor::Empty({1000}, DType::kF32);  // 4000 bytes, rounded to 64: 4032
    ASSERT_TRUE(x.ok());
    EXPECT_EQ(a.stats().in_use_bytes, before + 4032);
    {
      auto y = Tensor::Empty({10}, DType::kF32);  // 40 -> 64
      ASSERT_TRUE(y.ok());
      EXPECT_EQ(a.stats().in_use_bytes, before + 4096);
    }
    EXPECT_EQ(a.stats().in_use_bytes, before + 4032);
  }
  EXPECT_EQ(a.stats().in_use_bytes, before);
  EXPECT_GE(a.stats().peak_bytes, before + 4096);
  a.ResetPeak();
  EXPECT_EQ(a.stats().peak_bytes, a.stats().in_use_bytes);
}

}  // namespace smat
