// The decoders of kernels/decode.h on one GPU: the cache (running states, the
// profile table F while it exists, the type states U, the block deltas and the
// log-gate sums) lives in device memory, tokens and outputs are device tensors,
// and one kernel launch steps every (sequence, head) of the batch. Only the
// rare tabulation steps launch more: at t = n for the fixed horizon, at each
// block start for the stepped window (refer the table, U = C F with the SMat
// phase kernel SmatKernels::Tabulate, fold it into U).
//
// The math is the host decoders' (kernels/cpu/decode_cpu.cc), operation for
// operation: fp32 states updated as S <- fl(fl(a S) + fl(k v)) with no fused
// multiply-add (so a state holds the host's bits), log-gate sums and the
// exponentials of them in double, readouts accumulated in double. Only the
// order of the readout's double sums differs; results agree with the host to
// rounding of the final division (tests/gpu/decode_gpu_test.cc).
//
// This header has two parts: the kernel launchers (plain C++, included by
// decode_cuda.cu, which nvcc compiles without Abseil), and the factory that
// CudaBackend::CreateDecoder calls (ordinary C++ only).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace smat {

// What a decode step reads and writes for every (sequence, head) i < bh.
// State layouts: one state is r x p floats (p = dv + 1), row-major;
// tables are [bh, G, r, p] with per-entry log-gate sums [bh, G].
struct DecodeStepArgs {
  int64_t bh = 0;
  int r = 0;
  int dv = 0;
  int64_t P = 1;  // profiles (range of prof)
  int64_t B = 1;  // types (range of type)
  bool bf16 = false;  // phi, psi, v are bf16 (else fp32)
  float eps = 0.f;
  // Tokens [bh, r] / [bh, dv] / [bh]; logg, prof, type may be null (a = 1,
  // positional: pos_profile / pos_type for every i). Every id passed is
  // checked (pass null for a map the step does not read): an id out of range
  // makes that i's output NaN and leaves its cache untouched.
  const void* phi = nullptr;
  const void* psi = nullptr;
  const void* v = nullptr;
  const float* logg = nullptr;
  const int32_t* prof = nullptr;
  const int32_t* type = nullptr;
  int64_t pos_profile = 0;
  int64_t pos_type = 0;
  float* o = nullptr;  // [bh, dv]
  // S <- a S + Z, read with weight 1 (fixed: the running state; stepped: R_old).
  float* S = nullptr;
  // Optional second recurrence S2 <- a S2 + Z, not read (stepped: R_cur).
  float* S2 = nullptr;
  // Optional table: table[x] <- exp(lam - table_lam[x]) table[x] + Z with
  // x = prof (fixed: F while t < n; stepped: the current block's deltas), then
  // table_lam[x] = lam.
  float* table = nullptr;
  double* table_lam = nullptr;
  // Optional type read: ybar += exp(lam_offset[i] + lam) phi^T U[type]
  // (lam_offset null: 0).
  const float* U = nullptr;
  const double* lam_offset = nullptr;
  // lam[i] += logg (the sum the gates are referred to); required.
  double* lam = nullptr;
};

// One step for all bh (sequence, head) pairs: one kernel launch.
cudaError_t LaunchDecodeStep(const DecodeStepArgs& args, cudaStream_t stream);

// table[i, x] *= (float)exp(lam[i] - table_lam[i, x]) for every x < G: refers
// each entry from the last token that touched it to the token lam belongs to.
cudaError_t LaunchDecodeReferTable(int64_t bh, int64_t G, int64_t state, float* table,
                                   const double* table_lam, const double* lam,
                                   cudaStream_t stream);

// U[i] = fl(fl((float)exp(decay[i]) U[i]) + add[i]) over [bh, count] floats each.
cudaError_t LaunchDecodeDecayAdd(int64_t bh, int64_t count, float* U, const float* add,
                                 const double* decay, cudaStream_t stream);

// dst[i] = src[i]; src[i] = 0 for i < bh (the stepped window's block roll of
// the log-gate sums).
cudaError_t LaunchDecodeMoveScalars(int64_t bh, double* dst, double* src, cudaStream_t stream);

}  // namespace smat

#if !defined(__CUDACC__)
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/decode.h"
#include "kernels/smat_kernels.h"

namespace smat {

// The CUDA decoder for `spec` on device `device`: memory from `alloc`, streams
// resolved by `stream_of` (a Stream* of the owning backend -> cudaStream_t),
// tabulation by `smat` (that backend's SMat kernels). InvalidArgument for bad
// dims or window; ResourceExhausted when the cache does not fit.
absl::StatusOr<std::unique_ptr<Decoder>> MakeCudaDecoder(
    int device, std::function<absl::StatusOr<cudaStream_t>(Stream*)> stream_of, Allocator& alloc,
    SmatKernels* smat, const DecoderSpec& spec);

}  // namespace smat
#endif
