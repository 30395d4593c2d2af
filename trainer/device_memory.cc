// The caching allocator and backend (device_memory.h).
#include "trainer/device_memory.h"

#include <algorithm>
#include <utility>

#include "kernels/decode.h"

namespace smat {
namespace {

// Backend::CreateDecoder is forwarded where the Backend interface has it (the
// overload on int wins), and answered Unimplemented where it does not.
template <typename B>
auto ForwardCreateDecoder(B& backend, const DecoderSpec& spec, int)
    -> decltype(backend.CreateDecoder(spec)) {
  return backend.CreateDecoder(spec);
}
template <typename B>
absl::StatusOr<std::unique_ptr<Decoder>> ForwardCreateDecoder(B&, const DecoderSpec&, long) {
  return absl::UnimplementedError("this backend does not create decoders");
}

// Sizes are rounded up to 512 bytes, so buffers of nearly one size share
// blocks; a step's sizes repeat exactly every step anyway.
constexpr size_t kGranule = 512;

size_t Rounded(size_t bytes) {
  return std::max<size_t>(kGranule, (bytes + kGranule - 1) / kGranule * kGranule);
}

class CachingBackend final : public Backend {
 public:
  explicit CachingBackend(Backend& inner)
      : inner_(inner), alloc_(CachingAllocator::Over(inner.allocator())) {}

  Device device() const override { return inner_.device(); }
  std::string name() const override { return inner_.name(); }
  Allocator& allocator() override { return alloc_; }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override { return inner_.CreateStream(); }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override { return inner_.CreateEvent(); }
  absl::Status Record(Event& event, Stream* stream) override { return inner_.Record(event, stream); }
  absl::Status Wait(Stream* stream, Event& event) override { return inner_.Wait(stream, event); }
  absl::Status Synchronize(Stream* stream) override { return inner_.Synchronize(stream); }
  absl::StatusOr<float> ElapsedMs(Event& start, Event& stop) override {
    return inner_.ElapsedMs(start, stop);
  }
  absl::Status Copy(const Tensor& src, Tensor& dst, Stream* stream) override {
    return inner_.Copy(src, dst, stream);
  }
  absl::Status Fill(Tensor& t, double value, Stream* stream) override {
    return inner_.Fill(t, value, stream);
  }
  absl::Status Axpy(float alpha, const Tensor& x, Tensor& y, Stream* stream) override {
    return inner_.Axpy(alpha, x, y, stream);
  }
  absl::Status Gemm(Transpose ta, Transpose tb, float alpha, const Tensor& a, const Tensor& b,
                    float beta, Tensor& c, Stream* stream) override {
    return inner_.Gemm(ta, tb, alpha, a, b, beta, c, stream);
  }
  absl::StatusOr<SmatKernels*> smat() override { return inner_.smat(); }
  absl::StatusOr<ModelKernels*> model() override { return inner_.model(); }
  // No `override`: the interface may or may not declare it (see above); where
  // it does, this overrides it, with the decoder's cache from the inner backend.
  absl::StatusOr<std::unique_ptr<Decoder>> CreateDecoder(const DecoderSpec& spec) {
    return ForwardCreateDecoder(inner_, spec, 0);
  }

 private:
  Backend& inner_;
  CachingAllocator& alloc_;
};

}  // namespace

CachingAllocator& CachingAllocator::Over(Allocator& inner) {
  static std::mutex mu;
  static auto* all = new std::map<Allocator*, CachingAllocator*>();
  std::lock_guard<std::mutex> lock(mu);
  CachingAllocator*& a = (*all)[&inner];
  if (a == nullptr) a = new CachingAllocator(inner);
  return *a;
}

absl::StatusOr<void*> CachingAllocator::Allocate(size_t bytes) {
  const size_t size = Rounded(bytes);
  void* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(size);
    if (it != free_.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
      cached_ -= static_cast<int64_t>(size);
    }
  }
  if (p == nullptr) {
    absl::StatusOr<void*> fresh = inner_.Allocate(size);
    if (!fresh.ok()) {
      // Full: give the cache back and try once more.
      Trim();
      fresh = inner_.Allocate(size);
    }
    if (!fresh.ok()) return fresh.status();
    p = *fresh;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    sizes_[p] = size;
  }
  RecordAllocate(p, size);
  return p;
}

void CachingAllocator::Free(void* ptr) {
  if (ptr == nullptr) return;
  RecordFree(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sizes_.find(ptr);
  if (it == sizes_.end()) return;  // not ours: nothing to do
  free_[it->second].push_back(ptr);
  cached_ += static_cast<int64_t>(it->second);
  sizes_.erase(it);
}

int64_t CachingAllocator::cached_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cached_;
}

void CachingAllocator::Trim() {
  std::map<size_t, std::vector<void*>> blocks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    blocks.swap(free_);
    cached_ = 0;
  }
  // cudaFree waits for the device, so no kernel still reads a block freed here.
  for (auto& [size, ptrs] : blocks) {
    for (void* p : ptrs) inner_.Free(p);
  }
}

absl::Status CachingAllocator::FillCached(Backend& backend, double value) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [size, ptrs] : free_) {
    for (void* p : ptrs) {
      Tensor t = Tensor::Wrap(p, {static_cast<int64_t>(size / sizeof(float))}, DType::kF32,
                              inner_.device());
      SMAT_RETURN_IF_ERROR(backend.Fill(t, value));
    }
  }
  return backend.Synchronize(nullptr);
}

std::unique_ptr<Backend> MakeCachingBackend(Backend& inner) {
  return std::make_unique<CachingBackend>(inner);
}

}  // namespace smat
