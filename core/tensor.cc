#include "core/tensor.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace smat {

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF64: return 8;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU16: return 2;
  }
  return 0;
}

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "fp32";
    case DType::kF64: return "fp64";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kU16: return "uint16";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(const std::string& name) {
  for (DType t : {DType::kF32, DType::kF64, DType::kBF16, DType::kI32, DType::kI64, DType::kU16}) {
    if (name == DTypeName(t)) return t;
  }
  if (name == "float32") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "'; expected fp32, fp64, bf16, int32, int64 or uint16"));
}

std::string Device::ToString() const {
  return kind == DeviceKind::kCpu ? std::string("cpu") : absl::StrCat("cuda:", index);
}

Allocator::Stats Allocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Allocator::ResetPeak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes = stats_.in_use_bytes;
}

void Allocator::RecordAllocate(void* ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  sizes_[ptr] = bytes;
  stats_.in_use_bytes += static_cast<int64_t>(bytes);
  stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.in_use_bytes);
}

void Allocator::RecordFree(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sizes_.find(ptr);
  if (it == sizes_.end()) return;
  stats_.in_use_bytes -= static_cast<int64_t>(it->second);
  sizes_.erase(it);
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeToString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

uint16_t FloatToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  }
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

float Bf16ToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

absl::StatusOr<Tensor> Tensor::Empty(Shape shape, DType dtype, Allocator& alloc) {
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension in shape ", ShapeToString(shape)));
  }
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = alloc.device();
  SMAT_ASSIGN_OR_RETURN(void* p, alloc.Allocate(t.nbytes()));
  Allocator* a = &alloc;
  t.storage_ = std::shared_ptr<void>(p, [a](void* q) { a->Free(q); });
  t.base_ = p;
  return t;
}

absl::StatusOr<Tensor> Tensor::Zeros(Shape shape, DType dtype) {
  SMAT_ASSIGN_OR_RETURN(Tensor t, Empty(std::move(shape), dtype));
  std::memset(t.raw(), 0, t.nbytes());
  return t;
}

Tensor Tensor::Wrap(void* data, Shape shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.base_ = data;
  return t;
}

Tensor Tensor::View(int64_t element_offset, Shape shape) const {
  SMAT_CHECK(element_offset >= 0 && element_offset + NumElements(shape) <= numel());
  Tensor t = *this;
  t.offset_bytes_ = offset_bytes_ + static_cast<size_t>(element_offset) * DTypeSize(dtype_);
  t.shape_ = std::move(shape);
  return t;
}

absl::StatusOr<Tensor> Tensor::Reshape(Shape shape) const {
  if (NumElements(shape) != numel()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot reshape ", ShapeToString(shape_), " (",
                                                   numel(), " elements) to ", ShapeToString(shape)));
  }
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

std::string Tensor::DebugString() const {
  return absl::StrCat(DTypeName(dtype_), ShapeToString(shape_), " on ", device_.ToString());
}

absl::Status CheckShape(const Tensor& t, absl::Span<const int64_t> shape, const char* what) {
  if (t.shape() != Shape(shape.begin(), shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected shape ", ShapeToString(shape),
                                                   ", got ", ShapeToString(t.shape())));
  }
  return absl::OkStatus();
}

}  // namespace smat
