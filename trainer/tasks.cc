// Synthetic task generators (trainer/tasks.h).
#include "trainer/tasks.h"

#include <algorithm>
#include <unordered_set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/rng.h"

namespace smat {

// --- MQAR ----------------------------------------------------------------------------------

namespace {

// `count` distinct tokens from [lo, hi): the first `count` entries of a partial
// Fisher-Yates shuffle of the range, drawn from `draws` in order.
std::vector<int32_t> PickDistinct(PhiloxStream& draws, int64_t lo, int64_t hi, int64_t count) {
  std::vector<int32_t> pool(static_cast<size_t>(hi - lo));
  for (int64_t i = 0; i < hi - lo; ++i) pool[i] = static_cast<int32_t>(lo + i);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t j = i + static_cast<int64_t>(draws.Below(static_cast<uint64_t>(hi - lo - i)));
    std::swap(pool[i], pool[j]);
  }
  pool.resize(static_cast<size_t>(count));
  return pool;
}

}  // namespace

absl::Status CheckMqarSpec(const MqarSpec& s) {
  if (s.num_pairs < 1) {
    return absl::InvalidArgumentError(absl::StrCat("MQAR: num_pairs = ", s.num_pairs, " < 1"));
  }
  if (s.seq_len < 4 * s.num_pairs) {
    return absl::InvalidArgumentError(
        absl::StrCat("MQAR: seq_len = ", s.seq_len, " is below 4 * num_pairs = ", 4 * s.num_pairs));
  }
  if (s.vocab < 2 * s.num_pairs + 2 || s.vocab > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat("MQAR: vocab = ", s.vocab, " must be in [",
                                                   2 * s.num_pairs + 2, ", 2^31] for ", s.num_pairs,
                                                   " pairs"));
  }
  return absl::OkStatus();
}

void MakeMqarExample(const MqarSpec& s, uint64_t seed, uint64_t index, int32_t* inputs,
                     int32_t* targets, float* mask) {
  SMAT_CHECK(CheckMqarSpec(s).ok());
  const int64_t T = s.seq_len, P = s.num_pairs, half = s.vocab / 2;
  PhiloxStream draws(seed, index);
  std::fill(inputs, inputs + T, 0);
  std::fill(targets, targets + T, 0);
  std::fill(mask, mask + T, 0.f);

  // P distinct keys from [1, half) and P distinct values from [half, vocab).
  const std::vector<int32_t> keys = PickDistinct(draws, 1, half, P);
  const std::vector<int32_t> values = PickDistinct(draws, half, s.vocab, P);
  for (int64_t i = 0; i < P; ++i) {
    inputs[2 * i] = keys[i];
    inputs[2 * i + 1] = values[i];
  }

  // Query slots: even offsets of the query region [2P, T).
  const int64_t num_slots = (T - 2 * P) / 2;
  std::vector<int64_t> slots;
  slots.reserve(static_cast<size_t>(P));
  if (s.layout == DataConfig::PLACED) {
    for (int64_t j = 0; j < P; ++j) slots.push_back(num_slots - P + j);
  } else {
    // Floyd's algorithm: P distinct slots without materialising all of them
    // (T may be 2^20 while P is tens).
    std::unordered_set<int64_t> chosen;
    for (int64_t j = num_slots - P; j < num_slots; ++j) {
      const int64_t t = static_cast<int64_t>(draws.Below(static_cast<uint64_t>(j + 1)));
      chosen.insert(chosen.count(t) ? j : t);
    }
    slots.assign(chosen.begin(), chosen.end());
    std::sort(slots.begin(), slots.end());
  }
  // Keys are asked in a random order.
  std::vector<int64_t> order(static_cast<size_t>(P));
  for (int64_t i = 0; i < P; ++i) order[i] = i;
  for (int64_t i = P - 1; i > 0; --i) {
    std::swap(order[i], order[draws.Below(static_cast<uint64_t>(i + 1))]);
  }
  // PLACED aligns the slots to the end: the last query sits at T - 2.
  const int64_t region = s.layout == DataConfig::PLACED ? T - 2 * num_slots : 2 * P;
  for (int64_t q = 0; q < P; ++q) {
    const int64_t pos = region + 2 * slots[q];
    inputs[pos] = keys[order[q]];
    targets[pos] = values[order[q]];
    mask[pos] = 1.f;
  }
}

// --- multi-key retrieval -----------------------------------------------------------------

namespace {
// n distinct values of [0, range) in increasing order, by Floyd's algorithm
// (range may be 2^20 slots while n is tens).
std::vector<int64_t> DistinctSorted(PhiloxStream& draws, int64_t n, int64_t range) {
  std::unordered_set<int64_t> chosen;
  for (int64_t j = range - n; j < range; ++j) {
    const int64_t t = static_cast<int64_t>(draws.Below(static_cast<uint64_t>(j + 1)));
    chosen.insert(chosen.count(t) ? j : t);
  }
  std::vector<int64_t> out(chosen.begin(), chosen.end());
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

absl::Status CheckMultiKeySpec(const MultiKeySpec& s) {
  if (s.num_pairs < 1 || s.num_queries < 1 || s.keys_per_query < 1 ||
      s.keys_per_query > s.num_pairs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MULTI_KEY: num_pairs = ", s.num_pairs, " and num_queries = ", s.num_queries,
        " must be >= 1 and keys_per_query = ", s.keys_per_query, " in [1, num_pairs]"));
  }
  const int64_t need = 2 * s.num_pairs + 2 * s.keys_per_query * s.num_queries;
  if (s.seq_len < need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MULTI_KEY: seq_len = ", s.seq_len, " is below 2 * num_pairs + 2 * keys_per_query * ",
        "num_queries = ", need));
  }
  if (s.vocab < 2 * s.num_pairs + 2 || s.vocab > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat("MULTI_KEY: vocab = ", s.vocab,
                                                   " must be in [", 2 * s.num_pairs + 2,
                                                   ", 2^31] for ", s.num_pairs, " pairs"));
  }
  return absl::OkStatus();
}

