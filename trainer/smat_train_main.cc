// smat_train: trains a model from a config, in one process or as many ranks
// under mpirun on a parallel.dp x parallel.sp grid (ARCHITECTURE.md sections 1, 4).
//
//   build/smat_train --config configs/tiny_cpu.textproto
//   mpirun -np 2 build/smat_train --config configs/demo_cpu.textproto --set run.steps=50
//
// Start-up is all-or-nothing: every rank loads and validates the config, checks
// the grid against the world size, opens the data and builds the model, and the
// ranks agree on the outcome (one small all-reduce) before any training step,
// so a bad config, a missing or damaged data file or an impossible shape stops
// every rank with its message and exit code 2, never one rank hanging in a
// collective. Exit codes: core/exit_codes.h.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <mpi.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/config.h"
#include "core/exit_codes.h"
#include "core/status.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "parallel/launch_env.h"
#include "parallel/mpi_communicator.h"
#include "parallel/process_group.h"
#include "parallel/rank_placement.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_writer.h"
#include "trainer/metrics.h"
#include "trainer/preemption.h"
#include "trainer/progress.h"
#include "trainer/train_loop.h"

ABSL_FLAG(std::string, config, "", "training config, protobuf text format (configs/*.textproto)");

namespace smat {
namespace {

constexpr char kUsage[] =
    "smat_train --config FILE [--set path.to.field=value ...]\n"
    "  Trains a SMat-Attention model. Under mpirun the world size must equal\n"
    "  parallel.dp * parallel.sp. --set may be repeated; it overrides one scalar\n"
    "  field of the config (e.g. --set run.steps=100 --set smat.d=1).\n"
    "  Exit codes: 0 done, 2 bad config or data, 3 retryable failure (a rank or\n"
    "  collective failed), 4 the loss became NaN/inf.";

// --set may repeat, which an absl flag cannot express (the last would win), so
// its occurrences are taken out of argv before absl parses the rest.
std::vector<std::string> ExtractOverrides(int& argc, char** argv, absl::Status* error) {
  std::vector<std::string> overrides;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strcmp(a, "--set") == 0 || std::strcmp(a, "-set") == 0) {
      if (i + 1 >= argc) {
        *error = absl::InvalidArgumentError("--set needs a value: --set path.to.field=value");
        break;
      }
      overrides.push_back(argv[++i]);
    } else if (absl::StartsWith(a, "--set=") || absl::StartsWith(a, "-set=")) {
      overrides.push_back(std::strchr(a, '=') + 1);
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  return overrides;
}

// Every rank passes its own outcome; all get OK only if every rank's was OK.
// A rank that failed keeps its own status; the others learn that a peer failed
// (its message is printed by that rank).
absl::Status AgreeOnSetup(Communicator& control, const absl::Status& mine, const char* what) {
  absl::StatusOr<Tensor> flag = Tensor::Zeros({1}, DType::kI32);
  if (!flag.ok()) return flag.status();
  flag->data<int32_t>()[0] = mine.ok() ? 0 : 1;
  absl::Status s = control.AllReduce(*flag);
  if (!s.ok()) return Annotate(s, "agreeing on ", what);
  if (!mine.ok()) return mine;
  const int failed = flag->data<int32_t>()[0];
  if (failed > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(failed, " other rank(s) failed during ", what, "; see their messages"));
  }
  return absl::OkStatus();
}

struct Setup {
  TrainConfig config;
  std::unique_ptr<ProcessGroup> pg;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Trainer> trainer;
};

absl::Status CheckGrid(const TrainConfig& cfg, int world_size) {
  const int dp = cfg.parallel().dp(), sp = cfg.parallel().sp();
  if (static_cast<int64_t>(dp) * sp == world_size) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "parallel.dp = ", dp, " x parallel.sp = ", sp, " needs ", dp * sp, " ranks but ",
      world_size, world_size == 1 ? " was started" : " were started",
      "; run `mpirun -np ", dp * sp, " smat_train ...` or change parallel.dp / parallel.sp "
      "(--set parallel.sp=", world_size, ")"));
}

