// The CPU implementation of ModelKernels (kernels/model_kernels.h): plain
// loops in fp32 over host tensors, reductions in a fixed order (rows in
// increasing index), matrix products through the backend's Gemm (CBLAS). It is
// the reference a CUDA implementation will be tested against.
//
//   std::unique_ptr<ModelKernels> mk = MakeCpuModelKernels();
//   SMAT_RETURN_IF_ERROR(mk->SwiGluForward(gate, up, y));
#pragma once

#include <memory>

#include "kernels/model_kernels.h"

namespace smat {

std::unique_ptr<ModelKernels> MakeCpuModelKernels();

}  // namespace smat
