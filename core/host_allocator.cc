// CachingHostAllocator (host_allocator.h) and CpuAllocator() (tensor.h).
#include "core/host_allocator.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace smat {
namespace {

size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

constexpr size_t kMiB = size_t{1} << 20;
constexpr int64_t kDefaultCapacityMiB = 1024;

// SMAT_HOST_ALLOCATOR_CACHE in MiB; anything but a whole number >= 0 is
// reported and the default kept.
size_t CapacityFromEnvironment() {
  const char* env = std::getenv("SMAT_HOST_ALLOCATOR_CACHE");
  int64_t mib = kDefaultCapacityMiB;
  if (env != nullptr && (!absl::SimpleAtoi(env, &mib) || mib < 0 || mib > (int64_t{1} << 30))) {
    std::fprintf(stderr,
                 "smat: SMAT_HOST_ALLOCATOR_CACHE=%s is not a size in MiB (0 turns the cache "
                 "off); caching up to %lld MiB\n",
                 env, static_cast<long long>(kDefaultCapacityMiB));
    mib = kDefaultCapacityMiB;
  }
  return static_cast<size_t>(mib) * kMiB;
}

}  // namespace

size_t CachingHostAllocator::SizeClass(size_t bytes) {
  constexpr size_t kKiB = 1024;
  if (bytes <= 4 * kKiB) return RoundUp(bytes == 0 ? 1 : bytes, 64);
  if (bytes <= kMiB) return RoundUp(bytes, 4 * kKiB);
  if (bytes <= 64 * kMiB) return RoundUp(bytes, 128 * kKiB);
  return RoundUp(bytes, 2 * kMiB);
}

CachingHostAllocator::~CachingHostAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  ReleaseCacheLocked();
}

absl::StatusOr<void*> CachingHostAllocator::Allocate(size_t bytes) {
  const size_t size = SizeClass(bytes);
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cached_.find(size);
    if (it != cached_.end()) {
      p = it->second.back().second;  // the one freed last: likeliest still in cache
      it->second.pop_back();
      if (it->second.empty()) cached_.erase(it);
      cached_bytes_ -= size;
    } else {
      p = std::aligned_alloc(64, size);
      if (p == nullptr && cached_bytes_ > 0) {
        ReleaseCacheLocked();
        p = std::aligned_alloc(64, size);
      }
      if (p == nullptr) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "host allocation of ", bytes, " bytes failed (after giving back the cache)"));
      }
      block_size_[p] = size;
    }
  }
  RecordAllocate(p, RoundUp(bytes == 0 ? 1 : bytes, 64));
  return p;
}

void CachingHostAllocator::Free(void* ptr) {
  if (ptr == nullptr) return;
  RecordFree(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = block_size_.find(ptr);
  if (it == block_size_.end()) {
    std::fprintf(stderr, "smat: host allocator asked to free %p, which it never gave out\n", ptr);
    return;
  }
  const size_t size = it->second;
  if (size > capacity_) {
    block_size_.erase(it);
    std::free(ptr);
    return;
  }
  while (cached_bytes_ + size > capacity_ && !cached_.empty()) EvictOldestLocked();
  cached_[size].emplace_back(frees_++, ptr);
  cached_bytes_ += size;
}

size_t CachingHostAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_bytes_;
}

void CachingHostAllocator::ReleaseCache() {
  std::lock_guard<std::mutex> lock(mu_);
  ReleaseCacheLocked();
}

void CachingHostAllocator::EvictOldestLocked() {
  auto oldest = cached_.end();
  for (auto it = cached_.begin(); it != cached_.end(); ++it) {
    if (oldest == cached_.end() || it->second.front().first < oldest->second.front().first) {
      oldest = it;
    }
  }
  if (oldest == cached_.end()) return;
  void* p = oldest->second.front().second;
  oldest->second.pop_front();
  cached_bytes_ -= oldest->first;
  if (oldest->second.empty()) cached_.erase(oldest);
  block_size_.erase(p);
  std::free(p);
}

void CachingHostAllocator::ReleaseCacheLocked() {
  for (auto& [size, blocks] : cached_) {
    for (const auto& [order, p] : blocks) {
      block_size_.erase(p);
      std::free(p);
    }
  }
  cached_.clear();
  cached_bytes_ = 0;
}

Allocator& CpuAllocator() {
  // Never destroyed: it outlives every tensor, whatever the order of static
  // destruction.
  static CachingHostAllocator* alloc = new CachingHostAllocator(CapacityFromEnvironment());
  return *alloc;
}

}  // namespace smat
