// smat_op's I/O, planning and compute steps (see smat_op_run.h).
#include "tools/smat_op_run.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/convert.h"
#include "core/npy.h"
#include "core/status.h"
#include "kernels/backend.h"
#include "kernels/decode.h"

namespace smat {
namespace {

std::string JoinPath(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / name).string();
}

// Reads dir/name; an absent optional file gives an undefined tensor.
absl::StatusOr<Tensor> ReadOperand(const std::string& dir, const std::string& name,
                                   bool required, const std::string& why) {
  const std::string path = JoinPath(dir, name);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    if (!required) return Tensor();
    return absl::NotFoundError(absl::StrCat(path, ": not found; ", why));
  }
  absl::StatusOr<Tensor> t = ReadNpy(path);
  if (!t.ok()) return Annotate(t.status(), path);
  return t;
}

absl::Status Expect(const Tensor& t, const std::string& file, DType dtype,
                    absl::Span<const int64_t> shape, const std::string& layout) {
  if (t.dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": dtype ", DTypeName(t.dtype()), ", expected ",
        dtype == DType::kI32 ? "int32 (save with .astype(np.int32))"
                             : "float32 (save with .astype(np.float32))"));
  }
  if (t.shape() != Shape(shape.begin(), shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": shape ", ShapeToString(t.shape()),
                                                   ", expected ", ShapeToString(shape), " ",
                                                   layout));
  }
  return absl::OkStatus();
}

// A defined host tensor on `backend`'s device (a copy for CUDA), converted to
// `dtype` first when it differs.
absl::StatusOr<Tensor> ToDevice(Backend& backend, const Tensor& host, DType dtype) {
  if (!host.defined()) return Tensor();
  Tensor src = host;
  if (host.dtype() != dtype) {
    SMAT_ASSIGN_OR_RETURN(src, ConvertDType(host, dtype));
  }
  if (backend.device().is_cpu()) return src;
  SMAT_ASSIGN_OR_RETURN(Tensor dev, Tensor::Empty(src.shape(), dtype, backend.allocator()));
  SMAT_RETURN_IF_ERROR(backend.Copy(src, dev));
  return dev;
}

// A host fp32 copy of a device tensor (undefined stays undefined).
absl::StatusOr<Tensor> ToHostF32(Backend& backend, const Tensor& t) {
  if (!t.defined()) return Tensor();
  Tensor host = t;
  if (!t.device().is_cpu()) {
    SMAT_ASSIGN_OR_RETURN(host, Tensor::Empty(t.shape(), t.dtype()));
    SMAT_RETURN_IF_ERROR(backend.Copy(t, host));
    SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  }
  if (host.dtype() != DType::kF32) return ConvertDType(host, DType::kF32);
  return host;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
  return out + "\"";
}

}  // namespace

absl::StatusOr<SmatOpMode> ParseSmatOpMode(const std::string& name) {
  if (name == "forward") return SmatOpMode::kForward;
  if (name == "backward") return SmatOpMode::kBackward;
  if (name == "decode") return SmatOpMode::kDecode;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown operation \"", name, "\"; use forward, backward, decode or plan"));
}

