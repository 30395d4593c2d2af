// Host dtype conversions (core/convert.h). Elements go through double for
// floating types and int64 for integer types: both hold every source value of
// the supported dtypes exactly, so the only rounding is the final store.
#include "core/convert.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace smat {
namespace {

bool IsFloating(DType t) { return t == DType::kF32 || t == DType::kF64 || t == DType::kBF16; }

double LoadFloating(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kF32: return t.data<float>()[i];
    case DType::kF64: return t.data<double>()[i];
    case DType::kBF16: return Bf16ToFloat(t.data<uint16_t>()[i]);
    default: SMAT_CHECK(false);
  }
  return 0;
}

int64_t LoadInteger(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kI32: return t.data<int32_t>()[i];
    case DType::kI64: return t.data<int64_t>()[i];
    case DType::kU16: return t.data<uint16_t>()[i];
    default: SMAT_CHECK(false);
  }
  return 0;
}

void StoreFloating(Tensor& t, int64_t i, double v) {
  switch (t.dtype()) {
    case DType::kF32: t.data<float>()[i] = static_cast<float>(v); break;
    // double -> float -> bf16 rounds twice; for bf16 sources and fp32 sources the
    // first step is exact, which covers every tensor smat converts to bf16.
    case DType::kBF16: t.data<uint16_t>()[i] = FloatToBf16(static_cast<float>(v)); break;
    case DType::kF64: t.data<double>()[i] = v; break;
    default: SMAT_CHECK(false);
  }
}

}  // namespace

absl::StatusOr<Tensor> ConvertDType(const Tensor& t, DType to) {
  if (!t.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ConvertDType: ", t.DebugString(), " is not in host memory; copy it to the host first"));
  }
  const DType from = t.dtype();
  if (IsFloating(from) && !IsFloating(to)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ConvertDType: ", DTypeName(from), " to ", DTypeName(to),
        " is not supported; round the values explicitly before converting to an integer type"));
  }
  SMAT_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(t.shape(), to));
  const int64_t n = t.numel();
  if (from == to) {
    if (n > 0) std::memcpy(out.raw(), t.raw(), t.nbytes());
    return out;
  }
  for (int64_t i = 0; i < n; ++i) {
    if (IsFloating(from)) {
      StoreFloating(out, i, LoadFloating(t, i));
      continue;
    }
    const int64_t v = LoadInteger(t, i);
    switch (to) {
      case DType::kF32:
      case DType::kF64:
      case DType::kBF16: StoreFloating(out, i, static_cast<double>(v)); break;
      case DType::kI64: out.data<int64_t>()[i] = v; break;
      case DType::kI32:
      case DType::kU16: {
        const int64_t lo = to == DType::kI32 ? INT32_MIN : 0;
        const int64_t hi = to == DType::kI32 ? INT32_MAX : UINT16_MAX;
        if (v < lo || v > hi) {
          return absl::InvalidArgumentError(
              absl::StrCat("ConvertDType: element ", i, " = ", v, " does not fit ", DTypeName(to)));
        }
        if (to == DType::kI32) {
          out.data<int32_t>()[i] = static_cast<int32_t>(v);
        } else {
          out.data<uint16_t>()[i] = static_cast<uint16_t>(v);
        }
        break;
      }
    }
  }
  return out;
}

}  // namespace smat
