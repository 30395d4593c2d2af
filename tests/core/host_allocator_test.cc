// The host allocator (core/host_allocator.h): size classes, reuse of freed
// blocks without growth, a cache that never holds more than its capacity
// (the blocks freed longest ago given back first), no cache at capacity 0,
// exact byte counts, and many threads at once.
#include "core/host_allocator.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

namespace smat {
namespace {

constexpr size_t kKiB = 1024, kMiB = kKiB * kKiB;

TEST(HostAllocatorTest, SizeClasses) {
  EXPECT_EQ(CachingHostAllocator::SizeClass(0), 64u);
  EXPECT_EQ(CachingHostAllocator::SizeClass(1), 64u);
  EXPECT_EQ(CachingHostAllocator::SizeClass(65), 128u);
  EXPECT_EQ(CachingHostAllocator::SizeClass(4 * kKiB), 4 * kKiB);
  EXPECT_EQ(CachingHostAllocator::SizeClass(4 * kKiB + 1), 8 * kKiB);
  EXPECT_EQ(CachingHostAllocator::SizeClass(kMiB), kMiB);
  EXPECT_EQ(CachingHostAllocator::SizeClass(kMiB + 1), kMiB + 128 * kKiB);
  EXPECT_EQ(CachingHostAllocator::SizeClass(64 * kMiB), 64 * kMiB);
  EXPECT_EQ(CachingHostAllocator::SizeClass(64 * kMiB + 1), 66 * kMiB);
}

TEST(HostAllocatorTest, ReusesFreedBlocksWithoutGrowth) {
  CachingHostAllocator a(/*capacity=*/size_t{1} << 30);
  const std::vector<size_t> sizes = {40, 4000, 777001, (3 << 20) + 5, (70 << 20) + 3};
  std::set<void*> first;
  for (int it = 0; it < 20; ++it) {
    std::vector<void*> ps;
    for (size_t n : sizes) {
      auto p = a.Allocate(n);
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_EQ(reinterpret_cast<uintptr_t>(*p) % 64, 0u) << n << " bytes";
      std::memset(*p, it, n);  // the whole request is usable
      ps.push_back(*p);
    }
    if (it == 0) {
      first.insert(ps.begin(), ps.end());
    } else {
      for (void* p : ps) ASSERT_TRUE(first.count(p)) << "iteration " << it << " got a new block";
    }
    for (void* p : ps) a.Free(p);
  }
  EXPECT_EQ(first.size(), sizes.size());
  size_t classes = 0;
  for (size_t n : sizes) classes += CachingHostAllocator::SizeClass(n);
  EXPECT_EQ(a.cached_bytes(), classes);
  EXPECT_EQ(a.stats().in_use_bytes, 0);
  // The bytes asked for, rounded to 64, not the classes.
  EXPECT_EQ(a.stats().peak_bytes, 64 + 4032 + 777024 + ((3 << 20) + 64) + ((70 << 20) + 64));
  a.ReleaseCache();
  EXPECT_EQ(a.cached_bytes(), 0u);
}

TEST(HostAllocatorTest, BlocksOfOtherClassesAreNotHandedOut) {
  CachingHostAllocator a(/*capacity=*/size_t{1} << 30);
  void* p = *a.Allocate(2 * kMiB);
  a.Free(p);
  void* q = *a.Allocate(3 * kMiB);  // another class: new memory
  EXPECT_NE(q, p);
  EXPECT_EQ(a.cached_bytes(), 2 * kMiB);
  void* r = *a.Allocate(2 * kMiB - 100);  // the same class as p
  EXPECT_EQ(r, p);
  EXPECT_EQ(a.cached_bytes(), 0u);
  a.Free(q);
  a.Free(r);
}

TEST(HostAllocatorTest, HoldsNoMoreThanItsCapacityGivingBackTheOldestFirst) {
  CachingHostAllocator a(/*capacity=*/8 * kMiB);
  void* b2 = *a.Allocate(2 * kMiB);
  void* b3 = *a.Allocate(3 * kMiB);
  void* b4 = *a.Allocate(4 * kMiB);
  void* b9 = *a.Allocate(9 * kMiB);
  a.Free(b2);
  a.Free(b3);
  EXPECT_EQ(a.cached_bytes(), 5 * kMiB);
  // 4 more would make 9 > 8: the block freed longest ago (2 MiB) goes back.
  a.Free(b4);
  EXPECT_EQ(a.cached_bytes(), 7 * kMiB);
  // Larger than the whole cache: straight back to the system.
  a.Free(b9);
  EXPECT_EQ(a.cached_bytes(), 7 * kMiB);
  // The cached classes are handed out again, the evicted one is not.
  EXPECT_EQ(*a.Allocate(3 * kMiB), b3);
  EXPECT_EQ(*a.Allocate(4 * kMiB), b4);
  EXPECT_EQ(a.cached_bytes(), 0u);
  void* again2 = *a.Allocate(2 * kMiB);  // new memory (may reuse b2's address)
  a.Free(again2);
  a.Free(b3);
  a.Free(b4);
  EXPECT_EQ(a.cached_bytes(), 9 * kMiB - 2 * kMiB);  // 2 evicted again to fit 4
  EXPECT_EQ(a.stats().in_use_bytes, 0);
}

TEST(HostAllocatorTest, TakesTheBlockOfItsClassFreedLast) {
  CachingHostAllocator a(/*capacity=*/size_t{1} << 30);
  void* x = *a.Allocate(kMiB);
  void* y = *a.Allocate(kMiB);
  a.Free(x);
  a.Free(y);
  EXPECT_EQ(*a.Allocate(kMiB), y);
  EXPECT_EQ(*a.Allocate(kMiB), x);
  a.Free(x);
  a.Free(y);
}

TEST(HostAllocatorTest, WithoutTheCacheEveryFreeGivesItsMemoryBack) {
  CachingHostAllocator a(/*capacity=*/0);
  for (int it = 0; it < 3; ++it) {
    void* p = *a.Allocate(5 * kMiB);
    std::memset(p, 1, 5 * kMiB);
    a.Free(p);
    EXPECT_EQ(a.cached_bytes(), 0u);
  }
  EXPECT_EQ(a.stats().in_use_bytes, 0);
}

TEST(HostAllocatorTest, ForeignPointersAreRefusedNotFreed) {
  CachingHostAllocator a(/*capacity=*/size_t{1} << 30);
  int local = 0;
  a.Free(&local);  // says so on stderr; must not crash or cache it
  a.Free(nullptr);
  EXPECT_EQ(a.cached_bytes(), 0u);
  void* p = *a.Allocate(100);
  EXPECT_NE(p, static_cast<void*>(&local));
  a.Free(p);
}

TEST(HostAllocatorTest, ManyThreadsAtOnce) {
  CachingHostAllocator a(/*capacity=*/4 * kMiB);  // evicting now and then too
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&a, &bad, t] {
      for (int it = 0; it < 500; ++it) {
        const size_t n = 1000 + static_cast<size_t>((t * 7919 + it * 104729) % (2 * kMiB));
        auto p = a.Allocate(n);
        if (!p.ok()) {
          ++bad[t];
          continue;
        }
        auto* bytes = static_cast<unsigned char*>(*p);
        std::memset(bytes, t + 1, n);
        std::this_thread::yield();
        // Nobody else was handed a block this thread holds.
        if (bytes[0] != t + 1 || bytes[n / 2] != t + 1 || bytes[n - 1] != t + 1) ++bad[t];
        a.Free(*p);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(bad[t], 0) << "thread " << t;
  EXPECT_EQ(a.stats().in_use_bytes, 0);
}

TEST(HostAllocatorTest, TensorsUseTheCachingAllocator) {
  auto* a = dynamic_cast<CachingHostAllocator*>(&CpuAllocator());
  ASSERT_NE(a, nullptr);
  void* first = nullptr;
  {
    auto t = Tensor::Empty({(5 << 20) + 3}, DType::kF32);  // a class no other test uses
    ASSERT_TRUE(t.ok());
    first = t->raw();
  }
  auto again = Tensor::Empty({(5 << 20) + 3}, DType::kF32);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->raw(), first);
}

}  // namespace
}  // namespace smat
