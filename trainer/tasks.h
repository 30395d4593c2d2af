// Synthetic long-context tasks, generated on the fly from (seed, example index):
// multi-query associative recall (MQAR), and the paper's multi-key retrieval and
// subset routing (Section 4, Appendix G.2) posed as token tasks. Each generator
// writes one example's inputs, targets and loss mask; only answer positions carry
// loss. The batch sampler (trainer/data.h) serves them by global sequence index.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "core/config.pb.h"

namespace smat {

// Multi-query associative recall (Zoology, Arora et al. 2023), one example of
// length T. Keys are drawn without replacement from [1, vocab/2), values from
// [vocab/2, vocab); token 0 is filler. The sequence is k_1 v_1 ... k_P v_P, then
// a query region in which every key appears once, at an even offset, with the
// filler elsewhere. The target at a query key's position is its value; only
// those P positions carry loss. Layout UNIFORM: query slots uniformly random
// over the query region (Zoology draws them from a power law; uniform makes the
// distance to the pairs uniform). Layout PLACED: the queries fill the last 2P
// positions, so every query sits T - 4P tokens after the pair region.
struct MqarSpec {
  int64_t seq_len = 0;    // T >= 4P
  int64_t num_pairs = 0;  // P >= 1
  int64_t vocab = 0;      // >= 2P + 2
  DataConfig::Layout layout = DataConfig::UNIFORM;
};
absl::Status CheckMqarSpec(const MqarSpec& spec);
// Writes example `index` for `seed`: inputs, targets (int32) and mask (fp32),
// each of length T.
void MakeMqarExample(const MqarSpec& spec, uint64_t seed, uint64_t index, int32_t* inputs,
                     int32_t* targets, float* mask);

// The paper's two routing tasks (Section 4 and Appendix G.2) read a vector per
// query row (a k-hot logit vector trained with binary cross-entropy, or one
// output channel per landmark); smat trains next-token cross-entropy, so both
// are posed here as token tasks whose answer spells that vector out, one token
// per item, and a query is right when all its answer tokens are (the paper's
// exact-support match). Choices the text leaves open are marked "choice".

// Multi-key retrieval ("multi-key subset recall", Appendix G.2): N key-payload
// pairs sit at random positions of the distant context, and each query asks for
// k of the keys at once. Tokens: 0 filler, 1 answer marker, keys distinct from
// [2, half), payloads distinct from [half, vocab), half = 2 + (vocab - 2) / 2.
// The context C = T - 2kQ holds the pairs as adjacent (key, payload) tokens at
// N distinct random even offsets, filler elsewhere. Then Q queries of 2k tokens
// each: the k requested keys (a fresh random k-subset of the N per query), then
// k answer markers whose targets are the requested payloads in the same order;
// only those kQ answer positions carry loss. Choice: the requested keys are
// listed in the order their pairs appear in the context, so the listing is a
// function of the requested set (the paper's query is a set) and the answer is
// the set of payloads in one canonical order.
inline constexpr int32_t kTaskAnswerToken = 1;    // input at every answer position
inline constexpr int32_t kSubsetSelectToken = 2;  // subset routing: landmark l is in A
inline constexpr int32_t kSubsetSkipToken = 3;    // subset routing: landmark l is not
inline constexpr int32_t kSubsetFirstPayload = 4;

struct MultiKeySpec {
  int64_t seq_len = 0;         // T >= 2N + 2kQ
  int64_t num_pairs = 0;       // N >= 1
  int64_t keys_per_query = 0;  // k in [1, N]
  int64_t num_queries = 0;     // Q >= 1
  int64_t vocab = 0;           // >= 2N + 2
};
absl::Status CheckMultiKeySpec(const MultiKeySpec& spec);
// Example `index` for `seed`: inputs, targets (int32) and mask (fp32), length T.
void MakeMultiKeyExample(const MultiKeySpec& spec, uint64_t seed, uint64_t index,
                         int32_t* inputs, int32_t* targets, float* mask);

// Subset routing (Section 4): k landmark positions j_1 < ... < j_k of the
// context each hold an independent random payload x_l; every other context
// position is the filler 0 (the paper's zero value). A query names a subset
// A of the landmarks and must answer y_A, x_l in channel l for l in A and zero
// elsewhere. Tokens: 0 filler (and the "absent" answer), 1 answer marker,
// 2 select, 3 skip, payloads from [4, vocab). The context is C = T - 2kQ and
// landmark l (0-based) sits at floor((2l + 1) C / (2k)). Then Q queries of 2k
// tokens: k flags (select if l in A, else skip), then k answer markers, the
// l-th with target x_l if l in A, else 0; only the kQ answer positions carry
// loss. Payloads and each query's subset (uniform over all 2^k, empty and full
// included) are drawn afresh per example. Choices: the landmarks are at fixed,
// evenly spread positions (the paper resamples payloads and subsets, not
// positions, so routing may be positional), the subset is given as k flags in
// landmark order, and channel l of y_A is answer token l.
struct SubsetRoutingSpec {
  int64_t seq_len = 0;      // T >= k + 2kQ
  int64_t landmarks = 0;    // k >= 1
  int64_t num_queries = 0;  // Q >= 1
  int64_t vocab = 0;        // >= 6: 4 control tokens and at least 2 payloads
};
absl::Status CheckSubsetRoutingSpec(const SubsetRoutingSpec& spec);
// Position of landmark l (0-based) in an example of `spec`.
int64_t SubsetLandmarkPosition(const SubsetRoutingSpec& spec, int64_t l);
void MakeSubsetRoutingExample(const SubsetRoutingSpec& spec, uint64_t seed, uint64_t index,
                              int32_t* inputs, int32_t* targets, float* mask);

}  // namespace smat
