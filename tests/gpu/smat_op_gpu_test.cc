// The composed SMat op (kernels/smat.h) on the GPU against the CPU op and the
// double reference: outputs and every gradient under random upstream
// gradients, on the whole-span cases of smat_gpu_cases.h (tolerances there);
// then the same inputs again must give the same bits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/smat_reference.h"
#include "kernels/smat.h"
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
using testing_util::RandomProblem;
using testing_util::RandomVector;

class SmatOpGpuTest : public GpuTest {};

struct OpResult {
  std::vector<Tensor> host;  // o, d_phi, d_psi, d_v, (d_logg)
};

// The op's inputs on `be` (bf16: features rounded to bf16; the CPU gets the
// rounded values in fp32).
absl::StatusOr<SmatInputs> LoadInputs(Backend& be, const SmatReferenceProblem& pr, bool bf16) {
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
  return in;
}

// do_bf16: the GPU gets d_o as bf16 (its values must be bf16 already).
absl::StatusOr<OpResult> RunOp(Backend& be, const SmatPlan& plan, const SmatReferenceProblem& pr,
                               bool bf16, const std::vector<double>& d_o, bool do_bf16 = false) {
  const bool gpu = !be.device().is_cpu();
  SMAT_ASSIGN_OR_RETURN(const SmatInputs in, LoadInputs(be, pr, bf16));
  const Shape do_shape = {pr.batch, pr.T, pr.H, pr.dv};
  Tensor rounded;
  const Tensor d_o_host =
      do_bf16 && gpu ? HostBf16(d_o, do_shape, &rounded) : HostF32(d_o, do_shape);
  SMAT_ASSIGN_OR_RETURN(Tensor dout,
                        gpu ? ToDevice(be, d_o_host) : absl::StatusOr<Tensor>(d_o_host));
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

TEST_F(SmatOpGpuTest, WholeOpMatchesCpuAndReferenceAndRepeatsBitwise) {
  for (const Case& cs : Cases()) {
    if (cs.t0 != 0) continue;  // the composed op runs the whole span
    const ProblemSpec& sp = cs.spec;
    SCOPED_TRACE(CaseName(cs));
    SMAT_ASSERT_OK_AND_ASSIGN(SmatPlan plan, MakeSmatPlan(sp.T, sp.d, sp.chunk));
    SmatReferenceProblem pr = RandomProblem(plan, sp);
    // The reference sees exactly the values the kernels see.
    for (auto* v : {&pr.phi, &pr.psi, &pr.v}) {
      for (double& x : *v)
        x = cs.bf16 ? Bf16ToFloat(FloatToBf16(static_cast<float>(x))) : static_cast<float>(x);
    }
    for (double& x : pr.logg) x = static_cast<float>(x);
    // With bf16 inputs the output gradient comes both ways: fp32, and bf16
    // as the trainer passes it (o is bf16), which ChunkBackward's B7 takes as
    // gbar's factor.
    std::vector<bool> grads_bf16 = {false};
    if (cs.bf16) grads_bf16.push_back(true);
    for (const bool do_bf16 : grads_bf16) {
      SCOPED_TRACE(do_bf16 ? "bf16 d_o" : "fp32 d_o");
      std::vector<double> d_o = RandomVector(sp.batch * sp.T * sp.H * sp.dv, sp.seed + 99);
      if (do_bf16) {
        for (double& x : d_o) x = Bf16ToFloat(FloatToBf16(static_cast<float>(x)));
      }
      SMAT_ASSERT_OK_AND_ASSIGN(OpResult cpu, RunOp(*cpu_, plan, pr, cs.bf16, d_o));
      SMAT_ASSERT_OK_AND_ASSIGN(OpResult gpu, RunOp(*gpu_, plan, pr, cs.bf16, d_o, do_bf16));
      SMAT_ASSERT_OK_AND_ASSIGN(OpResult again, RunOp(*gpu_, plan, pr, cs.bf16, d_o, do_bf16));
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
        std::printf("%-40s %-7s %s d_o  gpu-cpu %.3g  gpu-ref %.3g  cpu-ref %.3g\n",
                    CaseName(cs).c_str(), names[i], do_bf16 ? "bf16" : "fp32", vs_cpu, vs_ref,
                    cpu_vs_ref);
        const double tol = !cs.bf16         ? kF32Tol
                           : i == 0         ? TileTol(true, kBf16OutTol)
                           : Bf16Products() ? kBf16ProductsOpGradTol
                                            : kBf16OpGradTol;
        EXPECT_LE(vs_cpu, tol) << names[i];
        EXPECT_LE(vs_ref, tol) << names[i];
        EXPECT_GT(MaxAbs(c), 0.0) << names[i];
        ASSERT_EQ(gpu.host[i].nbytes(), again.host[i].nbytes());
        EXPECT_EQ(std::memcmp(gpu.host[i].raw(), again.host[i].raw(), gpu.host[i].nbytes()), 0)
            << names[i] << ": two runs on the same inputs differ";
      }
    }
  }
}

