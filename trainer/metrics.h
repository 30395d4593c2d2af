// TrainingMetrics: every rank's training metrics, served for Prometheus to pull
// (ARCHITECTURE.md section 8). Each rank runs its own prometheus-cpp Exposer on
// metrics.host:(metrics.port + local_rank), so ranks sharing a host never share
// a port and a scrape never waits on another rank or on a collective.
//
// Series (every one labelled job = metrics.job_name and rank = world rank;
// base units after the Prometheus naming conventions):
//
//   smat_step                               gauge      optimizer steps completed
//   smat_loss                               gauge      training loss of the last step
//   smat_loss_is_finite                     gauge      0 once a step's loss was NaN/inf
//   smat_tokens_total                       counter    tokens this rank processed
//   smat_step_duration_seconds              histogram  wall time per step
//   smat_comm_seconds_total{op}             counter    time blocked in collectives, per kind
//   smat_comm_bytes_total{op}               counter    bytes of the tensors they filled, per kind
//   smat_grad_norm, smat_learning_rate      gauges
//   smat_checkpoint_duration_seconds        gauge      time the loop waited for the newest save
//   smat_checkpoint_bytes                   gauge      bytes this rank wrote for a save
//   smat_last_checkpoint_timestamp_seconds  gauge      Unix time of the newest save
//   smat_restarts_total                     counter    job restarts ($SMAT_RESTART_COUNT)
//   smat_device_memory_bytes                gauge      memory in use on the rank's device
//   smat_start_time_seconds                 gauge      Unix time this process started
//
// Where Prometheus finds the ranks. After the Exposer is listening, each rank
// writes two files under <run_dir>/metrics/ (atomically, by rename):
//
//   rank_<R>.port   the port, one line (metrics.port 0 lets the kernel pick it)
//   rank_<R>.json   a Prometheus file_sd target list for this rank:
//                   [{"targets": ["<host>:<port>"], "labels": {"rank": "<R>"}}]
//
// so a Prometheus with file_sd_configs { files: [<run_dir>/metrics/*.json] }
// (deploy/prometheus/prometheus.yml) scrapes every rank of a job without any
// rank gathering the others' ports, and a restarted job on a different grid
// simply rewrites them. A rank that ends cleanly removes its two files. The
// advertised host is metrics.host, or this machine's host name when
// metrics.host is a wildcard address (0.0.0.0, ::). A job started by
// smat_launch also has <run_dir>/metrics/targets.json with every rank of the
// job (fixed ports only), written before the ranks start, and the launcher
// removes an earlier attempt's rank files first (launcher/metrics_targets.h).
//
// Cost: an update is a handful of relaxed atomic adds and one uncontended
// histogram lock (docs/PERFORMANCE.md, "Instrumentation overhead": well below
// 1% of a step). Updates are thread-safe, so an asynchronous checkpoint writer
// may call RecordCheckpoint while the training loop calls RecordStep.
//
//   SMAT_ASSIGN_OR_RETURN(std::unique_ptr<TrainingMetrics> metrics,
//                         TrainingMetrics::Create(cfg.metrics(), pg.world_rank(),
//                                                 pg.local_rank(), cfg.run().dir()));
//   StepRecord rec{.step = step, .loss = loss, .tokens = tokens, .step_seconds = dt};
//   rec.comm.push_back({"all_reduce", comm_s, comm_bytes});
//   metrics->RecordStep(rec);
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/config.pb.h"

namespace prometheus {
class Counter;
class Exposer;
template <typename T>
class Family;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace smat {

// Collective time and volume of one step for one kind of collective. `op` is
// the label value ("all_reduce", "all_gather", "reduce_scatter", "broadcast",
// "barrier" exist from the start; another name adds a series on first use). It
// is read only during the RecordStep call, so a literal or any live string will do.
struct CommOpRecord {
  std::string_view op;
  // The trainer reports every collective of the step, the SMat layers'
  // included, with these meanings (parallel/comm_stats.h):
  double seconds = 0;  // host time this rank was blocked in them
  int64_t bytes = 0;   // bytes of the tensors they filled on this rank
};

// What one optimizer step on this rank produced, for RecordStep.
struct StepRecord {
  int64_t step = 0;          // optimizer steps completed, this one included
  double loss = 0;           // training loss of the step (NaN/inf exported as is)
  int64_t tokens = 0;        // tokens this rank processed in the step (its spans:
                             // the sum over ranks is the job's tokens)
  double step_seconds = 0;   // wall time of the step on this rank
  double grad_norm = 0;      // global gradient norm before clipping
  double learning_rate = 0;  // learning rate the step used
  absl::InlinedVector<CommOpRecord, 5> comm;  // collectives of the step, per kind
};

// A committed checkpoint, for RecordCheckpoint.
struct CheckpointRecord {
  int64_t step = 0;
  double seconds = 0;              // how long the training loop waited for the save
                                   // (asynchronous saves: the copy; synchronous: all)
  int64_t bytes = 0;               // bytes this rank wrote (the newest committed shard)
  double unix_time_seconds = 0;    // when it was saved (0: now)
};

class TrainingMetrics {
 public:
  // Starts serving this rank's metrics (unless config.enabled() is false: then
  // values are kept and Scrape() works, but nothing listens and no files are
  // written) and writes the rank's port and target files under run_dir
  // (skipped when run_dir is empty). `config` should have defaults applied
  // (core/config.h ApplyDefaults); an empty job_name becomes "smat".
  // Errors: kUnavailable when the port is in use, kInvalidArgument for a bad
  // port, rank or $SMAT_RESTART_COUNT, kFailedPrecondition when the run
  // directory cannot be written.
  static absl::StatusOr<std::unique_ptr<TrainingMetrics>> Create(const MetricsConfig& config,
                                                                 int rank, int local_rank,
                                                                 const std::string& run_dir);
  ~TrainingMetrics();
  TrainingMetrics(const TrainingMetrics&) = delete;
  TrainingMetrics& operator=(const TrainingMetrics&) = delete;

