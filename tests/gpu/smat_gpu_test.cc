// The CUDA SMat phases (kernels/cuda/smat_cuda.h) against the CPU phases
// (kernels/cpu/smat_cpu.h), phase by phase on identical inputs, at the odd
// sizes of smat_gpu_cases.h (T = 1, 63, 127, 700, 1000, 1031, 2000, 4700; r =
// 60 or small; chunks 16..128; d = 1..3), gated and not, positional and
// content maps, whole spans and spans starting inside the sequence, fp32 and
// bf16 inputs. SMAT_CUDA_CHUNK_TILES picks the chunk-tile kernels checked where
// the fast sizes fit (c <= 128, r, dv <= 64: every case): unset, tensor cores
// for the forward tile (smat_chunk_mma.cu) and B7 (the fused kernel of
// smat_chunk_bwd_mma.cu) of bf16 inputs and FFMA tiles otherwise; "mma",
// tensor cores for all four (B7 of fp32 inputs as the three tiles of
// smat_chunk_mma.cu); "ffma", the FFMA tiles of smat_chunk_fast.cu;
// "general", the general kernels (smat_chunk.cu). Run all four when any
// changes. Device outputs are NaN-poisoned before each phase; accumulated
// (+=) outputs start from the same random values on both sides; the same
// inputs twice give the same bits. Tolerances: smat_gpu_cases.h. The whole
// op: smat_op_gpu_test.cc.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/smat.h"
#include "kernels/smat_kernels.h"
#include "tests/gpu/gpu_test_util.h"
#include "tests/gpu/smat_gpu_cases.h"
#include "tests/kernels/smat_test_util.h"

