// Counter-based random numbers: Philox4x32-10 (Salmon, Moraes, Dror and Shaw,
// "Parallel random numbers: as easy as 1, 2, 3", SC 2011).
//
// A counter-based generator has no state to carry around: the numbers are a
// pure function of (key, counter). That is what makes a run reproducible on any
// grid and after a resume: the value used for element i of a tensor depends only
// on (seed, offset + i), never on which rank or thread produced it, nor on how
// many numbers were drawn before. The block function and the conversions below
// are __host__ __device__ under nvcc and use no std:: calls, so a CUDA kernel
// and the CPU reference produce the same words (the uniform floats are exactly
// equal; normals go through logf/sinf/cosf, which may differ by a few ulp
// between the host libm and the CUDA math library). Measured on an H200 with
// 4M draws: words and uniforms identical, normals within 7.2e-7 absolute;
// --use_fast_math widens that to 3e-5, so kernels that must match the host
// reference should not use it for these functions.
//
// Counter layout used by the fill helpers (and by any kernel that wants to
// reproduce them): element index e = offset + i draws from the block with
// counter {lo32(e / 4), hi32(e / 4), lo32(stream), hi32(stream)} and key
// {lo32(seed), hi32(seed)}, word e % 4 of the block's output.
//
//   SMAT_ASSIGN_OR_RETURN(Tensor w, Tensor::Empty({d_in, d_out}, DType::kF32));
//   SMAT_RETURN_IF_ERROR(FillNormal(w, /*seed=*/run_seed, /*offset=*/0, 0.f, 0.02f));
#pragma once

#include <math.h>  // logf, sqrtf, sinf, cosf: global names usable in device code.
#include <stdint.h>

#include "absl/status/status.h"
#include "core/tensor.h"

#if defined(__CUDACC__)
#define SMAT_HD __host__ __device__
#else
#define SMAT_HD
#endif

namespace smat {

struct PhiloxCounter {
  uint32_t w[4];
};
struct PhiloxKey {
  uint32_t w[2];
};

// Round constants of Philox4x32 (Random123, philox.h).
inline constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
inline constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
inline constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
inline constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1

// One Philox4x32 round: two 32x32 -> 64 bit products, then a mix of the halves.
SMAT_HD inline PhiloxCounter PhiloxRound(PhiloxCounter c, PhiloxKey k) {
  const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c.w[0];
  const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c.w[2];
  const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
  const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
  PhiloxCounter r;
  r.w[0] = hi1 ^ c.w[1] ^ k.w[0];
  r.w[1] = lo1;
  r.w[2] = hi0 ^ c.w[3] ^ k.w[1];
  r.w[3] = lo0;
  return r;
}

// Philox4x32-10: ten rounds, the key bumped by the Weyl constants between them.
// Matches Random123's philox4x32(ctr, key) bit for bit (known-answer tested).
SMAT_HD inline PhiloxCounter Philox4x32(PhiloxCounter counter, PhiloxKey key) {
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key.w[0] += kPhiloxW0;
      key.w[1] += kPhiloxW1;
    }
    counter = PhiloxRound(counter, key);
  }
  return counter;
}

SMAT_HD inline PhiloxKey PhiloxKeyFromSeed(uint64_t seed) {
  PhiloxKey k;
  k.w[0] = static_cast<uint32_t>(seed);
  k.w[1] = static_cast<uint32_t>(seed >> 32);
  return k;
}

// The block that holds element `index` of stream `stream` (4 elements a block).
SMAT_HD inline PhiloxCounter PhiloxCounterFor(uint64_t index, uint64_t stream) {
  const uint64_t block = index >> 2;
  PhiloxCounter c;
  c.w[0] = static_cast<uint32_t>(block);
  c.w[1] = static_cast<uint32_t>(block >> 32);
  c.w[2] = static_cast<uint32_t>(stream);
  c.w[3] = static_cast<uint32_t>(stream >> 32);
  return c;
}

