// The CUDA SMat phases (kernels/cuda/smat_cuda.h) against the CPU phases
// (kernels/cpu/smat_cpu.h), phase by phase on identical inputs, and the whole
// op (kernels/smat.h) against the CPU op and the double reference: outputs and
// every gradient under random upstream gradients, at odd sizes (T = 1, 63, 127,
// 700, 1000, 1031, 2000, 4700; r = 60 or small; chunks 16..128; d = 1..3), gated and not,
// positional and content maps, whole spans and spans starting inside the
// sequence, fp32 and bf16 inputs. SMAT_CUDA_CHUNK_TILES picks the chunk-tile
// kernels checked where the fast sizes fit (c <= 128, r, dv <= 64: every case
// below): unset, tensor cores for the forward tile (smat_chunk_mma.cu) and
// B7 (the fused kernel of smat_chunk_bwd_mma.cu) of bf16 inputs and FFMA tiles
// otherwise; "mma", tensor cores for all four (B7 of fp32 inputs as the three
// tiles of smat_chunk_mma.cu); "ffma",
// the FFMA tiles of smat_chunk_fast.cu; "general", the general kernels
// (smat_chunk.cu). Run all four when any changes. Device outputs are
// NaN-poisoned before each
// phase; accumulated (+=) outputs start from the same random values on both
// sides; the same inputs twice give the same bits.
//
// Tolerances. fp32: 1e-5 of the largest reference magnitude (the CPU phases
// are fp32 too; the two differ only in summation order and expf vs std::exp,
// a few ulp per term, well under 1e-6 for these sums: see smat_cpu_test.cc).
// bf16: the device reads bf16 inputs and widens them exactly to fp32, and the
// CPU runs on the same bf16-rounded values in fp32, so the same 1e-5 holds for
// every fp32 result of a phase; only o itself is rounded to bf16 (relative
// half-ulp 2^-9), checked at 2^-8. The tensor-core tiles keep the 1e-5: bf16
// inputs enter the bf16 MMAs exactly, and every fp32 operand (fp32 inputs,
// gbar, S_in, D_bar, the score tile) is split into three bf16 parts whose
// products down to 2^-16 relative are summed in fp32 (gpu_smat_parts2_test
// runs the fused bf16 tiles with two parts, SMAT_CUDA_BF16_PARTS=2: measured
// up to 5.8e-6 on an H200, 2026-12-01). The whole op's gradients with bf16 inputs
// are computed from that bf16 o (kBf16OpGradTol below says how much that costs).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/smat_reference.h"
#include "kernels/smat.h"
#include "kernels/smat_kernels.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/kernels/smat_test_util.h"

