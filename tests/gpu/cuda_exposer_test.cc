// The PLATFORM.md trap, tested: cuBLAS linked at start-up makes civetweb (the
// HTTP server inside prometheus-cpp's Exposer) fail to create its threads. In
// one process: no cuBLAS mapped at start-up, then the CUDA backend loaded with
// dlopen and a cuBLAS GEMM run, then an Exposer started, and a plain-socket
// scrape of /metrics must return HTTP 200 with the metric registered here.
// This binary links smat_kernels and prometheus-cpp, never cuBLAS.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"
#include "tests/gpu/gpu_test_util.h"

namespace smat {
namespace gpu_test {
namespace {

// Read before main, once the loader has mapped every linked library.
const bool kCublasMappedAtStartup = CublasMapped();

// GET /metrics over a plain TCP connection to 127.0.0.1:port; the whole
// response (HTTP/1.0: the server closes the connection when done).
absl::StatusOr<std::string> Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: errno ", errno));
  timeval timeout{10, 0};  // a hung server fails the test instead of hanging it
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect to 127.0.0.1:", port, ": errno ", err));
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  if (send(fd, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("send of the scrape request failed");
  }
  std::string response;
  char buf[4096];
  for (;;) {
    const ssize_t got = recv(fd, buf, sizeof(buf), 0);
    if (got <= 0) break;
    response.append(buf, static_cast<size_t>(got));
  }
  close(fd);
  return response;
}

TEST(CudaExposerTest, ExposerServesAfterCublasIsLoaded) {
  ASSERT_FALSE(kCublasMappedAtStartup)
      << "libcublas is mapped at start-up: some library this test links pulls in cuBLAS; "
         "only libsmat_cuda.so (dlopened) may (PLATFORM.md)";

  absl::StatusOr<std::unique_ptr<Backend>> loaded = CreateBackend(Device::Cuda(0));
  if (!loaded.ok()) {
    if (RequireGpu()) FAIL() << "SMAT_REQUIRE_GPU=1 but the CUDA backend did not load: " << loaded.status();
    GTEST_SKIP() << "no CUDA backend on this machine, GPU test skipped: " << loaded.status();
  }
  Backend& gpu = **loaded;

  // A real cuBLAS call, so its thread-local state exists before the Exposer
  // starts its threads. Integer inputs: the product is exact.
  const int64_t m = 96, k = 64, n = 80;
  std::vector<float> av = RandomIntegers(m * k, 4, 1), bv = RandomIntegers(k * n, 4, 2);
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor a, ToDevice(gpu, HostTensor({m, k}, DType::kF32, av)));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor b, ToDevice(gpu, HostTensor({k, n}, DType::kF32, bv)));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor c, Tensor::Empty({m, n}, DType::kF32, gpu.allocator()));
  SMAT_ASSERT_OK(gpu.Gemm(Transpose::kNo, Transpose::kNo, 1.f, a, b, 0.f, c));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor h, ToHost(gpu, c));
  for (int64_t i = 0; i < m; i += 7) {
    for (int64_t j = 0; j < n; j += 5) {
      float want = 0;
      for (int64_t p = 0; p < k; ++p) want += av[i * k + p] * bv[p * n + j];
      ASSERT_EQ(h.data<float>()[i * n + j], want) << i << ", " << j;
    }
  }
  ASSERT_TRUE(CublasMapped()) << "the GEMM ran, so libcublas must be mapped now";

  auto registry = std::make_shared<prometheus::Registry>();
  auto& family = prometheus::BuildCounter()
                     .Name("smat_gpu_exposer_test_total")
                     .Help("Counts nothing; proves the Exposer serves next to cuBLAS")
                     .Register(*registry);
  family.Add({{"backend", "cuda"}}).Increment(3);

  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    exposer = std::make_unique<prometheus::Exposer>("127.0.0.1:0");
  } catch (const std::exception& e) {
    FAIL() << "prometheus::Exposer failed to start after cuBLAS was loaded (the PLATFORM.md "
              "trap: cuBLAS TLS vs civetweb thread stacks): "
           << e.what();
  }
  exposer->RegisterCollectable(registry);
  const std::vector<int> ports = exposer->GetListeningPorts();
  ASSERT_EQ(ports.size(), 1u);

  SMAT_ASSERT_OK_AND_ASSIGN(std::string response, Scrape(ports[0]));
  EXPECT_TRUE(absl::StartsWith(response, "HTTP/1.1 200") || absl::StartsWith(response, "HTTP/1.0 200"))
      << response.substr(0, 200);
  EXPECT_TRUE(absl::StrContains(response, "smat_gpu_exposer_test_total{backend=\"cuda\"} 3"))
      << response;
}

}  // namespace
}  // namespace gpu_test
}  // namespace smat
