// CudaDecoder (decode_cuda.h): the fixed-horizon and stepped-window decoders of
// kernels/decode.h with their cache in device memory. The host side tracks the
// position, validates tensors and launches; every number lives on the device.
// Mirrors kernels/cpu/decode_cpu.cc member for member (same names, same steps)
// so the two can be read side by side.
#include "kernels/cuda/decode_cuda.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "kernels/cuda/cuda_check.h"

namespace smat {
namespace {

class CudaDecoder final : public Decoder {
 public:
  CudaDecoder(int device, std::function<absl::StatusOr<cudaStream_t>(Stream*)> stream_of,
              Allocator& alloc, SmatKernels* smat, const DecoderSpec& spec)
      : device_(device), stream_of_(std::move(stream_of)), alloc_(alloc), smat_(smat),
        spec_(spec), bh_(spec.dims.batch * spec.dims.heads),
        rp_(spec.dims.r * (spec.dims.dv + 1)) {}

  absl::Status Init();
  absl::Status Step(const DecodeToken& token, Tensor* o, Stream* stream) override;
  int64_t position() const override { return t_; }
  int64_t StateBytes() const override;

 private:
  bool stepped() const { return spec_.window > 0; }
  // A zero-filled fp32 / fp64 device tensor of `shape`.
  absl::StatusOr<Tensor> Zeros(const Shape& shape, DType dtype, cudaStream_t s);
  absl::Status ZeroFill(Tensor& t, cudaStream_t s);
  absl::Status CheckTensor(const Tensor& t, DType dtype, absl::Span<const int64_t> shape,
                           const char* what) const;
  absl::Status CheckToken(const DecodeToken& tok) const;
  absl::Status TabulateFixed(Stream* stream, cudaStream_t s);
  absl::Status EnterBlock(int64_t block, Stream* stream, cudaStream_t s);

  const int device_;
  const std::function<absl::StatusOr<cudaStream_t>(Stream*)> stream_of_;
  Allocator& alloc_;
  SmatKernels* const smat_;
  const DecoderSpec spec_;
  const int64_t bh_;
  const int64_t rp_;
  int64_t t_ = 0;

