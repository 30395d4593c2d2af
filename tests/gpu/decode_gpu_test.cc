// The CUDA decoders (kernels/cuda/decode_cuda.h, through
// Backend::CreateDecoder) against the host decoders (kernels/decode.h) at every
// position: T = 1031 tokens, r = 24, dv = 16, batch 3, heads 2, d = 2 and 3,
// gated and not, positional and content maps, fp32 and bf16 inputs, the fixed
// horizon over its whole T (then OutOfRange) and the stepped window run past
// its T_max (ten tabulations). The device output is NaN-poisoned before every
// step; the same inputs twice give the same bits.
//
// Tolerance: 1e-5 of the largest host output of the step. The device updates
// its fp32 states with the host's operations in the host's order (no fused
// multiply-adds) and accumulates readouts in double, so the two differ by the
// order of double sums and by the device's exp() against glibc's, far below it
// (on an H200 the largest error is 0 in every case: the outputs are the host's bits).
// bf16: the device widens bf16 inputs exactly, the host decodes the same
// bf16-rounded values in fp32, so the same tolerance holds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/geometry.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/decode.h"
#include "tests/gpu/gpu_test_util.h"

namespace smat {
namespace {

using gpu_test::GpuTest;
using gpu_test::HostTensor;

constexpr double kTol = 1e-5;
constexpr int64_t kT = 1031, kBatch = 3, kHeads = 2, kR = 24, kDv = 16, kChunk = 16;

struct Case {
  std::string name;
  int d;
  int64_t window;  // 0: fixed horizon over T = kT; else stepped, plan from tmax
  int64_t tmax;
  bool gated;
  bool content;
  DType dtype;
};

// Per-token inputs, [T][batch * H * X] each, already rounded to `dtype`.
struct Tokens {
  std::vector<std::vector<float>> phi, psi, v, logg;
  std::vector<std::vector<int32_t>> prof, type;
};

float Round(float x, DType dtype) {
  return dtype == DType::kBF16 ? Bf16ToFloat(FloatToBf16(x)) : x;
}

Tokens MakeTokens(const Case& c, const SmatGeometry& g, int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> feat(0.05f, 1.f), val(-1.f, 1.f), gate(-0.2f, 0.f);
  const int64_t bh = kBatch * kHeads;
  Tokens tk;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> phi(bh * kR), psi(bh * kR), v(bh * kDv);
    for (float& x : phi) x = Round(feat(rng), c.dtype);
    for (float& x : psi) x = Round(feat(rng), c.dtype);
    for (float& x : v) x = Round(val(rng), c.dtype);
    tk.phi.push_back(std::move(phi));
    tk.psi.push_back(std::move(psi));
    tk.v.push_back(std::move(v));
    if (c.gated) {
      std::vector<float> lg(bh);
      for (float& x : lg) x = gate(rng);
      tk.logg.push_back(std::move(lg));
    }
    if (c.content) {
      std::vector<int32_t> prof(bh), type(bh);
      for (int32_t& x : prof) x = static_cast<int32_t>(rng() % g.P);
      for (int32_t& x : type) x = static_cast<int32_t>(rng() % g.B);
      tk.prof.push_back(std::move(prof));
      tk.type.push_back(std::move(type));
    }
  }
  return tk;
}

Tensor IdTensor(const std::vector<int32_t>& ids) {
  Tensor t = Tensor::Empty({kBatch, kHeads}, DType::kI32).value();
  std::memcpy(t.raw(), ids.data(), t.nbytes());
  return t;
}

// Token t as host tensors of `dtype` (features) / fp32 / int32.
DecodeToken HostToken(const Tokens& tk, int64_t t, DType dtype) {
  DecodeToken tok;
  tok.phi = HostTensor({kBatch, kHeads, kR}, dtype, tk.phi[t]);
  tok.psi = HostTensor({kBatch, kHeads, kR}, dtype, tk.psi[t]);
  tok.v = HostTensor({kBatch, kHeads, kDv}, dtype, tk.v[t]);
  if (!tk.logg.empty()) tok.logg = HostTensor({kBatch, kHeads}, DType::kF32, tk.logg[t]);
  if (!tk.prof.empty()) tok.prof = IdTensor(tk.prof[t]);
  if (!tk.type.empty()) tok.type = IdTensor(tk.type[t]);
  return tok;
}

class DecodeGpuTest : public GpuTest {
 protected:
  // The host decoder's outputs at every position, [T][bh * dv].
  std::vector<std::vector<float>> RunHost(const DecoderSpec& spec, const Tokens& tk, int64_t T) {
    std::vector<std::vector<float>> out;
    absl::StatusOr<std::unique_ptr<Decoder>> dec = cpu_->CreateDecoder(spec);
    EXPECT_TRUE(dec.ok()) << dec.status();
    if (!dec.ok()) return out;
    Tensor o;
    for (int64_t t = 0; t < T; ++t) {
      const absl::Status s = (*dec)->Step(HostToken(tk, t, DType::kF32), &o);
      EXPECT_TRUE(s.ok()) << "host step " << t << ": " << s;
      if (!s.ok()) return out;
      out.push_back(gpu_test::FloatValues(o));
    }
    return out;
  }