// d = 2 at the benchmark's widths (r = dv = 64, chunk 128) on two heads.
ProblemSpec BenchmarkWidths(int64_t T, bool gated, uint64_t seed) {
  return ProblemSpec{.batch = 1,
                     .T = T,
                     .H = 2,
                     .r = 64,
                     .dv = 64,
                     .d = 2,
                     .chunk = 128,
                     .gated = gated,
                     .eps = 1e-3,
                     .seed = seed};
}

// The forward's long-range phases run on the backend's side stream
// (SmatKernels::ForkSide) while the causal states start on the caller's, and
// the outputs wait for the reads. Two forwards on different inputs go back to
// back on a stream of the caller's, twice: the second one's o against the
// CPU op's (reads left over from the first, or not yet written, would be far
// outside the tolerance) and bit for bit against its repeat. Ungated, the
// walk joins after its first launches; gated, the three phases join before
// the outputs.
TEST_F(SmatOpGpuTest, SideStreamForwardsBackToBack) {
  SMAT_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, gpu_->CreateStream());
  for (bool gated : {false, true}) {
    SCOPED_TRACE(gated ? "gated" : "ungated");
    ProblemSpec sp = BenchmarkWidths(8192, gated, /*seed=*/41);
    SMAT_ASSERT_OK_AND_ASSIGN(SmatPlan plan, MakeSmatPlan(sp.T, sp.d, sp.chunk));
    ASSERT_TRUE(SmatHasLongRange(plan));
    const SmatReferenceProblem first = RandomProblem(plan, sp);
    sp.seed = 42;
    const SmatReferenceProblem second = RandomProblem(plan, sp);
    SMAT_ASSERT_OK_AND_ASSIGN(SmatInputs in1, LoadInputs(*gpu_, first, /*bf16=*/true));
    SMAT_ASSERT_OK_AND_ASSIGN(SmatInputs in2, LoadInputs(*gpu_, second, /*bf16=*/true));
    SmatForwardOutputs f1, f2, f1_again, f2_again;
    SMAT_ASSERT_OK(SmatForward(*gpu_, plan, in1, &f1, stream.get()));
    SMAT_ASSERT_OK(SmatForward(*gpu_, plan, in2, &f2, stream.get()));
    SMAT_ASSERT_OK(SmatForward(*gpu_, plan, in1, &f1_again, stream.get()));
    SMAT_ASSERT_OK(SmatForward(*gpu_, plan, in2, &f2_again, stream.get()));
    SMAT_ASSERT_OK(gpu_->Synchronize(stream.get()));
    SMAT_ASSERT_OK_AND_ASSIGN(SmatInputs cpu_in, LoadInputs(*cpu_, second, /*bf16=*/true));
    SmatForwardOutputs cpu_out;
    SMAT_ASSERT_OK(SmatForward(*cpu_, plan, cpu_in, &cpu_out));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor o2, ToHost(*gpu_, f2.o));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor o2_again, ToHost(*gpu_, f2_again.o));
    const std::vector<double> g = Values(o2), c = Values(cpu_out.o);
    ASSERT_EQ(g.size(), c.size());
    double err = 0.0;
    for (size_t j = 0; j < g.size(); ++j) {
      err = std::isfinite(g[j]) ? std::max(err, std::abs(g[j] - c[j])) : INFINITY;
    }
    err /= std::max(MaxAbs(c), kGradScaleFloor);
    std::printf("side stream, %s: o gpu-cpu %.3g\n", gated ? "gated" : "ungated", err);
    EXPECT_LE(err, TileTol(true, kBf16OutTol));
    EXPECT_GT(MaxAbs(c), 0.0);
    ASSERT_EQ(o2.nbytes(), o2_again.nbytes());
    EXPECT_EQ(std::memcmp(o2.raw(), o2_again.raw(), o2.nbytes()), 0)
        << "the same forward twice gave different bits";
  }
}