  // Fixed horizon (names of FixedHorizonDecoder):
  //   S_ [batch, H, r, p], F_ [batch, H, P, r, p] and F_lam_ [batch, H, P] while
  //   t < n, lam_ [batch, H], U_ [batch, H, B, r, p] from t = n.
  // Stepped window (names of SteppedWindowDecoder):
  //   R_old_ = S_, R_cur_, delta_cur_ = F_, delta_lam_ = F_lam_, delta_old_,
  //   lam_block_ = lam_, prev_block_total_, U_, U_scratch_ (C Delta_old).
  Tensor S_, R_cur_, F_, F_lam_, delta_old_, lam_, prev_block_total_, U_, U_scratch_;
};

absl::StatusOr<Tensor> CudaDecoder::Zeros(const Shape& shape, DType dtype, cudaStream_t s) {
  SMAT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(shape, dtype, alloc_));
  SMAT_RETURN_IF_ERROR(ZeroFill(t, s));
  return t;
}

absl::Status CudaDecoder::ZeroFill(Tensor& t, cudaStream_t s) {
  return CudaStatus(cudaMemsetAsync(t.raw(), 0, t.nbytes(), s), "decode: cudaMemsetAsync");
}

absl::Status CudaDecoder::Init() {
  const DecodeDims& d = spec_.dims;
  if (d.batch < 1 || d.heads < 1 || d.r < 1 || d.dv < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode: batch, heads, r and dv must all be >= 1; got batch = ", d.batch,
        ", heads = ", d.heads, ", r = ", d.r, ", dv = ", d.dv));
  }
  if (bh_ > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode: batch x heads = ", bh_, " exceeds the grid of one launch"));
  }
  if (spec_.window < 0 || (stepped() && spec_.window % spec_.plan.chunk != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode: the stepped window c_dc = ", spec_.window,
        " must be a positive multiple of the chunk ", spec_.plan.chunk,
        " (Definition 1), or 0 for the fixed horizon"));
  }
  SMAT_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  SMAT_ASSIGN_OR_RETURN(cudaStream_t s, stream_of_(nullptr));
  const SmatGeometry& g = spec_.plan.geo;
  const int64_t r = d.r, p = d.dv + 1;
  SMAT_ASSIGN_OR_RETURN(S_, Zeros({d.batch, d.heads, r, p}, DType::kF32, s));
  SMAT_ASSIGN_OR_RETURN(lam_, Zeros({d.batch, d.heads}, DType::kF64, s));
  if (stepped()) {
    SMAT_ASSIGN_OR_RETURN(R_cur_, Zeros({d.batch, d.heads, r, p}, DType::kF32, s));
    SMAT_ASSIGN_OR_RETURN(F_, Zeros({d.batch, d.heads, g.P, r, p}, DType::kF32, s));
    SMAT_ASSIGN_OR_RETURN(F_lam_, Zeros({d.batch, d.heads, g.P}, DType::kF64, s));
    SMAT_ASSIGN_OR_RETURN(delta_old_, Zeros({d.batch, d.heads, g.P, r, p}, DType::kF32, s));
    SMAT_ASSIGN_OR_RETURN(prev_block_total_, Zeros({d.batch, d.heads}, DType::kF64, s));
    SMAT_ASSIGN_OR_RETURN(U_, Zeros({d.batch, d.heads, g.B, r, p}, DType::kF32, s));
    SMAT_ASSIGN_OR_RETURN(U_scratch_, Tensor::Empty({d.batch, d.heads, g.B, r, p}, DType::kF32, alloc_));
  } else if (spec_.plan.n > 0) {
    SMAT_ASSIGN_OR_RETURN(F_, Zeros({d.batch, d.heads, g.P, r, p}, DType::kF32, s));
    SMAT_ASSIGN_OR_RETURN(F_lam_, Zeros({d.batch, d.heads, g.P}, DType::kF64, s));
  }
  // Zeroed before any step, whatever stream the steps run on.
  return CudaStatus(cudaStreamSynchronize(s), "decode: cudaStreamSynchronize");
}

int64_t CudaDecoder::StateBytes() const {
  int64_t bytes = 0;
  for (const Tensor* t : {&S_, &R_cur_, &F_, &F_lam_, &delta_old_, &lam_, &prev_block_total_,
                          &U_, &U_scratch_}) {
    if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
  }
  return bytes;
}

absl::Status CudaDecoder::CheckTensor(const Tensor& t, DType dtype,
                                      absl::Span<const int64_t> shape, const char* what) const {
  if (!t.defined()) {
    return absl::InvalidArgumentError(absl::StrCat("decode: ", what, " is missing"));
  }
  if (!(t.device() == Device::Cuda(device_))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "decode: ", what, " is on ", t.device().ToString(), "; the CUDA decoder's cache is on ",
        Device::Cuda(device_).ToString(), " and its tokens and outputs must be there too"));
  }
  if (t.dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat("decode: ", what, " must be ",
                                                   DTypeName(dtype), "; got ",
                                                   DTypeName(t.dtype())));
  }
  return CheckShape(t, shape, what);
}

absl::Status CudaDecoder::CheckToken(const DecodeToken& tok) const {
  const DecodeDims& d = spec_.dims;
  if (!tok.phi.defined()) return absl::InvalidArgumentError("decode: phi is missing");
  const DType in = tok.phi.dtype();
  if (in != DType::kF32 && in != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode: phi must be fp32 or bf16; got ", DTypeName(in)));
  }
  SMAT_RETURN_IF_ERROR(CheckTensor(tok.phi, in, {d.batch, d.heads, d.r}, "phi"));
  SMAT_RETURN_IF_ERROR(CheckTensor(tok.psi, in, {d.batch, d.heads, d.r}, "psi (dtype of phi)"));
  SMAT_RETURN_IF_ERROR(CheckTensor(tok.v, in, {d.batch, d.heads, d.dv}, "v (dtype of phi)"));
  if (tok.logg.defined()) {
    SMAT_RETURN_IF_ERROR(CheckTensor(tok.logg, DType::kF32, {d.batch, d.heads}, "logg"));
  }
  if (tok.prof.defined()) {
    SMAT_RETURN_IF_ERROR(CheckTensor(tok.prof, DType::kI32, {d.batch, d.heads}, "prof"));
  }
  if (tok.type.defined()) {
    SMAT_RETURN_IF_ERROR(CheckTensor(tok.type, DType::kI32, {d.batch, d.heads}, "type"));
  }
  return absl::OkStatus();
}

