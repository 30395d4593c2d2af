// Tensor: dtype, shape, device and an owning (reference-counted) buffer.
//
// A Tensor is always contiguous in C order. Views share the buffer of the
// tensor they come from (View, Reshape) and keep it alive. Memory on a device
// comes from an Allocator; the CPU allocator lives here, device allocators are
// provided by the kernels/ backends (core knows nothing about CUDA).
//
//   SMAT_ASSIGN_OR_RETURN(Tensor x, Tensor::Empty({B, T, H, r}, DType::kF32));
//   float* p = x.data<float>();          // host tensors only
//   Tensor row = x.View(t * H * r, {H, r});
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/status.h"

namespace smat {

enum class DType : int { kF32 = 0, kF64 = 1, kBF16 = 2, kI32 = 3, kI64 = 4, kU16 = 5 };

size_t DTypeSize(DType t);
const char* DTypeName(DType t);  // "fp32", "fp64", "bf16", "int32", "int64", "uint16"
absl::StatusOr<DType> ParseDType(const std::string& name);

enum class DeviceKind : int { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;
  static Device Cpu() { return {DeviceKind::kCpu, 0}; }
  static Device Cuda(int i = 0) { return {DeviceKind::kCuda, i}; }
  bool is_cpu() const { return kind == DeviceKind::kCpu; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  std::string ToString() const;  // "cpu", "cuda:0"
};

// Raw memory for one device. Implementations: CpuAllocator (below), and the
// device allocators of the backends in kernels/.
// Every allocator counts what it hands out (stats(): the bytes live now and
// their high-water mark since the last ResetPeak), so the trainer can report
// the memory of a step on any device.
class Allocator {
 public:
  struct Stats {
    int64_t in_use_bytes = 0;  // allocated and not yet freed
    int64_t peak_bytes = 0;    // most in use at once since the last ResetPeak
  };
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;

  Stats stats() const;
  void ResetPeak();  // peak_bytes = in_use_bytes

 protected:
  // Implementations call these on every successful allocation and every free.
  void RecordAllocate(void* ptr, size_t bytes);
  void RecordFree(void* ptr);

 private:
  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;
  Stats stats_;
};

// 64-byte aligned host memory, freed blocks cached for reuse
// (CachingHostAllocator, core/host_allocator.h). Process-wide and thread-safe.
Allocator& CpuAllocator();

using Shape = std::vector<int64_t>;
int64_t NumElements(absl::Span<const int64_t> shape);
std::string ShapeToString(absl::Span<const int64_t> shape);  // "[2, 3, 4]"

// bf16 <-> fp32 on the host (round to nearest even, NaN kept quiet).
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t b);

class Tensor {
 public:
  Tensor() = default;  // empty: no buffer, numel 0

  // Uninitialised memory from `alloc` (host memory by default).
  static absl::StatusOr<Tensor> Empty(Shape shape, DType dtype,
                                      Allocator& alloc = CpuAllocator());
  // Host tensor filled with zeros.
  static absl::StatusOr<Tensor> Zeros(Shape shape, DType dtype);
  // Wraps memory the caller keeps alive (no ownership).
  static Tensor Wrap(void* data, Shape shape, DType dtype, Device device = Device::Cpu());

  bool defined() const { return base_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i < 0 ? shape_.size() + i : i]; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return NumElements(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype_); }
  Device device() const { return device_; }

  void* raw() const { return static_cast<char*>(base_) + offset_bytes_; }
  // Typed pointer. Checks (programmer error) that T matches the dtype's size.
  template <typename T>
  T* data() const {
    SMAT_CHECK(sizeof(T) == DTypeSize(dtype_));
    return static_cast<T*>(raw());
  }

  // A contiguous view of `shape` starting `element_offset` elements in.
  Tensor View(int64_t element_offset, Shape shape) const;
  // Same elements, new shape (element count must match).
  absl::StatusOr<Tensor> Reshape(Shape shape) const;

  std::string DebugString() const;  // "fp32[2, 3] on cpu"

 private:
  std::shared_ptr<void> storage_;  // owns the allocation (or nothing, for Wrap)
  void* base_ = nullptr;
  size_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DType::kF32;
  Device device_;
};

// Returns InvalidArgument naming `what` unless t has exactly `shape`.
absl::Status CheckShape(const Tensor& t, absl::Span<const int64_t> shape, const char* what);

}  // namespace smat
