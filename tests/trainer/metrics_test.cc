// TrainingMetrics (trainer/metrics.h): series names, labels and values after
// RecordStep / RecordCheckpoint, the port and file_sd target files, a real HTTP
// scrape on loopback, the errors for a port in use and bad input, and the cost
// of one RecordStep (docs/PERFORMANCE.md, "Instrumentation overhead").
#include "trainer/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace smat {
namespace {

// A fresh directory under the test's temporary folder, removed at the end.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "smat_metrics_XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The value of the sample `series` (name and labels exactly as the text
// format spells them) in a scrape; NaN-safe (returns the parsed NaN); fails the
// test when the series is missing.
double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, series + " ")) continue;
    const std::string value(line.substr(series.size() + 1));
    if (value == "NaN" || value == "nan") return std::numeric_limits<double>::quiet_NaN();
    double v = 0;
    EXPECT_TRUE(absl::SimpleAtod(value, &v)) << line;
    return v;
  }
  ADD_FAILURE() << "no sample " << series << " in:\n" << text;
  return std::numeric_limits<double>::quiet_NaN();
}

MetricsConfig LoopbackConfig(int port, bool enabled = true) {
  MetricsConfig c;
  c.set_host("127.0.0.1");
  c.set_port(port);
  c.set_job_name("t");
  c.set_enabled(enabled);
  return c;
}

// GET /metrics from 127.0.0.1:port over a plain socket (HTTP/1.0: the server
// closes the connection when done); "" when the connection fails.
std::string HttpScrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  timeval timeout{10, 0};  // a hung server fails the test instead of hanging it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  std::string response;
  if (send(fd, request.data(), request.size(), 0) == static_cast<ssize_t>(request.size())) {
    char buf[4096];
    for (ssize_t got; (got = recv(fd, buf, sizeof(buf), 0)) > 0;) response.append(buf, got);
  }
  close(fd);
  return response;
}

// A socket listening on an ephemeral loopback port, to make a port busy.
class BusyPort {
 public:
  BusyPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 && listen(fd_, 1) == 0 &&
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port_ = ntohs(addr.sin_port);
    }
  }
  ~BusyPort() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(TrainingMetricsTest, ServesOnAPickedPortAndWritesTargetFiles) {
  TempDir run;
  unsetenv("SMAT_RESTART_COUNT");
  std::string port_file, targets_file;
  {
    auto m = TrainingMetrics::Create(LoopbackConfig(0), /*rank=*/3, /*local_rank=*/1, run.path());
    ASSERT_TRUE(m.ok()) << m.status();
    TrainingMetrics& metrics = **m;
    ASSERT_GT(metrics.port(), 0);
    EXPECT_EQ(metrics.url(), absl::StrCat("http://127.0.0.1:", metrics.port(), "/metrics"));

    port_file = run.path() + "/metrics/rank_3.port";
    targets_file = run.path() + "/metrics/rank_3.json";
    EXPECT_EQ(metrics.port_file(), port_file);
    EXPECT_EQ(metrics.targets_file(), targets_file);
    EXPECT_EQ(ReadFile(port_file), absl::StrCat(metrics.port(), "\n"));
    EXPECT_EQ(ReadFile(targets_file),
              absl::StrCat("[{\"targets\": [\"127.0.0.1:", metrics.port(),
                           "\"], \"labels\": {\"rank\": \"3\"}}]\n"));

    StepRecord rec;
    rec.step = 5;
    rec.loss = 2.5;
    rec.tokens = 4096;
    rec.step_seconds = 0.2;
    metrics.RecordStep(rec);
    const std::string http = HttpScrape(metrics.port());
    ASSERT_TRUE(absl::StartsWith(http, "HTTP/1.1 200")) << http;
    const std::string body = http.substr(http.find("\r\n\r\n") + 4);
    EXPECT_EQ(Sample(body, "smat_step{job=\"t\",rank=\"3\"}"), 5);
    EXPECT_EQ(Sample(body, "smat_tokens_total{job=\"t\",rank=\"3\"}"), 4096);
    EXPECT_EQ(Sample(body, "smat_restarts_total{job=\"t\",rank=\"3\"}"), 0);
  }
  // A rank that ends cleanly withdraws its target.
  EXPECT_FALSE(std::filesystem::exists(port_file));
  EXPECT_FALSE(std::filesystem::exists(targets_file));
}