absl::StatusOr<SmatOpOperands> ReadSmatOpOperands(const std::string& dir, SmatOpMode mode) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::NotFoundError(
        absl::StrCat("--in ", dir, ": not a directory; it must hold phi.npy, psi.npy and v.npy"));
  }
  const std::string needs = "the operation needs phi.npy, psi.npy and v.npy";
  SmatOpOperands op;
  SMAT_ASSIGN_OR_RETURN(op.in.phi, ReadOperand(dir, "phi.npy", true, needs));
  SMAT_ASSIGN_OR_RETURN(op.in.psi, ReadOperand(dir, "psi.npy", true, needs));
  SMAT_ASSIGN_OR_RETURN(op.in.v, ReadOperand(dir, "v.npy", true, needs));
  const Tensor& phi = op.in.phi;
  if (phi.rank() != 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        JoinPath(dir, "phi.npy"), ": shape ", ShapeToString(phi.shape()),
        " has rank ", phi.rank(), "; expected [B, T, H, r] (batch, tokens, heads, features)"));
  }
  op.batch = phi.dim(0);
  op.T = phi.dim(1);
  op.H = phi.dim(2);
  op.r = phi.dim(3);
  if (op.batch < 1 || op.T < 1 || op.H < 1 || op.r < 1) {
    return absl::InvalidArgumentError(absl::StrCat(JoinPath(dir, "phi.npy"), ": shape ",
                                                   ShapeToString(phi.shape()),
                                                   " is empty; every dimension must be >= 1"));
  }
  const std::string bthr = absl::StrCat("[B, T, H, r] like phi.npy");
  SMAT_RETURN_IF_ERROR(Expect(phi, JoinPath(dir, "phi.npy"), DType::kF32, phi.shape(), bthr));
  SMAT_RETURN_IF_ERROR(
      Expect(op.in.psi, JoinPath(dir, "psi.npy"), DType::kF32, phi.shape(), bthr));
  if (op.in.v.rank() != 4 || op.in.v.dim(3) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        JoinPath(dir, "v.npy"), ": shape ", ShapeToString(op.in.v.shape()),
        ", expected [B, T, H, dv] with B, T, H of phi.npy ", ShapeToString(phi.shape())));
  }
  op.dv = op.in.v.dim(3);
  const std::string bthd = "[B, T, H, dv] (B, T, H of phi.npy, dv of v.npy)";
  SMAT_RETURN_IF_ERROR(Expect(op.in.v, JoinPath(dir, "v.npy"), DType::kF32,
                              {op.batch, op.T, op.H, op.dv}, bthd));
  const std::string bth = "[B, T, H] (B, T, H of phi.npy)";
  SMAT_ASSIGN_OR_RETURN(op.in.logg, ReadOperand(dir, "logg.npy", false, ""));
  if (op.in.logg.defined()) {
    SMAT_RETURN_IF_ERROR(Expect(op.in.logg, JoinPath(dir, "logg.npy"), DType::kF32,
                                {op.batch, op.T, op.H}, bth));
  }
  SMAT_ASSIGN_OR_RETURN(op.in.prof, ReadOperand(dir, "prof.npy", false, ""));
  if (op.in.prof.defined()) {
    SMAT_RETURN_IF_ERROR(Expect(op.in.prof, JoinPath(dir, "prof.npy"), DType::kI32,
                                {op.batch, op.T, op.H}, bth));
  }
  SMAT_ASSIGN_OR_RETURN(op.in.type, ReadOperand(dir, "type.npy", false, ""));
  if (op.in.type.defined()) {
    SMAT_RETURN_IF_ERROR(Expect(op.in.type, JoinPath(dir, "type.npy"), DType::kI32,
                                {op.batch, op.T, op.H}, bth));
  }
  if (mode == SmatOpMode::kBackward) {
    SMAT_ASSIGN_OR_RETURN(op.d_o, ReadOperand(dir, "do.npy", true,
                                              "backward needs do.npy, the gradient of o"));
    SMAT_RETURN_IF_ERROR(Expect(op.d_o, JoinPath(dir, "do.npy"), DType::kF32,
                                {op.batch, op.T, op.H, op.dv}, "[B, T, H, dv] like v.npy"));
  }
  return op;
}

absl::StatusOr<SmatPlan> PlanSmatOp(const SmatOpConfig& cfg, int64_t T) {
  if (cfg.window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--window ", cfg.window, " must be >= 0 (0: fixed-horizon decoding)"));
  }
  if (cfg.window > 0 && cfg.mode != SmatOpMode::kDecode) {
    return absl::InvalidArgumentError(
        "--window (stepped-window decoding) applies to decode only; forward and backward "
        "run the SMat mask of length T");
  }
  int64_t plan_T = T;
  if (cfg.mode == SmatOpMode::kDecode && cfg.window > 0 && cfg.tmax > 0) plan_T = cfg.tmax;
  absl::StatusOr<SmatPlan> plan = MakeSmatPlan(plan_T, cfg.d, cfg.chunk, cfg.q);
  if (!plan.ok()) return plan.status();
  if (cfg.window > 0 && cfg.window % cfg.chunk != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--window ", cfg.window, " must be a multiple of --chunk ", cfg.chunk,
        " (Definition 1: blocks are made of whole chunks)"));
  }
  return plan;
}

