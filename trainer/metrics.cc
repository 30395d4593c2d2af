// TrainingMetrics: the prometheus-cpp registry and Exposer of one rank, and the
// port / file_sd target files that tell Prometheus and smat_launch where it
// serves (see metrics.h).
#include "trainer/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace smat {
namespace {

// Step times run from tens of milliseconds (CPU demo configs) to minutes (1M
// tokens on many GPUs); roughly 1-2.5-5 per decade keeps quantile error within
// a bucket's width without a long tail of empty series.
const prometheus::Histogram::BucketBoundaries& StepBuckets() {
  static const auto* const kBuckets = new prometheus::Histogram::BucketBoundaries{
      0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600};
  return *kBuckets;
}

// The collectives of parallel/communicator.h, so their series exist (at 0)
// from the first scrape and rate() has a starting point.
constexpr const char* kKnownCommOps[] = {"all_reduce", "all_gather", "reduce_scatter",
                                         "broadcast", "barrier"};

bool IsWildcardHost(const std::string& host) {
  return host == "0.0.0.0" || host == "::" || host == "[::]" || host == "*";
}

// civetweb and Prometheus spell an IPv6 address in brackets.
std::string HostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && host.front() != '[') {
    return absl::StrCat("[", host, "]:", port);
  }
  return absl::StrCat(host, ":", port);
}

std::string AdvertisedHost(const std::string& host) {
  if (!IsWildcardHost(host)) return host;
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0') return name;
  return "localhost";
}

// Why civetweb could not start. Its exception says only "null context ...
// Possible problem binding to port", which also covers the cuBLAS TLS trap of
// PLATFORM.md; binding the address ourselves tells the two apart. IPv4 only:
// other hosts get the generic message.
std::string DiagnoseListenFailure(const std::string& host, int port) {
  in_addr addr{};
  const std::string ip = IsWildcardHost(host) ? "0.0.0.0" : host == "localhost" ? "127.0.0.1"
                                                                                 : host;
  if (port == 0 || inet_pton(AF_INET, ip.c_str(), &addr) != 1) return "";
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as civetweb does
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr = addr;
  const int rc = bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa));
  const int err = errno;
  close(fd);
  if (rc == 0) return "";
  return std::strerror(err) + std::string(err == EADDRINUSE ? " (in use)" : "");
}

// Writes `text` to `path` through a temporary name and a rename, so a reader
// (Prometheus polls file_sd files) never sees a half-written file.
absl::Status WriteFileAtomically(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.close();
    if (!out) {
      return absl::FailedPreconditionError(absl::StrCat(
          "metrics: cannot write ", tmp, " (", std::strerror(errno),
          "); make run.dir writable or point it elsewhere"));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    return absl::FailedPreconditionError(
        absl::StrCat("metrics: cannot rename ", tmp, " to ", path, " (", ec.message(), ")"));
  }
  return absl::OkStatus();
}

// JSON string body for the few characters a host or label may need escaped.
std::string JsonEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out.push_back('\\');
    if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
      continue;
    }
    out.push_back(c);
  }
  return out;
}

double NowUnixSeconds() { return absl::ToUnixMicros(absl::Now()) * 1e-6; }

}  // namespace

// Registered with the Exposer ahead of the registry, so within one scrape the
// count goes up before the registry's values are read: a scrape counted after
// WaitForScrape began has read values at least as new as the call.
class TrainingMetrics::ScrapeCounter : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    absl::MutexLock lock(&mu_);
    ++count_;
    return {};
  }
  int64_t count() const {
    absl::MutexLock lock(&mu_);
    return count_;
  }
  // Waits until count() exceeds `seen`, at most until `deadline`.
  bool WaitPast(int64_t seen, absl::Time deadline) const {
    absl::MutexLock lock(&mu_);
    auto past = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return count_ > seen; };
    return mu_.AwaitWithDeadline(absl::Condition(&past), deadline);
  }

 private:
  mutable absl::Mutex mu_;
  mutable int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

absl::StatusOr<int64_t> RestartCountFromEnvironment() {
  const char* env = std::getenv("SMAT_RESTART_COUNT");
  if (env == nullptr || env[0] == '\0') return 0;
  int64_t n = 0;
  if (!absl::SimpleAtoi(env, &n) || n < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics: SMAT_RESTART_COUNT = '", env,
        "' is not a non-negative integer; smat_launch sets it to the number of restarts, "
        "unset it when running smat_train by hand"));
  }
  return n;
}