namespace smat {
namespace {

using gpu_test::GpuTest;
using gpu_test::ToDevice;
using gpu_test::ToHost;
using namespace smat_gpu_cases;  // NOLINT: the cases and helpers these tests share
using testing_util::MaxAbs;
using testing_util::MaxRelError;
using testing_util::RandomProblem;
using testing_util::RandomVector;

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

// Device tensors that must hold the same bits, in pairs under a name; `why`
// says which two runs gave them.
using BitPairs = std::vector<std::tuple<const char*, Tensor*, Tensor*>>;
void ExpectSameBits(Backend& gpu, const BitPairs& pairs, const char* why) {
  for (const auto& [what, first, second] : pairs) {
    const Tensor x = ToHost(gpu, *first).value(), y = ToHost(gpu, *second).value();
    ASSERT_EQ(x.nbytes(), y.nbytes()) << what;
    EXPECT_EQ(std::memcmp(x.raw(), y.raw(), x.nbytes()), 0) << what << ": " << why;
  }
}

class SmatGpuTest : public GpuTest {};

TEST_F(SmatGpuTest, EveryPhaseMatchesCpu) {
  SMAT_ASSERT_OK_AND_ASSIGN(SmatKernels * ck, cpu_->smat());
  SMAT_ASSERT_OK_AND_ASSIGN(SmatKernels * gk, gpu_->smat());
  int walked_cases = 0;          // cases that ran ChunkStatesAndOutputs' walk
  int fused_backward_cases = 0;  // cases that ran ChunkBackward's fused path
  int fused_do_bf16_cases = 0;   // the same from a bf16 d_o
  int factored_reads_cases = 0;  // TypeReadsBackwardFromFactors ran
  for (const Case& cs : Cases()) {
    const ProblemSpec& sp = cs.spec;
    SCOPED_TRACE(CaseName(cs));
    std::printf("%s\n", CaseName(cs).c_str());
    SMAT_ASSERT_OK_AND_ASSIGN(SmatPlan plan, MakeSmatPlan(sp.T, sp.d, sp.chunk));
    const SmatSpan span{cs.t0, sp.T};
    const SmatReferenceProblem pr = RandomProblem(plan, sp);
    const int64_t b = sp.batch, L = span.length(), Lc = span.num_chunks(plan), H = sp.H, r = sp.r,
                  dv = sp.dv, p = dv + 1, P = plan.geo.P, Bt = plan.geo.B;
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
    const std::vector<double> d_o = RandomVector(b * L * H * dv, 106);
    pb.Put("d_o", HostF32(d_o, {b, L, H, dv}));
    if (cs.bf16) {
      // The output gradient as the trainer passes it with bf16 inputs: bf16, as o.
      Tensor rounded;
      const Tensor t = HostBf16(d_o, {b, L, H, dv}, &rounded);
      pb.Put("d_o_bf16", rounded, t);
    }

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
      return k.ChunkOutputs(plan, span, t("phi"), t("psi"), t("v"), o("lam"), t("S_in"), &t("ybar"),
                            nullptr);
    });
    pb.Compare("ChunkOutputs", "ybar", TileTol(cs.bf16, tol), true);
    both("TypeReads", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.TypeReads(plan, span, t("phi"), t("U"), o("lam"), o("chunk_decay"),
                         o("recent_offset"), o("type"), &t("ybar"), SmatWrite::kAdd, nullptr);
    });
    pb.Compare("TypeReads", "ybar", TileTol(cs.bf16, tol), true);
    // The normaliser must stay positive for o to mean anything: take |ybar|.
    {
      Tensor& y = pb.C("ybar");
      for (int64_t i = 0; i < y.numel(); ++i)
        y.data<float>()[i] = std::abs(y.data<float>()[i]) + 0.1f;
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
      pb.Compare("TypeReads (=)", "reads", TileTol(cs.bf16, tol), plan.n > 0);
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
      ExpectSameBits(*gpu_, {{"o", &o_a, &o_b}, {"den", &den_a, &den_b}},
                     "NormalizedOutputs differs in bits from the three phases");
      pb.Compare("NormalizedOutputs", "o_fused", TileTol(cs.bf16, cs.bf16 ? kBf16OutTol : tol),
                 true);
      pb.Compare("NormalizedOutputs", "den_fused", TileTol(cs.bf16, tol), true);

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
      const bool walks = cs.bf16 && !gated && r <= 64 && dv >= 32 && dv <= 64 && sp.chunk <= 128;
      if (TensorCoreChunkTiles()) {
        EXPECT_EQ(walked, walks) << "ChunkStatesAndOutputs";
      }
      if (walked) {
        ++walked_cases;
        Tensor S2 = empty({b, Lc, H, r, p}, DType::kF32), den2 = empty({b, L, H}, DType::kF32);
        Tensor o2 = empty({b, L, H, dv}, o_dtype);
        SMAT_ASSERT_OK_AND_ASSIGN(const bool again, walk(&S2, &o2, &den2));
        EXPECT_TRUE(again);
        ExpectSameBits(*gpu_,
                       {{"S_in", &pb.G("S_in_w"), &S2},
                        {"o", &pb.G("o_w"), &o2},
                        {"den", &pb.G("den_w"), &den2}},
                       "two ChunkStatesAndOutputs calls differ");
        pb.Compare("ChunkStatesAndOutputs", "S_in_w", tol, true);
        pb.Compare("ChunkStatesAndOutputs", "o_w", TileTol(cs.bf16, cs.bf16 ? kBf16OutTol : tol),
                   true);
        pb.Compare("ChunkStatesAndOutputs", "den_w", TileTol(cs.bf16, tol), true);
      }
    }
    // Backward starts from the CPU's fp32 o on both sides.
    pb.Put("o", pb.C("o"));

