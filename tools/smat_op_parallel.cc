// smat_op's sequence-parallel driver (see smat_op_parallel.h).
#include "tools/smat_op_parallel.h"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/convert.h"
#include "kernels/backend.h"
#include "parallel/mpi_communicator.h"
#include "parallel/sequence_parallel_smat.h"

namespace smat {
namespace {

// A host span slice on the backend, converted to `dtype` (bf16 features on
// the CPU are rounded to bf16 and computed in fp32, as smat_op does).
absl::StatusOr<Tensor> SpanOnBackend(Backend& backend, const Tensor& full, const SmatSpan& span,
                                     DType dtype) {
  if (!full.defined()) return Tensor();
  SMAT_ASSIGN_OR_RETURN(Tensor part, SliceSpan(full, span));
  if (dtype == DType::kBF16) {
    SMAT_ASSIGN_OR_RETURN(part, ConvertDType(part, DType::kBF16));
    if (backend.device().is_cpu()) {
      SMAT_ASSIGN_OR_RETURN(part, ConvertDType(part, DType::kF32));
    }
  }
  if (backend.device().is_cpu()) return part;
  SMAT_ASSIGN_OR_RETURN(Tensor dev, Tensor::Empty(part.shape(), part.dtype(), backend.allocator()));
  SMAT_RETURN_IF_ERROR(backend.Copy(part, dev));
  return dev;
}

// The span result on the host in fp32, gathered to the whole sequence.
absl::StatusOr<Tensor> Gathered(Backend& backend, Communicator& host,
                                const std::vector<SmatSpan>& spans, const Tensor& t) {
  if (!t.defined()) return Tensor();
  Tensor h = t;
  if (!t.device().is_cpu()) {
    SMAT_ASSIGN_OR_RETURN(h, Tensor::Empty(t.shape(), t.dtype()));
    SMAT_RETURN_IF_ERROR(backend.Copy(t, h));
    SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  }
  if (h.dtype() != DType::kF32) {
    SMAT_ASSIGN_OR_RETURN(h, ConvertDType(h, DType::kF32));
  }
  return GatherSpans(host, spans, h);
}

absl::Status RunOnRanks(const SmatOpConfig& cfg, const std::string& in_dir,
                        const std::string& out_dir, MpiCommunicator& world) {
  if (cfg.mode == SmatOpMode::kDecode) {
    return absl::InvalidArgumentError(
        "decode runs token by token on one process; run smat_op decode without mpirun");
  }
  SMAT_ASSIGN_OR_RETURN(SmatOpOperands ops, ReadSmatOpOperands(in_dir, cfg.mode));
  SMAT_ASSIGN_OR_RETURN(SmatPlan plan, PlanSmatOp(cfg, ops.T));
  SMAT_ASSIGN_OR_RETURN(std::vector<SmatSpan> spans, SplitSequence(plan, world.size()));
  const SmatSpan span = spans[world.rank()];

  // One GPU per rank on a host: cuda means cuda:<local rank>.
  Device device = cfg.device;
  if (!device.is_cpu()) {
    MPI_Comm local;
    MPI_Comm_split_type(world.comm(), MPI_COMM_TYPE_SHARED, world.rank(), MPI_INFO_NULL, &local);
    int local_rank = 0;
    MPI_Comm_rank(local, &local_rank);
    MPI_Comm_free(&local);
    device = Device::Cuda(device.index + local_rank);
  }
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateBackend(device));

  SmatInputs mine;
  mine.eps = cfg.eps;
  SMAT_ASSIGN_OR_RETURN(mine.phi, SpanOnBackend(*backend, ops.in.phi, span, cfg.dtype));
  SMAT_ASSIGN_OR_RETURN(mine.psi, SpanOnBackend(*backend, ops.in.psi, span, cfg.dtype));
  SMAT_ASSIGN_OR_RETURN(mine.v, SpanOnBackend(*backend, ops.in.v, span, cfg.dtype));
  SMAT_ASSIGN_OR_RETURN(mine.logg, SpanOnBackend(*backend, ops.in.logg, span, DType::kF32));
  SMAT_ASSIGN_OR_RETURN(mine.prof, SpanOnBackend(*backend, ops.in.prof, span, DType::kI32));
  SMAT_ASSIGN_OR_RETURN(mine.type, SpanOnBackend(*backend, ops.in.type, span, DType::kI32));

  SpSmatForwardOutputs fwd;
  SMAT_RETURN_IF_ERROR(Annotate(
      SequenceParallelSmatForward(*backend, world, plan, spans, mine, &fwd), "forward"));
  SmatOpResults res;
  SMAT_ASSIGN_OR_RETURN(res.o, Gathered(*backend, world, spans, fwd.o));
  if (cfg.mode == SmatOpMode::kBackward) {
    SMAT_ASSIGN_OR_RETURN(Tensor d_o, SpanOnBackend(*backend, ops.d_o, span, DType::kF32));
    SmatGradients g;
    SMAT_RETURN_IF_ERROR(Annotate(
        SequenceParallelSmatBackward(*backend, world, plan, spans, mine, fwd, d_o, &g), "backward"));
    SMAT_ASSIGN_OR_RETURN(res.dphi, Gathered(*backend, world, spans, g.phi));
    SMAT_ASSIGN_OR_RETURN(res.dpsi, Gathered(*backend, world, spans, g.psi));
    SMAT_ASSIGN_OR_RETURN(res.dv, Gathered(*backend, world, spans, g.v));
    SMAT_ASSIGN_OR_RETURN(res.dlogg, Gathered(*backend, world, spans, g.logg));
  }
  if (world.rank() == 0) {
    std::fprintf(stderr, "smat_op: sequence-parallel over %d ranks, spans", world.size());
    for (const SmatSpan& s : spans) std::fprintf(stderr, " [%lld, %lld)",
                                                 static_cast<long long>(s.t0),
                                                 static_cast<long long>(s.t1));
    std::fprintf(stderr, " (n = %lld); per layer: %s\n", static_cast<long long>(plan.n),
                 fwd.volume.ToString().c_str());
    SMAT_RETURN_IF_ERROR(WriteSmatOpResults(out_dir, res));
  }
  // Nobody leaves before rank 0 has written (a launcher may read the files
  // as soon as the job ends).
  return world.Barrier();
}

}  // namespace

int SmatOpLaunchedWorldSize() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    const char* v = std::getenv(name);
    int size = 0;
    if (v != nullptr && absl::SimpleAtoi(v, &size) && size > 0) return size;
  }
  return 1;
}

int RunSmatOpUnderMpi(const SmatOpConfig& cfg, const std::string& in_dir,
                      const std::string& out_dir) {
  absl::StatusOr<MpiSession> mpi = MpiSession::Init(nullptr, nullptr);
  if (!mpi.ok()) {
    std::fprintf(stderr, "smat_op: %s\n", std::string(mpi.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<CommOptions> opts = CommOptions::FromEnvironment();
  if (!opts.ok()) AbortJob(opts.status());
  absl::StatusOr<std::unique_ptr<MpiCommunicator>> world =
      MpiCommunicator::Create(MPI_COMM_WORLD, *opts);
  if (!world.ok()) AbortJob(world.status());
  absl::Status s = RunOnRanks(cfg, in_dir, out_dir, **world);
  if (!s.ok()) {
    AbortJob(Annotate(s, "smat_op (rank ", (*world)->rank(), " of ", (*world)->size(), ")"));
  }
  return 0;
}

}  // namespace smat