  // The CUDA decoder's outputs at every position; o is poisoned before each step.
  std::vector<std::vector<float>> RunGpu(const DecoderSpec& spec, const Tokens& tk, int64_t T,
                                         DType dtype) {
    std::vector<std::vector<float>> out;
    absl::StatusOr<std::unique_ptr<Decoder>> dec = gpu_->CreateDecoder(spec);
    EXPECT_TRUE(dec.ok()) << dec.status();
    if (!dec.ok()) return out;
    DecodeToken dev;
    Tensor o = Tensor::Empty({kBatch, kHeads, kDv}, DType::kF32, gpu_->allocator()).value();
    Tensor o_host = Tensor::Empty({kBatch, kHeads, kDv}, DType::kF32).value();
    for (int64_t t = 0; t < T; ++t) {
      const DecodeToken host = HostToken(tk, t, dtype);
      for (auto [src, dst] : {std::pair{&host.phi, &dev.phi}, std::pair{&host.psi, &dev.psi},
                              std::pair{&host.v, &dev.v}, std::pair{&host.logg, &dev.logg},
                              std::pair{&host.prof, &dev.prof}, std::pair{&host.type, &dev.type}}) {
        if (!src->defined()) continue;
        if (!dst->defined()) *dst = Tensor::Empty(src->shape(), src->dtype(), gpu_->allocator()).value();
        EXPECT_TRUE(gpu_->Copy(*src, *dst).ok());
      }
      EXPECT_TRUE(gpu_->Fill(o, std::numeric_limits<double>::quiet_NaN()).ok());
      const absl::Status s = (*dec)->Step(dev, &o);
      EXPECT_TRUE(s.ok()) << "gpu step " << t << ": " << s;
      if (!s.ok()) return out;
      EXPECT_TRUE(gpu_->Copy(o, o_host).ok());
      EXPECT_TRUE(gpu_->Synchronize(nullptr).ok());
      out.push_back(gpu_test::FloatValues(o_host));
    }
    if (spec.window == 0) {
      // The horizon: one token more is OutOfRange, as on the host.
      const absl::Status s = (*dec)->Step(dev, &o);
      EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
    }
    EXPECT_EQ((*dec)->position(), T);
    EXPECT_GT((*dec)->StateBytes(), 0);
    return out;
  }

