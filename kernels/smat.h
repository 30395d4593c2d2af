// SMat-Attention on one device: the forward and backward op composed from the
// phases of kernels/smat_kernels.h over the single span [0, T) (paper
// Algorithm 1 with the gating of Lemma 4; backward per Appendix E). The
// sequence-parallel composition in parallel/ uses the same phases with
// collectives in between; this file is its single-rank counterpart and the
// thing the references are checked against.
//
//   SMAT_ASSIGN_OR_RETURN(SmatPlan plan, MakeSmatPlan(T, /*d=*/2, /*chunk=*/64));
//   SmatInputs in{.phi = phi, .psi = psi, .v = v, .logg = logg};  // prof/type: positional
//   SmatForwardOutputs fwd;
//   SMAT_RETURN_IF_ERROR(SmatForward(backend, plan, in, &fwd));   // fwd.o [batch, T, H, dv]
//   SmatGradients grads;
//   SMAT_RETURN_IF_ERROR(SmatBackward(backend, plan, in, fwd, d_o, &grads));
//
// Memory (per sequence and head; c = chunk, P points, B types, p = dv + 1):
// forward keeps O(T/c r p) chunk states, O((P + B) r p) tables and O(T p)
// token rows; saved for backward: lam O(T), chunk decays O(T/c), chunk incoming
// states O(T/c r p), U O(B r p), den O(T) and o. Never O(T r p).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/geometry.h"
#include "core/tensor.h"
#include "kernels/backend.h"
#include "kernels/smat_kernels.h"

namespace smat {

struct SmatInputs {
  Tensor phi;   // [batch, T, H, r]  query features >= 0 (fp32; bf16 on CUDA)
  Tensor psi;   // [batch, T, H, r]  key features >= 0 (key gate folded in)
  Tensor v;     // [batch, T, H, dv] values
  Tensor logg;  // [batch, T, H] fp32 log-gates <= 0, or undefined: ungated
  Tensor prof;  // [batch, T, H] int32 in [0, P), or undefined: positional profiles
  Tensor type;  // [batch, T, H] int32 in [0, B), or undefined: positional types
  float eps = 0.f;  // o = ybar[0:dv] / (ybar[dv] + eps)
};

// Sizes of one call, checked against the plan (span: the tokens the tensors hold).
struct SmatDims {
  int64_t batch = 0;
  int64_t L = 0;   // tokens held (span length; T for the whole op)
  int64_t Lc = 0;  // chunks held
  int64_t H = 0;
  int64_t r = 0;
  int64_t dv = 0;
  int64_t p = 0;  // dv + 1
};

// Validates shapes, dtypes and devices of `in` for `span` of `plan` (phi, psi,
// v hold the span's tokens) and returns the sizes; InvalidArgument naming the
// offending tensor otherwise.
absl::StatusOr<SmatDims> CheckSmatInputs(const SmatPlan& plan, const SmatSpan& span,
                                         const SmatInputs& in);

// The plan SmatForward and SmatBackward run for `plan`. With d = 1 and
// positional maps every recent token reads the one type table, which holds
// every distant token: the mask is causal, and the split at n only cuts one
// causal scan in two, the recent block reading the distant one through
// pooling, tabulation and per-type reads (two more passes over the tokens
// forward, three backward). The op then runs d = 1 as one block (n = 0,
// every token recent), which gives the same outputs up to fp32 rounding
// without the long-range branch. Content maps (content_maps: prof or type
// given) keep the plan: an id out of range takes a token out of the tables.
// Other plans are returned as they are.
SmatPlan SmatOpPlan(const SmatPlan& plan, bool content_maps);

// Whether the long-range branch (pooling, tabulation, per-type reads and
// their adjoints) has anything to carry: tokens on both sides of n.
inline bool SmatHasLongRange(const SmatPlan& plan) { return plan.n > 0 && plan.m > 0; }

// What backward needs from forward, all fp32 on the backend's device.
struct SmatSaved {
  Tensor lam;          // [batch, T, H] chunk-local log-decay prefix (undefined: ungated)
  Tensor chunk_decay;  // [batch, Nc, H] (undefined: ungated)
  Tensor S_in;         // [batch, Nc, H, r, p] chunk incoming states
  Tensor U;            // [batch, H, B, r, p] type table (referred to Lambda_{n-1})
  Tensor den;          // [batch, T, H] ybar[dv] + eps
};

struct SmatForwardOutputs {
  Tensor o;  // [batch, T, H, dv], dtype of v
  SmatSaved saved;
};

struct SmatGradients {
  Tensor phi;   // [batch, T, H, r]  fp32
  Tensor psi;   // [batch, T, H, r]  fp32
  Tensor v;     // [batch, T, H, dv] fp32
  Tensor logg;  // [batch, T, H] fp32 (undefined when ungated)
};

// What SmatForward keeps in fwd->saved: everything SmatBackward needs
// (training), or nothing (inference, evaluation). Without it fwd->saved
// stays empty, and where the backend walks the chunks
// (SmatKernels::ChunkStatesAndOutputs) the chunks' incoming states, O(T/c r p)
// floats, are never allocated or written. o agrees with the training
// forward's: bit for bit where the same kernels run (the CPU backend), within
// the rounding of its dtype where the backend walks on other kernels then
// (the CUDA backend on an H200); each repeats bit for bit.
enum class SmatKeep { kForBackward, kNothing };

// Forward over [0, T): allocates fwd->o and fwd->saved on backend's device.
absl::Status SmatForward(Backend& backend, const SmatPlan& plan, const SmatInputs& in,
                         SmatForwardOutputs* fwd, Stream* stream = nullptr,
                         SmatKeep keep = SmatKeep::kForBackward);

// Backward of L = sum(d_o * o): allocates and fills *grads.
absl::Status SmatBackward(Backend& backend, const SmatPlan& plan, const SmatInputs& in,
                          const SmatForwardOutputs& fwd,
                          const Tensor& d_o,  // [batch, T, H, dv] fp32
                          SmatGradients* grads, Stream* stream = nullptr);

// The same with an explicit phase implementation (backend provides memory and
// Fill; kernels must run on its device), e.g. to compare two implementations.
absl::Status SmatForward(Backend& backend, SmatKernels& kernels, const SmatPlan& plan,
                         const SmatInputs& in, SmatForwardOutputs* fwd, Stream* stream = nullptr,
                         SmatKeep keep = SmatKeep::kForBackward);
absl::Status SmatBackward(Backend& backend, SmatKernels& kernels, const SmatPlan& plan,
                          const SmatInputs& in, const SmatForwardOutputs& fwd, const Tensor& d_o,
                          SmatGradients* grads, Stream* stream = nullptr);

}  // namespace smat
