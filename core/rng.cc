// Host fills for core/rng.h: one Philox block per four elements, so a fill of
// n elements costs n/4 block evaluations plus the edges of an unaligned span.
#include "core/rng.h"

#include "absl/strings/str_cat.h"

namespace smat {
namespace {

absl::Status CheckHost(const Tensor& t, const char* what) {
  if (!t.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": tensor ", t.DebugString(),
                                                   " is not in host memory; fill on the host "
                                                   "and copy, or use the device kernel"));
  }
  return absl::OkStatus();
}

// Calls emit(i, block_words) for every element i of [0, n), evaluating each
// Philox block once even when offset is not a multiple of 4.
template <typename Emit>
void ForEachBlockWord(uint64_t seed, uint64_t stream, uint64_t offset, int64_t n, Emit emit) {
  const PhiloxKey key = PhiloxKeyFromSeed(seed);
  int64_t i = 0;
  while (i < n) {
    const uint64_t index = offset + static_cast<uint64_t>(i);
    const PhiloxCounter out = Philox4x32(PhiloxCounterFor(index, stream), key);
    const int first_lane = static_cast<int>(index & 3u);
    for (int lane = first_lane; lane < 4 && i < n; ++lane, ++i) emit(i, lane, out);
  }
}

// Stores a float result into t's dtype.
void StoreFloat(Tensor& t, int64_t i, float v) {
  switch (t.dtype()) {
    case DType::kF32: t.data<float>()[i] = v; break;
    case DType::kF64: t.data<double>()[i] = static_cast<double>(v); break;
    case DType::kBF16: t.data<uint16_t>()[i] = FloatToBf16(v); break;
    default: SMAT_CHECK(false);
  }
}

absl::Status CheckFloating(const Tensor& t, const char* what) {
  SMAT_RETURN_IF_ERROR(CheckHost(t, what));
  if (t.dtype() != DType::kF32 && t.dtype() != DType::kF64 && t.dtype() != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": dtype ", DTypeName(t.dtype()),
                                                   " is not supported; use fp32, fp64 or bf16"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status FillUniform(Tensor& t, uint64_t seed, uint64_t offset, float lo, float hi,
                         uint64_t stream) {
  SMAT_RETURN_IF_ERROR(CheckFloating(t, "FillUniform"));
  if (!(lo < hi)) {
    return absl::InvalidArgumentError(
        absl::StrCat("FillUniform: empty range [", lo, ", ", hi, ")"));
  }
  const float scale = hi - lo;
  ForEachBlockWord(seed, stream, offset, t.numel(),
                   [&](int64_t i, int lane, const PhiloxCounter& out) {
                     StoreFloat(t, i, lo + scale * UniformFromWord(out.w[lane]));
                   });
  return absl::OkStatus();
}

absl::Status FillNormal(Tensor& t, uint64_t seed, uint64_t offset, float mean, float stddev,
                        uint64_t stream) {
  SMAT_RETURN_IF_ERROR(CheckFloating(t, "FillNormal"));
  if (!(stddev >= 0.f)) {
    return absl::InvalidArgumentError(absl::StrCat("FillNormal: stddev = ", stddev, " < 0"));
  }
  // Same element -> words mapping as PhiloxNormal (lanes 0,1 share words 0,1).
  ForEachBlockWord(
      seed, stream, offset, t.numel(), [&](int64_t i, int lane, const PhiloxCounter& out) {
        const int pair = lane >> 1;
        const float z = NormalFromWords(out.w[2 * pair], out.w[2 * pair + 1], (lane & 1) != 0);
        StoreFloat(t, i, mean + stddev * z);
      });
  return absl::OkStatus();
}

absl::Status FillUniformInt(Tensor& t, uint64_t seed, uint64_t offset, int64_t lo, int64_t hi,
                            uint64_t stream) {
  SMAT_RETURN_IF_ERROR(CheckHost(t, "FillUniformInt"));
  if (t.dtype() != DType::kI32 && t.dtype() != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat("FillUniformInt: dtype ", DTypeName(t.dtype()),
                                                   " is not supported; use int32 or int64"));
  }
  if (!(lo < hi) || static_cast<uint64_t>(hi - lo) > (uint64_t{1} << 32)) {
    return absl::InvalidArgumentError(absl::StrCat("FillUniformInt: range [", lo, ", ", hi,
                                                   ") must be non-empty and at most 2^32 wide"));
  }
  if (t.dtype() == DType::kI32 && (lo < INT32_MIN || hi - 1 > INT32_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("FillUniformInt: range [", lo, ", ", hi, ") does not fit int32"));
  }
  const uint64_t range = static_cast<uint64_t>(hi - lo);
  ForEachBlockWord(seed, stream, offset, t.numel(),
                   [&](int64_t i, int lane, const PhiloxCounter& out) {
                     const int64_t v = lo + static_cast<int64_t>((out.w[lane] * range) >> 32);
                     if (t.dtype() == DType::kI32) {
                       t.data<int32_t>()[i] = static_cast<int32_t>(v);
                     } else {
                       t.data<int64_t>()[i] = v;
                     }
                   });
  return absl::OkStatus();
}

}  // namespace smat
