// CpuBackend: the Backend that every binary has, running each operation at
// once on the calling thread.
//
// Memory is host memory from CpuAllocator(); streams and events exist so code
// written for the CUDA backend runs unchanged (an event records the host time
// at Record, so ElapsedMs measures the host work between two events). Dense
// products go to CBLAS (OpenBLAS): bf16 operands are widened to fp32 first, so
// the result is the fp32 product of the bf16-rounded inputs, which is what the
// CUDA backend's cuBLAS call computes too.
//
//   CpuBackend cpu;
//   SMAT_RETURN_IF_ERROR(cpu.Gemm(Transpose::kNo, Transpose::kNo, 1.f, a, b, 0.f, c));
#pragma once

#include <memory>
#include <string>

#include "kernels/backend.h"

namespace smat {

class CpuBackend final : public Backend {
 public:
  CpuBackend();
  ~CpuBackend() override;

  Device device() const override { return Device::Cpu(); }
  std::string name() const override { return "cpu"; }
  Allocator& allocator() override { return CpuAllocator(); }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override;
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override;
  absl::Status Record(Event& event, Stream* stream) override;
  absl::Status Wait(Stream* stream, Event& event) override;
  absl::Status Synchronize(Stream* stream) override;
  absl::StatusOr<float> ElapsedMs(Event& start, Event& stop) override;

  absl::Status Copy(const Tensor& src, Tensor& dst, Stream* stream = nullptr) override;
  absl::Status Fill(Tensor& t, double value, Stream* stream = nullptr) override;
  absl::Status Axpy(float alpha, const Tensor& x, Tensor& y, Stream* stream = nullptr) override;
  absl::Status Gemm(Transpose ta, Transpose tb, float alpha, const Tensor& a, const Tensor& b,
                    float beta, Tensor& c, Stream* stream = nullptr) override;

  // The CPU SMat phases (kernels/cpu/smat_cpu.h); always available.
  absl::StatusOr<SmatKernels*> smat() override;
  // The CPU model ops (kernels/cpu/model_kernels_cpu.h); always available.
  absl::StatusOr<ModelKernels*> model() override;
  // The host decoders (kernels/decode.h, CreateHostDecoder).
  absl::StatusOr<std::unique_ptr<Decoder>> CreateDecoder(const DecoderSpec& spec) override;

 private:
  std::unique_ptr<SmatKernels> smat_;  // complete type in the .cc (constructor, destructor)
  std::unique_ptr<ModelKernels> model_;
};

// The threads OpenBLAS runs each of this process's products on: its own
// choice (OPENBLAS_NUM_THREADS, else one per CPU the process may use) until
// SetCpuBlasThreads (threads >= 1; smat_train sets it where ranks share a
// host, parallel/launch_env.h CpuThreadsPerRank).
int CpuBlasThreads();
void SetCpuBlasThreads(int threads);

}  // namespace smat
