// SmatCudaArgs (smat_cuda_args.h): the argument checks of the CUDA SMat phases.
#include "kernels/cuda/smat_cuda_args.h"

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace smat {

std::string SmatCudaArgs::Describe(const Tensor& t) {
  return t.defined() ? t.DebugString() : std::string("nothing");
}

absl::Status SmatCudaArgs::OnDevice(const Tensor& t, const char* name) const {
  if (!t.defined())
    return absl::InvalidArgumentError(absl::StrCat("smat cuda: ", name, " is missing"));
  if (!(t.device() == Device::Cuda(device_))) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat cuda: ", name, " is on ", t.device().ToString(),
                     ", expected cuda:", device_, "; copy it to the GPU first"));
  }
  return absl::OkStatus();
}

absl::Status SmatCudaArgs::CheckF32(const Tensor& t, const Shape& shape, const char* name) const {
  SMAT_RETURN_IF_ERROR(OnDevice(t, name));
  if (t.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat cuda: ", name, " must be fp32; got ", t.DebugString()));
  }
  return CheckShape(t, shape, name);
}

absl::Status SmatCudaArgs::CheckOptionalF32(const Tensor& t, const Shape& shape,
                                            const char* name) const {
  return t.defined() ? CheckF32(t, shape, name) : absl::OkStatus();
}

absl::Status SmatCudaArgs::CheckOut(const Tensor* t, const Shape& shape, const char* name) const {
  if (t == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("smat cuda: output ", name, " is null"));
  return CheckF32(*t, shape, name);
}

absl::Status SmatCudaArgs::CheckFeatures(const SmatCudaDims& d, const Tensor& t, const char* name,
                                         int64_t width) const {
  SMAT_RETURN_IF_ERROR(OnDevice(t, name));
  if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat cuda: ", name, " must be fp32 or bf16; got ", t.DebugString()));
  }
  return CheckShape(t, {d.batch, d.L, d.H, width}, name);
}

absl::Status SmatCudaArgs::CheckGates(const SmatCudaDims& d, const Tensor& lam,
                                      const Tensor& chunk_decay) const {
  if (lam.defined() != chunk_decay.defined()) {
    return absl::InvalidArgumentError(
        "smat cuda: lam and chunk_decay must both be given (gated) or both be undefined");
  }
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(lam, {d.batch, d.L, d.H}, "lam"));
  return CheckOptionalF32(chunk_decay, {d.batch, d.Lc, d.H}, "chunk_decay");
}

absl::Status SmatCudaArgs::CheckMap(const SmatCudaDims& d, const Tensor& map,
                                    const char* name) const {
  if (!map.defined()) return absl::OkStatus();
  SMAT_RETURN_IF_ERROR(OnDevice(map, name));
  if (map.dtype() != DType::kI32) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat cuda: ", name, " must be int32; got ", map.DebugString()));
  }
  return CheckShape(map, {d.batch, d.L, d.H}, name);
}

absl::StatusOr<SmatCudaDims> SmatCudaArgs::Dims(const SmatPlan& plan, const SmatSpan& span,
                                                const Tensor& t, const char* name, int64_t r,
                                                int64_t dv, bool features) const {
  SMAT_RETURN_IF_ERROR(ValidateSmatSpan(plan, span));
  if (!t.defined() || t.rank() < 3 || t.dim(1) != span.length()) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat cuda: ", name, " must be [batch, L = ", span.length(),
                     ", H, ...] for span [", span.t0, ", ", span.t1, "); got ", Describe(t)));
  }
  SmatCudaDims d;
  d.batch = t.dim(0);
  d.L = span.length();
  d.Lc = span.num_chunks(plan);
  d.H = t.dim(2);
  d.r = r;
  d.dv = dv;
  d.p = dv + 1;
  d.chunk = plan.chunk;
  d.t0 = span.t0;
  d.n = plan.n;
  d.bf16 = features && t.dtype() == DType::kBF16;
  return d;
}