namespace smat {
namespace {

using gpu_test::GpuTest;
using gpu_test::ToDevice;
using gpu_test::ToHost;
using testing_util::MaxAbs;
using testing_util::MaxRelError;
using testing_util::ProblemSpec;
using testing_util::RandomProblem;
using testing_util::RandomVector;

constexpr double kF32Tol = 1e-5;
constexpr double kBf16OutTol = 1.0 / 256;
// The whole op's gradients with bf16 inputs: the composer stores o in bf16 and
// backward reads it back, so gbar[dv] = -(d_o . o) / den carries o's rounding
// (relative 2^-9) into d_phi, d_psi and d_logg, amplified where gbar . vbar
// cancels (for the diagonal term it is d_o . (v - o) / den). Measured on an
// H200 (2026-11-30): at most 8.8e-3 (d_logg, T = 1031, d = 2); d_v, which only
// sees gbar[0:dv] = d_o / den, stays at 7e-7. The phase test, which starts
// backward from the CPU's fp32 o, holds every phase to 1e-5 for bf16 too.
constexpr double kBf16OpGradTol = 1.0 / 64;
// Scale floor of the op-level comparison: a gradient whose entries are all far
// below the O(1) inputs is rounding noise around an exact zero (T = 1: o = v
// whatever phi and psi are, so d_phi = d_psi = 0), compared in absolute terms.
constexpr double kGradScaleFloor = 0.1;

struct Case {
  ProblemSpec spec;
  bool bf16 = false;
  int64_t t0 = 0;  // span start (a multiple of chunk); the span ends at T
};

std::string CaseName(const Case& c) {
  return absl::StrCat(c.spec.Name(), c.bf16 ? "_bf16" : "_fp32", "_t0_", c.t0);
}

std::vector<Case> Cases() {
  std::vector<Case> cs;
  auto add = [&](int64_t batch, int64_t T, int64_t H, int64_t r, int64_t dv, int d, int64_t c,
                 bool gated, bool content, double eps, bool bf16, int64_t t0, uint64_t seed) {
    Case k;
    k.spec.batch = batch;
    k.spec.T = T;
    k.spec.H = H;
    k.spec.r = r;
    k.spec.dv = dv;
    k.spec.d = d;
    k.spec.chunk = c;
    k.spec.gated = gated;
    k.spec.content = content;
    k.spec.eps = eps;
    k.spec.seed = seed;
    k.bf16 = bf16;
    k.t0 = t0;
    cs.push_back(k);
  };
  add(1, 1, 2, 5, 3, 1, 16, false, false, 0.0, false, 0, 1);
  add(1, 63, 2, 60, 7, 2, 16, true, false, 0.0, false, 0, 2);
  add(1, 127, 2, 8, 5, 2, 32, true, true, 1e-3, false, 0, 3);
  add(1, 1000, 2, 60, 17, 3, 64, true, false, 0.0, false, 0, 4);
  add(1, 1031, 2, 64, 64, 2, 128, true, false, 0.0, true, 0, 5);
  add(1, 1031, 3, 60, 3, 1, 16, true, false, 1e-3, true, 0, 6);
  add(2, 1000, 3, 16, 9, 2, 64, true, true, 0.0, false, 64, 7);
  add(1, 1031, 2, 12, 6, 2, 32, false, false, 0.0, false, 320, 8);
  add(1, 1000, 2, 20, 8, 3, 64, false, true, 0.0, true, 0, 9);
  // The fast chunk tiles (smat_chunk_fast.cu: c <= 128, r, dv <= 64) at the
  // benchmark's r = dv = 64 and c = 128 with a partial last chunk: fp32 over
  // several heads and batches from a span inside the sequence, and bf16 with
  // widths that fill only part of a 16-byte staging slot (24 = 3 x 8, 16).
  add(2, 1031, 3, 64, 64, 2, 128, false, false, 0.0, false, 128, 10);
  add(1, 700, 2, 24, 16, 1, 128, true, false, 0.0, true, 0, 11);
  // The hardest case for split tensor-core products: fp32 and gated (every
  // operand of every chunk product split, the score tile scaled by the gates).
  add(1, 1031, 2, 64, 64, 2, 128, true, false, 0.0, false, 0, 12);
  // The fused tensor-core B7 of bf16 inputs (smat_chunk_bwd_mma.cu): ungated
  // over several heads and batches from a span inside the sequence; widths
  // that are not multiples of 8 (rows staged one element at a time) with a
  // single 32-column half of v_bar; and c = 64 with dv between 32 and 64, so
  // that half the warps hold only the second v_bar half of an earlier block.
  add(2, 1031, 3, 64, 64, 2, 128, false, false, 0.0, true, 128, 13);
  add(1, 1000, 2, 33, 17, 2, 128, true, false, 0.0, true, 256, 14);
  add(1, 700, 2, 40, 47, 1, 64, true, false, 0.0, true, 64, 15);
  // The bf16 outer sums of ungated inputs (smat_outer_bf16.cu): content maps
  // with vbar's ones inside the staged width (dv = 40) and r < 64; a dv that
  // is not a multiple of 8 (vbar on the general kernel, gbar on the bf16 one)
  // at d = 3 from a span inside the sequence; d = 1, whose one profile is
  // pooled in several segments.
  add(1, 1031, 2, 24, 40, 2, 64, false, true, 0.0, true, 0, 16);
  add(2, 700, 2, 56, 13, 3, 32, false, false, 1e-3, true, 32, 17);
  add(1, 1031, 2, 32, 24, 1, 16, false, false, 0.0, true, 0, 18);
  // The gate gradient's suffix sums over several 2048-token segments (a
  // span of 4636 tokens: three segments, the last one partial).
  add(1, 4700, 2, 8, 5, 2, 64, true, false, 0.0, false, 64, 19);
  // TypeReads of bf16 inputs with rows of odd width p through shared memory
  // (smat_reads_bf16.cu, StoreRowsStaged: where a block's groups hold a whole
  // tile of tokens on average, as d = 1's single type does) at the
  // benchmark's widths, gated, from a span inside the sequence.
  add(1, 2000, 2, 64, 64, 1, 128, true, false, 0.0, true, 128, 20);
  // ChunkStatesAndOutputs' walk (ungated bf16): many chunks, so that each
  // part is walked in several segments with a partial last one and a partial
  // last chunk; and r, dv off the constant widths (dv = 33 staged one element
  // at a time) with incoming states from a span inside the sequence.
  add(1, 4700, 2, 64, 64, 2, 32, false, false, 0.0, true, 0, 21);
  add(2, 2000, 2, 48, 33, 1, 128, false, false, 1e-3, true, 384, 22);
  return cs;
}

// Host tensors from doubles: fp32, or bf16 (then `rounded` receives the
// bf16 values as fp32 for the CPU side).
Tensor HostF32(const std::vector<double>& x, const Shape& shape) {
  return testing_util::ToF32(x, shape);
}
Tensor HostBf16(const std::vector<double>& x, const Shape& shape, Tensor* rounded) {
  Tensor t = Tensor::Empty(shape, DType::kBF16).value();
  *rounded = Tensor::Empty(shape, DType::kF32).value();
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t b = FloatToBf16(static_cast<float>(x[i]));
    t.data<uint16_t>()[i] = b;
    rounded->data<float>()[i] = Bf16ToFloat(b);
  }
  return t;
}

// Tokens [t0, T) of a [batch, T, H, width] vector.
template <typename V>
std::vector<V> SliceTokens(const std::vector<V>& x, int64_t batch, int64_t T, int64_t H,
                           int64_t width, int64_t t0) {
  std::vector<V> out;
  for (int64_t b = 0; b < batch; ++b) {
    const auto first = x.begin() + ((b * T + t0) * H) * width;
    out.insert(out.end(), first, first + (T - t0) * H * width);
  }
  return out;
}

std::vector<double> Values(const Tensor& host) {
  std::vector<double> out(host.numel());
  if (host.dtype() == DType::kF32) {
    for (int64_t i = 0; i < host.numel(); ++i) out[i] = host.data<float>()[i];
  } else {
    for (int64_t i = 0; i < host.numel(); ++i) out[i] = Bf16ToFloat(host.data<uint16_t>()[i]);
  }
  return out;
}

// Runs each phase on the CPU and the GPU with identical inputs and compares.
// Tensors live in pairs (cpu, gpu) under a name; after a comparison the GPU
// copy is replaced by the CPU result so each phase is checked in isolation.
class PhaseBench {
 public:
  PhaseBench(Backend& cpu, Backend& gpu) : cpu_(cpu), gpu_(gpu) {}

