// smat_bench decode (see smat_bench_decode.h).
#include "tools/smat_bench_decode.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/geometry.h"
#include "core/status.h"
#include "kernels/decode.h"
#include "tools/smat_bench_util.h"

namespace smat {
namespace {

// A pool of distinct random tokens on the device, stepped through cyclically.
absl::StatusOr<std::vector<DecodeToken>> TokenPool(Backend& backend, const SmatBenchConfig& cfg,
                                                   int64_t count) {
  const int64_t b = cfg.batch, H = cfg.heads;
  auto make = [&](Shape shape, DType dtype, uint64_t seed, float lo, float hi) {
    return RandomOnDevice(backend, std::move(shape), dtype, seed, lo, hi);
  };
  // The host decoders take fp32 only (they would widen bf16 anyway).
  const DType feat = backend.device().is_cpu() ? DType::kF32 : cfg.dtype;
  SMAT_ASSIGN_OR_RETURN(Tensor phi, make({count, b, H, cfg.r}, feat, 11, 0.05f, 1.f));
  SMAT_ASSIGN_OR_RETURN(Tensor psi, make({count, b, H, cfg.r}, feat, 12, 0.05f, 1.f));
  SMAT_ASSIGN_OR_RETURN(Tensor v, make({count, b, H, cfg.dv}, feat, 13, -1.f, 1.f));
  Tensor logg;
  if (cfg.gated) {
    // Mild decay (a >= 0.99) so that distant keys still weigh something.
    SMAT_ASSIGN_OR_RETURN(logg, make({count, b, H}, DType::kF32, 14, -0.01f, 0.f));
  }
  std::vector<DecodeToken> pool(count);
  for (int64_t k = 0; k < count; ++k) {
    pool[k].phi = phi.View(k * b * H * cfg.r, {b, H, cfg.r});
    pool[k].psi = psi.View(k * b * H * cfg.r, {b, H, cfg.r});
    pool[k].v = v.View(k * b * H * cfg.dv, {b, H, cfg.dv});
    if (logg.defined()) pool[k].logg = logg.View(k * b * H, {b, H});
  }
  return pool;
}

}  // namespace

absl::Status RunDecodeBenchmark(const SmatBenchConfig& cfg, const DecodeBenchOptions& opt) {
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateBackend(opt.device));
  const int64_t T = opt.T, window = opt.window;
  const int d = opt.d;
  SMAT_ASSIGN_OR_RETURN(SmatPlan plan, MakeSmatPlan(T, d, cfg.chunk, cfg.q));
  const int reps = std::max(cfg.reps, 30), warmup = std::max(cfg.warmup, 10);
  // Timed positions: the last (warmup + 2 reps) of T.
  const int64_t tail = warmup + 3 * int64_t{reps};
  if (T <= tail) {
    return absl::InvalidArgumentError(absl::StrCat("--T ", T, " must exceed the ", tail,
                                                   " timed and warm-up positions"));
  }
  double copy = 0;  // device copy bandwidth, bytes per second
  if (!backend->device().is_cpu()) {
    SMAT_ASSIGN_OR_RETURN(copy, CopyBandwidth(*backend));
  }
  backend->allocator().ResetPeak();
  const int64_t base_bytes = backend->allocator().stats().in_use_bytes;

