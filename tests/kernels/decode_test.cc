// Tests of the decoders and the stepped-window forward pass (kernels/decode.h):
// the fixed-horizon decoder against a dense double reference of the SMat mask
// (eq. 4, 6, 13) and against the chunked SMat op (kernels/smat.h); the
// stepped-window decoder against both the stepped-window forward pass and the
// dense reference of Definition 1. At every position, gated and not, d = 1..3,
// odd sizes, positional and content maps, and past T_max.
#include "kernels/decode.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/geometry.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/smat.h"

namespace smat {
namespace {

struct Problem {
  SmatInputs in;
  int64_t batch, T, H, r, dv;
};

// Random inputs: features in [0.05, 1] (nonnegative, as after a feature map),
// values in [-1, 1], log-gates in [-0.2, 0] when gated; content maps when asked.
Problem MakeProblem(int64_t batch, int64_t T, int64_t H, int64_t r, int64_t dv, bool gated,
                    const SmatGeometry* content, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> feat(0.05f, 1.f), val(-1.f, 1.f), gate(-0.2f, 0.f);
  Problem pr{{}, batch, T, H, r, dv};
  pr.in.phi = *Tensor::Empty({batch, T, H, r}, DType::kF32);
  pr.in.psi = *Tensor::Empty({batch, T, H, r}, DType::kF32);
  pr.in.v = *Tensor::Empty({batch, T, H, dv}, DType::kF32);
  for (int64_t i = 0; i < pr.in.phi.numel(); ++i) pr.in.phi.data<float>()[i] = feat(rng);
  for (int64_t i = 0; i < pr.in.psi.numel(); ++i) pr.in.psi.data<float>()[i] = feat(rng);
  for (int64_t i = 0; i < pr.in.v.numel(); ++i) pr.in.v.data<float>()[i] = val(rng);
  if (gated) {
    pr.in.logg = *Tensor::Empty({batch, T, H}, DType::kF32);
    for (int64_t i = 0; i < pr.in.logg.numel(); ++i) pr.in.logg.data<float>()[i] = gate(rng);
  }
  if (content != nullptr) {
    pr.in.prof = *Tensor::Empty({batch, T, H}, DType::kI32);
    pr.in.type = *Tensor::Empty({batch, T, H}, DType::kI32);
    for (int64_t i = 0; i < batch * T * H; ++i) {
      pr.in.prof.data<int32_t>()[i] = static_cast<int32_t>(rng() % content->P);
      pr.in.type.data<int32_t>()[i] = static_cast<int32_t>(rng() % content->B);
    }
  }
  return pr;
}

// Copies token t of a [batch, T, H, X] tensor into a [batch, H, X] tensor.
Tensor TokenSlice(const Tensor& x, int64_t t) {
  const int64_t batch = x.dim(0), T = x.dim(1), H = x.dim(2);
  const int64_t X = x.rank() == 4 ? x.dim(3) : 1;
  Shape shape = {batch, H};
  if (x.rank() == 4) shape.push_back(X);
  Tensor out = *Tensor::Empty(shape, x.dtype());
  const size_t es = DTypeSize(x.dtype());
  for (int64_t b = 0; b < batch; ++b) {
    const char* src = static_cast<const char*>(x.raw()) + ((b * T + t) * H) * X * es;
    std::copy(src, src + H * X * es, static_cast<char*>(out.raw()) + b * H * X * es);
  }
  return out;
}

DecodeToken TokenAt(const SmatInputs& in, int64_t t) {
  DecodeToken tok;
  tok.phi = TokenSlice(in.phi, t);
  tok.psi = TokenSlice(in.psi, t);
  tok.v = TokenSlice(in.v, t);
  if (in.logg.defined()) tok.logg = TokenSlice(in.logg, t);
  if (in.prof.defined()) tok.prof = TokenSlice(in.prof, t);
  if (in.type.defined()) tok.type = TokenSlice(in.type, t);
  return tok;
}

// Runs a decoder over all T tokens; returns o [batch, T, H, dv] with every
// element checked written (poisoned with NaN first).
template <typename Decoder>
std::vector<float> Decode(Decoder& dec, const Problem& pr) {
  std::vector<float> o(pr.batch * pr.T * pr.H * pr.dv, std::nanf(""));
  Tensor ot;
  for (int64_t t = 0; t < pr.T; ++t) {
    absl::Status s = dec.Step(TokenAt(pr.in, t), &ot);
    EXPECT_TRUE(s.ok()) << "t=" << t << ": " << s;
    if (!s.ok()) return o;
    for (int64_t b = 0; b < pr.batch; ++b)
      for (int64_t h = 0; h < pr.H; ++h)
        for (int64_t j = 0; j < pr.dv; ++j)
          o[((b * pr.T + t) * pr.H + h) * pr.dv + j] = ot.data<float>()[(b * pr.H + h) * pr.dv + j];
  }
  return o;
}

// fp32 states and inputs against a double reference (or against the chunked
// fp32 op, whose own rounding is of the same size). Every output row is a
// ratio of sums of at most T positive-weight terms accumulated in fp32
// (relative rounding ~T * 2^-24 in the worst case, ~sqrt(T) * 2^-24 typical);
// the tolerance is relative to max(|o_ref|, 0.1) (0.1: outputs that cancel to
// ~0 are judged against the values' scale, |v| <= 1). Observed maximum at these
// sizes: 3.6e-7 (a few fp32 ulps); 1e-6 is the spec's bound. A single wrongly
// included key or gate moves outputs by > 1e-2 (seen when the tests were
// checked against deliberately broken decoders).
void ExpectClose(const std::vector<float>& got, const std::vector<double>& ref, const Problem& pr,
                 const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  double max_rel = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << what << ": element " << i << " not written";
    const double scale = std::max(std::fabs(ref[i]), 0.1);
    max_rel = std::max(max_rel, std::fabs(got[i] - ref[i]) / scale);
    norm += ref[i] * ref[i];
  }
  EXPECT_GT(norm, 1e-3) << what << ": reference is all zero";
  EXPECT_LT(max_rel, 1e-6) << what;
}


struct Case {
  int64_t T;
  int d;
  int64_t chunk;
  int64_t q;
  bool gated;
  bool content;
};

TEST(FixedHorizonDecoderTest, MatchesDenseSmatMask) {
  const std::vector<Case> cases = {
      {1, 1, 4, 0, false, false},   {37, 1, 4, 0, true, false},  {101, 2, 4, 0, false, false},
      {101, 2, 4, 0, true, false},  {163, 3, 8, 0, false, false}, {163, 3, 8, 0, true, false},
      {97, 2, 8, 0, true, true},    {131, 3, 4, 3, true, true},
  };
  uint64_t seed = 1;
  for (const Case& c : cases) {
    auto plan = MakeSmatPlan(c.T, c.d, c.chunk, c.q);
    ASSERT_TRUE(plan.ok()) << plan.status();
    Problem pr = MakeProblem(2, c.T, 3, 5, 3, c.gated, c.content ? &plan->geo : nullptr, seed++);
    pr.in.eps = 1e-6f;
    auto dec = FixedHorizonDecoder::Create(*plan, {pr.batch, pr.H, pr.r, pr.dv}, pr.in.eps);
    ASSERT_TRUE(dec.ok()) << dec.status();
    std::vector<float> o = Decode(*dec, pr);
    DenseReferenceOutputs ref = MaskedAttentionDenseReference(pr.in, SmatMaskFn(*plan, pr.in));
    ExpectClose(o, ref.o, pr,
                absl::StrCat("T=", c.T, " d=", c.d, " gated=", c.gated, " content=", c.content));
    // The horizon is T.
    Tensor ot;
    absl::Status past = dec->Step(TokenAt(pr.in, 0), &ot);
    EXPECT_EQ(past.code(), absl::StatusCode::kOutOfRange) << past;
    EXPECT_NE(past.message().find("stepped-window"), std::string::npos);
  }
}

// The fixed-horizon decoder against the chunked SMat op (kernels/smat.h on the
// CPU backend): two fp32 computations of the same outputs in different orders.
TEST(FixedHorizonDecoderTest, MatchesChunkedSmatOp) {
  auto cpu = CreateBackend(Device::Cpu());
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const std::vector<Case> cases = {
      {63, 1, 4, 0, true, false},   {127, 2, 8, 0, false, false}, {127, 2, 8, 0, true, false},
      {203, 3, 8, 0, true, false},  {131, 3, 4, 3, true, true},
  };
  uint64_t seed = 50;
  for (const Case& c : cases) {
    auto plan = MakeSmatPlan(c.T, c.d, c.chunk, c.q);
    ASSERT_TRUE(plan.ok()) << plan.status();
    Problem pr = MakeProblem(2, c.T, 3, 7, 5, c.gated, c.content ? &plan->geo : nullptr, seed++);
    pr.in.eps = 1e-6f;
    SmatForwardOutputs fwd;
    absl::Status s = SmatForward(**cpu, *plan, pr.in, &fwd);
    ASSERT_TRUE(s.ok()) << s;
    auto dec = FixedHorizonDecoder::Create(*plan, {pr.batch, pr.H, pr.r, pr.dv}, pr.in.eps);
    ASSERT_TRUE(dec.ok()) << dec.status();
    std::vector<double> op(fwd.o.data<float>(), fwd.o.data<float>() + fwd.o.numel());
    ExpectClose(Decode(*dec, pr), op, pr,
                absl::StrCat("vs SmatForward T=", c.T, " d=", c.d, " gated=", c.gated));
  }
}

// With d = 1 the SMat mask is causal (Theorem 3.1 (ii)): the decoder is plain
// causal linear attention, here checked against a mask written independently.
TEST(FixedHorizonDecoderTest, DOneIsCausalLinearAttention) {
  auto plan = MakeSmatPlan(45, 1, 4);
  ASSERT_TRUE(plan.ok());
  Problem pr = MakeProblem(1, 45, 2, 4, 5, true, nullptr, 99);
  auto dec = FixedHorizonDecoder::Create(*plan, {pr.batch, pr.H, pr.r, pr.dv}, 0.f);
  ASSERT_TRUE(dec.ok());
  std::vector<float> o = Decode(*dec, pr);
  DenseReferenceOutputs ref = MaskedAttentionDenseReference(
      pr.in, [](int64_t, int64_t, int64_t t, int64_t s) { return s <= t; });
  ExpectClose(o, ref.o, pr, "causal");
}

// The cache after the boundary is B type states + one running state; F is gone.
TEST(FixedHorizonDecoderTest, CacheShrinksAtBoundary) {
  auto plan = MakeSmatPlan(300, 3, 8);  // n = 144, q = 7? k^3 >= 144 -> k = 6, q = 7, P = 49
  ASSERT_TRUE(plan.ok()) << plan.status();
  Problem pr = MakeProblem(1, plan->n + 1, 1, 4, 3, false, nullptr, 5);
  auto dec = FixedHorizonDecoder::Create(*plan, {1, 1, 4, 3}, 0.f);
  ASSERT_TRUE(dec.ok());
  const int64_t rp = 4 * 4;
  EXPECT_GE(dec->StateBytes(), (plan->geo.P + 1) * rp * 4);
  Decode(*dec, pr);  // through token n
  EXPECT_EQ(dec->position(), plan->n + 1);
  EXPECT_LT(dec->StateBytes(), (plan->geo.B + 1) * rp * 4 + 64);
}

TEST(SteppedWindowTest, ForwardAndDecoderMatchDenseReference) {
  struct SCase {
    int64_t T_max, T;
    int d;
    int64_t chunk, window, q;
    bool gated, content;
  };
  // T > T_max in most cases (the point of the stepped window); odd T.
  const std::vector<SCase> cases = {
      {64, 151, 1, 4, 16, 0, false, false},  {64, 151, 1, 4, 16, 0, true, false},
      {128, 301, 2, 4, 32, 0, false, false}, {128, 301, 2, 4, 32, 0, true, false},
      {200, 333, 3, 4, 48, 3, false, false}, {200, 333, 3, 4, 48, 3, true, false},
      {128, 257, 2, 8, 24, 0, true, true},   {128, 99, 2, 4, 4, 0, true, false},
  };
  uint64_t seed = 100;
  for (const SCase& c : cases) {
    auto plan = MakeSmatPlan(c.T_max, c.d, c.chunk, c.q);
    ASSERT_TRUE(plan.ok()) << plan.status();
    Problem pr = MakeProblem(2, c.T, 2, 5, 3, c.gated, c.content ? &plan->geo : nullptr, seed++);
    const std::string what = absl::StrCat("T_max=", c.T_max, " T=", c.T, " d=", c.d,
                                          " window=", c.window, " gated=", c.gated,
                                          " content=", c.content);
    DenseReferenceOutputs ref =
        MaskedAttentionDenseReference(pr.in, SteppedWindowMaskFn(*plan, c.window, pr.in));
    Tensor o;
    absl::Status s = SteppedWindowForward(*plan, c.window, pr.in, &o);
    ASSERT_TRUE(s.ok()) << s;
    ExpectClose(std::vector<float>(o.data<float>(), o.data<float>() + o.numel()), ref.o, pr,
                what + " forward");
    auto dec = SteppedWindowDecoder::Create(*plan, c.window, {pr.batch, pr.H, pr.r, pr.dv}, 0.f);
    ASSERT_TRUE(dec.ok()) << dec.status();
    ExpectClose(Decode(*dec, pr), ref.o, pr, what + " decoder");
  }
}

// Definition 1 by hand, 0-based, c_dc = 4: position t = 9 is in block 2, so
// n(9) = 4: keys 4..9 are in the window and keys 0..3 go through C.
TEST(SteppedWindowTest, MaskEntriesByHand) {
  auto plan = MakeSmatPlan(40, 2, 4, 3);  // q = 3, P = 3, B = 3: type h = line x = h
  ASSERT_TRUE(plan.ok());
  for (int64_t s = 4; s <= 9; ++s) EXPECT_TRUE(SteppedWindowMaskEntry(*plan, 4, 9, s, 0, 1));
  EXPECT_FALSE(SteppedWindowMaskEntry(*plan, 4, 9, 10, 0, 0));
  EXPECT_TRUE(SteppedWindowMaskEntry(*plan, 4, 9, 3, 0, 0));
  EXPECT_FALSE(SteppedWindowMaskEntry(*plan, 4, 9, 3, 0, 1));
  // Blocks 0 and 1 see everything before them (n(t) = 0).
  for (int64_t s = 0; s <= 7; ++s) EXPECT_TRUE(SteppedWindowMaskEntry(*plan, 4, 7, s, 0, 1));
  // The mask of a length-t sequence is the leading block of a longer one: the
  // entry depends on (t, s) only, so check a far position against block arithmetic.
  EXPECT_TRUE(SteppedWindowMaskEntry(*plan, 4, 1001, 996, 0, 1));   // n(1001) = 996
  EXPECT_FALSE(SteppedWindowMaskEntry(*plan, 4, 1001, 995, 0, 1));  // through C: x=1 not on x=0
}

// With the window at least T every position is in blocks 0/1 and both stepped
// passes are causal linear attention.
TEST(SteppedWindowTest, WideWindowIsCausal) {
  auto plan = MakeSmatPlan(64, 2, 4);
  ASSERT_TRUE(plan.ok());
  Problem pr = MakeProblem(1, 63, 3, 6, 2, true, nullptr, 7);
  DenseReferenceOutputs ref = MaskedAttentionDenseReference(
      pr.in, [](int64_t, int64_t, int64_t t, int64_t s) { return s <= t; });
  Tensor o;
  ASSERT_TRUE(SteppedWindowForward(*plan, 64, pr.in, &o).ok());
  ExpectClose(std::vector<float>(o.data<float>(), o.data<float>() + o.numel()), ref.o, pr, "fwd");
  auto dec = SteppedWindowDecoder::Create(*plan, 64, {1, 3, 6, 2}, 0.f);
  ASSERT_TRUE(dec.ok());
  ExpectClose(Decode(*dec, pr), ref.o, pr, "decoder");
}

TEST(DecodeErrorsTest, BadInputsAreInvalidArgument) {
  auto plan = MakeSmatPlan(101, 2, 4);
  ASSERT_TRUE(plan.ok());
  auto dec = FixedHorizonDecoder::Create(*plan, {2, 3, 5, 3}, 0.f);
  ASSERT_TRUE(dec.ok());
  Problem pr = MakeProblem(2, 3, 3, 5, 3, true, nullptr, 11);
  DecodeToken tok = TokenAt(pr.in, 0);
  Tensor o;
  DecodeToken wrong = tok;
  wrong.phi = *Tensor::Empty({2, 3, 4}, DType::kF32);
  absl::Status s = dec->Step(wrong, &o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("phi"), std::string::npos) << s;
  wrong = tok;
  wrong.logg = *Tensor::Zeros({2, 3}, DType::kF32);  // not tok's buffer
  wrong.logg.data<float>()[1] = 0.5f;
  s = dec->Step(wrong, &o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("<= 0"), std::string::npos) << s;
  wrong = tok;
  wrong.prof = *Tensor::Zeros({2, 3}, DType::kI32);
  wrong.prof.data<int32_t>()[4] = static_cast<int32_t>(plan->geo.P);
  s = dec->Step(wrong, &o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("prof[4]"), std::string::npos) << s;
  EXPECT_EQ(dec->position(), 0);  // failed steps consume nothing
  EXPECT_TRUE(dec->Step(tok, &o).ok());
  EXPECT_EQ(dec->position(), 1);

  auto bad_window = SteppedWindowDecoder::Create(*plan, 6, {1, 1, 2, 2}, 0.f);
  ASSERT_FALSE(bad_window.ok());
  EXPECT_NE(bad_window.status().message().find("multiple of the chunk"), std::string::npos);
  EXPECT_FALSE(FixedHorizonDecoder::Create(*plan, {0, 1, 2, 2}, 0.f).ok());
}

// Backend::CreateDecoder on the CPU backend returns the host decoders behind
// the Decoder interface: the same outputs, bit for bit, as the classes used
// directly, for both kinds; a bad window is refused the same way.
TEST(DecoderFactoryTest, CpuBackendGivesTheHostDecoders) {
  std::unique_ptr<Backend> cpu = CreateBackend(Device::Cpu()).value();
  auto plan = MakeSmatPlan(163, 3, 8);
  ASSERT_TRUE(plan.ok());
  const SmatGeometry& g = plan->geo;
  Problem pr = MakeProblem(2, 163, 3, 5, 4, true, &g, 21);
  const DecodeDims dims{2, 3, 5, 4};
  for (int64_t window : {int64_t{0}, int64_t{40}}) {
    SCOPED_TRACE(absl::StrCat("window ", window));
    const DecoderSpec spec{.plan = *plan, .window = window, .dims = dims, .eps = 1e-6f};
    absl::StatusOr<std::unique_ptr<Decoder>> dec = cpu->CreateDecoder(spec);
    ASSERT_TRUE(dec.ok()) << dec.status();
    const std::vector<float> via_backend = Decode(**dec, pr);
    EXPECT_EQ((*dec)->position(), pr.T);
    EXPECT_GT((*dec)->StateBytes(), 0);
    std::vector<float> direct;
    if (window == 0) {
      auto fixed = FixedHorizonDecoder::Create(*plan, dims, 1e-6f);
      ASSERT_TRUE(fixed.ok());
      direct = Decode(*fixed, pr);
    } else {
      auto stepped = SteppedWindowDecoder::Create(*plan, window, dims, 1e-6f);
      ASSERT_TRUE(stepped.ok());
      direct = Decode(*stepped, pr);
    }
    ASSERT_EQ(via_backend.size(), direct.size());
    EXPECT_EQ(std::memcmp(via_backend.data(), direct.data(), direct.size() * sizeof(float)), 0);
    EXPECT_FALSE(std::isnan(via_backend[0]));
  }
  const DecoderSpec bad{.plan = *plan, .window = 6, .dims = dims};
  absl::StatusOr<std::unique_ptr<Decoder>> refused = cpu->CreateDecoder(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("multiple of the chunk"), std::string::npos);
}

}  // namespace
}  // namespace smat