// At t = n (FixedHorizonDecoder::Tabulate): refer F to Lambda_{n-1}, U = C F
// (the SMat Tabulate phase), drop F, restart S and lam for the recent block.
absl::Status CudaDecoder::TabulateFixed(Stream* stream, cudaStream_t s) {
  const SmatGeometry& g = spec_.plan.geo;
  const DecodeDims& d = spec_.dims;
  if (spec_.plan.n == 0) {
    SMAT_ASSIGN_OR_RETURN(U_, Zeros({d.batch, d.heads, g.B, d.r, d.dv + 1}, DType::kF32, s));
    return absl::OkStatus();
  }
  SMAT_ASSIGN_OR_RETURN(U_, Tensor::Empty({d.batch, d.heads, g.B, d.r, d.dv + 1}, DType::kF32,
                                          alloc_));
  SMAT_RETURN_IF_ERROR(CudaStatus(LaunchDecodeReferTable(bh_, g.P, rp_, F_.data<float>(),
                                                         F_lam_.data<double>(),
                                                         lam_.data<double>(), s),
                                  "decode: refer-table kernel"));
  SMAT_RETURN_IF_ERROR(smat_->Tabulate(spec_.plan, F_, &U_, stream));
  // F goes once the tabulation has read it (Section 3.3: the cache is U + S).
  SMAT_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  F_ = Tensor();
  F_lam_ = Tensor();
  SMAT_RETURN_IF_ERROR(ZeroFill(S_, s));  // the recent block starts from zero at n
  return ZeroFill(lam_, s);
}

// SteppedWindowDecoder::EnterBlock at the first token of `block` (>= 1).
absl::Status CudaDecoder::EnterBlock(int64_t block, Stream* stream, cudaStream_t s) {
  const SmatGeometry& g = spec_.plan.geo;
  if (block >= 2) {
    // U <- exp(sum of logg over block - 2) U + C Delta_old.
    SMAT_RETURN_IF_ERROR(smat_->Tabulate(spec_.plan, delta_old_, &U_scratch_, stream));
    SMAT_RETURN_IF_ERROR(CudaStatus(
        LaunchDecodeDecayAdd(bh_, g.B * rp_, U_.data<float>(), U_scratch_.data<float>(),
                             prev_block_total_.data<double>(), s),
        "decode: decay-add kernel"));
  }
  // Delta_cur (block - 1) referred to its last token becomes Delta_old.
  SMAT_RETURN_IF_ERROR(CudaStatus(LaunchDecodeReferTable(bh_, g.P, rp_, F_.data<float>(),
                                                         F_lam_.data<double>(),
                                                         lam_.data<double>(), s),
                                  "decode: refer-table kernel"));
  SMAT_RETURN_IF_ERROR(CudaStatus(
      LaunchDecodeMoveScalars(bh_, prev_block_total_.data<double>(), lam_.data<double>(), s),
      "decode: block-roll kernel"));
  std::swap(delta_old_, F_);
  SMAT_RETURN_IF_ERROR(ZeroFill(F_, s));
  SMAT_RETURN_IF_ERROR(ZeroFill(F_lam_, s));
  std::swap(S_, R_cur_);  // R_old <- R_cur (started at n(t)); R_cur restarts
  return ZeroFill(R_cur_, s);
}

