// The host allocator of tensors (CpuAllocator(), core/tensor.h): 64-byte
// aligned memory, with freed blocks cached for reuse.
//
// Why cache: glibc serves large requests with mmap (from 32 MiB always,
// smaller ones until its threshold has adapted) and gives them back with
// munmap, so a training loop that allocates and frees the same activations
// every step faults their pages in afresh each time. Over 40 steps of
// configs/demo_cpu.textproto on one rank that was about 1.4 million page
// faults and a quarter of the process's time in the kernel. A cached block is
// handed out again with its pages already mapped.
//
// Sizes are rounded up to classes (64 B up to 4 KiB, 4 KiB up to 1 MiB,
// 128 KiB up to 64 MiB, 2 MiB above), and a request takes the block of its
// class freed last, else new memory. The cache holds at most `capacity`
// bytes: a freed block larger than that goes back to the system at once, and
// caching one that does not fit gives back the blocks freed longest ago until
// it does. So the process holds at most `capacity` bytes more than its tensors
// need, however their sizes change (a sweep over T, a checkpoint's host
// copies). When the system refuses memory, the cache is given back and the
// request tried once more. Memory handed out is not cleared
// (Tensor::Empty is uninitialised). stats() counts the bytes asked for rounded
// up to 64, not the classes.
//
// SMAT_HOST_ALLOCATOR_CACHE (read once, by the first use of CpuAllocator())
// sets CpuAllocator()'s capacity in MiB: unset, 1024; 0 turns the cache off,
// every Free returning its memory at once (for memory checkers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace smat {

class CachingHostAllocator final : public Allocator {
 public:
  explicit CachingHostAllocator(size_t capacity) : capacity_(capacity) {}
  ~CachingHostAllocator() override;
  CachingHostAllocator(const CachingHostAllocator&) = delete;
  CachingHostAllocator& operator=(const CachingHostAllocator&) = delete;

  Device device() const override { return Device::Cpu(); }
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* ptr) override;

  // Bytes of the blocks cached now (freed, not yet given back).
  size_t cached_bytes() const;
  // Gives every cached block back to the system.
  void ReleaseCache();

  static size_t SizeClass(size_t bytes);

 private:
  // Gives back the block freed longest ago.
  void EvictOldestLocked();
  void ReleaseCacheLocked();

  const size_t capacity_;
  mutable std::mutex mu_;
  // Size class -> its cached blocks with the order they were freed in, oldest
  // first.
  std::map<size_t, std::deque<std::pair<uint64_t, void*>>> cached_;
  std::unordered_map<void*, size_t> block_size_;  // every block handed out or cached
  size_t cached_bytes_ = 0;
  uint64_t frees_ = 0;
};

}  // namespace smat
