// The CUDA implementation of ModelKernels (kernels/model_kernels.h): the dense
// model ops on one GPU, for fp32 activations and int32 ids/targets living on
// that device. Each op follows the interface's contract (overwrite vs
// accumulate, allowed aliasing, InvalidArgument naming the operand) and runs
// every reduction in a fixed order without floating-point atomics, so equal
// inputs give equal bits. Ops that perform the CPU implementation's fp32
// operations in the CPU's order (embedding, residual add, short convolution
// outputs and input gradients, Cast, AdamWUpdate) match
// kernels/cpu/model_kernels_cpu.cc bit for bit; the others agree to fp32
// rounding (RMSNorm's y to an ulp of rstd, whose double sum of squares runs in
// another order; see tests/gpu/model_kernels_gpu_test.cc).
//
// Ids and targets come from data, so they are checked on the device: a small
// kernel finds the first bad row and its index is copied back, one host
// synchronisation per EmbeddingForward / EmbeddingBackward / CrossEntropy*
// call (the cross-entropy and SumOfSquares also copy their double result back).
// Scratch memory is stream-ordered (cudaMallocAsync / cudaFreeAsync on the
// call's stream).
//
// Created once per backend by CudaBackend::model():
//
//   SMAT_ASSIGN_OR_RETURN(ModelKernels* mk, cuda_backend.model());
//   SMAT_RETURN_IF_ERROR(mk->RmsNormForward(x, w, 1e-6f, y, rstd, stream));
#pragma once

#include <memory>

#include "kernels/cuda/smat_cuda.h"
#include "kernels/model_kernels.h"

namespace smat {

// The model kernels for CUDA device `device`; `stream_of` maps the owning
// backend's streams; `max_blocks` caps the grid of the element-wise kernels.
std::unique_ptr<ModelKernels> MakeCudaModelKernels(int device, CudaStreamResolver stream_of,
                                                   int max_blocks);

}  // namespace smat