  // An input: `host` on the CPU side, `device_host` (same values, maybe bf16)
  // copied to the GPU.
  void Put(const std::string& name, const Tensor& host, const Tensor& device_host) {
    cpu_t_[name] = host;
    gpu_t_[name] = ToDevice(gpu_, device_host).value();
  }
  void Put(const std::string& name, const Tensor& host) { Put(name, host, host); }
  // An output written in full: NaN-poisoned on both sides.
  void Out(const std::string& name, const Shape& shape) {
    Tensor c = Tensor::Empty(shape, DType::kF32).value();
    std::vector<float> nan(c.numel(), std::nanf(""));
    std::memcpy(c.raw(), nan.data(), c.nbytes());
    cpu_t_[name] = c;
    Tensor g = Tensor::Empty(shape, DType::kF32, gpu_.allocator()).value();
    SMAT_CHECK(gpu_.Fill(g, std::nan("")).ok());
    gpu_t_[name] = g;
  }
  // An accumulated (+=) output: the same random start on both sides.
  void Acc(const std::string& name, const Shape& shape, uint64_t seed) {
    const Tensor h = HostF32(RandomVector(NumElements(shape), seed), shape);
    Put(name, h);
    cpu_t_[name] = HostF32(RandomVector(NumElements(shape), seed), shape);  // own copy
  }
  Tensor& C(const std::string& name) { return cpu_t_.at(name); }
  Tensor& G(const std::string& name) { return gpu_t_.at(name); }
  Tensor CU(const std::string& name) { return cpu_t_.count(name) ? cpu_t_[name] : Tensor(); }
  Tensor GU(const std::string& name) { return gpu_t_.count(name) ? gpu_t_[name] : Tensor(); }

  // Compares GPU against CPU for `name`; returns the relative error.
  double Compare(const std::string& what, const std::string& name, double tol,
                 bool expect_nonzero) {
    const Tensor host = ToHost(gpu_, gpu_t_.at(name)).value();
    const std::vector<double> g = Values(host);
    const std::vector<double> c = Values(cpu_t_.at(name));
    const double err = MaxRelError(g, c);
    std::printf("  %-28s %-16s rel err %.3g (max |ref| %.3g)\n", what.c_str(), name.c_str(), err,
                MaxAbs(c));
    EXPECT_LE(err, tol) << what << ": " << name;
    if (expect_nonzero) {
      EXPECT_GT(MaxAbs(c), 0.0) << what << ": " << name << " is all zeros";
    }
    // Continue from the CPU values (fp32 results only; o keeps the GPU dtype).
    if (host.dtype() == DType::kF32) gpu_t_[name] = ToDevice(gpu_, cpu_t_.at(name)).value();
    return err;
  }

