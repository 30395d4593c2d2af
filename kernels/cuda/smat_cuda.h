// The CUDA implementation of SmatKernels (kernels/smat_kernels.h): every
// SMat-Attention phase, forward and backward, on one GPU, for fp32 or bf16
// phi / psi / v with fp32 accumulation, states, tables and scans. Results are
// bitwise repeatable (fixed reduction orders, no floating-point atomics) and
// the work of each phase is spread over (chunk or group, b * H) blocks so one
// sequence with a few heads still fills the device.
//
// Created by CudaBackend::smat(); usable directly in code that already holds
// a CUDA stream resolver:
//
//   std::unique_ptr<SmatKernels> k = MakeCudaSmatKernels(0, resolver);
//   SMAT_RETURN_IF_ERROR(SmatForward(backend, *k, plan, in, &fwd));
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/smat_kernels.h"

namespace smat {

// Maps a Stream* of the owning backend (nullptr: its default stream) to the
// CUDA stream to launch on; an error for a foreign stream.
using CudaStreamResolver = std::function<absl::StatusOr<cudaStream_t>(Stream*)>;

// Makes the side stream of ForkSide (SmatKernels): a stream of the owning
// backend, so that the resolver knows it.
using CudaSideStreamMaker = std::function<absl::StatusOr<std::unique_ptr<Stream>>()>;

// The SMat phase kernels for CUDA device `device`. Tensors passed to them must
// live on that device (Device::Cuda(device)). Without `make_side`, ForkSide
// returns the stream it is given (one stream for everything).
std::unique_ptr<SmatKernels> MakeCudaSmatKernels(int device, CudaStreamResolver stream_of,
                                                 CudaSideStreamMaker make_side = nullptr);

}  // namespace smat