// SmatKeep::kNothing (inference) on the GPU: o as the forward that keeps the
// states for backward gives it, nothing kept, and, where the chunks
// are walked (ungated bf16), a peak that leaves out the chunks' incoming
// states; gated (or with SMAT_CUDA_CHUNK_TILES=ffma or general), the three
// phases pass them through memory either way.
TEST_F(SmatOpGpuTest, ForwardWithoutBackwardKeepsNoStates) {
  for (bool gated : {false, true}) {
    SCOPED_TRACE(gated ? "gated" : "ungated");
    const ProblemSpec sp = BenchmarkWidths(8192 + 77, gated, /*seed=*/43);
    SMAT_ASSERT_OK_AND_ASSIGN(SmatPlan plan, MakeSmatPlan(sp.T, sp.d, sp.chunk));
    const SmatReferenceProblem pr = RandomProblem(plan, sp);
    SMAT_ASSERT_OK_AND_ASSIGN(SmatInputs in, LoadInputs(*gpu_, pr, /*bf16=*/true));
    Allocator& alloc = gpu_->allocator();
    SmatForwardOutputs train, infer;
    SMAT_ASSERT_OK(gpu_->Synchronize(nullptr));
    alloc.ResetPeak();
    const int64_t base_train = alloc.stats().in_use_bytes;
    SMAT_ASSERT_OK(SmatForward(*gpu_, plan, in, &train));
    SMAT_ASSERT_OK(gpu_->Synchronize(nullptr));
    const int64_t peak_train = alloc.stats().peak_bytes - base_train;
    alloc.ResetPeak();
    const int64_t base_infer = alloc.stats().in_use_bytes;
    SMAT_ASSERT_OK(SmatForward(*gpu_, plan, in, &infer, nullptr, SmatKeep::kNothing));
    SMAT_ASSERT_OK(gpu_->Synchronize(nullptr));
    const int64_t peak_infer = alloc.stats().peak_bytes - base_infer;
    EXPECT_FALSE(infer.saved.S_in.defined() || infer.saved.U.defined() ||
                 infer.saved.den.defined() || infer.saved.lam.defined());
    ASSERT_TRUE(train.saved.S_in.defined());
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor o_train, ToHost(*gpu_, train.o));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor o_infer, ToHost(*gpu_, infer.o));
    ASSERT_EQ(o_train.nbytes(), o_infer.nbytes());
    const std::vector<double> ot = Values(o_train), oi = Values(o_infer);
    EXPECT_GT(MaxAbs(oi), 0.0);
    // Ungated on an H200 the forward without states walks on warpgroup MMAs
    // and the one that keeps them, adding the reads at d = 2, on mma.sync
    // (WalkKind in smat_chunk_walk.cu), unless
    // SMAT_CUDA_CHUNK_TILES takes one kernel for both: then the same bits.
    const char* tiles = std::getenv("SMAT_CUDA_CHUNK_TILES");
    if (gated || (tiles != nullptr && *tiles != '\0')) {
      EXPECT_EQ(std::memcmp(o_train.raw(), o_infer.raw(), o_train.nbytes()), 0)
          << "the forward without backward gave other bits";
    } else {
      double err = 0.0;
      for (size_t j = 0; j < ot.size(); ++j) {
        err = std::isfinite(oi[j]) ? std::max(err, std::abs(oi[j] - ot[j])) : INFINITY;
      }
      err /= std::max(MaxAbs(ot), kGradScaleFloor);
      std::printf("forward without states, ungated: o against the forward keeping them %.3g\n",
                  err);
      // Each o is its fp32 value rounded to bf16 (half an ulp, 2^-8 of it),
      // and the two fp32 values differ in their last bits: a rounding may go
      // either way, one ulp apart (up to 2^-7 of the value).
      EXPECT_LE(err, TileTol(true, 2 * kBf16OutTol));
      SmatForwardOutputs again;
      SMAT_ASSERT_OK(SmatForward(*gpu_, plan, in, &again, nullptr, SmatKeep::kNothing));
      SMAT_ASSERT_OK_AND_ASSIGN(Tensor o_again, ToHost(*gpu_, again.o));
      EXPECT_EQ(std::memcmp(o_again.raw(), o_infer.raw(), o_infer.nbytes()), 0)
          << "the forward without backward gave other bits when run again";
    }
    const int64_t states = train.saved.S_in.nbytes();
    std::printf("forward peak %s: %lld bytes keeping the states, %lld without (states %lld)\n",
                gated ? "gated" : "ungated", static_cast<long long>(peak_train),
                static_cast<long long>(peak_infer), static_cast<long long>(states));
    if (!gated && TensorCoreChunkTiles()) {
      EXPECT_LE(peak_infer, peak_train - states);
    }
    EXPECT_LE(peak_infer, peak_train);
    SmatGradients grads;
    SMAT_ASSERT_OK_AND_ASSIGN(
        Tensor d_o, ToDevice(*gpu_, HostF32(RandomVector(pr.batch * pr.T * pr.H * pr.dv, 44),
                                            {pr.batch, pr.T, pr.H, pr.dv})));
    const absl::Status st = SmatBackward(*gpu_, plan, in, infer, d_o, &grads);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  }
}