TEST(TrainingMetricsTest, StepAndCheckpointRecordsSetEverySeries) {
  auto m = TrainingMetrics::Create(LoopbackConfig(9400, /*enabled=*/false), 1, 1, "");
  ASSERT_TRUE(m.ok()) << m.status();
  TrainingMetrics& metrics = **m;
  EXPECT_EQ(metrics.port(), 0);  // disabled: nothing listens
  EXPECT_EQ(metrics.url(), "");

  StepRecord rec;
  rec.step = 1;
  rec.loss = 3.0;
  rec.tokens = 100;
  rec.step_seconds = 0.03;
  rec.grad_norm = 1.5;
  rec.learning_rate = 1e-3;
  rec.comm.push_back({"all_reduce", 0.01, 4000});
  rec.comm.push_back({"all_gather", 0.002, 512});
  metrics.RecordStep(rec);
  rec.step = 2;
  rec.loss = 2.0;
  rec.tokens = 200;
  rec.step_seconds = 0.7;
  rec.comm.clear();
  rec.comm.push_back({"all_reduce", 0.03, 4000});
  rec.comm.push_back({"send_recv", 0.5, 7});  // an op named by the caller, added on first use
  metrics.RecordStep(rec);
  metrics.RecordCheckpoint({.step = 2, .seconds = 1.25, .bytes = 1 << 20,
                            .unix_time_seconds = 1.8e9});
  metrics.SetDeviceMemoryBytes(int64_t{3} << 30);

  const std::string text = metrics.Scrape();
  const std::string l = "{job=\"t\",rank=\"1\"}";
  EXPECT_EQ(Sample(text, "smat_step" + l), 2);
  EXPECT_EQ(Sample(text, "smat_loss" + l), 2.0);
  EXPECT_EQ(Sample(text, "smat_loss_is_finite" + l), 1);
  EXPECT_EQ(Sample(text, "smat_tokens_total" + l), 300);
  EXPECT_EQ(Sample(text, "smat_grad_norm" + l), 1.5);
  EXPECT_EQ(Sample(text, "smat_learning_rate" + l), 1e-3);
  EXPECT_EQ(Sample(text, "smat_step_duration_seconds_count" + l), 2);
  EXPECT_NEAR(Sample(text, "smat_step_duration_seconds_sum" + l), 0.73, 1e-12);
  // 0.03 falls in (0.025, 0.05], 0.7 in (0.5, 1].
  EXPECT_EQ(Sample(text, "smat_step_duration_seconds_bucket{job=\"t\",rank=\"1\",le=\"0.025\"}"), 0);
  EXPECT_EQ(Sample(text, "smat_step_duration_seconds_bucket{job=\"t\",rank=\"1\",le=\"0.05\"}"), 1);
  EXPECT_EQ(Sample(text, "smat_step_duration_seconds_bucket{job=\"t\",rank=\"1\",le=\"0.5\"}"), 1);
  EXPECT_EQ(Sample(text, "smat_step_duration_seconds_bucket{job=\"t\",rank=\"1\",le=\"1\"}"), 2);
  EXPECT_EQ(Sample(text, "smat_step_duration_seconds_bucket{job=\"t\",rank=\"1\",le=\"+Inf\"}"), 2);
  EXPECT_NEAR(Sample(text, "smat_comm_seconds_total{job=\"t\",rank=\"1\",op=\"all_reduce\"}"),
              0.04, 1e-12);
  EXPECT_EQ(Sample(text, "smat_comm_bytes_total{job=\"t\",rank=\"1\",op=\"all_reduce\"}"), 8000);
  EXPECT_EQ(Sample(text, "smat_comm_bytes_total{job=\"t\",rank=\"1\",op=\"all_gather\"}"), 512);
  EXPECT_EQ(Sample(text, "smat_comm_bytes_total{job=\"t\",rank=\"1\",op=\"send_recv\"}"), 7);
  // Collectives never used still have their series, at 0, for rate().
  EXPECT_EQ(Sample(text, "smat_comm_seconds_total{job=\"t\",rank=\"1\",op=\"broadcast\"}"), 0);
  EXPECT_EQ(Sample(text, "smat_checkpoint_duration_seconds" + l), 1.25);
  EXPECT_EQ(Sample(text, "smat_checkpoint_bytes" + l), 1 << 20);
  EXPECT_EQ(Sample(text, "smat_last_checkpoint_timestamp_seconds" + l), 1.8e9);
  EXPECT_EQ(Sample(text, "smat_device_memory_bytes" + l), static_cast<double>(int64_t{3} << 30));
  const double start = Sample(text, "smat_start_time_seconds" + l);
  EXPECT_GT(start, 1.7e9);  // a Unix time in seconds, not milliseconds
  EXPECT_LT(start, 1e10);
}

