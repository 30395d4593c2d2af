// Device memory for training: a caching allocator over a backend's allocator,
// and a Backend that hands it out.
//
// A training step allocates and frees the same few hundred activation and
// gradient buffers every step. The CUDA backend's allocator is cudaMalloc /
// cudaFree, and cudaFree waits for the whole device, so every freed
// activation would stall the host until the GPU drained its queue and the
// next kernels could not be queued ahead. CachingAllocator keeps freed blocks
// by size and hands them out again: from the second step on a step allocates
// nothing from CUDA. Blocks are reused in host order on the backend's one
// stream, which orders every kernel that touched a block before any kernel of
// its next user (the communicators synchronise that stream before they read a
// buffer, trainer/smat_mixer.cc, trainer/train_loop.cc). When the device is
// full, the cached blocks are returned and the allocation retried.
//
// stats() counts the bytes handed out (live tensors), not the cache, so the
// progress line's memory is what the step needed; cached_bytes() is the rest.
//
//   std::unique_ptr<Backend> cached = MakeCachingBackend(*cuda_backend);
//   SMAT_ASSIGN_OR_RETURN(auto model, Model::Create(cfg, *cached));
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tensor.h"
#include "kernels/backend.h"

namespace smat {

class CachingAllocator final : public Allocator {
 public:
  // The caching allocator over `inner`, one per inner allocator for the whole
  // process and never destroyed (a Tensor's deleter calls its allocator, and
  // tensors may outlive whatever made them), like the allocators it wraps.
  static CachingAllocator& Over(Allocator& inner);

  Device device() const override { return inner_.device(); }
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* ptr) override;

  // Bytes held in the cache (freed by tensors, not returned to `inner`).
  int64_t cached_bytes() const;
  // Returns every cached block to `inner`.
  void Trim();
  // Fills every cached block with `value` as fp32 through `backend` (a test
  // aid: NaN there makes any read of memory a later tensor never wrote show).
  absl::Status FillCached(Backend& backend, double value);

 private:
  explicit CachingAllocator(Allocator& inner) : inner_(inner) {}

  Allocator& inner_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // by rounded size
  std::map<void*, size_t> sizes_;              // live blocks: rounded size
  int64_t cached_ = 0;
};

// A Backend that forwards everything to `inner` (which must outlive it) but
// allocates through CachingAllocator::Over(inner.allocator()).
std::unique_ptr<Backend> MakeCachingBackend(Backend& inner);

}  // namespace smat