absl::StatusOr<std::unique_ptr<TrainingMetrics>> TrainingMetrics::Create(
    const MetricsConfig& config, int rank, int local_rank, const std::string& run_dir) {
  if (rank < 0 || local_rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics: rank ", rank, " / local rank ", local_rank, " must be non-negative"));
  }
  const int base_port = config.has_port() ? config.port() : 9400;
  if (base_port < 0 || base_port > 65535 || (base_port > 0 && base_port + local_rank > 65535)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics: port ", base_port, " + local rank ", local_rank,
        " is not a TCP port; set metrics.port to 1..", 65535 - local_rank,
        " or 0 (each rank picks a free port)"));
  }
  const std::string host = config.has_host() ? config.host() : "0.0.0.0";
  if (host.empty()) {
    return absl::InvalidArgumentError(
        "metrics: metrics.host is empty; set it to an address to listen on (0.0.0.0: all)");
  }
  SMAT_ASSIGN_OR_RETURN(const int64_t restarts, RestartCountFromEnvironment());

  std::unique_ptr<TrainingMetrics> m(new TrainingMetrics());
  const std::string job = config.job_name().empty() ? "smat" : config.job_name();
  m->Build(job, rank, static_cast<double>(restarts));
  if (config.has_enabled() && !config.enabled()) return m;

  const int port = base_port == 0 ? 0 : base_port + local_rank;
  const std::string bind = HostPort(host, port);
  try {
    m->exposer_ = std::make_unique<prometheus::Exposer>(bind, /*num_threads=*/2);
  } catch (const std::exception& e) {
    const std::string why = DiagnoseListenFailure(host, port);
    if (absl::StrContains(why, "(in use)")) {
      return absl::UnavailableError(absl::StrCat(
          "metrics: port ", port, " on ", host, " is in use (", why, ", rank ", rank,
          " = metrics.port ", base_port, " + local rank ", local_rank,
          "); set metrics.port to a free port or 0, or end the process holding it"));
    }
    return absl::UnavailableError(absl::StrCat(
        "metrics: cannot serve on ", bind, " (", e.what(), why.empty() ? "" : "; bind: ", why,
        "); check metrics.host is an address of this machine. If the port is free, a library "
        "linked at start-up with large thread-local storage (cuBLAS) starves civetweb's "
        "threads: load it with dlopen (PLATFORM.md)"));
  }
  m->scrape_counter_ = std::make_shared<ScrapeCounter>();
  m->exposer_->RegisterCollectable(m->scrape_counter_);
  m->exposer_->RegisterCollectable(m->registry_);
  const std::vector<int> ports = m->exposer_->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    return absl::InternalError(absl::StrCat("metrics: the exposer on ", bind,
                                            " reports no listening port"));
  }
  m->port_ = ports[0];
  const std::string target = HostPort(AdvertisedHost(host), m->port_);
  m->url_ = absl::StrCat("http://", target, "/metrics");

  if (!run_dir.empty()) {
    const std::string dir = absl::StrCat(run_dir, "/metrics");
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) {
      return absl::FailedPreconditionError(absl::StrCat(
          "metrics: cannot create ", dir, " (", ec.message(),
          "); make run.dir writable or point it elsewhere"));
    }
    const std::string port_file = absl::StrCat(dir, "/rank_", rank, ".port");
    const std::string targets_file = absl::StrCat(dir, "/rank_", rank, ".json");
    SMAT_RETURN_IF_ERROR(WriteFileAtomically(port_file, absl::StrCat(m->port_, "\n")));
    m->port_file_ = port_file;
    SMAT_RETURN_IF_ERROR(WriteFileAtomically(
        targets_file, absl::StrCat("[{\"targets\": [\"", JsonEscape(target),
                                   "\"], \"labels\": {\"rank\": \"", rank, "\"}}]\n")));
    m->targets_file_ = targets_file;
  }
  std::fprintf(stderr, "smat: rank %d serves metrics on %s (job %s)\n", rank, m->url_.c_str(),
               job.c_str());
  std::fflush(stderr);
  return m;
}