absl::Status BuildGroupAndBackend(Setup& s) {
  SMAT_ASSIGN_OR_RETURN(CommOptions comm, CommOptions::FromConfig(s.config.parallel()));
  SMAT_ASSIGN_OR_RETURN(Device device, ParseDevice(s.config.parallel().device()));
  ProcessGroupOptions opts;
  opts.sp = s.config.parallel().sp();
  opts.backend = device.is_cpu() ? CommBackend::kMpi : CommBackend::kNccl;
  opts.comm = comm;
  SMAT_ASSIGN_OR_RETURN(s.pg, ProcessGroup::Create(MPI_COMM_WORLD, opts));
  if (!device.is_cpu()) device = Device::Cuda(s.pg->device() >= 0 ? s.pg->device() : 0);
  SMAT_ASSIGN_OR_RETURN(s.backend, CreateBackend(device));
  return absl::OkStatus();
}

// Where CPU ranks share a set of CPUs, their BLAS threads share them
// (CpuThreadsPerRank). Returns the line to print, "" where OpenBLAS keeps its
// own choice.
std::string ShareCpusAmongRanks(const PlacementReport& placement) {
  const int threads =
      CpuThreadsPerRank(std::getenv, placement.ranks_sharing_cpus, placement.allowed_cpus);
  if (threads == 0) return "";
  SetCpuBlasThreads(threads);
  return absl::StrFormat(
      "smat: BLAS on %d thread%s per rank: %d ranks share rank 0's %d CPUs "
      "(OPENBLAS_NUM_THREADS chooses)",
      threads, threads == 1 ? "" : "s", placement.ranks_sharing_cpus, placement.allowed_cpus);
}

std::string DescribeRun(const Setup& s) {
  const TrainConfig& c = s.config;
  int64_t params = s.trainer->model().NumParameterElements();
  return absl::StrFormat(
      "smat: %s: %s parameters (width %d, %d layers, %d heads), smat d = %d, chunk %d; "
      "T = %d, batch %d per dp group; grid dp %d x sp %d on %s; %d steps",
      c.run().name(), FormatCount(static_cast<double>(params)), c.model().width(),
      c.model().layers(), c.model().heads(), c.smat().d(), c.smat().chunk(), c.data().seq_len(),
      c.data().batch_size(), s.pg->dp(), s.pg->sp(), s.backend->name(), c.run().steps());
}

// The state a checkpoint holds (trainer/checkpoint.h), as host tensors: a
// device parameter is copied out (the writer copies again when async; the
// double copy only happens on GPUs and only every checkpoint.every_steps).
absl::StatusOr<CheckpointState> MakeCheckpointState(const TrainConfig& cfg, Trainer& trainer,
                                                    Backend& backend) {
  const TrainState& ts = trainer.state();
  CheckpointState ck;
  ck.step = ts.step;
  ck.sampler_cursor = ts.sampler_cursor();
  // No random numbers are drawn during training beyond counter-based Philox
  // streams keyed by these seeds and the step (core/rng.h, trainer/data.h).
  ck.rng_state = absl::StrCat("philox run.seed=", cfg.run().seed(), " data.seed=",
                              cfg.data().seed());
  ck.config_text = ConfigToText(cfg);
  ck.dp = cfg.parallel().dp();
  ck.sp = cfg.parallel().sp();
  for (auto& [name, t] : ts.Tensors()) {
    Tensor host = t;
    if (!t.device().is_cpu()) {
      SMAT_ASSIGN_OR_RETURN(host, Tensor::Empty(t.shape(), t.dtype()));
      SMAT_RETURN_IF_ERROR(backend.Copy(t, host));
      SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
    }
    ck.tensors.push_back({name, host});
  }
  return ck;
}