absl::StatusOr<SmatCudaDims> SmatCudaArgs::FeatureDims(const SmatPlan& plan, const SmatSpan& span,
                                                       const Tensor& psi, const Tensor& v) const {
  if (!psi.defined() || psi.rank() != 4 || !v.defined() || v.rank() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat cuda: psi and v must be [batch, L, H, r] and "
                     "[batch, L, H, dv]; got ",
                     Describe(psi), " and ", Describe(v)));
  }
  SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, Dims(plan, span, psi, "psi", psi.dim(3), v.dim(3), true));
  SMAT_RETURN_IF_ERROR(CheckFeatures(d, psi, "psi", d.r));
  SMAT_RETURN_IF_ERROR(CheckFeatures(d, v, "v", d.dv));
  if (v.dtype() != psi.dtype()) {
    return absl::InvalidArgumentError(
        absl::StrCat("smat cuda: phi, psi and v must share a dtype; got psi ", psi.DebugString(),
                     ", v ", v.DebugString()));
  }
  return d;
}

absl::StatusOr<SmatCudaDims> SmatCudaArgs::ChunkOutputDims(const SmatPlan& plan,
                                                           const SmatSpan& span, const Tensor& phi,
                                                           const Tensor& psi, const Tensor& v,
                                                           const Tensor& lam,
                                                           const Tensor& S_in) const {
  SMAT_ASSIGN_OR_RETURN(SmatCudaDims d, FeatureDims(plan, span, psi, v));
  SMAT_RETURN_IF_ERROR(CheckFeatures(d, phi, "phi", d.r));
  SMAT_RETURN_IF_ERROR(CheckOptionalF32(lam, {d.batch, d.L, d.H}, "lam"));
  SMAT_RETURN_IF_ERROR(CheckF32(S_in, {d.batch, d.Lc, d.H, d.r, d.p}, "S_in"));
  return d;
}

absl::StatusOr<SmatCudaDims> SmatCudaArgs::TableDims(const SmatPlan& plan, const SmatSpan& span,
                                                     const Tensor& phi, const Tensor& table,
                                                     const char* name) const {
  if (!phi.defined() || phi.rank() != 4 || !table.defined() || table.rank() != 5) {
    return absl::InvalidArgumentError(absl::StrCat("smat cuda: phi must be [batch, L, H, r] and ",
                                                   name, " [batch, H, G, r, p]; got ",
                                                   Describe(phi), " and ", Describe(table)));
  }
  SMAT_ASSIGN_OR_RETURN(SmatCudaDims d,
                        Dims(plan, span, phi, "phi", phi.dim(3), table.dim(4) - 1, true));
  SMAT_RETURN_IF_ERROR(CheckFeatures(d, phi, "phi", d.r));
  SMAT_RETURN_IF_ERROR(CheckF32(table, {d.batch, d.H, plan.geo.B, d.r, d.p}, name));
  return d;
}

absl::StatusOr<SmatCudaDims> SmatCudaArgs::StateDims(const SmatPlan& plan, const SmatSpan& span,
                                                     const Tensor& t, const char* name) const {
  SMAT_RETURN_IF_ERROR(ValidateSmatSpan(plan, span));
  if (!t.defined() || t.rank() != 5 || t.dim(1) != span.num_chunks(plan)) {
    return absl::InvalidArgumentError(absl::StrCat("smat cuda: ", name,
                                                   " must be [batch, Lc = ", span.num_chunks(plan),
                                                   ", H, r, p]; got ", Describe(t)));
  }
  SmatCudaDims d;
  d.batch = t.dim(0);
  d.L = span.length();
  d.Lc = t.dim(1);
  d.H = t.dim(2);
  d.r = t.dim(3);
  d.p = t.dim(4);
  d.dv = d.p - 1;
  d.chunk = plan.chunk;
  d.t0 = span.t0;
  d.n = plan.n;
  SMAT_RETURN_IF_ERROR(CheckF32(t, t.shape(), name));
  return d;
}

}  // namespace smat