 private:
  Backend& cpu_;
  Backend& gpu_;
  std::map<std::string, Tensor> cpu_t_, gpu_t_;
};

class SmatGpuTest : public GpuTest {};

TEST_F(SmatGpuTest, EveryPhaseMatchesCpu) {
  SMAT_ASSERT_OK_AND_ASSIGN(SmatKernels * ck, cpu_->smat());
  SMAT_ASSERT_OK_AND_ASSIGN(SmatKernels * gk, gpu_->smat());
  int walked_cases = 0;  // cases that ran ChunkStatesAndOutputs' walk
  for (const Case& cs : Cases()) {
    const ProblemSpec& sp = cs.spec;
    SCOPED_TRACE(CaseName(cs));
    std::printf("%s\n", CaseName(cs).c_str());
    SMAT_ASSERT_OK_AND_ASSIGN(SmatPlan plan, MakeSmatPlan(sp.T, sp.d, sp.chunk));
    const SmatSpan span{cs.t0, sp.T};
    const SmatReferenceProblem pr = RandomProblem(plan, sp);
    const int64_t b = sp.batch, L = span.length(), Lc = span.num_chunks(plan), H = sp.H,
                  r = sp.r, dv = sp.dv, p = dv + 1, P = plan.geo.P, Bt = plan.geo.B;
    const bool gated = sp.gated;
    const double tol = kF32Tol;
    PhaseBench pb(*cpu_, *gpu_);
    auto feature = [&](const std::string& name, const std::vector<double>& x, int64_t width) {
      const std::vector<double> s = SliceTokens(x, b, sp.T, H, width, cs.t0);
      if (cs.bf16) {
        Tensor rounded;
        const Tensor t = HostBf16(s, {b, L, H, width}, &rounded);
        pb.Put(name, rounded, t);
      } else {
        pb.Put(name, HostF32(s, {b, L, H, width}));
      }
    };
    feature("phi", pr.phi, r);
    feature("psi", pr.psi, r);
    feature("v", pr.v, dv);
    if (sp.content) {
      pb.Put("prof", testing_util::ToI32(SliceTokens(pr.prof, b, sp.T, H, 1, cs.t0), {b, L, H}));
      pb.Put("type", testing_util::ToI32(SliceTokens(pr.type, b, sp.T, H, 1, cs.t0), {b, L, H}));
    }
    // Non-positive random offsets exercise the span inputs of SPANS (iv) and B4.
    auto nonpositive = [&](const std::string& name, const Shape& shape, uint64_t seed) {
      std::vector<double> x = RandomVector(NumElements(shape), seed);
      for (double& e : x) e = -0.5 * std::abs(e);
      pb.Put(name, HostF32(x, shape));
    };
    if (gated) {
      pb.Put("logg", HostF32(SliceTokens(pr.logg, b, sp.T, H, 1, cs.t0), {b, L, H}));
      nonpositive("recent_offset", {b, H}, 101);
      nonpositive("tail", {b, H}, 102);
    }
    pb.Put("incoming", HostF32(RandomVector(b * 2 * H * r * p, 103), {b, 2, H, r, p}));
    pb.Put("incoming_grad", HostF32(RandomVector(b * 2 * H * r * p, 104), {b, 2, H, r, p}));
    pb.Put("suffix_in", HostF32(RandomVector(b * H, 105), {b, H}));
    pb.Put("d_o", HostF32(RandomVector(b * L * H * dv, 106), {b, L, H, dv}));

    // Runs `call` on both sides (kernels, tensor getter) and checks the status.
    auto both = [&](const char* what, const std::function<absl::Status(
                                          SmatKernels&, const std::function<Tensor&(const char*)>&,
                                          const std::function<Tensor(const char*)>&)>& call) {
      const absl::Status sc = call(
          *ck, [&](const char* n) -> Tensor& { return pb.C(n); },
          [&](const char* n) { return pb.CU(n); });
      ASSERT_TRUE(sc.ok()) << what << " (cpu): " << sc;
      const absl::Status sg = call(
          *gk, [&](const char* n) -> Tensor& { return pb.G(n); },
          [&](const char* n) { return pb.GU(n); });
      ASSERT_TRUE(sg.ok()) << what << " (cuda): " << sg;
      SMAT_ASSERT_OK(gpu_->Synchronize(nullptr));
    };
    using Get = std::function<Tensor&(const char*)>;
    using Opt = std::function<Tensor(const char*)>;
    const bool distant = span.touches_distant(plan), recent = span.touches_recent(plan);

    if (gated) {
      pb.Out("lam", {b, L, H});
      pb.Out("chunk_decay", {b, Lc, H});
      both("ChunkLogDecay", [&](SmatKernels& k, const Get& t, const Opt&) {
        return k.ChunkLogDecay(plan, span, t("logg"), &t("lam"), &t("chunk_decay"), nullptr);
      });
      pb.Compare("ChunkLogDecay", "lam", tol, true);
      pb.Compare("ChunkLogDecay", "chunk_decay", tol, true);
    }
    pb.Out("D", {b, Lc, H, r, p});
    both("ChunkSummaries", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.ChunkSummaries(plan, span, t("psi"), t("v"), o("lam"), o("chunk_decay"), &t("D"),
                              nullptr);
    });
    pb.Compare("ChunkSummaries", "D", tol, true);
    pb.Out("S_in", {b, Lc, H, r, p});
    pb.Out("span_state", {b, 2, H, r, p});
    pb.Out("span_decay", {b, 2, H});
    both("ChunkScan", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.ChunkScan(plan, span, t("D"), o("chunk_decay"), t("incoming"), &t("S_in"),
                         &t("span_state"), &t("span_decay"), nullptr);
    });
    pb.Compare("ChunkScan", "S_in", tol, true);
    pb.Compare("ChunkScan", "span_state", tol, true);
    pb.Compare("ChunkScan", "span_decay", tol, false);
    pb.Out("F", {b, H, P, r, p});
    both("ProfilePooling", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.ProfilePooling(plan, span, t("psi"), t("v"), o("lam"), o("chunk_decay"), o("prof"),
                              &t("F"), nullptr);
    });
    pb.Compare("ProfilePooling", "F", tol, distant);
    if (!distant) {
      // Give the tables something to carry when the span has no distant part.
      pb.Put("F", HostF32(RandomVector(b * H * P * r * p, 107), {b, H, P, r, p}));
    }
    pb.Out("U", {b, H, Bt, r, p});
    both("Tabulate", [&](SmatKernels& k, const Get& t, const Opt&) {
      return k.Tabulate(plan, t("F"), &t("U"), nullptr);
    });
    pb.Compare("Tabulate", "U", tol, true);
    pb.Out("ybar", {b, L, H, p});
    both("ChunkOutputs", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.ChunkOutputs(plan, span, t("phi"), t("psi"), t("v"), o("lam"), t("S_in"),
                            &t("ybar"), nullptr);
    });
    pb.Compare("ChunkOutputs", "ybar", tol, true);
    both("TypeReads", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.TypeReads(plan, span, t("phi"), t("U"), o("lam"), o("chunk_decay"),
                         o("recent_offset"), o("type"), &t("ybar"), SmatWrite::kAdd, nullptr);
    });
    pb.Compare("TypeReads", "ybar", tol, true);
    // The normaliser must stay positive for o to mean anything: take |ybar|.
    {
      Tensor& y = pb.C("ybar");
      for (int64_t i = 0; i < y.numel(); ++i) y.data<float>()[i] = std::abs(y.data<float>()[i]) + 0.1f;
      pb.Put("ybar", y);
    }
    Tensor o_dev_host = Tensor::Empty({b, L, H, dv}, cs.bf16 ? DType::kBF16 : DType::kF32).value();
    pb.Out("o", {b, L, H, dv});
    pb.G("o") = Tensor::Empty({b, L, H, dv}, o_dev_host.dtype(), gpu_->allocator()).value();
    SMAT_ASSERT_OK(gpu_->Fill(pb.G("o"), std::nan("")));
    pb.Out("den", {b, L, H});
    both("Normalize", [&](SmatKernels& k, const Get& t, const Opt&) {
      return k.Normalize(t("ybar"), static_cast<float>(sp.eps), &t("o"), &t("den"), nullptr);
    });
    pb.Compare("Normalize", "o", cs.bf16 ? kBf16OutTol : tol, true);
    pb.Compare("Normalize", "den", tol, true);
    // F6 + F7 + F8 in one (the forward's path): TypeReads writes the recent
    // rows of `reads` (random elsewhere: those must survive, and the fused
    // phase must not read them); then o and den from NaN. Non-negative states
    // and tables keep every normaliser positive, as the features are.
    {
      auto put_abs = [&](const char* from, const char* to) {
        Tensor x = Tensor::Empty(pb.C(from).shape(), DType::kF32).value();
        for (int64_t i = 0; i < x.numel(); ++i) {
          x.data<float>()[i] = std::abs(pb.C(from).data<float>()[i]);
        }
        pb.Put(to, x);
      };
      put_abs("S_in", "S_in_pos");
      put_abs("U", "U_pos");
      pb.Acc("reads", {b, L, H, p}, 112);
      both("TypeReads (=)", [&](SmatKernels& k, const Get& t, const Opt& o) {
        return k.TypeReads(plan, span, t("phi"), t("U_pos"), o("lam"), o("chunk_decay"),
                           o("recent_offset"), o("type"), &t("reads"), SmatWrite::kAssign, nullptr);
      });
      // n = 0: every row is recent and reads nothing, so all are zero.
      pb.Compare("TypeReads (=)", "reads", tol, plan.n > 0);
      pb.Out("o_fused", {b, L, H, dv});
      pb.G("o_fused") = Tensor::Empty({b, L, H, dv}, o_dev_host.dtype(), gpu_->allocator()).value();
      SMAT_ASSERT_OK(gpu_->Fill(pb.G("o_fused"), std::nan("")));
      pb.Out("den_fused", {b, L, H});
      both("NormalizedOutputs", [&](SmatKernels& k, const Get& t, const Opt& o) {
        return k.NormalizedOutputs(plan, span, t("phi"), t("psi"), t("v"), o("lam"), t("S_in_pos"),
                                   t("reads"), static_cast<float>(sp.eps), &t("o_fused"),
                                   &t("den_fused"), nullptr);
      });
      // On the GPU alone, from the GPU's own reads: the same bits as its three
      // phases (ChunkOutputs, TypeReads +=, Normalize).
      auto empty = [&](const Shape& shape, DType dtype) {
        return Tensor::Empty(shape, dtype, gpu_->allocator()).value();
      };
      const DType o_dtype = o_dev_host.dtype();
      Tensor reads_g = empty({b, L, H, p}, DType::kF32), ybar3 = empty({b, L, H, p}, DType::kF32);
      Tensor o_a = empty({b, L, H, dv}, o_dtype), o_b = empty({b, L, H, dv}, o_dtype);
      Tensor den_a = empty({b, L, H}, DType::kF32), den_b = empty({b, L, H}, DType::kF32);
      const float eps = static_cast<float>(sp.eps);
      SMAT_ASSERT_OK(gk->TypeReads(plan, span, pb.G("phi"), pb.G("U_pos"), pb.GU("lam"),
                                   pb.GU("chunk_decay"), pb.GU("recent_offset"), pb.GU("type"),
                                   &reads_g, SmatWrite::kAssign, nullptr));
      SMAT_ASSERT_OK(gk->NormalizedOutputs(plan, span, pb.G("phi"), pb.G("psi"), pb.G("v"),
                                           pb.GU("lam"), pb.G("S_in_pos"), reads_g, eps, &o_a,
                                           &den_a, nullptr));
      SMAT_ASSERT_OK(gk->ChunkOutputs(plan, span, pb.G("phi"), pb.G("psi"), pb.G("v"), pb.GU("lam"),
                                      pb.G("S_in_pos"), &ybar3, nullptr));
      SMAT_ASSERT_OK(gk->TypeReads(plan, span, pb.G("phi"), pb.G("U_pos"), pb.GU("lam"),
                                   pb.GU("chunk_decay"), pb.GU("recent_offset"), pb.GU("type"),
                                   &ybar3, SmatWrite::kAdd, nullptr));
      SMAT_ASSERT_OK(gk->Normalize(ybar3, eps, &o_b, &den_b, nullptr));
      for (const auto& [what, fused, three] :
           {std::tuple{"o", &o_a, &o_b}, std::tuple{"den", &den_a, &den_b}}) {
        const Tensor x = ToHost(*gpu_, *fused).value(), y = ToHost(*gpu_, *three).value();
        EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0)
            << what << ": NormalizedOutputs differs in bits from the three phases";
      }
      pb.Compare("NormalizedOutputs", "o_fused", cs.bf16 ? kBf16OutTol : tol, true);
      pb.Compare("NormalizedOutputs", "den_fused", tol, true);

      // F2 + F3 + NormalizedOutputs in one walk (ChunkStatesAndOutputs): the
      // CPU runs the three phases from non-negative incoming states; the GPU
      // walks where it can (ungated bf16 inputs on the fused tiles, dv >= 32)
      // and must say so, from NaN-poisoned S_in, o and den, twice for the bits.
      put_abs("incoming", "incoming_pos");
      pb.Out("D_w", {b, Lc, H, r, p});
      pb.Out("S_in_w", {b, Lc, H, r, p});
      pb.Out("span_state_w", {b, 2, H, r, p});
      pb.Out("span_decay_w", {b, 2, H});
      pb.Out("o_w", {b, L, H, dv});
      pb.G("o_w") = Tensor::Empty({b, L, H, dv}, o_dev_host.dtype(), gpu_->allocator()).value();
      SMAT_ASSERT_OK(gpu_->Fill(pb.G("o_w"), std::nan("")));
      pb.Out("den_w", {b, L, H});
      SMAT_ASSERT_OK(ck->ChunkSummaries(plan, span, pb.C("psi"), pb.C("v"), pb.CU("lam"),
                                        pb.CU("chunk_decay"), &pb.C("D_w"), nullptr));
      SMAT_ASSERT_OK(ck->ChunkScan(plan, span, pb.C("D_w"), pb.CU("chunk_decay"),
                                   pb.C("incoming_pos"), &pb.C("S_in_w"), &pb.C("span_state_w"),
                                   &pb.C("span_decay_w"), nullptr));
      SMAT_ASSERT_OK(ck->NormalizedOutputs(plan, span, pb.C("phi"), pb.C("psi"), pb.C("v"),
                                           pb.CU("lam"), pb.C("S_in_w"), pb.C("reads"), eps,
                                           &pb.C("o_w"), &pb.C("den_w"), nullptr));
      auto walk = [&](Tensor* S, Tensor* o, Tensor* den) {
        return gk->ChunkStatesAndOutputs(plan, span, pb.G("phi"), pb.G("psi"), pb.G("v"),
                                         pb.GU("lam"), pb.GU("chunk_decay"), pb.G("incoming_pos"),
                                         pb.G("reads"), eps, S, o, den, nullptr);
      };
      SMAT_ASSERT_OK_AND_ASSIGN(const bool walked,
                                walk(&pb.G("S_in_w"), &pb.G("o_w"), &pb.G("den_w")));
      const char* tiles = std::getenv("SMAT_CUDA_CHUNK_TILES");
      const bool default_tiles =
          tiles == nullptr || *tiles == '\0' || std::strcmp(tiles, "mma") == 0;
      const bool walks = cs.bf16 && !gated && r <= 64 && dv >= 32 && dv <= 64 && sp.chunk <= 128;
      if (default_tiles) {
        EXPECT_EQ(walked, walks) << "ChunkStatesAndOutputs";
      }
      if (walked) {
        ++walked_cases;
        Tensor S2 = empty({b, Lc, H, r, p}, DType::kF32), den2 = empty({b, L, H}, DType::kF32);
        Tensor o2 = empty({b, L, H, dv}, o_dtype);
        SMAT_ASSERT_OK_AND_ASSIGN(const bool again, walk(&S2, &o2, &den2));
        EXPECT_TRUE(again);
        for (const auto& [what, first, second] :
             {std::tuple{"S_in", &pb.G("S_in_w"), &S2}, std::tuple{"o", &pb.G("o_w"), &o2},
              std::tuple{"den", &pb.G("den_w"), &den2}}) {
          const Tensor x = ToHost(*gpu_, *first).value(), y = ToHost(*gpu_, *second).value();
          EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0)
              << what << ": two ChunkStatesAndOutputs calls differ";
        }
        pb.Compare("ChunkStatesAndOutputs", "S_in_w", tol, true);
        pb.Compare("ChunkStatesAndOutputs", "o_w", cs.bf16 ? kBf16OutTol : tol, true);
        pb.Compare("ChunkStatesAndOutputs", "den_w", tol, true);
      }
    }
    // Backward starts from the CPU's fp32 o on both sides.
    pb.Put("o", pb.C("o"));

    pb.Out("gbar", {b, L, H, p});
    if (gated) pb.Out("dlam_row", {b, L, H});
    both("NormalizeBackward", [&](SmatKernels& k, const Get& t, const Opt&) {
      return k.NormalizeBackward(t("d_o"), t("o"), t("den"), static_cast<float>(sp.eps),
                                 &t("gbar"), gated ? &t("dlam_row") : nullptr, nullptr);
    });
    pb.Compare("NormalizeBackward", "gbar", tol, true);
    if (gated) {
      pb.Compare("NormalizeBackward", "dlam_row", tol, sp.eps > 0);
    }
    // B1 + B5 in one pass: against the CPU, and on the GPU alone the same
    // bits as its two phases (S_in_bar: ungated; gated the fused kernel
    // weights gbar where ChunkStateGradients weights phi). The bf16 cases
    // with r % 8 == 0 and even dv <= 64 run the fused kernel of
    // smat_state_grads.cu, gated and ungated.
    {
      pb.Out("gbar_f", {b, L, H, p});
      if (gated) pb.Out("dlam_row_f", {b, L, H});
      pb.Out("S_in_bar_f", {b, Lc, H, r, p});
      both("NormalizeBackwardStates", [&](SmatKernels& k, const Get& t, const Opt& o) {
        return k.NormalizeBackwardStates(
            plan, span, t("d_o"), t("o"), t("den"), static_cast<float>(sp.eps), t("phi"), o("lam"),
            &t("gbar_f"), gated ? &t("dlam_row_f") : nullptr, &t("S_in_bar_f"), nullptr);
      });
      auto empty = [&](const Shape& shape) {
        return Tensor::Empty(shape, DType::kF32, gpu_->allocator()).value();
      };
      Tensor gbar_a = empty({b, L, H, p}), gbar_b = empty({b, L, H, p});
      Tensor dlam_a = empty({b, L, H}), dlam_b = empty({b, L, H});
      Tensor sib_a = empty({b, Lc, H, r, p}), sib_b = empty({b, Lc, H, r, p});
      const float eps = static_cast<float>(sp.eps);
      SMAT_ASSERT_OK(gk->NormalizeBackwardStates(plan, span, pb.G("d_o"), pb.G("o"), pb.G("den"),
                                                 eps, pb.G("phi"), pb.GU("lam"), &gbar_a,
                                                 gated ? &dlam_a : nullptr, &sib_a, nullptr));
      SMAT_ASSERT_OK(gk->NormalizeBackward(pb.G("d_o"), pb.G("o"), pb.G("den"), eps, &gbar_b,
                                           gated ? &dlam_b : nullptr, nullptr));
      SMAT_ASSERT_OK(
          gk->ChunkStateGradients(plan, span, pb.G("phi"), gbar_b, pb.GU("lam"), &sib_b, nullptr));
      std::vector<std::tuple<const char*, Tensor*, Tensor*>> pairs = {{"gbar", &gbar_a, &gbar_b}};
      if (gated) {
        pairs.emplace_back("dlam_row", &dlam_a, &dlam_b);
      } else {
        pairs.emplace_back("S_in_bar", &sib_a, &sib_b);
      }
      for (const auto& [what, fused, two] : pairs) {
        const Tensor x = ToHost(*gpu_, *fused).value(), y = ToHost(*gpu_, *two).value();
        EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0)
            << what << ": NormalizeBackwardStates differs in bits from the two phases";
      }
      pb.Compare("NormalizeBackwardStates", "gbar_f", tol, true);
      if (gated) pb.Compare("NormalizeBackwardStates", "dlam_row_f", tol, sp.eps > 0);
      pb.Compare("NormalizeBackwardStates", "S_in_bar_f", tol, true);
    }
    pb.Acc("phi_bar", {b, L, H, r}, 108);
    pb.Acc("psi_bar", {b, L, H, r}, 109);
    pb.Acc("v_bar", {b, L, H, dv}, 110);
    pb.Out("U_bar", {b, H, Bt, r, p});
    both("TypeReadsBackward", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.TypeReadsBackward(plan, span, t("phi"), t("U"), t("gbar"), o("lam"),
                                 o("chunk_decay"), o("recent_offset"), o("type"), &t("phi_bar"),
                                 &t("U_bar"), nullptr);
    });
    // With n = 0 there is no distant block and no recent token reads U.
    const bool reads = recent && plan.n > 0;
    pb.Compare("TypeReadsBackward", "U_bar", tol, reads);
    pb.Compare("TypeReadsBackward", "phi_bar", tol, true);
    if (!reads) pb.Put("U_bar", HostF32(RandomVector(b * H * Bt * r * p, 111), {b, H, Bt, r, p}));
    pb.Out("F_bar", {b, H, P, r, p});
    both("TabulateBackward", [&](SmatKernels& k, const Get& t, const Opt&) {
      return k.TabulateBackward(plan, t("U_bar"), &t("F_bar"), nullptr);
    });
    pb.Compare("TabulateBackward", "F_bar", tol, true);
    both("ProfilePoolingBackward", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.ProfilePoolingBackward(plan, span, t("psi"), t("v"), o("lam"), o("chunk_decay"),
                                      o("tail"), o("prof"), t("F_bar"), &t("psi_bar"),
                                      &t("v_bar"), nullptr);
    });
    pb.Compare("ProfilePoolingBackward", "psi_bar", tol, true);
    pb.Compare("ProfilePoolingBackward", "v_bar", tol, true);
    pb.Out("S_in_bar", {b, Lc, H, r, p});
    both("ChunkStateGradients", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.ChunkStateGradients(plan, span, t("phi"), t("gbar"), o("lam"), &t("S_in_bar"),
                                   nullptr);
    });
    pb.Compare("ChunkStateGradients", "S_in_bar", tol, true);
    pb.Out("D_bar", {b, Lc, H, r, p});
    pb.Out("state_grad", {b, 2, H, r, p});
    both("ChunkScanBackward", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.ChunkScanBackward(plan, span, t("S_in_bar"), o("chunk_decay"), t("incoming_grad"),
                                 &t("D_bar"), &t("state_grad"), nullptr);
    });
    pb.Compare("ChunkScanBackward", "D_bar", tol, true);
    pb.Compare("ChunkScanBackward", "state_grad", tol, true);
    both("ChunkOutputsBackward", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.ChunkOutputsBackward(
          plan, span, t("phi"), t("psi"), t("v"), o("lam"), o("chunk_decay"), t("S_in"), t("gbar"),
          t("D_bar"), &t("phi_bar"), &t("psi_bar"), &t("v_bar"), SmatWrite::kAdd, nullptr);
    });
    pb.Compare("ChunkOutputsBackward", "phi_bar", tol, true);
    pb.Compare("ChunkOutputsBackward", "psi_bar", tol, true);
    pb.Compare("ChunkOutputsBackward", "v_bar", tol, true);
    // Written (=) rather than added to: from NaN-poisoned outputs, so every
    // element the GPU leaves unwritten fails the comparison.
    pb.Out("phi_bar_set", {b, L, H, r});
    pb.Out("psi_bar_set", {b, L, H, r});
    pb.Out("v_bar_set", {b, L, H, dv});
    both("ChunkOutputsBackward (=)", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.ChunkOutputsBackward(plan, span, t("phi"), t("psi"), t("v"), o("lam"),
                                    o("chunk_decay"), t("S_in"), t("gbar"), t("D_bar"),
                                    &t("phi_bar_set"), &t("psi_bar_set"), &t("v_bar_set"),
                                    SmatWrite::kAssign, nullptr);
    });
    pb.Compare("ChunkOutputsBackward (=)", "phi_bar_set", tol, true);
    pb.Compare("ChunkOutputsBackward (=)", "psi_bar_set", tol, true);
    pb.Compare("ChunkOutputsBackward (=)", "v_bar_set", tol, true);
    if (gated) {
      pb.Out("logg_bar", {b, L, H});
      pb.Out("span_sum", {b, H});
      both("LogDecayBackward", [&](SmatKernels& k, const Get& t, const Opt&) {
        return k.LogDecayBackward(plan, span, t("psi"), t("psi_bar"), t("dlam_row"),
                                  t("suffix_in"), &t("logg_bar"), &t("span_sum"), nullptr);
      });
      pb.Compare("LogDecayBackward", "logg_bar", tol, true);
      pb.Compare("LogDecayBackward", "span_sum", tol, true);
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
  const char* tiles = std::getenv("SMAT_CUDA_CHUNK_TILES");
  if (tiles == nullptr || *tiles == '\0') {
    EXPECT_GE(walked_cases, 4) << "the walk of ChunkStatesAndOutputs ran on too few cases";
  }
}

