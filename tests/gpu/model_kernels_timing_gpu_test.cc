// A timing printout of the CUDA model kernels at the trainer's shapes, with the
// device copy bandwidth measured in the same process as the ceiling; it checks
// the outputs against the CPU too. docs/PERFORMANCE.md quotes it:
//   SMAT_REQUIRE_GPU=1 build-gpu/gpu_test --gtest_filter='*TimingAtTrainerShapes*'
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "model_kernels_gpu_util.h"

namespace smat {
namespace gpu_test {
namespace {

// ------------------------------------------------------------------ timing printout

// TIMING PRINTOUT at the trainer's shapes (N = 16384 tokens, W = 384,
// F = 1024, V = 256, cross-entropy chunks of 4096): CUDA-event times and the
// bytes each kernel must move at least, against the measured device-to-device
// copy bandwidth. It also checks the outputs against the CPU.
TEST_F(ModelKernelsGpuTest, TimingAtTrainerShapes) {
  const int64_t N = 16384, W = 384, F = 1024, V = 256, H = 6, r = 64, chunk = 4096;
  const int reps = 20;
  auto start = gpu_->CreateEvent(), stop = gpu_->CreateEvent();
  ASSERT_TRUE(start.ok() && stop.ok());
  auto time_ms = [&](const std::function<absl::Status()>& f) -> double {
    SMAT_CHECK(f().ok());  // warm-up
    SMAT_CHECK(gpu_->Record(**start, nullptr).ok());
    for (int i = 0; i < reps; ++i) SMAT_CHECK(f().ok());
    SMAT_CHECK(gpu_->Record(**stop, nullptr).ok());
    return *gpu_->ElapsedMs(**start, **stop) / reps;
  };
  // Copy bandwidth: read + write of 512 MiB.
  Tensor c1 = Poisoned({128 << 20}, 1.0), c2 = Poisoned({128 << 20});
  const double copy_ms = time_ms([&] { return gpu_->Copy(c1, c2); });
  const double copy_gbs = 2.0 * c1.nbytes() / (copy_ms * 1e6);
  c1 = Tensor();
  c2 = Tensor();
  std::printf("[timing] device-to-device copy: %.3f ms for 2 x %zu MiB = %.0f GB/s\n", copy_ms,
              static_cast<size_t>(128 << 22 >> 20), copy_gbs);
  struct Row {
    std::string op;
    double ms, bytes;
  };
  std::vector<Row> rows;
  const double fb = 4.0;
  const Tensor hx = Random({N, W}, 50), hw = Random({W}, 51), hg = Random({N, F}, 52, 3.f);
  const Tensor hu = Random({N, F}, 53);
  Tensor x = Dev(hx), w = Dev(hw), y = Poisoned({N, W}), rstd = Poisoned({N});
  Tensor dy = Dev(Random({N, W}, 54)), dx = Poisoned({N, W}), dw = Poisoned({W}, 0.0);
  Tensor gate = Dev(hg), up = Dev(hu), act = Poisoned({N, F}), dgate = Poisoned({N, F});
  Tensor dup = Poisoned({N, F}), dact = Dev(Random({N, F}, 55));
  rows.push_back({"RmsNormForward", time_ms([&] { return gmk_->RmsNormForward(x, w, 1e-6f, y, rstd); }),
                  fb * 2 * N * W});
  rows.push_back({"RmsNormBackward", time_ms([&] { return gmk_->RmsNormBackward(x, w, rstd, dy, dx, dw); }),
                  fb * 3 * N * W});
  rows.push_back({"SwiGluForward", time_ms([&] { return gmk_->SwiGluForward(gate, up, act); }),
                  fb * 3 * N * F});
  rows.push_back({"SwiGluBackward",
                  time_ms([&] { return gmk_->SwiGluBackward(gate, up, dact, dgate, dup); }),
                  fb * 5 * N * F});
  rows.push_back({"ResidualAdd", time_ms([&] { return gmk_->ResidualAdd(x, dy, dx); }),
                  fb * 3 * N * W});
  rows.push_back({"NegSoftplusForward", time_ms([&] { return gmk_->NegSoftplusForward(x, y); }),
                  fb * 2 * N * W});
  rows.push_back({"SoftplusBackward", time_ms([&] { return gmk_->SoftplusBackward(x, dy, dx); }),
                  fb * 3 * N * W});
  Tensor phi = Dev(Random({N, H, r}, 56)), gsc = Dev(Random({N, H}, 57)), phi2 = Poisoned({N, H, r});
  Tensor dphi = Dev(Random({N, H, r}, 58)), dphi2 = Poisoned({N, H, r}), dg = Poisoned({N, H});
  rows.push_back({"SigmoidScaleForward", time_ms([&] { return gmk_->SigmoidScaleForward(phi, gsc, phi2); }),
                  fb * 2 * N * H * r});
  rows.push_back({"SigmoidScaleBackward",
                  time_ms([&] { return gmk_->SigmoidScaleBackward(phi, gsc, dphi, dphi2, dg); }),
                  fb * 3 * N * H * r});
  Tensor phim = phi.View(0, {N * H, r}), phim2 = phi2.View(0, {N * H, r});
  Tensor dphim = dphi.View(0, {N * H, r}), dphim2 = dphi2.View(0, {N * H, r});
  rows.push_back({"ExpRowMaxForward", time_ms([&] { return gmk_->ExpRowMaxForward(phim, phim2); }),
                  fb * 2 * N * H * r});
  rows.push_back({"ExpRowMaxBackward",
                  time_ms([&] { return gmk_->ExpRowMaxBackward(phim, phim2, dphim, dphim2); }),
                  fb * 4 * N * H * r});
  // Short conv over q, k, v of 4 sequences of 4096 tokens: C = 3 W.
  const int64_t nb = 4, L = N / nb, C = 3 * W;
  Tensor cx = Dev(Random({nb, L, C}, 59)), cp = Dev(Random({nb, 3, C}, 60));
  Tensor cw = Dev(Random({4, C}, 61)), cy = Poisoned({nb, L, C}), cdy = Dev(Random({nb, L, C}, 62));
  Tensor cdx = Poisoned({nb, L, C}), cdp = Poisoned({nb, 3, C}), cdw = Poisoned({4, C}, 0.0);
  rows.push_back({"ShortConvForward", time_ms([&] { return gmk_->ShortConvForward(cx, cp, cw, cy); }),
                  fb * 2 * N * C});
  rows.push_back({"ShortConvBackward",
                  time_ms([&] { return gmk_->ShortConvBackward(cx, cp, cw, cdy, cdx, cdp, cdw); }),
                  fb * 4 * N * C});
  const Tensor hids = Ids(N, V, 63);
  Tensor table = Dev(Random({V, W}, 64)), ids = Dev(hids), emb = Poisoned({N, W});
  Tensor dtable = Poisoned({V, W}, 0.0);
  rows.push_back({"EmbeddingForward", time_ms([&] { return gmk_->EmbeddingForward(table, ids, emb); }),
                  fb * 2 * N * W});
  rows.push_back({"EmbeddingBackward",
                  time_ms([&] { return gmk_->EmbeddingBackward(ids, dy, dtable); }),
                  fb * N * W});
  Tensor pw = Dev(Random({N * W}, 65)), pg = Dev(Random({N * W}, 66)), pm = Poisoned({N * W}, 0.0);
  Tensor pv = Poisoned({N * W}, 0.0), pbf = Tensor::Empty({N * W}, DType::kBF16, gpu_->allocator()).value();
  ModelKernels::AdamWScalars s;
  s.step_size = 1e-3f;
  rows.push_back({"AdamWUpdate (6.3M params)",
                  time_ms([&] { return gmk_->AdamWUpdate(pw, pg, pm, pv, s); }), fb * 7 * N * W});
  rows.push_back({"Cast fp32->bf16", time_ms([&] { return gmk_->Cast(pg, pbf); }), 6.0 * N * W});
  rows.push_back({"SumOfSquares (6.3M)",
                  time_ms([&]() -> absl::Status { return gmk_->SumOfSquares({pg}).status(); }),
                  fb * N * W});
  Tensor h = Dev(Random({N, W}, 67)), wh = Dev(Random({V, W}, 68, 0.2f));
  Tensor tg = Dev(Ids(N, V, 69)), wt = Poisoned({N}, 1.0), lse = Poisoned({N});
  Tensor dh = Poisoned({N, W}), dwh = Poisoned({V, W}, 0.0);
  double loss = 0;
  rows.push_back({"CrossEntropyForward (V 256, chunk 4096)",
                  time_ms([&] { return gmk_->CrossEntropyForward(*gpu_, h, wh, tg, wt, chunk, lse, &loss); }),
                  fb * (N * W + V * W + N)});
  rows.push_back({"CrossEntropyBackward (V 256, chunk 4096)",
                  time_ms([&] {
                    return gmk_->CrossEntropyBackward(*gpu_, h, wh, tg, wt, lse, 1.f / N, chunk, dh, dwh);
                  }),
                  fb * (2 * N * W + 2 * V * W + 2 * N)});
  // The GPT-2 vocabulary: the products dominate (2 N V W flops forward,
  // three times that backward, with the logits recomputed).
  {
    const int64_t Vl = 50257;
    Tensor whl = Dev(Random({Vl, W}, 70, 0.05f)), tgl = Dev(Ids(N, Vl, 71));
    Tensor dwl = Poisoned({Vl, W}, 0.0);
    double lossl = 0;
    const double fwd = time_ms([&] {
      return gmk_->CrossEntropyForward(*gpu_, h, whl, tgl, wt, chunk, lse, &lossl);
    });
    const double bwd = time_ms([&] {
      return gmk_->CrossEntropyBackward(*gpu_, h, whl, tgl, wt, lse, 1.f / N, chunk, dh, dwl);
    });
    const double flops = 2.0 * N * Vl * W;
    std::printf("[timing] CrossEntropyForward (V 50257, chunk 4096): %.3f ms, %.1f TFLOP/s of fp32 products\n",
                fwd, flops / (fwd * 1e9));
    std::printf("[timing] CrossEntropyBackward (V 50257, chunk 4096): %.3f ms, %.1f TFLOP/s of fp32 products\n",
                bwd, 3 * flops / (bwd * 1e9));
    EXPECT_TRUE(std::isfinite(lossl) && lossl > 0) << lossl;
    EXPECT_NEAR(lossl / N, std::log(static_cast<double>(Vl)), 0.5)
        << "small logits: the mean loss is about log V";
  }
  std::printf("[timing] %-42s %10s %10s %8s\n", "op", "ms", "GB/s", "of copy");
  for (const Row& row : rows) {
    const double gbs = row.bytes / (row.ms * 1e6);
    std::printf("[timing] %-42s %10.4f %10.0f %7.0f%%\n", row.op.c_str(), row.ms, gbs,
                100.0 * gbs / copy_gbs);
  }
  // Correctness at this shape: the last outputs against the CPU.
  Tensor cy_host = *Tensor::Empty({N, W}, DType::kF32), crs = *Tensor::Empty({N}, DType::kF32);
  ASSERT_TRUE(cmk_->RmsNormForward(hx, hw, 1e-6f, cy_host, crs).ok());
  SMAT_ASSERT_OK(gmk_->RmsNormForward(x, w, 1e-6f, y, rstd));
  ExpectClose(Host(y), cy_host, 4e-7, 0, "RmsNormForward at the trainer's shape");
  Tensor cact = *Tensor::Empty({N, F}, DType::kF32);
  ASSERT_TRUE(cmk_->SwiGluForward(hg, hu, cact).ok());
  ExpectClose(Host(act), cact, 1e-5, 1e-6, "SwiGluForward at the trainer's shape");
  Tensor cemb = *Tensor::Empty({N, W}, DType::kF32);
  ASSERT_TRUE(cmk_->EmbeddingForward(Host(table), hids, cemb).ok());
  ExpectBitwise(Host(emb), cemb, "EmbeddingForward at the trainer's shape");
  Tensor clse = *Tensor::Empty({N}, DType::kF32);
  double closs = 0;
  ASSERT_TRUE(cmk_->CrossEntropyForward(*cpu_, Host(h), Host(wh), Host(tg), Host(wt), chunk, clse,
                                        &closs).ok());
  EXPECT_NEAR(loss, closs, 1e-5 * std::fabs(closs));
}

}  // namespace
}  // namespace gpu_test
}  // namespace smat
