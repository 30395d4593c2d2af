// CudaCachingAllocator (cuda_allocator.h).
#include "kernels/cuda/cuda_allocator.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/cuda/cuda_check.h"

namespace smat {
namespace {

// Makes `device` current for one scope and restores the caller's device.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      restore_ = cudaSetDevice(device) == cudaSuccess;
    }
  }
  ~DeviceScope() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

}  // namespace

size_t CudaCachingAllocator::SizeClass(size_t bytes) {
  constexpr size_t kMiB = size_t{1} << 20;
  if (bytes < kMiB) return RoundUp(std::max<size_t>(bytes, 1), 512);
  if (bytes < 64 * kMiB) return RoundUp(bytes, 128 << 10);
  return RoundUp(bytes, 2 * kMiB);
}

absl::StatusOr<void*> CudaCachingAllocator::Allocate(size_t bytes) {
  const size_t size = SizeClass(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  DeviceScope scope(device_);
  ReclaimLocked();
  auto take_cached = [&]() -> void* {
    auto it = cached_.find(size);
    if (it == cached_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    return p;
  };
  void* p = take_cached();
  if (p == nullptr && WaitForInFlightLocked(size)) p = take_cached();
  if (p == nullptr) {
    cudaError_t err = cudaMalloc(&p, size);
    if (err != cudaSuccess) {
      cudaGetLastError();  // an allocation failure is not sticky; clear it
      ReleaseCacheLocked();
      err = cudaMalloc(&p, size);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      return Annotate(CudaStatus(err, "cudaMalloc"),
                      absl::StrCat("allocating ", bytes, " bytes on cuda:", device_, " (",
                                   free_bytes >> 20, " MiB free of ", total_bytes >> 20,
                                   " MiB, after releasing the allocator's cache)"));
    }
    block_size_[p] = size;
    reserved_ += size;
  }
  RecordAllocate(p, bytes);
  return p;
}

void CudaCachingAllocator::Free(void* ptr) {
  if (ptr == nullptr) return;
  RecordFree(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = block_size_.find(ptr);
  if (it == block_size_.end()) {
    std::fprintf(stderr, "smat: cuda:%d allocator asked to free %p, which it never gave out\n",
                 device_, ptr);
    return;
  }
  DeviceScope scope(device_);
  InFlight block{ptr, it->second, {}};
  for (cudaStream_t s : streams_) {
    cudaEvent_t e = nullptr;
    if (!spare_events_.empty()) {
      e = spare_events_.back();
      spare_events_.pop_back();
    } else if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
      // Cannot tell when the stream is done with the block: wait for it now.
      cudaGetLastError();
      cudaStreamSynchronize(s);
      continue;
    }
    if (cudaEventRecord(e, s) != cudaSuccess) {
      // At process exit the runtime may be torn down; the memory goes with the
      // context then, and waiting is the safe answer otherwise.
      cudaGetLastError();
      cudaStreamSynchronize(s);
      spare_events_.push_back(e);
      continue;
    }
    block.events.push_back(e);
  }
  in_flight_.push_back(std::move(block));
}

void CudaCachingAllocator::RegisterStream(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.push_back(stream);
}

void CudaCachingAllocator::UnregisterStream(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::find(streams_.begin(), streams_.end(), stream);
  if (it == streams_.end()) return;
  DeviceScope scope(device_);
  // Blocks freed from now on record no event on this stream, so whatever it
  // still has queued must finish first.
  cudaStreamSynchronize(stream);
  streams_.erase(it);
}

size_t CudaCachingAllocator::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}

void CudaCachingAllocator::RecycleEventsLocked(std::vector<cudaEvent_t>& events) {
  spare_events_.insert(spare_events_.end(), events.begin(), events.end());
  events.clear();
}

void CudaCachingAllocator::ReclaimLocked() {
  // In order of Free: a block's events were recorded after those of the
  // blocks before it on each stream, so the first unfinished block ends the
  // scan (later ones are very likely unfinished too).
  while (!in_flight_.empty()) {
    InFlight& block = in_flight_.front();
    while (!block.events.empty()) {
      const cudaError_t err = cudaEventQuery(block.events.back());
      if (err == cudaErrorNotReady) return;
      if (err != cudaSuccess) cudaGetLastError();  // a broken context: nothing runs any more
      spare_events_.push_back(block.events.back());
      block.events.pop_back();
    }
    cached_[block.size].push_back(block.ptr);
    in_flight_.pop_front();
  }
}

bool CudaCachingAllocator::WaitForInFlightLocked(size_t size) {
  for (auto it = in_flight_.begin(); it != in_flight_.end(); ++it) {
    if (it->size != size) continue;
    for (cudaEvent_t e : it->events) {
      if (cudaEventSynchronize(e) != cudaSuccess) cudaGetLastError();
    }
    RecycleEventsLocked(it->events);
    cached_[it->size].push_back(it->ptr);
    in_flight_.erase(it);
    ReclaimLocked();  // the blocks freed before it have most likely finished too
    return true;
  }
  return false;
}

void CudaCachingAllocator::ReleaseCacheLocked() {
  cudaDeviceSynchronize();
  cudaGetLastError();
  for (InFlight& block : in_flight_) {
    RecycleEventsLocked(block.events);
    cached_[block.size].push_back(block.ptr);
  }
  in_flight_.clear();
  for (auto& [size, blocks] : cached_) {
    for (void* p : blocks) {
      cudaFree(p);
      block_size_.erase(p);
      reserved_ -= size;
    }
  }
  cached_.clear();
  // Scratch memory of the kernels comes from the default stream-ordered pool,
  // which keeps what it reserved; give that back too.
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, device_) == cudaSuccess) cudaMemPoolTrimTo(pool, 0);
  cudaGetLastError();
}

CudaCachingAllocator& DeviceAllocator(int device) {
  static std::mutex mu;
  static auto* allocators = new std::map<int, CudaCachingAllocator*>();
  std::lock_guard<std::mutex> lock(mu);
  CudaCachingAllocator*& a = (*allocators)[device];
  if (a == nullptr) a = new CudaCachingAllocator(device);
  return *a;
}

}  // namespace smat