  void RunCase(const Case& c) {
    SCOPED_TRACE(c.name);
    const int64_t plan_T = c.window == 0 ? kT : c.tmax;
    absl::StatusOr<SmatPlan> plan = MakeSmatPlan(plan_T, c.d, kChunk);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const DecoderSpec spec{.plan = *plan, .window = c.window,
                           .dims = {kBatch, kHeads, kR, kDv}, .eps = 1e-6f};
    const Tokens tk = MakeTokens(c, plan->geo, kT, 1000 + c.d * 10 + c.window);
    const auto host = RunHost(spec, tk, kT);
    const auto gpu = RunGpu(spec, tk, kT, c.dtype);
    ASSERT_EQ(host.size(), static_cast<size_t>(kT));
    ASSERT_EQ(gpu.size(), static_cast<size_t>(kT));
    int failures = 0;
    double worst = 0;
    for (int64_t t = 0; t < kT; ++t) {
      double scale = 0;
      for (float x : host[t]) scale = std::max(scale, std::fabs(static_cast<double>(x)));
      ASSERT_GT(scale, 0) << "host outputs at t = " << t << " are all zero";
      for (size_t j = 0; j < host[t].size(); ++j) {
        const double err = std::fabs(static_cast<double>(gpu[t][j]) - host[t][j]);
        worst = std::max(worst, err / scale);
        if (!(err <= kTol * scale) && failures++ < 5) {
          ADD_FAILURE() << "t = " << t << " element " << j << ": gpu " << gpu[t][j] << ", host "
                        << host[t][j] << " (scale " << scale << ")";
        }
      }
    }
    EXPECT_EQ(failures, 0) << "of " << kT * kBatch * kHeads * kDv << " outputs";
    std::printf("[ %s ] largest error %.3g of the step's largest output\n", c.name.c_str(), worst);
    // Determinism: a second decoder on the same inputs gives the same bits.
    const auto again = RunGpu(spec, tk, kT, c.dtype);
    ASSERT_EQ(again.size(), gpu.size());
    for (int64_t t = 0; t < kT; ++t) {
      ASSERT_EQ(std::memcmp(again[t].data(), gpu[t].data(), gpu[t].size() * sizeof(float)), 0)
          << "second run differs at t = " << t;
    }
  }
};

TEST_F(DecodeGpuTest, FixedHorizonD2) {
  RunCase({"fixed d=2", 2, 0, 0, false, false, DType::kF32});
  RunCase({"fixed d=2 gated content", 2, 0, 0, true, true, DType::kF32});
}

TEST_F(DecodeGpuTest, FixedHorizonD3) {
  RunCase({"fixed d=3", 3, 0, 0, false, false, DType::kF32});
  RunCase({"fixed d=3 gated content", 3, 0, 0, true, true, DType::kF32});
}

TEST_F(DecodeGpuTest, SteppedWindowPastTmaxD2) {
  // T_max = 600, c_dc = 96: 1031 tokens are 11 blocks, 9 tabulations.
  RunCase({"stepped d=2", 2, 96, 600, false, false, DType::kF32});
  RunCase({"stepped d=2 gated content", 2, 96, 600, true, true, DType::kF32});
}

TEST_F(DecodeGpuTest, SteppedWindowPastTmaxD3) {
  RunCase({"stepped d=3", 3, 96, 600, false, false, DType::kF32});
  RunCase({"stepped d=3 gated content", 3, 96, 600, true, true, DType::kF32});
}

TEST_F(DecodeGpuTest, Bf16Inputs) {
  RunCase({"fixed d=2 gated bf16", 2, 0, 0, true, false, DType::kBF16});
  RunCase({"stepped d=3 gated content bf16", 3, 96, 600, true, true, DType::kBF16});
}

TEST_F(DecodeGpuTest, BadTokens) {
  const SmatPlan plan = MakeSmatPlan(200, 2, kChunk).value();
  const DecoderSpec spec{.plan = plan, .window = 0, .dims = {kBatch, kHeads, kR, kDv}};
  std::unique_ptr<Decoder> dec = gpu_->CreateDecoder(spec).value();
  const Case c{"bad", 2, 0, 0, false, true, DType::kF32};
  const Tokens tk = MakeTokens(c, plan.geo, plan.n + 1, 7);
  Tensor o;
  // Host tensors are refused, naming the tensor and the device.
  const absl::Status host = dec->Step(HostToken(tk, 0, DType::kF32), &o);
  EXPECT_EQ(host.code(), absl::StatusCode::kInvalidArgument) << host;
  EXPECT_NE(host.message().find("phi is on cpu"), std::string::npos) << host;
  EXPECT_EQ(dec->position(), 0);
  // A type id outside [0, B) at a recent token: NaN for that (sequence, head)
  // only (the device cannot return an error without a synchronisation).
  for (int64_t t = 0; t <= plan.n; ++t) {
    DecodeToken h = HostToken(tk, t, DType::kF32);
    if (t == plan.n) h.type.data<int32_t>()[1] = static_cast<int32_t>(plan.geo.B);
    DecodeToken d;
    d.phi = gpu_test::ToDevice(*gpu_, h.phi).value();
    d.psi = gpu_test::ToDevice(*gpu_, h.psi).value();
    d.v = gpu_test::ToDevice(*gpu_, h.v).value();
    d.prof = gpu_test::ToDevice(*gpu_, h.prof).value();
    d.type = gpu_test::ToDevice(*gpu_, h.type).value();
    SMAT_ASSERT_OK(dec->Step(d, &o));
  }
  const std::vector<float> out = gpu_test::FloatValues(gpu_test::ToHost(*gpu_, o).value());
  for (int64_t i = 0; i < kBatch * kHeads; ++i) {
    for (int64_t j = 0; j < kDv; ++j) {
      if (i == 1) {
        EXPECT_TRUE(std::isnan(out[i * kDv + j])) << "element " << j;
      } else {
        EXPECT_TRUE(std::isfinite(out[i * kDv + j])) << "row " << i << " element " << j;
      }
    }
  }
}

}  // namespace
}  // namespace smat