namespace {

// Decodes every position on `backend`'s decoder (Backend::CreateDecoder): each
// token is gathered on the host and, for a device decoder, copied there (phi,
// psi and v converted to feature_dtype), and each output copied back.
absl::StatusOr<Tensor> DecodeOnBackend(Backend& backend, const SmatPlan& plan, int64_t window,
                                       const SmatInputs& in, DType feature_dtype) {
  const int64_t batch = in.phi.dim(0), T = in.phi.dim(1), H = in.phi.dim(2);
  const int64_t r = in.phi.dim(3), dv = in.v.dim(3);
  const bool on_host = backend.device().is_cpu();
  if (window == 0 && plan.T != T) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fixed-horizon decoding needs the plan of the sequence length: plan T = ", plan.T,
        ", inputs T = ", T));
  }
  SMAT_ASSIGN_OR_RETURN(Tensor o, Tensor::Empty({batch, T, H, dv}, DType::kF32));
  // Token t of a [B, T, H, X] tensor gathered into a [B, H, X] tensor.
  auto slice = [&](const Tensor& x, int64_t t, Tensor& dst) {
    if (!x.defined()) return;
    const int64_t X = x.rank() == 4 ? x.dim(3) : 1;
    const size_t row = static_cast<size_t>(H * X) * DTypeSize(x.dtype());
    for (int64_t b = 0; b < batch; ++b) {
      const char* src = static_cast<const char*>(x.raw()) + (b * T + t) * row;
      std::copy(src, src + row, static_cast<char*>(dst.raw()) + b * row);
    }
  };
  DecodeToken tok;  // host staging
  SMAT_ASSIGN_OR_RETURN(tok.phi, Tensor::Empty({batch, H, r}, DType::kF32));
  SMAT_ASSIGN_OR_RETURN(tok.psi, Tensor::Empty({batch, H, r}, DType::kF32));
  SMAT_ASSIGN_OR_RETURN(tok.v, Tensor::Empty({batch, H, dv}, DType::kF32));
  if (in.logg.defined()) {
    SMAT_ASSIGN_OR_RETURN(tok.logg, Tensor::Empty({batch, H}, DType::kF32));
  }
  if (in.prof.defined()) {
    SMAT_ASSIGN_OR_RETURN(tok.prof, Tensor::Empty({batch, H}, DType::kI32));
  }
  if (in.type.defined()) {
    SMAT_ASSIGN_OR_RETURN(tok.type, Tensor::Empty({batch, H}, DType::kI32));
  }
  SMAT_ASSIGN_OR_RETURN(Tensor o_host, Tensor::Empty({batch, H, dv}, DType::kF32));
  DecodeToken dev = tok;  // what the decoder reads
  Tensor o_t = o_host;
  if (!on_host) {
    for (auto [src, dst] : {std::pair{&tok.phi, &dev.phi}, std::pair{&tok.psi, &dev.psi},
                            std::pair{&tok.v, &dev.v}, std::pair{&tok.logg, &dev.logg},
                            std::pair{&tok.prof, &dev.prof}, std::pair{&tok.type, &dev.type}}) {
      if (!src->defined()) continue;
      const bool feature = src == &tok.phi || src == &tok.psi || src == &tok.v;
      SMAT_ASSIGN_OR_RETURN(*dst, Tensor::Empty(src->shape(), feature ? feature_dtype : src->dtype(),
                                                backend.allocator()));
    }
    SMAT_ASSIGN_OR_RETURN(o_t, Tensor::Empty({batch, H, dv}, DType::kF32, backend.allocator()));
  }
  const DecoderSpec spec{.plan = plan, .window = window, .dims = {batch, H, r, dv}, .eps = in.eps};
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> decoder, backend.CreateDecoder(spec));
  for (int64_t t = 0; t < T; ++t) {
    slice(in.phi, t, tok.phi);
    slice(in.psi, t, tok.psi);
    slice(in.v, t, tok.v);
    slice(in.logg, t, tok.logg);
    slice(in.prof, t, tok.prof);
    slice(in.type, t, tok.type);
    if (!on_host) {
      for (auto [src, dst] : {std::pair{&tok.phi, &dev.phi}, std::pair{&tok.psi, &dev.psi},
                              std::pair{&tok.v, &dev.v}, std::pair{&tok.logg, &dev.logg},
                              std::pair{&tok.prof, &dev.prof}, std::pair{&tok.type, &dev.type}}) {
        if (!src->defined()) continue;
        Tensor host = *src;
        if (host.dtype() != dst->dtype()) {
          SMAT_ASSIGN_OR_RETURN(host, ConvertDType(host, dst->dtype()));
        }
        SMAT_RETURN_IF_ERROR(backend.Copy(host, *dst));
      }
    }
    absl::Status s = decoder->Step(dev, &o_t);
    if (!s.ok()) return Annotate(s, "decoding token ", t);
    if (!on_host) {
      SMAT_RETURN_IF_ERROR(backend.Copy(o_t, o_host));
      SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
    }
    const size_t row = static_cast<size_t>(H * dv);
    for (int64_t b = 0; b < batch; ++b) {
      std::copy(o_host.data<float>() + b * row, o_host.data<float>() + (b + 1) * row,
                o.data<float>() + (b * T + t) * row);
    }
  }
  return o;
}

}  // namespace

