// Host dtype conversions between smat tensors, e.g. a bf16 activation to fp32
// before writing it as .npy (numpy has no bf16), or fp32 weights read from .npy
// to bf16 for a bf16 run.
//
//   SMAT_ASSIGN_OR_RETURN(Tensor f, ToFloat32(bf16_tensor));
//   SMAT_RETURN_IF_ERROR(WriteNpy("x.npy", f));
#pragma once

#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace smat {

// A new host tensor of the same shape with every element converted to `to`.
// Supported: any floating type (fp32, fp64, bf16) to any floating type (to bf16:
// round to nearest even, as FloatToBf16); any integer type (int32, int64,
// uint16) to a floating type (rounded to nearest, as numpy's astype) or to another
// integer type, checked to fit exactly (an int64 token id above 2^31 is an error,
// not a silent wrap). Floating to integer is refused: it would have to pick a
// rounding rule the caller should state. Converting to the same dtype copies.
absl::StatusOr<Tensor> ConvertDType(const Tensor& t, DType to);

inline absl::StatusOr<Tensor> ToFloat32(const Tensor& t) { return ConvertDType(t, DType::kF32); }
inline absl::StatusOr<Tensor> ToBf16(const Tensor& t) { return ConvertDType(t, DType::kBF16); }

}  // namespace smat