// The walk of a forward with reads in one launch (SMAT_CUDA_WALK_SPLIT=0, set
// here for every variant) cuts its recent segments shorter than its distant
// ones by a weight (SMAT_CUDA_WALK_RECENT_WEIGHT, 1.3 by default; PlanWalk in
// smat_chunk_walk.cu): at these sizes on 132 SMs (2 x 8 heads, 313 chunks)
// 14 chunks a segment in both parts at weight 1, 18 and 12 at 1.5. Either way
// o of the forward for inference is as the forward that keeps the states
// gives it, and the same bits again.
TEST_F(SmatOpGpuTest, InferenceWalkWithShorterRecentSegments) {
  ProblemSpec sp = BenchmarkWidths(40000 + 77, /*gated=*/false, /*seed=*/47);
  sp.batch = 2;
  sp.H = 8;
  SMAT_ASSERT_OK_AND_ASSIGN(SmatPlan plan, MakeSmatPlan(sp.T, sp.d, sp.chunk));
  const SmatReferenceProblem pr = RandomProblem(plan, sp);
  SMAT_ASSERT_OK_AND_ASSIGN(SmatInputs in, LoadInputs(*gpu_, pr, /*bf16=*/true));
  SmatForwardOutputs train;
  SMAT_ASSERT_OK(SmatForward(*gpu_, plan, in, &train));
  SMAT_ASSERT_OK_AND_ASSIGN(Tensor o_train, ToHost(*gpu_, train.o));
  const std::vector<double> ot = Values(o_train);
  const char* split_env = std::getenv("SMAT_CUDA_WALK_SPLIT");
  const bool had_split = split_env != nullptr;  // the variant's, restored after each forward
  const std::string split_before = had_split ? split_env : "";
  for (const char* weight : {"1", "1.5"}) {
    SCOPED_TRACE(weight);
    ASSERT_EQ(setenv("SMAT_CUDA_WALK_RECENT_WEIGHT", weight, 1), 0);
    ASSERT_EQ(setenv("SMAT_CUDA_WALK_SPLIT", "0", 1), 0);
    SmatForwardOutputs infer, again;
    const absl::Status st1 = SmatForward(*gpu_, plan, in, &infer, nullptr, SmatKeep::kNothing);
    const absl::Status st2 = SmatForward(*gpu_, plan, in, &again, nullptr, SmatKeep::kNothing);
    unsetenv("SMAT_CUDA_WALK_RECENT_WEIGHT");
    if (had_split) {
      setenv("SMAT_CUDA_WALK_SPLIT", split_before.c_str(), 1);
    } else {
      unsetenv("SMAT_CUDA_WALK_SPLIT");
    }
    SMAT_ASSERT_OK(st1);
    SMAT_ASSERT_OK(st2);
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor o_infer, ToHost(*gpu_, infer.o));
    SMAT_ASSERT_OK_AND_ASSIGN(Tensor o_again, ToHost(*gpu_, again.o));
    const std::vector<double> oi = Values(o_infer);
    ASSERT_EQ(oi.size(), ot.size());
    EXPECT_GT(MaxAbs(oi), 0.0);
    double err = 0.0;
    for (size_t j = 0; j < ot.size(); ++j) {
      err = std::isfinite(oi[j]) ? std::max(err, std::abs(oi[j] - ot[j])) : INFINITY;
    }
    err /= std::max(MaxAbs(ot), kGradScaleFloor);
    std::printf("walk for inference, recent weight %s: o against the forward keeping states %.3g\n",
                weight, err);
    // As ForwardWithoutBackwardKeepsNoStates: one bf16 ulp either way.
    EXPECT_LE(err, TileTol(true, 2 * kBf16OutTol));
    EXPECT_EQ(std::memcmp(o_again.raw(), o_infer.raw(), o_infer.nbytes()), 0)
        << "the forward for inference gave other bits when run again";
  }
}