// checkpoint.resume: "none", "auto" (the newest intact checkpoint under
// checkpoint.dir, if any) or a checkpoint directory. Returns the path resumed
// from ("" when starting fresh).
absl::StatusOr<std::string> Resume(const TrainConfig& cfg, Trainer& trainer, Backend& backend) {
  const std::string& resume = cfg.checkpoint().resume();
  if (resume == "none") return std::string();
  std::string path = resume;
  if (resume == "auto") {
    absl::StatusOr<std::string> latest = FindLatestIntact(cfg.checkpoint().dir());
    if (latest.status().code() == absl::StatusCode::kNotFound) return std::string();
    if (!latest.ok()) return latest.status();
    path = *latest;
  }
  SMAT_ASSIGN_OR_RETURN(CheckpointState ck, LoadCheckpoint(path));
  std::map<std::string, const Tensor*> saved;
  for (const NamedTensor& t : ck.tensors) saved[t.name] = &t.tensor;
  for (auto& [name, dst] : trainer.state().Tensors()) {
    auto it = saved.find(name);
    if (it == saved.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint ", path, " has no tensor '", name, "': it was written for another model "
          "config; start fresh with --set checkpoint.resume=none or a new checkpoint.dir"));
    }
    const Tensor& src = *it->second;
    if (src.shape() != dst.shape() || src.dtype() != dst.dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint ", path, ": tensor '", name, "' is ", DTypeName(src.dtype()),
          ShapeToString(src.shape()), " but the model has ", DTypeName(dst.dtype()),
          ShapeToString(dst.shape()), "; the model config changed since it was written"));
    }
    SMAT_RETURN_IF_ERROR(backend.Copy(src, dst));
  }
  SMAT_RETURN_IF_ERROR(backend.Synchronize(nullptr));
  trainer.state().RestoreStep(ck.step, ck.sampler_cursor);
  return path;
}