  SMAT_ASSIGN_OR_RETURN(std::vector<DecodeToken> pool, TokenPool(*backend, cfg, 64));
  const DecoderSpec spec{.plan = plan,
                         .window = window,
                         .dims = {cfg.batch, cfg.heads, cfg.r, cfg.dv},
                         .eps = 1e-6f};
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Decoder> dec, backend->CreateDecoder(spec));
  SMAT_ASSIGN_OR_RETURN(Tensor o, Tensor::Empty({cfg.batch, cfg.heads, cfg.dv}, DType::kF32,
                                                backend->allocator()));
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> e0, backend->CreateEvent());
  SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> e1, backend->CreateEvent());
  auto step = [&]() -> absl::Status {
    const int64_t t = dec->position();
    return dec->Step(pool[t % static_cast<int64_t>(pool.size())], &o);
  };
  // Steps that launch more than the step kernel: t = n (fixed horizon), each
  // block start (stepped window; the tabulation proper from the third block).
  auto tabulates = [&](int64_t t) {
    return window == 0 ? t == plan.n : (t > 0 && t % window == 0);
  };

  // Fast-forward to the tail: every step, untimed except the tabulating ones.
  struct TabStep {
    int64_t t;
    double event_ms, wall_ms;
  };
  std::vector<TabStep> tabs;
  const int64_t ff = T - tail;
  double wall_tab = 0;
  const double ff_start = NowSeconds();
  while (dec->position() < ff) {
    const int64_t t = dec->position();
    if (tabulates(t)) {
      SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
      const double w0 = NowSeconds();
      SMAT_RETURN_IF_ERROR(backend->Record(*e0, nullptr));
      SMAT_RETURN_IF_ERROR(step());
      SMAT_RETURN_IF_ERROR(backend->Record(*e1, nullptr));
      SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
      const double w = (NowSeconds() - w0) * 1e3;
      SMAT_ASSIGN_OR_RETURN(float ms, backend->ElapsedMs(*e0, *e1));
      tabs.push_back({t, ms, w});
      wall_tab += w * 1e-3;
    } else {
      SMAT_RETURN_IF_ERROR(step());
    }
  }
  SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
  const double ff_seconds = NowSeconds() - ff_start;

  for (int i = 0; i < warmup; ++i) SMAT_RETURN_IF_ERROR(step());
  // Isolated: the stream idle before each step; events around the step alone.
  std::vector<double> isolated;
  for (int i = 0; i < reps; ++i) {
    SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
    SMAT_RETURN_IF_ERROR(backend->Record(*e0, nullptr));
    SMAT_RETURN_IF_ERROR(step());
    SMAT_RETURN_IF_ERROR(backend->Record(*e1, nullptr));
    SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
    SMAT_ASSIGN_OR_RETURN(float ms, backend->ElapsedMs(*e0, *e1));
    isolated.push_back(ms * 1e3);
  }
  // Back-to-back: an event between consecutive steps, read at the end.
  std::vector<std::unique_ptr<Event>> marks;
  for (int i = 0; i <= reps; ++i) {
    SMAT_ASSIGN_OR_RETURN(std::unique_ptr<Event> e, backend->CreateEvent());
    marks.push_back(std::move(e));
  }
  SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
  SMAT_RETURN_IF_ERROR(backend->Record(*marks[0], nullptr));
  for (int i = 0; i < reps; ++i) {
    SMAT_RETURN_IF_ERROR(step());
    SMAT_RETURN_IF_ERROR(backend->Record(*marks[i + 1], nullptr));
  }
  SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
  std::vector<double> stream;
  for (int i = 0; i < reps; ++i) {
    SMAT_ASSIGN_OR_RETURN(float ms, backend->ElapsedMs(*marks[i], *marks[i + 1]));
    stream.push_back(ms * 1e3);
  }
  const Allocator::Stats mem = backend->allocator().stats();  // before the queue's buffers

  // Device-bound: the steps queued behind a long copy, so the device never
  // waits for the host; the events between them then give the device's own
  // time per step (kernel and launch gap), whatever the host's launch path costs.
  std::vector<double> queued;
  double enqueue_us = 0, copy_us = 0;
  if (!backend->device().is_cpu()) {
    constexpr int64_t kQueueFloats = int64_t{256} << 20;  // 1 GiB each way: ~0.5 ms
    SMAT_ASSIGN_OR_RETURN(Tensor qsrc, Tensor::Empty({kQueueFloats}, DType::kF32,
                                                     backend->allocator()));
    SMAT_ASSIGN_OR_RETURN(Tensor qdst, Tensor::Empty({kQueueFloats}, DType::kF32,
                                                     backend->allocator()));
    SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
    SMAT_RETURN_IF_ERROR(backend->Record(*e0, nullptr));
    SMAT_RETURN_IF_ERROR(backend->Copy(qsrc, qdst));
    SMAT_RETURN_IF_ERROR(backend->Record(*marks[0], nullptr));
    const double h0 = NowSeconds();
    for (int i = 0; i < reps; ++i) {
      SMAT_RETURN_IF_ERROR(step());
      SMAT_RETURN_IF_ERROR(backend->Record(*marks[i + 1], nullptr));
    }
    enqueue_us = (NowSeconds() - h0) * 1e6;
    SMAT_RETURN_IF_ERROR(backend->Synchronize(nullptr));
    SMAT_ASSIGN_OR_RETURN(float cms, backend->ElapsedMs(*e0, *marks[0]));
    copy_us = cms * 1e3;
    for (int i = 0; i < reps; ++i) {
      SMAT_ASSIGN_OR_RETURN(float ms, backend->ElapsedMs(*marks[i], *marks[i + 1]));
      queued.push_back(ms * 1e3);
    }
  } else {
    for (int i = 0; i < reps; ++i) SMAT_RETURN_IF_ERROR(step());
  }
  if (dec->position() != T) {
    return absl::InternalError(absl::StrCat("decoded ", dec->position(), " of ", T, " tokens"));
  }

  // State traffic of one step at the timed positions (fp32 states of r x p):
  // fixed horizon (recent): S read + written, U[type] read; stepped window
  // (block >= 2): R_old, R_cur, Delta[prof] read + written, U[type] read.
  const double state = 4.0 * cfg.r * (cfg.dv + 1) * cfg.batch * cfg.heads;
  const double bytes = (window == 0 ? 3 : 7) * state;
  const double us_stream = Median(stream), us_iso = Median(isolated);
  const double peak_mb = static_cast<double>(mem.peak_bytes - base_bytes) / 1e6;
  std::printf("# smat_bench decode on %s\n", backend->name().c_str());
  std::printf(
      "decoder: %s, T = %lld, d = %d, n = %lld, q = %lld, P = %lld, B = %lld, batch %lld, heads "
      "%lld, r = %lld, dv = %lld, %s, %s\n",
      window == 0 ? "fixed horizon" : absl::StrCat("stepped window c_dc = ", window).c_str(),
      static_cast<long long>(T), d, static_cast<long long>(plan.n),
      static_cast<long long>(plan.geo.q), static_cast<long long>(plan.geo.P),
      static_cast<long long>(plan.geo.B), static_cast<long long>(cfg.batch),
      static_cast<long long>(cfg.heads), static_cast<long long>(cfg.r),
      static_cast<long long>(cfg.dv), DTypeName(cfg.dtype), cfg.gated ? "gated" : "ungated");
  std::printf("timed positions %lld..%lld (after %d warm-up steps), %d steps each way\n",
              static_cast<long long>(T - 3 * reps), static_cast<long long>(T - 1), warmup, reps);
  std::printf("step, back-to-back: median %.2f us/token (min %.2f, max %.2f)\n", us_stream,
              *std::min_element(stream.begin(), stream.end()),
              *std::max_element(stream.begin(), stream.end()));
  std::printf("step, isolated:     median %.2f us/token (min %.2f, max %.2f)\n", us_iso,
              *std::min_element(isolated.begin(), isolated.end()),
              *std::max_element(isolated.begin(), isolated.end()));
  if (!queued.empty()) {
    std::printf(
        "step, device-bound (queued behind a %.0f us copy; the host enqueued them in %.0f us%s): "
        "median %.2f us/token (min %.2f, max %.2f)\n",
        copy_us, enqueue_us, enqueue_us < copy_us ? "" : ", NOT ahead of the device",
        Median(queued), *std::min_element(queued.begin(), queued.end()),
        *std::max_element(queued.begin(), queued.end()));
  }
  const double gbs = bytes / (us_stream * 1e-6) / 1e9;
  if (copy > 0) {
    std::printf(
        "state traffic %.0f KB/token: %.1f GB/s back-to-back = %.2f%% of the copy bandwidth "
        "%.0f GB/s (bytes / copy bandwidth = %.3f us)\n",
        bytes / 1e3, gbs, 100.0 * gbs / (copy / 1e9), copy / 1e9, bytes / copy * 1e6);
  } else {
    std::printf("state traffic %.0f KB/token: %.1f GB/s back-to-back\n", bytes / 1e3, gbs);
  }
  std::printf("fast-forward: %lld steps in %.2f s wall = %.2f us/token (tabulation steps "
              "excluded)\n",
              static_cast<long long>(ff), ff_seconds,
              (ff_seconds - wall_tab) / std::max<double>(1, ff - tabs.size()) * 1e6);
  for (const TabStep& ts : tabs) {
    std::printf("tabulation step t = %lld: %.3f ms (events), %.3f ms wall\n",
                static_cast<long long>(ts.t), ts.event_ms, ts.wall_ms);
  }
  if (backend->device().is_cpu()) {  // the host decoders hold std::vectors, not allocations
    std::printf("decoder state now %.1f MB\n", static_cast<double>(dec->StateBytes()) / 1e6);
  } else {
    std::printf("decoder state now %.1f MB; peak device memory during the run %.1f MB (decoder, "
                "64-token input pool, output)\n",
                static_cast<double>(dec->StateBytes()) / 1e6, peak_mb);
  }
  std::printf("| %s | %d | %lld | %.2f | %.2f | %.2f | %.2f | %.1f | %.0f | %s | %.1f |\n",
              window == 0 ? "fixed" : absl::StrCat("stepped ", window).c_str(), d,
              static_cast<long long>(T), us_stream, us_iso, Median(queued),
              (ff_seconds - wall_tab) / std::max<double>(1, ff - tabs.size()) * 1e6, gbs,
              copy / 1e9,
              tabs.empty() ? "-"
                           : absl::StrCat(absl::StrFormat("%.2f", tabs.back().event_ms), " ms x ",
                                          tabs.size()).c_str(),
              peak_mb);
  return absl::OkStatus();
}

}  // namespace smat
