// metrics_probe: an MPI program whose ranks export TrainingMetrics
// (trainer/metrics.h) and update them as a training loop would, one "step"
// every 100 ms, so the Prometheus end-to-end test can scrape a multi-rank job
// without training a model. Each rank serves on 127.0.0.1 (metrics.port 0: a
// free port) and writes its target file under <run_dir>/metrics/.
//
//   mpirun -np 2 metrics_probe <run_dir> <max_seconds> [nan]
//
// A rank stops after max_seconds or as soon as <run_dir>/stop exists, then
// all ranks meet in a barrier and exit 0. Exit 1 with a message when the
// metrics cannot be served. With `nan`, the ranks end as smat_train does on a
// NaN loss: from step 20, once Prometheus has scraped them, they mark the loss
// non-finite, wait for one more scrape (at most 20 s) and exit 4.
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/time/time.h"
#include "trainer/metrics.h"

namespace {

constexpr int kExitNonFiniteLoss = 4;  // core/exit_codes.h

int Run(int rank, int local_rank, const std::string& run_dir, double max_seconds, bool nan) {
  smat::MetricsConfig config;
  config.set_host("127.0.0.1");  // tests stay on loopback
  config.set_port(0);
  config.set_job_name("smat_e2e");
  config.set_enabled(true);
  absl::StatusOr<std::unique_ptr<smat::TrainingMetrics>> metrics =
      smat::TrainingMetrics::Create(config, rank, local_rank, run_dir);
  if (!metrics.ok()) {
    std::fprintf(stderr, "metrics_probe rank %d: %s\n", rank, metrics.status().ToString().c_str());
    return 1;
  }
  const auto start = std::chrono::steady_clock::now();
  const std::filesystem::path stop = std::filesystem::path(run_dir) / "stop";
  smat::StepRecord rec;
  for (int64_t step = 1;; ++step) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed > max_seconds || std::filesystem::exists(stop)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    rec.step = step;
    rec.loss = 6.0 / (1.0 + 0.05 * static_cast<double>(step));
    rec.tokens = 1024 * (rank + 1);  // distinct per rank, so a mix-up shows
    rec.step_seconds = 0.1;
    rec.grad_norm = 1.0;
    rec.learning_rate = 1e-3;
    rec.comm = {{"all_reduce", 0.01, 1 << 16}, {"all_gather", 0.001, 64}};
    (*metrics)->RecordStep(rec);
    (*metrics)->SetDeviceMemoryBytes(int64_t{1} << 26);
    if (step == 5) {
      (*metrics)->RecordCheckpoint({.step = step, .seconds = 0.25, .bytes = 1 << 20});
    }
    if (nan && step >= 20 && (*metrics)->scrapes() > 0) {
      (*metrics)->RecordNonFiniteLoss();
      const bool seen = (*metrics)->WaitForScrape(absl::Seconds(20));
      std::fprintf(stderr, "metrics_probe rank %d: loss marked non-finite at step %lld, %s\n",
                   rank, static_cast<long long>(step),
                   seen ? "scraped" : "not scraped within 20 s");
      return kExitNonFiniteLoss;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, local_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_free(&local);
  double max_seconds = 0;
  const bool nan = argc == 4 && std::string(argv[3]) == "nan";
  if ((argc != 3 && !nan) || !absl::SimpleAtod(argv[2], &max_seconds) || max_seconds <= 0) {
    if (rank == 0) std::fprintf(stderr, "usage: metrics_probe <run_dir> <max_seconds> [nan]\n");
    MPI_Finalize();
    return 2;
  }
  const int rc = Run(rank, local_rank, argv[1], max_seconds, nan);
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