// Ends a multi-rank job whose ranks may no longer agree (one failed mid-step
// while the others wait in a collective): MPI_Abort with the run's exit code.
[[noreturn]] void AbortAll(const absl::Status& status, int code, int rank) {
  std::fprintf(stderr, "smat: rank %d: %s\nsmat: rank %d: aborting the job (exit %d)\n", rank,
               status.ToString().c_str(), rank, code);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return.
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  absl::Status arg_error;
  std::vector<std::string> overrides = ExtractOverrides(argc, argv, &arg_error);
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (arg_error.ok() && rest.size() > 1) {
    arg_error = absl::InvalidArgumentError(absl::StrCat("unexpected argument '", rest[1], "'"));
  }
  if (arg_error.ok() && absl::GetFlag(FLAGS_config).empty()) {
    arg_error = absl::InvalidArgumentError("--config FILE is required");
  }
  if (!arg_error.ok()) {
    std::fprintf(stderr, "smat_train: %s\nusage: %s\n", std::string(arg_error.message()).c_str(),
                 kUsage);
    return kExitBadInput;
  }

  absl::StatusOr<MpiSession> mpi = MpiSession::Init(&argc, &argv);
  if (!mpi.ok()) {
    std::fprintf(stderr, "smat_train: %s\n", mpi.status().ToString().c_str());
    return ExitCodeForStatus(mpi.status());
  }
  const int rank = mpi->world_rank();
  const int world = mpi->world_size();
  auto fail = [&](const absl::Status& s) {
    std::fprintf(stderr, "smat_train: rank %d: %s\n", rank, std::string(s.message()).c_str());
    return ExitCodeForStatus(s);
  };

  // A host communicator for start-up verdicts, before the config (and so the
  // grid and the collective timeout) is known.
  absl::StatusOr<CommOptions> control_opts = CommOptions::FromEnvironment();
  if (!control_opts.ok()) return fail(control_opts.status());
  absl::StatusOr<std::unique_ptr<MpiCommunicator>> control =
      MpiCommunicator::Create(MPI_COMM_WORLD, *control_opts);
  if (!control.ok()) return fail(control.status());

  Setup s;
  // 1. Config and grid.
  absl::Status st = [&]() -> absl::Status {
    SMAT_ASSIGN_OR_RETURN(s.config, LoadConfig(absl::GetFlag(FLAGS_config), overrides));
    return CheckGrid(s.config, world);
  }();
  st = AgreeOnSetup(**control, st, "config loading");
  if (!st.ok()) return fail(st);

  // 2. Process group, backend; where every rank runs.
  st = BuildGroupAndBackend(s);
  st = AgreeOnSetup(**control, st, "process group and device set-up");
  if (!st.ok()) return fail(st);
  // The rank -> host -> CPUs -> GPU table, after checking the launcher's
  // environment (Open MPI, Slurm) against MPI's world
  // (parallel/rank_placement.h); CPU ranks that share CPUs share them among
  // their BLAS threads.
  absl::StatusOr<PlacementReport> placement = DescribeRankPlacement(**control, *s.pg, std::getenv);
  if (!placement.ok()) return fail(placement.status());
  ProgressPrinter progress(stdout, rank == 0);
  progress.Line(placement->table);
  if (s.backend->device().is_cpu()) {
    const std::string blas = ShareCpusAmongRanks(*placement);
    if (!blas.empty()) progress.Line(blas);
  }

  // 3. Data, model and optimizer.
  absl::StatusOr<std::unique_ptr<Trainer>> trainer = Trainer::Create(s.config, *s.pg, *s.backend);
  st = AgreeOnSetup(**control, trainer.status(), "data and model set-up");
  if (!st.ok()) return fail(st);
  s.trainer = std::move(*trainer);
  progress.Line(DescribeRun(s));

  // 4. Resume, metrics, checkpoint writer.
  absl::StatusOr<std::string> resumed = Resume(s.config, *s.trainer, *s.backend);
  st = AgreeOnSetup(**control, resumed.status(), "resuming from a checkpoint");
  if (!st.ok()) return fail(st);
  if (!resumed->empty()) {
    progress.Line(absl::StrCat("smat: resumed from ", *resumed, " at step ",
                               s.trainer->state().step));
    // Equal on any grid that loads this checkpoint (tests compare it).
    absl::StatusOr<uint32_t> crc = TrainStateCrc32(s.trainer->state(), *s.backend);
    if (!crc.ok()) return fail(crc.status());
    progress.Line(absl::StrFormat("smat: resumed state: data cursor %d, crc32 %08x",
                                  s.trainer->state().sampler_cursor(), *crc));
  }
  absl::StatusOr<std::unique_ptr<TrainingMetrics>> metrics = TrainingMetrics::Create(
      s.config.metrics(), rank, s.pg->local_rank(), s.config.run().dir());
  st = AgreeOnSetup(**control, metrics.status(), "metrics set-up");
  if (!st.ok()) return fail(st);
  const CheckpointConfig& ckc = s.config.checkpoint();
  CheckpointWriterOptions wopts =
      CheckpointWriterOptions::FromEnvironment(ckc.dir(), rank, world);
  wopts.keep_last = ckc.keep_last();
  wopts.keep_every = ckc.keep_every();
  wopts.async = ckc.async();
  CheckpointWriter writer(wopts, ExchangeOverCommunicator(s.pg->host_world()));
  if (absl::Status sig = InstallPreemptionHandlers(); !sig.ok()) return fail(sig);

  // 5. Train. An error on one rank may leave its peers waiting in a
  // collective (a NaN inside one rank's span, a read error, a dead peer), so
  // with several ranks any error ends the whole job with its exit code.
  EvalStats last_eval;
  bool evaluated = false;
  TrainHooks hooks;
  hooks.progress = &progress;
  hooks.on_eval = [&](const EvalStats& ev) {
    last_eval = ev;
    evaluated = true;
  };
  hooks.on_step = [&](const StepStats& step) {
    StepRecord rec;
    rec.step = step.step;
    rec.loss = step.loss;
    rec.tokens = step.tokens_local;
    rec.step_seconds = step.step_seconds;
    rec.grad_norm = step.grad_norm;
    rec.learning_rate = step.learning_rate;
    for (int i = 0; i < kNumCollectiveOps; ++i) {  // the SMat layers' and the loop's
      const CollectiveOp op = static_cast<CollectiveOp>(i);
      rec.comm.push_back({CollectiveOpLabel(op), step.comm[op].seconds, step.comm[op].bytes});
    }
    (*metrics)->RecordStep(rec);
    (*metrics)->SetDeviceMemoryBytes(step.memory_peak_bytes);
  };
  const int64_t total_steps = s.config.run().steps();
  bool preempted = false;
  auto save = [&](const TrainState& ts) -> absl::Status {
    const auto c0 = std::chrono::steady_clock::now();
    SMAT_ASSIGN_OR_RETURN(CheckpointState ck, MakeCheckpointState(s.config, *s.trainer,
                                                                  *s.backend));
    SMAT_RETURN_IF_ERROR(writer.Save(ck));
    CheckpointRecord rec;
    rec.step = ts.step;
    // With async saves this is the caller's stall (the copy); the write
    // itself overlaps the next steps.
    rec.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();
    rec.bytes = static_cast<int64_t>(writer.last_shard_bytes());
    (*metrics)->RecordCheckpoint(rec);
    // Rank 0's figures: the stall, and the previous save's background write
    // (Save committed it), for the checkpoint cost in docs/PERFORMANCE.md.
    std::string line = absl::StrFormat("smat: checkpoint step %d: loop stalled %.2f ms", ts.step,
                                       rec.seconds * 1e3);
    if (writer.last_committed_step() >= 0 && writer.last_write_seconds() > 0) {
      absl::StrAppendFormat(&line,
                            "; step %d committed, %d bytes a rank written in %.1f ms (%.1f MB/s)",
                            writer.last_committed_step(), writer.last_shard_bytes(),
                            writer.last_write_seconds() * 1e3,
                            writer.last_shard_bytes() / writer.last_write_seconds() / 1e6);
    }
    progress.Line(line);
    return absl::OkStatus();
  };
  hooks.after_step = [&](const TrainState& ts) -> absl::Status {
    // Commits an asynchronous save as soon as every rank has written it (a
    // crash before that loses only that save); collective, hence every step.
    SMAT_RETURN_IF_ERROR(writer.Poll());
    // SIGTERM/SIGUSR2 (preemption) or SIGUSR1 (checkpoint now) on any rank:
    // all ranks act at this same step (trainer/preemption.h).
    SMAT_ASSIGN_OR_RETURN(StopRequest stop, AgreeOnStopRequest(s.pg->host_world()));
    const int64_t every = ckc.every_steps();
    if ((every > 0 && (ts.step % every == 0 || ts.step == total_steps)) ||
        stop != StopRequest::kNone) {
      SMAT_RETURN_IF_ERROR(save(ts));
    }
    if (stop == StopRequest::kPreempt) {
      preempted = true;
      return absl::CancelledError(absl::StrCat("preempted at step ", ts.step));
    }
    return absl::OkStatus();
  };
  const auto t0 = std::chrono::steady_clock::now();
  st = s.trainer->Run(hooks);
  if (preempted && absl::IsCancelled(st)) st = absl::OkStatus();
  if (st.ok()) st = writer.Finish();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!st.ok()) {
    const int code = ExitCodeForStatus(st);
    if (code == kExitNonFiniteLoss) {
      // Let a watching Prometheus scrape the NaN before the series disappear
      // (alert SmatLossNotFinite); no wait when nothing scrapes this rank.
      (*metrics)->RecordNonFiniteLoss();
      (*metrics)->WaitForScrape(absl::Seconds(20));
    }
    if (world == 1) return fail(st);
    AbortAll(st, code, rank);
  }
  if (preempted) {
    progress.Line(absl::StrCat("smat: preempted: checkpoint of step ", s.trainer->state().step,
                               " written; exiting with code ", kExitPreempted));
    return kExitPreempted;
  }
  std::string summary = absl::StrCat("smat: done: ", s.trainer->state().step, " steps in ",
                                     FormatDuration(seconds));
  if (evaluated) {
    absl::StrAppend(&summary, absl::StrFormat("; final eval loss %.4f", last_eval.loss));
    if (last_eval.bits_per_byte >= 0) {
      absl::StrAppend(&summary, absl::StrFormat(", %.4f bits per byte", last_eval.bits_per_byte));
    }
    if (last_eval.accuracy >= 0) {
      absl::StrAppend(&summary,
                      absl::StrFormat(", accuracy %.2f%% (%.0f/%.0f sequences fully correct)",
                                      100.0 * last_eval.accuracy, last_eval.sequences_correct,
                                      last_eval.sequences));
    }
  }
  progress.Line(summary);
  return kExitOk;
}

}  // namespace
}  // namespace smat

int main(int argc, char** argv) { return smat::Main(argc, argv); }