// The composed op (kernels/smat.h) on the GPU against the CPU op and the
// double reference; then the same inputs again must give the same bits.
struct OpResult {
  std::vector<Tensor> host;  // o, d_phi, d_psi, d_v, (d_logg)
};

absl::StatusOr<OpResult> RunOp(Backend& be, const SmatPlan& plan, const SmatReferenceProblem& pr,
                               bool bf16, const std::vector<double>& d_o) {
  const bool gpu = !be.device().is_cpu();
  auto load = [&](const Tensor& host) -> absl::StatusOr<Tensor> {
    return gpu ? ToDevice(be, host) : absl::StatusOr<Tensor>(host);
  };
  auto feat = [&](const std::vector<double>& x, int64_t w) -> absl::StatusOr<Tensor> {
    Tensor rounded;
    const Shape shape = {pr.batch, pr.T, pr.H, w};
    if (!bf16) return load(HostF32(x, shape));
    const Tensor t = HostBf16(x, shape, &rounded);
    return load(gpu ? t : rounded);
  };
  SmatInputs in;
  SMAT_ASSIGN_OR_RETURN(in.phi, feat(pr.phi, pr.r));
  SMAT_ASSIGN_OR_RETURN(in.psi, feat(pr.psi, pr.r));
  SMAT_ASSIGN_OR_RETURN(in.v, feat(pr.v, pr.dv));
  const Shape tok = {pr.batch, pr.T, pr.H};
  if (pr.gated()) {
    SMAT_ASSIGN_OR_RETURN(in.logg, load(HostF32(pr.logg, tok)));
  }
  if (!pr.prof.empty()) {
    SMAT_ASSIGN_OR_RETURN(in.prof, load(testing_util::ToI32(pr.prof, tok)));
  }
  if (!pr.type.empty()) {
    SMAT_ASSIGN_OR_RETURN(in.type, load(testing_util::ToI32(pr.type, tok)));
  }
  in.eps = static_cast<float>(pr.eps);
  SMAT_ASSIGN_OR_RETURN(Tensor dout, load(HostF32(d_o, {pr.batch, pr.T, pr.H, pr.dv})));
  SmatForwardOutputs fwd;
  SMAT_RETURN_IF_ERROR(SmatForward(be, plan, in, &fwd));
  SmatGradients g;
  SMAT_RETURN_IF_ERROR(SmatBackward(be, plan, in, fwd, dout, &g));
  SMAT_RETURN_IF_ERROR(be.Synchronize(nullptr));
  OpResult res;
  for (const Tensor* t : {&fwd.o, &g.phi, &g.psi, &g.v, &g.logg}) {
    if (!t->defined()) continue;
    if (gpu) {
      SMAT_ASSIGN_OR_RETURN(Tensor h, ToHost(be, *t));
      res.host.push_back(h);
    } else {
      res.host.push_back(*t);
    }
  }
  return res;
}