void TrainingMetrics::Build(const std::string& job, int rank, double restarts) {
  registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *registry_;
  const prometheus::Labels labels = {{"job", job}, {"rank", absl::StrCat(rank)}};
  auto gauge = [&](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Labels(labels).Register(r).Add({});
  };
  auto counter = [&](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Labels(labels).Register(r).Add({});
  };
  step_ = gauge("smat_step", "Optimizer steps completed.");
  loss_ = gauge("smat_loss", "Training loss of the newest step (NaN/inf as computed).");
  loss_is_finite_ = gauge("smat_loss_is_finite",
                          "1 while every step's loss was finite, 0 once one was NaN or inf.");
  tokens_ = counter("smat_tokens_total", "Tokens this rank processed.");
  step_duration_ = &prometheus::BuildHistogram()
                        .Name("smat_step_duration_seconds")
                        .Help("Wall time of one optimizer step on this rank.")
                        .Labels(labels)
                        .Register(r)
                        .Add({}, StepBuckets());
  grad_norm_ = gauge("smat_grad_norm", "Global gradient norm of the newest step, before clipping.");
  learning_rate_ = gauge("smat_learning_rate", "Learning rate of the newest step.");
  checkpoint_duration_ = gauge("smat_checkpoint_duration_seconds",
                               "Duration of the newest checkpoint save as the training loop waited for it "
                               "(asynchronous saves: the copy out, the write overlaps later steps).");
  checkpoint_bytes_ = gauge("smat_checkpoint_bytes",
                            "Bytes this rank wrote for the newest checkpoint.");
  last_checkpoint_time_ = gauge("smat_last_checkpoint_timestamp_seconds",
                                "Unix time of the newest checkpoint save (0: none yet).");
  restarts_ = counter("smat_restarts_total",
                      "Restarts of this job by smat_launch (from SMAT_RESTART_COUNT).");
  device_memory_ = gauge("smat_device_memory_bytes", "Memory in use on this rank's device.");
  start_time_ = gauge("smat_start_time_seconds", "Unix time this rank's process started.");
  comm_seconds_family_ = &prometheus::BuildCounter()
                              .Name("smat_comm_seconds_total")
                              .Help("Time this rank spent in collectives, per collective kind.")
                              .Labels(labels)
                              .Register(r);
  comm_bytes_family_ = &prometheus::BuildCounter()
                            .Name("smat_comm_bytes_total")
                            .Help("Bytes this rank sent in collectives, per collective kind.")
                            .Labels(labels)
                            .Register(r);
  loss_is_finite_->Set(1);
  restarts_->Increment(restarts);
  start_time_->Set(NowUnixSeconds());
  absl::MutexLock lock(&comm_mu_);
  for (const char* op : kKnownCommOps) CommFor(op);
}

TrainingMetrics::~TrainingMetrics() {
  // Stop serving first, then withdraw the target: Prometheus drops the rank
  // at its next file_sd refresh instead of scraping a closed port forever.
  exposer_.reset();
  std::error_code ec;
  if (!targets_file_.empty()) std::filesystem::remove(targets_file_, ec);
  if (!port_file_.empty()) std::filesystem::remove(port_file_, ec);
}

TrainingMetrics::CommCounters& TrainingMetrics::CommFor(std::string_view op) {
  for (CommCounters& c : comm_) {
    if (c.op == op) return c;
  }
  const prometheus::Labels op_label = {{"op", std::string(op)}};
  comm_.push_back(CommCounters{std::string(op), &comm_seconds_family_->Add(op_label),
                               &comm_bytes_family_->Add(op_label)});
  return comm_.back();
}

void TrainingMetrics::RecordStep(const StepRecord& record) {
  step_->Set(static_cast<double>(record.step));
  loss_->Set(record.loss);
  if (!std::isfinite(record.loss)) loss_is_finite_->Set(0);
  // Counters refuse negative increments silently; a negative count is a bug
  // in the caller, and dropping it keeps the counter monotone as Prometheus needs.
  if (record.tokens > 0) tokens_->Increment(static_cast<double>(record.tokens));
  if (record.step_seconds >= 0) step_duration_->Observe(record.step_seconds);
  grad_norm_->Set(record.grad_norm);
  learning_rate_->Set(record.learning_rate);
  if (record.comm.empty()) return;
  absl::MutexLock lock(&comm_mu_);
  for (const CommOpRecord& c : record.comm) {
    CommCounters& counters = CommFor(c.op);
    if (c.seconds > 0) counters.seconds->Increment(c.seconds);
    if (c.bytes > 0) counters.bytes->Increment(static_cast<double>(c.bytes));
  }
}

void TrainingMetrics::RecordCheckpoint(const CheckpointRecord& record) {
  checkpoint_duration_->Set(record.seconds);
  checkpoint_bytes_->Set(static_cast<double>(record.bytes));
  last_checkpoint_time_->Set(record.unix_time_seconds > 0 ? record.unix_time_seconds
                                                          : NowUnixSeconds());
}

void TrainingMetrics::RecordNonFiniteLoss() {
  loss_->Set(std::numeric_limits<double>::quiet_NaN());
  loss_is_finite_->Set(0);
}

int64_t TrainingMetrics::scrapes() const {
  return scrape_counter_ == nullptr ? 0 : scrape_counter_->count();
}

bool TrainingMetrics::WaitForScrape(absl::Duration max_wait) {
  if (scrape_counter_ == nullptr) return false;
  const int64_t seen = scrape_counter_->count();
  if (seen == 0) return false;
  return scrape_counter_->WaitPast(seen, absl::Now() + max_wait);
}

void TrainingMetrics::SetDeviceMemoryBytes(int64_t bytes) {
  device_memory_->Set(static_cast<double>(bytes));
}

std::string TrainingMetrics::Scrape() const {
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

}  // namespace smat