    pb.Out("gbar", {b, L, H, p});
    if (gated) pb.Out("dlam_row", {b, L, H});
    both("NormalizeBackward", [&](SmatKernels& k, const Get& t, const Opt&) {
      return k.NormalizeBackward(t("d_o"), t("o"), t("den"), static_cast<float>(sp.eps), &t("gbar"),
                                 gated ? &t("dlam_row") : nullptr, nullptr);
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
      BitPairs pairs = {{"gbar", &gbar_a, &gbar_b}};
      if (gated) {
        pairs.emplace_back("dlam_row", &dlam_a, &dlam_b);
      } else {
        pairs.emplace_back("S_in_bar", &sib_a, &sib_b);
      }
      ExpectSameBits(*gpu_, pairs, "NormalizeBackwardStates differs in bits from the two phases");
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
                                 &t("U_bar"), SmatWrite::kAdd, nullptr);
    });
    // With n = 0 there is no distant block and no recent token reads U.
    const bool reads = recent && plan.n > 0;
    pb.Compare("TypeReadsBackward", "U_bar", TileTol(cs.bf16, tol), reads);
    pb.Compare("TypeReadsBackward", "phi_bar", TileTol(cs.bf16, tol), true);
    // Written (=): the recent rows from a random start both sides share, so
    // that a row added to or left unwritten fails; the distant rows keep it.
    pb.Acc("phi_bar_set_lr", {b, L, H, r}, 113);
    pb.Out("U_bar_set_lr", {b, H, Bt, r, p});
    both("TypeReadsBackward (=)", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.TypeReadsBackward(
          plan, span, t("phi"), t("U"), t("gbar"), o("lam"), o("chunk_decay"), o("recent_offset"),
          o("type"), &t("phi_bar_set_lr"), &t("U_bar_set_lr"), SmatWrite::kAssign, nullptr);
    });
    // Nonzero unless every row is recent and reads nothing (n = 0).
    const bool set_nonzero = distant || reads;
    pb.Compare("TypeReadsBackward (=)", "phi_bar_set_lr", TileTol(cs.bf16, tol), set_nonzero);
    // The same sums from gbar's factors (a bf16 d_o, den and gbar's column
    // dv), against the CPU's TypeReadsBackward on the gbar those make.
    if (cs.bf16) {
      pb.Out("gbar_fb", {b, L, H, p});
      SMAT_ASSERT_OK(ck->NormalizeBackward(pb.C("d_o_bf16"), pb.C("o"), pb.C("den"),
                                           static_cast<float>(sp.eps), &pb.C("gbar_fb"), nullptr,
                                           nullptr));
      std::vector<double> gden(b * L * H);
      const float* gb = static_cast<const float*>(pb.C("gbar_fb").raw());
      for (int64_t i = 0; i < b * L * H; ++i) gden[i] = gb[i * p + dv];
      pb.Put("gden", HostF32(gden, {b, L, H}));
      pb.Acc("phi_bar_tf", {b, L, H, r}, 112);
      pb.Out("U_bar_tf", {b, H, Bt, r, p});
      SMAT_ASSERT_OK(
          ck->TypeReadsBackward(plan, span, pb.C("phi"), pb.C("U"), pb.C("gbar_fb"), pb.CU("lam"),
                                pb.CU("chunk_decay"), pb.CU("recent_offset"), pb.CU("type"),
                                &pb.C("phi_bar_tf"), &pb.C("U_bar_tf"), SmatWrite::kAdd, nullptr));
      auto factored = [&](Tensor* phi_bar, Tensor* U_bar, SmatWrite write) {
        return gk->TypeReadsBackwardFromFactors(
            plan, span, pb.G("phi"), pb.G("U"), pb.G("d_o_bf16"), pb.G("den"), pb.G("gden"),
            pb.GU("lam"), pb.GU("chunk_decay"), pb.GU("recent_offset"), pb.GU("type"), phi_bar,
            U_bar, write, nullptr);
      };
      const Tensor phi_bar_start = ToHost(*gpu_, pb.G("phi_bar_tf")).value();
      SMAT_ASSERT_OK_AND_ASSIGN(const bool ran,
                                factored(&pb.G("phi_bar_tf"), &pb.G("U_bar_tf"), SmatWrite::kAdd));
      if (ran) {
        ++factored_reads_cases;
        Tensor pb2 = ToDevice(*gpu_, phi_bar_start).value();
        Tensor ub2 = Tensor::Empty({b, H, Bt, r, p}, DType::kF32, gpu_->allocator()).value();
        SMAT_ASSERT_OK(gpu_->Fill(ub2, std::nan("")));
        SMAT_ASSERT_OK_AND_ASSIGN(const bool again, factored(&pb2, &ub2, SmatWrite::kAdd));
        EXPECT_TRUE(again);
        ExpectSameBits(*gpu_,
                       {{"phi_bar", &pb.G("phi_bar_tf"), &pb2}, {"U_bar", &pb.G("U_bar_tf"), &ub2}},
                       "two TypeReadsBackwardFromFactors calls differ");
        pb.Compare("TypeReadsBackward (factors)", "U_bar_tf", TileTol(cs.bf16, tol), reads);
        pb.Compare("TypeReadsBackward (factors)", "phi_bar_tf", TileTol(cs.bf16, tol), true);
        // Written (=), as TypeReadsBackward (=) above.
        pb.Acc("phi_bar_tf_set", {b, L, H, r}, 114);
        pb.Out("U_bar_tf_set", {b, H, Bt, r, p});
        SMAT_ASSERT_OK(ck->TypeReadsBackward(
            plan, span, pb.C("phi"), pb.C("U"), pb.C("gbar_fb"), pb.CU("lam"), pb.CU("chunk_decay"),
            pb.CU("recent_offset"), pb.CU("type"), &pb.C("phi_bar_tf_set"), &pb.C("U_bar_tf_set"),
            SmatWrite::kAssign, nullptr));
        SMAT_ASSERT_OK_AND_ASSIGN(
            const bool set,
            factored(&pb.G("phi_bar_tf_set"), &pb.G("U_bar_tf_set"), SmatWrite::kAssign));
        EXPECT_TRUE(set);
        pb.Compare("TypeReadsBackward (factors, =)", "phi_bar_tf_set", TileTol(cs.bf16, tol),
                   set_nonzero);
        pb.Compare("TypeReadsBackward (factors, =)", "U_bar_tf_set", TileTol(cs.bf16, tol), reads);
      } else {
        const Tensor x = ToHost(*gpu_, pb.G("U_bar_tf")).value();
        EXPECT_TRUE(std::isnan(static_cast<const float*>(x.raw())[0]))
            << "TypeReadsBackwardFromFactors returned false but wrote U_bar";
      }
    }
    if (!reads) pb.Put("U_bar", HostF32(RandomVector(b * H * Bt * r * p, 111), {b, H, Bt, r, p}));
    pb.Out("F_bar", {b, H, P, r, p});
    both("TabulateBackward", [&](SmatKernels& k, const Get& t, const Opt&) {
      return k.TabulateBackward(plan, t("U_bar"), &t("F_bar"), nullptr);
    });
    pb.Compare("TabulateBackward", "F_bar", tol, true);
    both("ProfilePoolingBackward", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.ProfilePoolingBackward(plan, span, t("psi"), t("v"), o("lam"), o("chunk_decay"),
                                      o("tail"), o("prof"), t("F_bar"), &t("psi_bar"), &t("v_bar"),
                                      SmatWrite::kAdd, nullptr);
    });
    pb.Compare("ProfilePoolingBackward", "psi_bar", TileTol(cs.bf16, tol), true);
    pb.Compare("ProfilePoolingBackward", "v_bar", TileTol(cs.bf16, tol), true);
    // Written (=), as TypeReadsBackward (=) above: the distant rows.
    pb.Acc("psi_bar_set_lr", {b, L, H, r}, 115);
    pb.Acc("v_bar_set_lr", {b, L, H, dv}, 116);
    both("ProfilePoolingBackward (=)", [&](SmatKernels& k, const Get& t, const Opt& o) {
      return k.ProfilePoolingBackward(plan, span, t("psi"), t("v"), o("lam"), o("chunk_decay"),
                                      o("tail"), o("prof"), t("F_bar"), &t("psi_bar_set_lr"),
                                      &t("v_bar_set_lr"), SmatWrite::kAssign, nullptr);
    });
    pb.Compare("ProfilePoolingBackward (=)", "psi_bar_set_lr", TileTol(cs.bf16, tol), true);
    pb.Compare("ProfilePoolingBackward (=)", "v_bar_set_lr", TileTol(cs.bf16, tol), true);
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
    pb.Compare("ChunkOutputsBackward", "phi_bar", TileTol(cs.bf16, tol), true);
    pb.Compare("ChunkOutputsBackward", "psi_bar", TileTol(cs.bf16, tol), true);
    pb.Compare("ChunkOutputsBackward", "v_bar", TileTol(cs.bf16, tol), true);
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
    pb.Compare("ChunkOutputsBackward (=)", "phi_bar_set", TileTol(cs.bf16, tol), true);
    pb.Compare("ChunkOutputsBackward (=)", "psi_bar_set", TileTol(cs.bf16, tol), true);
    pb.Compare("ChunkOutputsBackward (=)", "v_bar_set", TileTol(cs.bf16, tol), true);
    // B1 + B5 + B6 + B7 in one call (ChunkBackward): the CPU runs the four
    // phases (no incoming gradient, the tiles writing); the GPU runs its
    // fused path where it has one (bf16 inputs on the fused kernels), from
    // NaN-poisoned outputs, twice for the bits. With bf16 inputs also from a
    // bf16 d_o, which B7 takes as gbar's factor (SmatGbarFactors).
    std::vector<const char*> output_grads = {"d_o"};
    if (cs.bf16) output_grads.push_back("d_o_bf16");
    for (const char* grad : output_grads) {
      SCOPED_TRACE(grad);
      const bool do_bf16 = std::strcmp(grad, "d_o_bf16") == 0;
      const std::string what = do_bf16 ? "ChunkBackward (bf16 d_o)" : "ChunkBackward";
      const float eps = static_cast<float>(sp.eps);
      for (const char* name : {"gbar_c", "phi_bar_c", "psi_bar_c", "v_bar_c"}) {
        const int64_t width = std::strcmp(name, "gbar_c") == 0    ? p
                              : std::strcmp(name, "v_bar_c") == 0 ? dv
                                                                  : r;
        pb.Out(name, {b, L, H, width});
      }
      if (gated) pb.Out("dlam_row_c", {b, L, H});
      Tensor sib = Tensor::Empty({b, Lc, H, r, p}, DType::kF32).value();
      Tensor dbar = Tensor::Empty({b, Lc, H, r, p}, DType::kF32).value();
      Tensor sgrad = Tensor::Empty({b, 2, H, r, p}, DType::kF32).value();
      SMAT_ASSERT_OK(ck->NormalizeBackwardStates(
          plan, span, pb.C(grad), pb.C("o"), pb.C("den"), eps, pb.C("phi"), pb.CU("lam"),
          &pb.C("gbar_c"), gated ? &pb.C("dlam_row_c") : nullptr, &sib, nullptr));
      SMAT_ASSERT_OK(ck->ChunkScanBackward(plan, span, sib, pb.CU("chunk_decay"), Tensor(), &dbar,
                                           &sgrad, nullptr));
      SMAT_ASSERT_OK(ck->ChunkOutputsBackward(
          plan, span, pb.C("phi"), pb.C("psi"), pb.C("v"), pb.CU("lam"), pb.CU("chunk_decay"),
          pb.C("S_in"), pb.C("gbar_c"), dbar, &pb.C("phi_bar_c"), &pb.C("psi_bar_c"),
          &pb.C("v_bar_c"), SmatWrite::kAssign, nullptr));
      auto fused = [&](Tensor* gbar, Tensor* dlam, Tensor* phi_bar, Tensor* psi_bar,
                       Tensor* v_bar) {
        return gk->ChunkBackward(plan, span, pb.G(grad), pb.G("o"), pb.G("den"), eps, pb.G("phi"),
                                 pb.G("psi"), pb.G("v"), pb.GU("lam"), pb.GU("chunk_decay"),
                                 pb.G("S_in"), gbar, dlam, phi_bar, psi_bar, v_bar,
                                 SmatLongRangeBackward(), nullptr);
      };
      SMAT_ASSERT_OK_AND_ASSIGN(const bool ran,
                                fused(&pb.G("gbar_c"), gated ? &pb.G("dlam_row_c") : nullptr,
                                      &pb.G("phi_bar_c"), &pb.G("psi_bar_c"), &pb.G("v_bar_c")));
      if (ran) {
        ++(do_bf16 ? fused_do_bf16_cases : fused_backward_cases);
        auto empty = [&](const Shape& shape) {
          return Tensor::Empty(shape, DType::kF32, gpu_->allocator()).value();
        };
        Tensor g2 = empty({b, L, H, p}), dl2 = empty({b, L, H}), pb2 = empty({b, L, H, r}),
               sb2 = empty({b, L, H, r}), vb2 = empty({b, L, H, dv});
        SMAT_ASSERT_OK_AND_ASSIGN(const bool again,
                                  fused(&g2, gated ? &dl2 : nullptr, &pb2, &sb2, &vb2));
        EXPECT_TRUE(again);
        // gbar's column dv alone ([b, L, H]): with a bf16 d_o the same outputs,
        // bit for bit, and that column of the full gbar; else not taken.
        {
          Tensor gd = empty({b, L, H}), dl3 = empty({b, L, H}), pb3 = empty({b, L, H, r}),
                 sb3 = empty({b, L, H, r}), vb3 = empty({b, L, H, dv});
          for (Tensor* t : {&gd, &pb3, &sb3, &vb3}) SMAT_ASSERT_OK(gpu_->Fill(*t, std::nan("")));
          SMAT_ASSERT_OK_AND_ASSIGN(const bool column,
                                    fused(&gd, gated ? &dl3 : nullptr, &pb3, &sb3, &vb3));
          EXPECT_EQ(column, do_bf16) << "ChunkBackward with gbar's column alone";
          if (column) {
            ExpectSameBits(*gpu_,
                           {{"phi_bar", &pb.G("phi_bar_c"), &pb3},
                            {"psi_bar", &pb.G("psi_bar_c"), &sb3},
                            {"v_bar", &pb.G("v_bar_c"), &vb3}},
                           "ChunkBackward with gbar's column alone differs from gbar in full");
            const Tensor full = ToHost(*gpu_, pb.G("gbar_c")).value();
            const Tensor col = ToHost(*gpu_, gd).value();
            const float* f = static_cast<const float*>(full.raw());
            const float* c = static_cast<const float*>(col.raw());
            int64_t differ = 0;
            for (int64_t i = 0; i < b * L * H; ++i)
              differ += std::memcmp(&f[i * p + dv], &c[i], 4) != 0;
            EXPECT_EQ(differ, 0) << "gbar's column dv written alone differs from gbar's";
          } else {
            const Tensor x = ToHost(*gpu_, pb3).value();
            EXPECT_TRUE(std::isnan(static_cast<const float*>(x.raw())[0]))
                << "ChunkBackward returned false but wrote phi_bar";
          }
        }
        BitPairs pairs = {{"gbar", &pb.G("gbar_c"), &g2},
                          {"phi_bar", &pb.G("phi_bar_c"), &pb2},
                          {"psi_bar", &pb.G("psi_bar_c"), &sb2},
                          {"v_bar", &pb.G("v_bar_c"), &vb2}};
        if (gated) pairs.emplace_back("dlam_row", &pb.G("dlam_row_c"), &dl2);
        ExpectSameBits(*gpu_, pairs, "two ChunkBackward calls differ");
        pb.Compare(what, "gbar_c", tol, true);
        if (gated) pb.Compare(what, "dlam_row_c", tol, sp.eps > 0);
        pb.Compare(what, "phi_bar_c", TileTol(cs.bf16, tol), true);
        pb.Compare(what, "psi_bar_c", TileTol(cs.bf16, tol), true);
        pb.Compare(what, "v_bar_c", TileTol(cs.bf16, tol), true);
      } else {
        // Nothing written: the poisoned outputs must still be NaN.
        const Tensor x = ToHost(*gpu_, pb.G("phi_bar_c")).value();
        EXPECT_TRUE(std::isnan(static_cast<const float*>(x.raw())[0]))
            << "ChunkBackward returned false but wrote phi_bar";
      }
    }
    if (gated) {
      pb.Out("logg_bar", {b, L, H});
      pb.Out("span_sum", {b, H});
      both("LogDecayBackward", [&](SmatKernels& k, const Get& t, const Opt&) {
        return k.LogDecayBackward(plan, span, t("psi"), t("psi_bar"), t("dlam_row"), t("suffix_in"),
                                  &t("logg_bar"), &t("span_sum"), nullptr);
      });
      pb.Compare("LogDecayBackward", "logg_bar", tol, true);
      pb.Compare("LogDecayBackward", "span_sum", tol, true);
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
  const char* tiles = std::getenv("SMAT_CUDA_CHUNK_TILES");
  if (tiles == nullptr || *tiles == '\0') {
    EXPECT_GE(walked_cases, 4) << "the walk of ChunkStatesAndOutputs ran on too few cases";
    EXPECT_GE(fused_backward_cases, 4) << "ChunkBackward's fused path ran on too few cases";
    EXPECT_GE(fused_do_bf16_cases, 4) << "ChunkBackward's fused path ran on too few bf16 d_o";
    EXPECT_GE(factored_reads_cases, 3) << "TypeReadsBackwardFromFactors ran on too few cases";
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