TEST_F(SmatGpuTest, WholeOpMatchesCpuAndReferenceAndRepeatsBitwise) {
  for (const Case& cs : Cases()) {
    if (cs.t0 != 0) continue;  // the composed op runs the whole span
    const ProblemSpec& sp = cs.spec;
    SCOPED_TRACE(CaseName(cs));
    SMAT_ASSERT_OK_AND_ASSIGN(SmatPlan plan, MakeSmatPlan(sp.T, sp.d, sp.chunk));
    SmatReferenceProblem pr = RandomProblem(plan, sp);
    // The reference sees exactly the values the kernels see.
    for (auto* v : {&pr.phi, &pr.psi, &pr.v}) {
      for (double& x : *v) x = cs.bf16 ? Bf16ToFloat(FloatToBf16(static_cast<float>(x)))
                                       : static_cast<float>(x);
    }
    for (double& x : pr.logg) x = static_cast<float>(x);
    const std::vector<double> d_o = RandomVector(sp.batch * sp.T * sp.H * sp.dv, sp.seed + 99);
    SMAT_ASSERT_OK_AND_ASSIGN(OpResult cpu, RunOp(*cpu_, plan, pr, cs.bf16, d_o));
    SMAT_ASSERT_OK_AND_ASSIGN(OpResult gpu, RunOp(*gpu_, plan, pr, cs.bf16, d_o));
    SMAT_ASSERT_OK_AND_ASSIGN(OpResult again, RunOp(*gpu_, plan, pr, cs.bf16, d_o));
    const SmatReferenceOutputs ref = SmatDenseReference(plan, pr);
    const SmatReferenceGradients rg = SmatDenseReferenceBackward(plan, pr, d_o);
    const std::vector<const std::vector<double>*> refs = {&ref.o, &rg.phi, &rg.psi, &rg.v,
                                                          &rg.logg};
    const char* names[] = {"o", "d_phi", "d_psi", "d_v", "d_logg"};
    ASSERT_EQ(cpu.host.size(), gpu.host.size());
    for (size_t i = 0; i < gpu.host.size(); ++i) {
      const std::vector<double> g = Values(gpu.host[i]), c = Values(cpu.host[i]);
      auto rel = [](const std::vector<double>& x, const std::vector<double>& ref) {
        double err = 0.0;
        for (size_t j = 0; j < x.size(); ++j) {
          if (!std::isfinite(x[j])) return static_cast<double>(INFINITY);
          err = std::max(err, std::abs(x[j] - ref[j]));
        }
        return err / std::max(MaxAbs(ref), kGradScaleFloor);
      };
      const double vs_cpu = rel(g, c), vs_ref = rel(g, *refs[i]), cpu_vs_ref = rel(c, *refs[i]);
      std::printf("%-40s %-7s gpu-cpu %.3g  gpu-ref %.3g  cpu-ref %.3g\n", CaseName(cs).c_str(),
                  names[i], vs_cpu, vs_ref, cpu_vs_ref);
      const double tol = !cs.bf16 ? kF32Tol : (i == 0 ? kBf16OutTol : kBf16OpGradTol);
      EXPECT_LE(vs_cpu, tol) << names[i];
      EXPECT_LE(vs_ref, tol) << names[i];
      EXPECT_GT(MaxAbs(c), 0.0) << names[i];
      ASSERT_EQ(gpu.host[i].nbytes(), again.host[i].nbytes());
      EXPECT_EQ(std::memcmp(gpu.host[i].raw(), again.host[i].raw(), gpu.host[i].nbytes()), 0)
          << names[i] << ": two runs on the same inputs differ";
    }
  }
}

TEST_F(SmatGpuTest, RejectsHostTensorsWithAClearError) {
  SMAT_ASSERT_OK_AND_ASSIGN(SmatKernels * gk, gpu_->smat());
  SMAT_ASSERT_OK_AND_ASSIGN(SmatPlan plan, MakeSmatPlan(64, 1, 16));
  const Tensor logg = Tensor::Zeros({1, 64, 1}, DType::kF32).value();
  Tensor lam = Tensor::Zeros({1, 64, 1}, DType::kF32).value();
  Tensor cd = Tensor::Zeros({1, 4, 1}, DType::kF32).value();
  const absl::Status s = gk->ChunkLogDecay(plan, SmatSpan::Whole(plan), logg, &lam, &cd, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("logg"), std::string::npos) << s;
}

}  // namespace
}  // namespace smat