absl::StatusOr<Tensor> DecodeSequence(const SmatPlan& plan, int64_t window,
                                      const SmatInputs& in) {
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Backend> cpu, CreateBackend(Device::Cpu()));
  return DecodeOnBackend(*cpu, plan, window, in, DType::kF32);
}

absl::StatusOr<SmatOpResults> ComputeSmatOp(const SmatOpConfig& cfg, const SmatPlan& plan,
                                            const SmatOpOperands& operands) {
  if (cfg.dtype != DType::kF32 && cfg.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype ", DTypeName(cfg.dtype), " is not supported; use fp32 or bf16"));
  }
  SmatInputs in = operands.in;
  in.eps = cfg.eps;
  SmatOpResults res;
  if (cfg.mode == SmatOpMode::kDecode) {
    if (!cfg.device.is_cpu()) {
      // The device's decoder (cache in device memory); bf16 operands are
      // handed to it as bf16, which it widens exactly to fp32.
      SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateBackend(cfg.device));
      SMAT_ASSIGN_OR_RETURN(res.o, DecodeOnBackend(*backend, plan, cfg.window, in, cfg.dtype));
      return res;
    }
    if (cfg.dtype == DType::kBF16) {
      // Same rounding of the operands as a bf16 forward; states stay fp32.
      for (Tensor* t : {&in.phi, &in.psi, &in.v}) {
        SMAT_ASSIGN_OR_RETURN(Tensor b, ConvertDType(*t, DType::kBF16));
        SMAT_ASSIGN_OR_RETURN(*t, ConvertDType(b, DType::kF32));
      }
    }
    SMAT_ASSIGN_OR_RETURN(res.o, DecodeSequence(plan, cfg.window, in));
    return res;
  }

  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateBackend(cfg.device));
  // The CPU SMat kernels are fp32: bf16 there means fp32 arithmetic on
  // bf16-rounded operands (what the CUDA bf16 path computes, up to summation order).
  const DType feature_dtype =
      (cfg.dtype == DType::kBF16 && !backend->device().is_cpu()) ? DType::kBF16 : DType::kF32;
  SmatInputs dev;
  dev.eps = cfg.eps;
  for (auto [src, dst] : {std::pair{&in.phi, &dev.phi}, std::pair{&in.psi, &dev.psi},
                          std::pair{&in.v, &dev.v}}) {
    Tensor host = *src;
    if (cfg.dtype == DType::kBF16 && feature_dtype == DType::kF32) {
      SMAT_ASSIGN_OR_RETURN(Tensor b, ConvertDType(host, DType::kBF16));
      SMAT_ASSIGN_OR_RETURN(host, ConvertDType(b, DType::kF32));
    }
    SMAT_ASSIGN_OR_RETURN(*dst, ToDevice(*backend, host, feature_dtype));
  }
  SMAT_ASSIGN_OR_RETURN(dev.logg, ToDevice(*backend, in.logg, DType::kF32));
  SMAT_ASSIGN_OR_RETURN(dev.prof, ToDevice(*backend, in.prof, DType::kI32));
  SMAT_ASSIGN_OR_RETURN(dev.type, ToDevice(*backend, in.type, DType::kI32));

  SmatForwardOutputs fwd;
  SMAT_RETURN_IF_ERROR(Annotate(SmatForward(*backend, plan, dev, &fwd), "forward"));
  SMAT_ASSIGN_OR_RETURN(res.o, ToHostF32(*backend, fwd.o));
  if (cfg.mode == SmatOpMode::kBackward) {
    SMAT_ASSIGN_OR_RETURN(Tensor d_o, ToDevice(*backend, operands.d_o, DType::kF32));
    SmatGradients grads;
    SMAT_RETURN_IF_ERROR(Annotate(SmatBackward(*backend, plan, dev, fwd, d_o, &grads), "backward"));
    SMAT_ASSIGN_OR_RETURN(res.dphi, ToHostF32(*backend, grads.phi));
    SMAT_ASSIGN_OR_RETURN(res.dpsi, ToHostF32(*backend, grads.psi));
    SMAT_ASSIGN_OR_RETURN(res.dv, ToHostF32(*backend, grads.v));
    SMAT_ASSIGN_OR_RETURN(res.dlogg, ToHostF32(*backend, grads.logg));
  }
  SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
  return res;
}