void MakeMultiKeyExample(const MultiKeySpec& s, uint64_t seed, uint64_t index, int32_t* inputs,
                         int32_t* targets, float* mask) {
  SMAT_CHECK(CheckMultiKeySpec(s).ok());
  const int64_t T = s.seq_len, N = s.num_pairs, k = s.keys_per_query, Q = s.num_queries;
  const int64_t half = 2 + (s.vocab - 2) / 2;
  PhiloxStream draws(seed, index);
  std::fill(inputs, inputs + T, 0);
  std::fill(targets, targets + T, 0);
  std::fill(mask, mask + T, 0.f);

  // N distinct keys from [2, half) and N distinct payloads from [half, vocab).
  const std::vector<int32_t> keys = PickDistinct(draws, 2, half, N);
  const std::vector<int32_t> payloads = PickDistinct(draws, half, s.vocab, N);
  // Pair i at the i-th of N sorted random even offsets of the context, so pair
  // indices are in context order.
  const int64_t context = T - 2 * k * Q;
  const std::vector<int64_t> slots = DistinctSorted(draws, N, context / 2);
  for (int64_t i = 0; i < N; ++i) {
    inputs[2 * slots[i]] = keys[i];
    inputs[2 * slots[i] + 1] = payloads[i];
  }
  std::vector<int64_t> pairs(static_cast<size_t>(N));
  for (int64_t q = 0; q < Q; ++q) {
    // A fresh k-subset of the pairs, listed in context order.
    for (int64_t i = 0; i < N; ++i) pairs[i] = i;
    for (int64_t i = 0; i < k; ++i) {
      std::swap(pairs[i], pairs[i + draws.Below(static_cast<uint64_t>(N - i))]);
    }
    std::sort(pairs.begin(), pairs.begin() + k);
    const int64_t at = context + 2 * k * q;
    for (int64_t j = 0; j < k; ++j) {
      inputs[at + j] = keys[pairs[j]];
      inputs[at + k + j] = kTaskAnswerToken;
      targets[at + k + j] = payloads[pairs[j]];
      mask[at + k + j] = 1.f;
    }
  }
}

// --- subset routing ------------------------------------------------------------------------

absl::Status CheckSubsetRoutingSpec(const SubsetRoutingSpec& s) {
  if (s.landmarks < 1 || s.num_queries < 1) {
    return absl::InvalidArgumentError(absl::StrCat("SUBSET_ROUTING: landmarks = ", s.landmarks,
                                                   " and num_queries = ", s.num_queries,
                                                   " must both be >= 1"));
  }
  const int64_t need = s.landmarks + 2 * s.landmarks * s.num_queries;
  if (s.seq_len < need) {
    return absl::InvalidArgumentError(
        absl::StrCat("SUBSET_ROUTING: seq_len = ", s.seq_len,
                     " is below landmarks + 2 * landmarks * num_queries = ", need));
  }
  if (s.vocab < kSubsetFirstPayload + 2 || s.vocab > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SUBSET_ROUTING: vocab = ", s.vocab, " must be in [", kSubsetFirstPayload + 2,
        ", 2^31] (4 control tokens and at least 2 payload values)"));
  }
  return absl::OkStatus();
}

int64_t SubsetLandmarkPosition(const SubsetRoutingSpec& s, int64_t l) {
  const int64_t context = s.seq_len - 2 * s.landmarks * s.num_queries;
  return (2 * l + 1) * context / (2 * s.landmarks);
}

void MakeSubsetRoutingExample(const SubsetRoutingSpec& s, uint64_t seed, uint64_t index,
                              int32_t* inputs, int32_t* targets, float* mask) {
  SMAT_CHECK(CheckSubsetRoutingSpec(s).ok());
  const int64_t T = s.seq_len, k = s.landmarks, Q = s.num_queries;
  PhiloxStream draws(seed, index);
  std::fill(inputs, inputs + T, 0);
  std::fill(targets, targets + T, 0);
  std::fill(mask, mask + T, 0.f);
  std::vector<int32_t> payload(static_cast<size_t>(k));
  for (int64_t l = 0; l < k; ++l) {
    payload[l] = static_cast<int32_t>(
        kSubsetFirstPayload +
        static_cast<int64_t>(draws.Below(static_cast<uint64_t>(s.vocab - kSubsetFirstPayload))));
    inputs[SubsetLandmarkPosition(s, l)] = payload[l];
  }
  const int64_t context = T - 2 * k * Q;
  for (int64_t q = 0; q < Q; ++q) {
    const int64_t at = context + 2 * k * q;
    for (int64_t l = 0; l < k; ++l) {
      // Each landmark in with probability 1/2: the subset is uniform over all 2^k.
      const bool selected = (draws.Next() >> 31) != 0;
      inputs[at + l] = selected ? kSubsetSelectToken : kSubsetSkipToken;
      inputs[at + k + l] = kTaskAnswerToken;
      targets[at + k + l] = selected ? payload[l] : 0;
      mask[at + k + l] = 1.f;
    }
  }
}

}  // namespace smat
