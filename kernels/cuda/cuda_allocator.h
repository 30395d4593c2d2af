// The device memory allocator of the CUDA backend: one per device for the
// whole process (tensors may outlive the backend that allocated them), caching
// freed blocks so that steady-state training allocates without cudaMalloc and
// frees without cudaFree (which synchronises the whole device).
//
// The reuse rule. A freed block is not reused until the work that may still
// read or write it has finished: Free records an event on every stream
// registered with the allocator (each CudaBackend's default stream and every
// stream from CudaBackend::CreateStream), and the block becomes reusable once
// all of those events have completed. So a tensor may be dropped while kernels
// that use it are still queued on any registered stream. Work on a stream the
// allocator does not know (NCCL's own stream in parallel/cuda) must have
// completed before its buffers are freed: NcclCommunicator's Wait does that.
//
// Sizes are rounded up to classes (512 B below 1 MiB, 128 KiB below 64 MiB,
// 2 MiB above) and a request takes a cached block of exactly its class. When
// none is ready but a block of that class is still in flight, the allocator
// waits for that block's events instead of growing (so a host running ahead of
// the GPU does not inflate the footprint). When cudaMalloc fails, it
// synchronises the device, returns every cached block to the driver (and trims
// the default stream-ordered pool that scratch memory comes from), and retries
// once; the error then says how much was asked and how much is free.
// stats() counts the bytes asked for, not the rounded sizes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace smat {

class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device) : device_(device) {}
  Device device() const override { return Device::Cuda(device_); }

  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* ptr) override;

  // Streams whose queued work may use this allocator's memory. Unregister
  // synchronises the stream first (its events could no longer be recorded),
  // so call it right before destroying the stream.
  void RegisterStream(cudaStream_t stream);
  void UnregisterStream(cudaStream_t stream);

  // Device memory held from the driver: in use, cached and in flight.
  size_t reserved_bytes() const;

 private:
  struct InFlight {
    void* ptr;
    size_t size;                       // the block's size class
    std::vector<cudaEvent_t> events;  // one per registered stream at Free time
  };

  static size_t SizeClass(size_t bytes);
  // Moves in-flight blocks whose events have all completed to the cache.
  void ReclaimLocked();
  void RecycleEventsLocked(std::vector<cudaEvent_t>& events);
  // Waits for the oldest in-flight block of `size`; false when there is none.
  bool WaitForInFlightLocked(size_t size);
  // Synchronises the device and gives every cached block back to the driver.
  void ReleaseCacheLocked();

  const int device_;
  mutable std::mutex mu_;
  std::vector<cudaStream_t> streams_;               // guarded by mu_
  std::map<size_t, std::vector<void*>> cached_;     // size class -> ready blocks
  std::deque<InFlight> in_flight_;                  // in order of Free
  std::unordered_map<void*, size_t> block_size_;    // every block handed out or cached
  std::vector<cudaEvent_t> spare_events_;
  size_t reserved_ = 0;
};

// The allocator of CUDA device `device`, created on first use and never
// destroyed (like CpuAllocator(); the library is never unloaded).
CudaCachingAllocator& DeviceAllocator(int device);

}  // namespace smat