absl::Status CudaDecoder::Step(const DecodeToken& tok, Tensor* o, Stream* stream) {
  const SmatPlan& plan = spec_.plan;
  const SmatGeometry& g = plan.geo;
  const DecodeDims& d = spec_.dims;
  if (!stepped() && t_ >= plan.T) {
    return absl::OutOfRangeError(absl::StrCat(
        "decode: the fixed-horizon decoder was planned for T = ", plan.T,
        " tokens and all of them have been decoded; plan a longer T or use the "
        "stepped-window decoder (--window) to decode past the horizon"));
  }
  SMAT_RETURN_IF_ERROR(CheckToken(tok));
  SMAT_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (!o->defined()) {
    SMAT_ASSIGN_OR_RETURN(*o, Tensor::Empty({d.batch, d.heads, d.dv}, DType::kF32, alloc_));
  } else {
    SMAT_RETURN_IF_ERROR(CheckTensor(*o, DType::kF32, {d.batch, d.heads, d.dv}, "o"));
  }
  SMAT_ASSIGN_OR_RETURN(cudaStream_t s, stream_of_(stream));

  DecodeStepArgs A;
  A.bh = bh_;
  A.r = static_cast<int>(d.r);
  A.dv = static_cast<int>(d.dv);
  A.P = g.P;
  A.B = g.B;
  A.bf16 = tok.phi.dtype() == DType::kBF16;
  A.eps = spec_.eps;
  A.phi = tok.phi.raw();
  A.psi = tok.psi.raw();
  A.v = tok.v.raw();
  A.logg = tok.logg.defined() ? tok.logg.data<float>() : nullptr;
  A.o = o->data<float>();
  if (stepped()) {
    const int64_t block = t_ / spec_.window;
    if (t_ > 0 && t_ % spec_.window == 0) SMAT_RETURN_IF_ERROR(EnterBlock(block, stream, s));
    // Every token is a query (type) now and a key (prof) later.
    A.prof = tok.prof.defined() ? tok.prof.data<int32_t>() : nullptr;
    A.type = tok.type.defined() ? tok.type.data<int32_t>() : nullptr;
    A.pos_profile = t_ % g.P;
    A.pos_type = t_ % g.B;
    A.S = S_.data<float>();  // R_old: the window [n(t), t]
    A.S2 = R_cur_.data<float>();
    A.table = F_.data<float>();
    A.table_lam = F_lam_.data<double>();
    if (block >= 2) {
      A.U = U_.data<float>();
      A.lam_offset = prev_block_total_.data<double>();
    }
  } else {
    if (t_ == plan.n) SMAT_RETURN_IF_ERROR(TabulateFixed(stream, s));
    A.S = S_.data<float>();
    if (t_ < plan.n) {  // distant: pool into F[prof], read the causal state
      A.prof = tok.prof.defined() ? tok.prof.data<int32_t>() : nullptr;
      A.pos_profile = PositionalProfile(g, t_);
      A.table = F_.data<float>();
      A.table_lam = F_lam_.data<double>();
    } else {  // recent: read U[type] with exp(Lambda_t - Lambda_{n-1}), and S
      A.type = tok.type.defined() ? tok.type.data<int32_t>() : nullptr;
      A.pos_type = PositionalType(g, plan.n, t_);
      A.U = U_.data<float>();
    }
  }
  A.lam = lam_.data<double>();
  SMAT_RETURN_IF_ERROR(CudaStatus(LaunchDecodeStep(A, s), "decode: step kernel"));
  ++t_;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Decoder>> MakeCudaDecoder(
    int device, std::function<absl::StatusOr<cudaStream_t>(Stream*)> stream_of, Allocator& alloc,
    SmatKernels* smat, const DecoderSpec& spec) {
  auto dec = std::make_unique<CudaDecoder>(device, std::move(stream_of), alloc, smat, spec);
  SMAT_RETURN_IF_ERROR(dec->Init());
  return std::unique_ptr<Decoder>(std::move(dec));
}

}  // namespace smat
