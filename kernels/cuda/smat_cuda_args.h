// Argument checks of the CUDA SMat phases (smat_cuda.cc): every tensor a
// phase takes is on the backend's GPU, of the dtype and shape the contract of
// kernels/smat_kernels.h gives it, or the call fails with InvalidArgument
// naming the tensor, what it is, and what was expected; and the span's sizes
// (SmatCudaDims) from the tensors that carry them.
//
//   const SmatCudaArgs args(device);
//   SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, args.FeatureDims(plan, span, psi, v));
//   SMAT_RETURN_IF_ERROR(args.CheckF32(S_in, {d.batch, d.Lc, d.H, d.r, d.p}, "S_in"));
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/cuda/smat_cuda_kernels.h"
#include "kernels/smat_kernels.h"

namespace smat {

class SmatCudaArgs {
 public:
  explicit SmatCudaArgs(int device) : device_(device) {}

  // t's DebugString, or "nothing" when t is undefined.
  static std::string Describe(const Tensor& t);

  // t is defined and on this GPU.
  absl::Status OnDevice(const Tensor& t, const char* name) const;
  // An fp32 tensor of `shape` on this GPU (optional: or undefined).
  absl::Status CheckF32(const Tensor& t, const Shape& shape, const char* name) const;
  absl::Status CheckOptionalF32(const Tensor& t, const Shape& shape, const char* name) const;
  // An output: not null, then as CheckF32.
  absl::Status CheckOut(const Tensor* t, const Shape& shape, const char* name) const;
  // phi / psi / v / o / d_o: fp32 or bf16 [batch, L, H, width]; phi, psi, v share d.bf16.
  absl::Status CheckFeatures(const SmatCudaDims& d, const Tensor& t, const char* name,
                             int64_t width) const;
  // lam [batch, L, H] and chunk_decay [batch, Lc, H]: both or neither.
  absl::Status CheckGates(const SmatCudaDims& d, const Tensor& lam,
                          const Tensor& chunk_decay) const;
  // A content map (prof or type): undefined, or int32 [batch, L, H].
  absl::Status CheckMap(const SmatCudaDims& d, const Tensor& map, const char* name) const;

  // Span sizes from a token tensor [batch, L, H, ...].
  absl::StatusOr<SmatCudaDims> Dims(const SmatPlan& plan, const SmatSpan& span, const Tensor& t,
                                    const char* name, int64_t r, int64_t dv, bool features) const;
  // From psi [batch, L, H, r] and v [batch, L, H, dv] (checked, one dtype).
  absl::StatusOr<SmatCudaDims> FeatureDims(const SmatPlan& plan, const SmatSpan& span,
                                           const Tensor& psi, const Tensor& v) const;
  // The inputs of the chunk-local outputs (ChunkOutputs, NormalizedOutputs):
  // FeatureDims, then phi like psi, lam (optional) and S_in [batch, Lc, H, r, p].
  absl::StatusOr<SmatCudaDims> ChunkOutputDims(const SmatPlan& plan, const SmatSpan& span,
                                               const Tensor& phi, const Tensor& psi,
                                               const Tensor& v, const Tensor& lam,
                                               const Tensor& S_in) const;
  // From phi [batch, L, H, r] and a table [batch, H, G, r, p].
  absl::StatusOr<SmatCudaDims> TableDims(const SmatPlan& plan, const SmatSpan& span,
                                         const Tensor& phi, const Tensor& table,
                                         const char* name) const;
  // From a chunk-state tensor [batch, Lc, H, r, p].
  absl::StatusOr<SmatCudaDims> StateDims(const SmatPlan& plan, const SmatSpan& span,
                                         const Tensor& t, const char* name) const;

 private:
  const int device_;
};

}  // namespace smat