  // Updates step, loss, tokens, the step-duration histogram, gradient norm,
  // learning rate and the per-op communication counters.
  void RecordStep(const StepRecord& record);
  void RecordCheckpoint(const CheckpointRecord& record);
  void SetDeviceMemoryBytes(int64_t bytes);
  // For a step the loop stopped before recording because its loss was NaN or
  // inf: smat_loss becomes NaN and smat_loss_is_finite 0 (the SmatLossNotFinite
  // alert), smat_step stays at the last completed step.
  void RecordNonFiniteLoss();

  // Blocks until Prometheus has scraped the values current at the call, or
  // max_wait passed; true if it did. Returns false at once when nothing has
  // ever scraped this rank (no Prometheus watching: no reason to wait) or
  // metrics are disabled. For a run that is about to end on a NaN loss, so the
  // alert sees it before the series disappear:
  //
  //   metrics->RecordNonFiniteLoss();
  //   metrics->WaitForScrape(absl::Seconds(20));   // then exit with code 4
  bool WaitForScrape(absl::Duration max_wait);
  // Scrapes served so far.
  int64_t scrapes() const;

  // The port this rank serves on (the kernel's pick when metrics.port is 0);
  // 0 when metrics are disabled.
  int port() const { return port_; }
  // "http://<advertised host>:<port>/metrics", or "" when disabled.
  const std::string& url() const { return url_; }
  // The files written under run_dir ("" when none were written).
  const std::string& port_file() const { return port_file_; }
  const std::string& targets_file() const { return targets_file_; }
  // The current metrics in the Prometheus text format, as a scrape returns them.
  std::string Scrape() const;

 private:
  struct CommCounters {
    std::string op;
    prometheus::Counter* seconds;
    prometheus::Counter* bytes;
  };

  class ScrapeCounter;  // a Collectable that counts the scrapes it is part of

  TrainingMetrics() = default;
  void Build(const std::string& job, int rank, double restarts);
  CommCounters& CommFor(std::string_view op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(comm_mu_);

  std::shared_ptr<ScrapeCounter> scrape_counter_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
  std::string url_, port_file_, targets_file_;

  prometheus::Gauge* step_ = nullptr;
  prometheus::Gauge* loss_ = nullptr;
  prometheus::Gauge* loss_is_finite_ = nullptr;
  prometheus::Counter* tokens_ = nullptr;
  prometheus::Histogram* step_duration_ = nullptr;
  prometheus::Gauge* grad_norm_ = nullptr;
  prometheus::Gauge* learning_rate_ = nullptr;
  prometheus::Gauge* checkpoint_duration_ = nullptr;
  prometheus::Gauge* checkpoint_bytes_ = nullptr;
  prometheus::Gauge* last_checkpoint_time_ = nullptr;
  prometheus::Counter* restarts_ = nullptr;
  prometheus::Gauge* device_memory_ = nullptr;
  prometheus::Gauge* start_time_ = nullptr;
  // Families of the per-op counters, to add an op seen for the first time.
  prometheus::Family<prometheus::Counter>* comm_seconds_family_ = nullptr;
  prometheus::Family<prometheus::Counter>* comm_bytes_family_ = nullptr;
  absl::Mutex comm_mu_;
  absl::InlinedVector<CommCounters, 8> comm_ ABSL_GUARDED_BY(comm_mu_);
};

// Parses $SMAT_RESTART_COUNT as smat_launch sets it: unset or empty is 0.
// InvalidArgument for anything but a non-negative integer.
absl::StatusOr<int64_t> RestartCountFromEnvironment();

}  // namespace smat