TEST(TrainingMetricsTest, NonFiniteLossIsExportedAndLatched) {
  auto m = TrainingMetrics::Create(LoopbackConfig(0, /*enabled=*/false), 0, 0, "");
  ASSERT_TRUE(m.ok()) << m.status();
  StepRecord rec;
  rec.step = 7;
  rec.loss = std::numeric_limits<double>::quiet_NaN();
  (*m)->RecordStep(rec);
  const std::string l = "{job=\"t\",rank=\"0\"}";
  EXPECT_TRUE(std::isnan(Sample((*m)->Scrape(), "smat_loss" + l)));
  EXPECT_EQ(Sample((*m)->Scrape(), "smat_loss_is_finite" + l), 0);
  rec.step = 8;
  rec.loss = 1.0;
  (*m)->RecordStep(rec);
  // Once NaN, the run is broken even if a later loss looks fine: the alert
  // must not clear by itself.
  EXPECT_EQ(Sample((*m)->Scrape(), "smat_loss_is_finite" + l), 0);
}

// The NaN path of smat_train: the loop stops before recording the step, main
// marks the loss and waits for one more scrape so the alert can see it.
TEST(TrainingMetricsTest, NonFiniteLossWaitsForAScrape) {
  auto m = TrainingMetrics::Create(LoopbackConfig(0), 0, 0, "");
  ASSERT_TRUE(m.ok()) << m.status();
  TrainingMetrics& metrics = **m;
  StepRecord rec;
  rec.step = 3;
  rec.loss = 4.0;
  metrics.RecordStep(rec);
  // Nobody has scraped yet: no Prometheus is watching, nothing to wait for.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(metrics.WaitForScrape(absl::Seconds(30)));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  ASSERT_FALSE(HttpScrape(metrics.port()).empty());
  EXPECT_EQ(metrics.scrapes(), 1);

  metrics.RecordNonFiniteLoss();
  std::string later;
  std::thread scraper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    later = HttpScrape(metrics.port());
  });
  EXPECT_TRUE(metrics.WaitForScrape(absl::Seconds(30)));
  scraper.join();
  const std::string l = "{job=\"t\",rank=\"0\"}";
  EXPECT_EQ(Sample(later, "smat_loss_is_finite" + l), 0);
  EXPECT_TRUE(std::isnan(Sample(later, "smat_loss" + l)));
  EXPECT_EQ(Sample(later, "smat_step" + l), 3);
  // And a bounded wait when no further scrape comes.
  EXPECT_FALSE(metrics.WaitForScrape(absl::Milliseconds(200)));
}

TEST(TrainingMetricsTest, PortInUseIsAnActionableError) {
  BusyPort busy;
  ASSERT_GT(busy.port(), 0);
  TempDir run;
  // local rank 1 serves on metrics.port + 1: aim that at the busy port.
  auto m = TrainingMetrics::Create(LoopbackConfig(busy.port() - 1), 4, 1, run.path());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable) << m.status();
  const std::string msg(m.status().message());
  EXPECT_TRUE(absl::StrContains(msg, absl::StrCat("port ", busy.port(), " on 127.0.0.1 is in use")))
      << msg;
  EXPECT_TRUE(absl::StrContains(msg, "set metrics.port to a free port or 0")) << msg;
  EXPECT_FALSE(std::filesystem::exists(run.path() + "/metrics/rank_4.json"));
}