// Word `index % 4` of the block for `index`: the raw 32 random bits of one element.
SMAT_HD inline uint32_t PhiloxWord(uint64_t seed, uint64_t stream, uint64_t index) {
  const PhiloxCounter out = Philox4x32(PhiloxCounterFor(index, stream), PhiloxKeyFromSeed(seed));
  return out.w[index & 3u];
}

// Uniform in [0, 1) from the top 24 bits: every value is a multiple of 2^-24 and
// exactly representable in fp32, so the conversion is identical on every device.
SMAT_HD inline float UniformFromWord(uint32_t x) {
  return static_cast<float>(x >> 8) * 5.9604644775390625e-08f;  // 2^-24
}

// Uniform in (0, 1]: safe as the argument of a logarithm.
SMAT_HD inline float UniformOpenZeroFromWord(uint32_t x) {
  return static_cast<float>((x >> 8) + 1u) * 5.9604644775390625e-08f;
}

// Standard normals by Box-Muller from two words: radius from `a`, angle from `b`.
// `second` picks the sine branch, so one pair of words gives two independent normals.
SMAT_HD inline float NormalFromWords(uint32_t a, uint32_t b, bool second) {
  const float radius = sqrtf(-2.0f * logf(UniformOpenZeroFromWord(a)));
  const float angle = 6.28318530717958647692f * UniformFromWord(b);
  return radius * (second ? sinf(angle) : cosf(angle));
}

// Standard normal for element `index`: words (0, 1) of its block serve elements
// 4k and 4k + 1, words (2, 3) serve 4k + 2 and 4k + 3.
SMAT_HD inline float PhiloxNormal(uint64_t seed, uint64_t stream, uint64_t index) {
  const PhiloxCounter out = Philox4x32(PhiloxCounterFor(index, stream), PhiloxKeyFromSeed(seed));
  const int pair = static_cast<int>((index >> 1) & 1u);
  return NormalFromWords(out.w[2 * pair], out.w[2 * pair + 1], (index & 1u) != 0);
}

SMAT_HD inline float PhiloxUniform(uint64_t seed, uint64_t stream, uint64_t index) {
  return UniformFromWord(PhiloxWord(seed, stream, index));
}

// --- host helpers ----------------------------------------------------------------
// Fill a host tensor; element i (C order) uses index offset + i, so filling a view
// of a span gives the same numbers as the same span of a full fill. `stream`
// separates independent uses of one seed (e.g. one stream per parameter).

// Uniform in [lo, hi). fp32, fp64 or bf16 (rounded to nearest even).
absl::Status FillUniform(Tensor& t, uint64_t seed, uint64_t offset, float lo = 0.f, float hi = 1.f,
                         uint64_t stream = 0);
// Normal(mean, stddev). fp32, fp64 or bf16.
absl::Status FillNormal(Tensor& t, uint64_t seed, uint64_t offset, float mean = 0.f,
                        float stddev = 1.f, uint64_t stream = 0);
// Integers uniform in [lo, hi) (hi - lo <= 2^32), int32 or int64. Uses the
// multiply-high mapping floor(word * (hi - lo) / 2^32): deterministic, with a bias
// below (hi - lo) / 2^32, negligible for token ids.
absl::Status FillUniformInt(Tensor& t, uint64_t seed, uint64_t offset, int64_t lo, int64_t hi,
                            uint64_t stream = 0);

// Sequential 32-bit draws from one Philox stream: word i of (seed, stream), i =
// 0, 1, 2, ... Host code that needs a few draws per item (data generators,
// hashes) reads them in order without tracking counters itself.
class PhiloxStream {
 public:
  PhiloxStream(uint64_t seed, uint64_t stream) : seed_(seed), stream_(stream) {}
  uint32_t Next() { return PhiloxWord(seed_, stream_, next_++); }
  // Uniform in [0, n) for n <= 2^32 by multiply-high (bias < n / 2^32).
  uint64_t Below(uint64_t n) { return (static_cast<uint64_t>(Next()) * n) >> 32; }
  uint64_t Next64() {
    const uint64_t lo = Next();
    return lo | (static_cast<uint64_t>(Next()) << 32);
  }

 private:
  uint64_t seed_, stream_, next_ = 0;
};

}  // namespace smat
