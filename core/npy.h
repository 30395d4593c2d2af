// NumPy .npy files: the exchange format between smat and Python (smat_op reads
// operands and writes results as .npy; tests compare against numpy references).
//
// Supported: format versions 1.0 and 2.0 (read and write) and 3.0 (read; its
// UTF-8 header is parsed like the others), C order, little-endian dtypes
//   '<f4' fp32   '<f8' fp64   '<i4' int32   '<i8' int64   '<u2' uint16
// Everything else (Fortran order, big-endian, other dtypes, object arrays) is
// refused with a message naming the file and what to change in numpy. bf16 has
// no numpy dtype: convert to fp32 first (ToFloat32 in core/convert.h).
//
//   SMAT_ASSIGN_OR_RETURN(Tensor q, ReadNpy("q.npy"));     // e.g. fp32[B, T, H, r]
//   SMAT_RETURN_IF_ERROR(WriteNpy("o.npy", o));
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace smat {

// Reads a whole .npy file into a new host tensor. Errors: kNotFound (no such
// file), kInvalidArgument (not a .npy file, or a layout/dtype smat does not
// read), kDataLoss (damaged: truncated header or data, malformed header).
absl::StatusOr<Tensor> ReadNpy(const std::string& path);

// Writes a host tensor as .npy (version 1.0, or 2.0 when the header needs more
// than 65535 bytes). Atomic: written to a temporary file in the same directory,
// flushed to disk, then renamed over `path`, so readers never see a partial file.
absl::Status WriteNpy(const std::string& path, const Tensor& t);

// The .npy header (magic, version, length, dict, padding) numpy would write for
// an array of this dtype and shape, padded so the data starts at a multiple of
// 64 bytes. Exposed for tests and for writers that stream the data themselves.
absl::StatusOr<std::string> NpyHeader(DType dtype, const Shape& shape);

}  // namespace smat