TEST(TrainingMetricsTest, BadInputIsRejected) {
  auto past_end = TrainingMetrics::Create(LoopbackConfig(65535), 0, 1, "");
  ASSERT_FALSE(past_end.ok());
  EXPECT_EQ(past_end.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(past_end.status().message(), "metrics.port"))
      << past_end.status();

  MetricsConfig no_host = LoopbackConfig(0);
  no_host.set_host("");
  EXPECT_EQ(TrainingMetrics::Create(no_host, 0, 0, "").status().code(),
            absl::StatusCode::kInvalidArgument);

  TempDir run;
  const std::string file = run.path() + "/not_a_dir";
  std::ofstream(file) << "x";
  auto unwritable = TrainingMetrics::Create(LoopbackConfig(0), 0, 0, file);
  ASSERT_FALSE(unwritable.ok());
  EXPECT_EQ(unwritable.status().code(), absl::StatusCode::kFailedPrecondition)
      << unwritable.status();
}

TEST(TrainingMetricsTest, RestartCountComesFromTheLauncher) {
  setenv("SMAT_RESTART_COUNT", "4", 1);
  auto m = TrainingMetrics::Create(LoopbackConfig(0, false), 2, 0, "");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(Sample((*m)->Scrape(), "smat_restarts_total{job=\"t\",rank=\"2\"}"), 4);

  setenv("SMAT_RESTART_COUNT", "four", 1);
  auto bad = TrainingMetrics::Create(LoopbackConfig(0, false), 2, 0, "");
  unsetenv("SMAT_RESTART_COUNT");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "SMAT_RESTART_COUNT = 'four'"))
      << bad.status();
}

// The cost of instrumenting one step: a RecordStep as the training loop makes
// it (loss, tokens, histogram, two gauges, three collective kinds), while the
// exposer is live. Printed for docs/PERFORMANCE.md; the bound is generous (a
// CPU demo step takes tens of milliseconds, so 1% of it is far above 50 us)
// and only catches a lock or allocation storm sneaking into the update path.
TEST(TrainingMetricsTest, RecordStepCostsMicroseconds) {
  auto m = TrainingMetrics::Create(LoopbackConfig(0), 0, 0, "");
  ASSERT_TRUE(m.ok()) << m.status();
  StepRecord rec;
  rec.loss = 2.0;
  rec.tokens = 8192;
  rec.step_seconds = 0.05;
  rec.grad_norm = 1.0;
  rec.learning_rate = 3e-4;
  rec.comm = {{"all_reduce", 1e-3, 1 << 20}, {"all_gather", 1e-4, 4096}, {"barrier", 1e-5, 0}};
  constexpr int kCalls = 200000;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kCalls; ++i) {
    rec.step = i;
    rec.step_seconds = 0.01 * (i % 100);  // spread over the buckets
    (*m)->RecordStep(rec);
  }
  const double ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
      kCalls;
  std::printf("[ metrics  ] RecordStep: %.0f ns per call (%d calls, 3 collective kinds)\n", ns,
              kCalls);
  EXPECT_LT(ns, 50e3);
  EXPECT_EQ(Sample((*m)->Scrape(), "smat_step_duration_seconds_count{job=\"t\",rank=\"0\"}"),
            kCalls);

  // A scrape serializes the registry on civetweb's thread, off the training
  // thread, once per scrape interval (seconds): reported for the record.
  constexpr int kScrapes = 200;
  const auto scrape_start = std::chrono::steady_clock::now();
  size_t scraped_bytes = 0;
  for (int i = 0; i < kScrapes; ++i) scraped_bytes += (*m)->Scrape().size();
  const double scrape_us = std::chrono::duration<double, std::micro>(
                               std::chrono::steady_clock::now() - scrape_start)
                               .count() /
                           kScrapes;
  std::printf("[ metrics  ] Scrape: %.0f us per scrape (%zu bytes of text)\n", scrape_us,
              scraped_bytes / kScrapes);
}

}  // namespace
}  // namespace smat