// ChunkBackward runs the long-range branch before B7 where B7 can add to its
// rows (ungated bf16 at r = dv = 64 on warpgroup MMAs; SMAT_CUDA_LONG_RANGE_FIRST)
// and after it elsewhere; each gradient element is then the same two fp32
// terms added once, in either order, so the gradients are the same values
// both ways (compared as floats: a zero may change its sign). Positional and
// content maps (whose rows the branch zeroes before it adds), bf16 d_o as
// the trainer passes it, against the CPU op too.
TEST_F(SmatOpGpuTest, LongRangeBranchBeforeOrAfterTheTiles) {
  const char* env = std::getenv("SMAT_CUDA_LONG_RANGE_FIRST");
  const bool had_env = env != nullptr;
  const std::string env_before = had_env ? env : "";
  for (const bool content : {false, true}) {
    SCOPED_TRACE(content ? "content maps" : "positional maps");
    ProblemSpec sp = BenchmarkWidths(3000 + 59, /*gated=*/false, /*seed=*/content ? 53 : 51);
    sp.content = content;
    SMAT_ASSERT_OK_AND_ASSIGN(SmatPlan plan, MakeSmatPlan(sp.T, sp.d, sp.chunk));
    SmatReferenceProblem pr = RandomProblem(plan, sp);
    for (auto* v : {&pr.phi, &pr.psi, &pr.v}) {
      for (double& x : *v) x = Bf16ToFloat(FloatToBf16(static_cast<float>(x)));
    }
    std::vector<double> d_o = RandomVector(sp.batch * sp.T * sp.H * sp.dv, sp.seed + 99);
    for (double& x : d_o) x = Bf16ToFloat(FloatToBf16(static_cast<float>(x)));
    ASSERT_EQ(setenv("SMAT_CUDA_LONG_RANGE_FIRST", "1", 1), 0);
    absl::StatusOr<OpResult> first = RunOp(*gpu_, plan, pr, true, d_o, /*do_bf16=*/true);
    ASSERT_EQ(setenv("SMAT_CUDA_LONG_RANGE_FIRST", "0", 1), 0);
    absl::StatusOr<OpResult> after = RunOp(*gpu_, plan, pr, true, d_o, /*do_bf16=*/true);
    if (had_env) {
      setenv("SMAT_CUDA_LONG_RANGE_FIRST", env_before.c_str(), 1);
    } else {
      unsetenv("SMAT_CUDA_LONG_RANGE_FIRST");
    }
    ASSERT_TRUE(first.ok()) << first.status();
    ASSERT_TRUE(after.ok()) << after.status();
    SMAT_ASSERT_OK_AND_ASSIGN(OpResult cpu, RunOp(*cpu_, plan, pr, true, d_o));
    ASSERT_EQ(first->host.size(), 4u);  // o and three gradients (ungated)
    ASSERT_EQ(after->host.size(), 4u);
    const char* names[] = {"o", "d_phi", "d_psi", "d_v"};
    for (size_t i = 0; i < 4; ++i) {
      SCOPED_TRACE(names[i]);
      const std::vector<double> x = Values(first->host[i]), y = Values(after->host[i]),
                                c = Values(cpu.host[i]);
      ASSERT_EQ(x.size(), y.size());
      int64_t differ = 0;
      double err = 0.0;
      for (size_t j = 0; j < x.size(); ++j) {
        differ += !(x[j] == y[j]);  // NaN differs too
        err = std::isfinite(x[j]) ? std::max(err, std::abs(x[j] - c[j])) : INFINITY;
      }
      err /= std::max(MaxAbs(c), kGradScaleFloor);
      std::printf(
          "long-range branch first (%s): %-5s %lld of %zu differ from it after; "
          "against the CPU %.3g\n",
          content ? "content" : "positional", names[i], static_cast<long long>(differ), x.size(),
          err);
      EXPECT_EQ(differ, 0) << "the long-range branch before the tiles gave other values";
      EXPECT_GT(MaxAbs(c), 0.0);
      EXPECT_LE(err, i == 0           ? TileTol(true, kBf16OutTol)
                     : Bf16Products() ? kBf16ProductsOpGradTol
                                      : kBf16OpGradTol);
    }
  }
}

}  // namespace
}  // namespace smat
