// smat_op's work, separated from its flags: reading the operands of one SMat
// operation from .npy files, planning, computing (forward, backward, token-by-
// token decoding) and writing the results. The compute step
// (ComputeSmatOp) takes host tensors and returns host tensors, so a sequence-
// parallel driver under mpirun can replace it without touching the I/O.
//
//   SMAT_ASSIGN_OR_RETURN(SmatOpConfig cfg, ...);             // from flags
//   SMAT_RETURN_IF_ERROR(RunSmatOp(cfg, "in_dir", "out_dir"));  // o.npy, ...
//
// Files (float32 unless noted; B batch, T tokens, H heads):
//   phi.npy, psi.npy [B, T, H, r]; v.npy [B, T, H, dv]; optional logg.npy
//   [B, T, H] (gated); optional prof.npy, type.npy int32 [B, T, H] (content
//   assignment; positional maps when absent); backward: do.npy [B, T, H, dv].
//   Written: o.npy [B, T, H, dv]; backward also dphi.npy, dpsi.npy, dv.npy and
//   dlogg.npy when logg.npy was given.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/smat.h"

namespace smat {

enum class SmatOpMode : int { kForward = 0, kBackward = 1, kDecode = 2 };

// "forward", "backward", "decode".
absl::StatusOr<SmatOpMode> ParseSmatOpMode(const std::string& name);

struct SmatOpConfig {
  SmatOpMode mode = SmatOpMode::kForward;
  int d = 0;            // VC dimension (>= 1)
  int64_t q = 0;        // field size; 0: picked from (T, d) (core/geometry.h)
  int64_t chunk = 64;   // chunk width c
  float eps = 1e-6f;    // o = ybar[0:dv] / (ybar[dv] + eps)
  int64_t window = 0;   // decode: stepped-window block length c_dc; 0: fixed horizon
  int64_t tmax = 0;     // decode with window: T_max of the geometry; 0: T of the inputs
  Device device = Device::Cpu();
  DType dtype = DType::kF32;  // fp32 or bf16 (phi, psi, v rounded to bf16)
};

// Host tensors of one operation, as read from the input directory.
struct SmatOpOperands {
  SmatInputs in;  // phi, psi, v (+ logg, prof, type when present); eps from the config
  Tensor d_o;     // [B, T, H, dv] backward only
  int64_t batch = 0, T = 0, H = 0, r = 0, dv = 0;
};

// Host results to write.
struct SmatOpResults {
  Tensor o;      // [B, T, H, dv]
  Tensor dphi;   // [B, T, H, r]   backward
  Tensor dpsi;   // [B, T, H, r]   backward
  Tensor dv;     // [B, T, H, dv]  backward
  Tensor dlogg;  // [B, T, H]      backward, gated
};

// Reads and validates the operands in `dir` for `mode`. InvalidArgument /
// NotFound / DataLoss naming the file and what is wrong with it.
absl::StatusOr<SmatOpOperands> ReadSmatOpOperands(const std::string& dir, SmatOpMode mode);

// The plan the operation runs with: MakeSmatPlan(T, d, chunk, q); for decode
// with a window, T_max = cfg.tmax (or T). Also checks the window.
absl::StatusOr<SmatPlan> PlanSmatOp(const SmatOpConfig& cfg, int64_t T);

// The compute step: forward / backward through the SMat op on cfg.device
// (kernels/smat.h via CreateBackend), or decoding token by token with the backend's decoder
// (kernels/decode.h, Backend::CreateDecoder). Host tensors in, host tensors out.
absl::StatusOr<SmatOpResults> ComputeSmatOp(const SmatOpConfig& cfg, const SmatPlan& plan,
                                            const SmatOpOperands& operands);

// Decodes every position 0..T-1 token by token: the fixed-horizon decoder
// (window = 0; plan.T must equal T) or the stepped-window decoder. o [B, T, H, dv].
absl::StatusOr<Tensor> DecodeSequence(const SmatPlan& plan, int64_t window, const SmatInputs& in);

// Writes the defined results as .npy files into `dir` (created if missing).
absl::Status WriteSmatOpResults(const std::string& dir, const SmatOpResults& results);

// Read, plan, compute, write.
absl::Status RunSmatOp(const SmatOpConfig& cfg, const std::string& in_dir,
                       const std::string& out_dir);

// The geometry of a plan as one JSON object: T, d, q, n, m, P, B, nnz_C,
// chunk, num_chunks, num_directions, warnings.
std::string SmatPlanJson(const SmatPlan& plan);

}  // namespace smat
