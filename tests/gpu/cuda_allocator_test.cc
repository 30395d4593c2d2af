// The CUDA backend's caching allocator (kernels/cuda/cuda_allocator.h): exact
// byte counts and peak, reuse of freed blocks without growth over a loop of
// allocate / use / free, and no reuse while another stream may still use a block.
#include <cstdint>
#include <set>
#include <vector>

#include "model_kernels_gpu_util.h"

namespace smat {
namespace gpu_test {
namespace {

// ------------------------------------------------------------------ the allocator

TEST_F(ModelKernelsGpuTest, AllocatorCountsBytesAndReusesFreedBlocks) {
  Allocator& a = gpu_->allocator();
  const int64_t before = a.stats().in_use_bytes;
  a.ResetPeak();
  {
    Tensor t1 = Tensor::Empty({1000}, DType::kF32, a).value();         // 4000 B
    Tensor t2 = Tensor::Empty({(3 << 20) + 5}, DType::kU16, a).value();  // 6 MiB + 10
    EXPECT_EQ(a.stats().in_use_bytes, before + 4000 + (6 << 20) + 10);
    Tensor t3 = Tensor::Empty({3}, DType::kF32, a).value();
    EXPECT_EQ(a.stats().in_use_bytes, before + 4000 + (6 << 20) + 10 + 12);
  }
  EXPECT_EQ(a.stats().in_use_bytes, before);
  EXPECT_EQ(a.stats().peak_bytes, before + 4000 + (6 << 20) + 10 + 12);

  // A loop of allocate / use / free reuses the same blocks: no growth. Sizes
  // no other test uses, so no block cached earlier can stand in.
  const std::vector<int64_t> sizes = {777001, (1 << 18) + 7, 3001, (50 << 20) + 1};
  std::set<void*> first;
  for (int it = 0; it < 40; ++it) {
    std::vector<Tensor> ts;
    for (int64_t n : sizes) {
      ts.push_back(Tensor::Empty({n}, DType::kF32, a).value());
      SMAT_ASSERT_OK(gpu_->Fill(ts.back(), it));  // kernels queued on the block
    }
    for (const Tensor& t : ts) {
      if (it == 0) {
        first.insert(t.raw());
      } else {
        ASSERT_TRUE(first.count(t.raw())) << "iteration " << it << " got a new block";
      }
    }
  }
  EXPECT_EQ(first.size(), sizes.size());
  EXPECT_EQ(a.stats().in_use_bytes, before);

  // Memory freed while another stream still works on it is not handed out
  // before that work is done: fill a large tensor on a second stream, free it
  // at once, take a block of the same size on the default stream and fill it
  // there; the later fill must win everywhere.
  auto side = gpu_->CreateStream();
  ASSERT_TRUE(side.ok()) << side.status();
  const int64_t big = (64 << 20) + 12345;  // ~256 MiB of fp32: the side fill takes a while
  void* freed = nullptr;
  {
    Tensor t = Tensor::Empty({big}, DType::kF32, a).value();
    freed = t.raw();
    for (int rep = 0; rep < 8; ++rep) SMAT_ASSERT_OK(gpu_->Fill(t, 1.0, side->get()));
  }
  Tensor u = Tensor::Empty({big}, DType::kF32, a).value();
  SMAT_ASSERT_OK(gpu_->Fill(u, 2.0));
  const Tensor hu = Host(u);
  int64_t wrong = 0;
  for (int64_t i = 0; i < big; ++i) wrong += hu.data<float>()[i] != 2.f;
  EXPECT_EQ(wrong, 0) << "a block was reused while another stream still wrote it";
  EXPECT_EQ(u.raw(), freed) << "the block of the same size should have been reused";
}

}  // namespace
}  // namespace gpu_test
}  // namespace smat