absl::Status WriteSmatOpResults(const std::string& dir, const SmatOpResults& results) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--out ", dir, ": cannot create the directory: ", ec.message()));
  }
  const std::pair<const char*, const Tensor*> files[] = {
      {"o.npy", &results.o},       {"dphi.npy", &results.dphi}, {"dpsi.npy", &results.dpsi},
      {"dv.npy", &results.dv},     {"dlogg.npy", &results.dlogg}};
  for (const auto& [name, t] : files) {
    if (!t->defined()) continue;
    SMAT_RETURN_IF_ERROR(Annotate(WriteNpy(JoinPath(dir, name), *t), "writing ", JoinPath(dir, name)));
  }
  return absl::OkStatus();
}

absl::Status RunSmatOp(const SmatOpConfig& cfg, const std::string& in_dir,
                       const std::string& out_dir) {
  SMAT_ASSIGN_OR_RETURN(SmatOpOperands operands, ReadSmatOpOperands(in_dir, cfg.mode));
  SMAT_ASSIGN_OR_RETURN(SmatPlan plan, PlanSmatOp(cfg, operands.T));
  for (const std::string& w : plan.warnings) std::fprintf(stderr, "smat_op: warning: %s\n", w.c_str());
  SMAT_ASSIGN_OR_RETURN(SmatOpResults results, ComputeSmatOp(cfg, plan, operands));
  return WriteSmatOpResults(out_dir, results);
}

std::string SmatPlanJson(const SmatPlan& plan) {
  const SmatGeometry& g = plan.geo;
  std::vector<std::string> warnings;
  for (const std::string& w : plan.warnings) warnings.push_back(JsonString(w));
  return absl::StrCat("{\"T\": ", plan.T, ", \"d\": ", g.d, ", \"q\": ", g.q, ", \"n\": ", plan.n,
                      ", \"m\": ", plan.m, ", \"P\": ", g.P, ", \"B\": ", g.B,
                      ", \"nnz_C\": ", g.nnz_C(), ", \"chunk\": ", plan.chunk,
                      ", \"num_chunks\": ", plan.num_chunks,
                      ", \"num_directions\": ", g.num_directions, ", \"warnings\": [",
                      absl::StrJoin(warnings, ", "), "]}");
}

}  // namespace smat
