// Tests for trainer/tasks.h: MQAR (the uniform and placed layouts), multi-key
// retrieval and subset routing examples (structure, answers recoverable by
// each task's rule, determinism per seed and index, bad specs rejected), and
// the batch sampler serving the routing tasks from their generators.
#include "trainer/tasks.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/config.h"
#include "gtest/gtest.h"
#include "trainer/data.h"

namespace smat {
namespace {

bool Contains(const absl::Status& s, const std::string& needle) {
  return std::string(s.message()).find(needle) != std::string::npos;
}

MqarSpec Spec(int64_t T, int64_t P, int64_t V, DataConfig::Layout layout) {
  MqarSpec s;
  s.seq_len = T;
  s.num_pairs = P;
  s.vocab = V;
  s.layout = layout;
  return s;
}

// Checks the MQAR invariants of one example and returns its masked positions.
std::vector<int64_t> CheckMqar(const MqarSpec& s, const std::vector<int32_t>& in,
                               const std::vector<int32_t>& tgt, const std::vector<float>& mask) {
  const int64_t P = s.num_pairs, half = s.vocab / 2;
  std::map<int32_t, int32_t> value_of;
  for (int64_t i = 0; i < P; ++i) {
    EXPECT_GE(in[2 * i], 1);
    EXPECT_LT(in[2 * i], half);
    EXPECT_GE(in[2 * i + 1], half);
    EXPECT_LT(in[2 * i + 1], s.vocab);
    EXPECT_TRUE(value_of.emplace(in[2 * i], in[2 * i + 1]).second) << "repeated key";
  }
  std::vector<int64_t> masked;
  std::set<int32_t> asked;
  for (int64_t t = 2 * P; t < s.seq_len; ++t) {
    if (mask[t] == 1.f) {
      masked.push_back(t);
      EXPECT_TRUE(value_of.count(in[t])) << "query at " << t << " is not a key";
      EXPECT_EQ(tgt[t], value_of[in[t]]) << "wrong answer at " << t;
      asked.insert(in[t]);
    } else {
      EXPECT_EQ(mask[t], 0.f);
      EXPECT_EQ(in[t], 0) << "filler expected at " << t;
      EXPECT_EQ(tgt[t], 0);
    }
  }
  for (int64_t t = 0; t < 2 * P; ++t) EXPECT_EQ(mask[t], 0.f);
  EXPECT_EQ(static_cast<int64_t>(asked.size()), P) << "every key is asked exactly once";
  return masked;
}

TEST(MqarTest, ExamplesHaveTheZoologyStructure) {
  for (auto layout : {DataConfig::UNIFORM, DataConfig::PLACED}) {
    for (int64_t T : {64, 65, 1031}) {
      const MqarSpec s = Spec(T, 8, 40, layout);
      std::vector<int32_t> in(T), tgt(T);
      std::vector<float> mask(T);
      for (uint64_t index = 0; index < 20; ++index) {
        MakeMqarExample(s, 5, index, in.data(), tgt.data(), mask.data());
        const std::vector<int64_t> masked = CheckMqar(s, in, tgt, mask);
        ASSERT_EQ(masked.size(), 8u);
        if (layout == DataConfig::PLACED) {
          for (int64_t j = 0; j < 8; ++j) EXPECT_EQ(masked[j], T - 16 + 2 * j);
        } else {
          for (int64_t p : masked) EXPECT_EQ((p - 16) % 2, 0);
        }
      }
    }
  }
  // The smallest legal T = 4P leaves exactly P slots.
  const MqarSpec tight = Spec(32, 8, 18, DataConfig::UNIFORM);
  std::vector<int32_t> in(32), tgt(32);
  std::vector<float> mask(32);
  MakeMqarExample(tight, 1, 0, in.data(), tgt.data(), mask.data());
  EXPECT_EQ(CheckMqar(tight, in, tgt, mask).size(), 8u);
  EXPECT_FALSE(CheckMqarSpec(Spec(31, 8, 18, DataConfig::UNIFORM)).ok());
  EXPECT_FALSE(CheckMqarSpec(Spec(32, 8, 17, DataConfig::UNIFORM)).ok());
}

TEST(MqarTest, DeterministicPerSeedAndIndexAndVaried) {
  const MqarSpec s = Spec(256, 16, 64, DataConfig::UNIFORM);
  auto make = [&](uint64_t seed, uint64_t index) {
    std::vector<int32_t> in(256), tgt(256);
    std::vector<float> mask(256);
    MakeMqarExample(s, seed, index, in.data(), tgt.data(), mask.data());
    return in;
  };
  EXPECT_EQ(make(3, 7), make(3, 7));
  EXPECT_NE(make(3, 7), make(3, 8));
  EXPECT_NE(make(3, 7), make(4, 7));
  // Query positions spread over the region: over 200 examples, the first query
  // lands in many distinct places (uniform over ~ (256 - 32) / 2 slots).
  std::set<int64_t> first_query;
  for (uint64_t i = 0; i < 200; ++i) {
    const std::vector<int32_t> in = make(9, i);
    for (int64_t t = 32; t < 256; ++t) {
      if (in[t] != 0) {
        first_query.insert(t);
        break;
      }
    }
  }
  EXPECT_GT(first_query.size(), 10u);
}

// --- multi-key retrieval and subset routing -------------------------------------------

MultiKeySpec MultiKey(int64_t T, int64_t N, int64_t k, int64_t Q, int64_t V) {
  MultiKeySpec s;
  s.seq_len = T;
  s.num_pairs = N;
  s.keys_per_query = k;
  s.num_queries = Q;
  s.vocab = V;
  return s;
}

struct Example {
  std::vector<int32_t> in, tgt;
  std::vector<float> mask;
  bool operator==(const Example& o) const { return in == o.in && tgt == o.tgt && mask == o.mask; }
};

Example MakeMultiKey(const MultiKeySpec& s, uint64_t seed, uint64_t index) {
  Example e{std::vector<int32_t>(s.seq_len, -1), std::vector<int32_t>(s.seq_len, -1),
            std::vector<float>(s.seq_len, -1.f)};
  MakeMultiKeyExample(s, seed, index, e.in.data(), e.tgt.data(), e.mask.data());
  return e;
}

// Reads the pairs back from the context and answers every query by the task's
// rule (the payload next to each requested key); checks the layout on the way
// and returns the requested key sets.
std::vector<std::vector<int32_t>> CheckMultiKey(const MultiKeySpec& s, const Example& e) {
  const int64_t T = s.seq_len, N = s.num_pairs, k = s.keys_per_query, Q = s.num_queries;
  const int64_t half = 2 + (s.vocab - 2) / 2, context = T - 2 * k * Q;
  std::map<int32_t, int32_t> payload_of;
  std::map<int32_t, int64_t> position_of;
  std::set<int32_t> payloads;
  for (int64_t t = 0; t < context; t += 2) {
    if (e.in[t] == 0) {
      EXPECT_EQ(e.in[t + 1], 0) << "payload without a key at " << t + 1;
      continue;
    }
    EXPECT_GE(e.in[t], 2);
    EXPECT_LT(e.in[t], half);
    EXPECT_GE(e.in[t + 1], half);
    EXPECT_LT(e.in[t + 1], s.vocab);
    EXPECT_EQ(payload_of.count(e.in[t]), 0u) << "key repeated";
    payload_of[e.in[t]] = e.in[t + 1];
    position_of[e.in[t]] = t;
    payloads.insert(e.in[t + 1]);
  }
  EXPECT_EQ(static_cast<int64_t>(payload_of.size()), N);
  EXPECT_EQ(static_cast<int64_t>(payloads.size()), N);
  for (int64_t t = 0; t < context; ++t) EXPECT_EQ(e.mask[t], 0.f);
  std::vector<std::vector<int32_t>> asked;
  for (int64_t q = 0; q < Q; ++q) {
    const int64_t at = context + 2 * k * q;
    std::vector<int32_t> keys;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t key = e.in[at + j];
      EXPECT_EQ(e.mask[at + j], 0.f);
      EXPECT_EQ(payload_of.count(key), 1u) << "query key " << key << " is not in the context";
      if (j > 0) {
        EXPECT_LT(position_of[e.in[at + j - 1]], position_of[key]) << "not in context order";
      }
      EXPECT_EQ(e.in[at + k + j], kTaskAnswerToken);
      EXPECT_EQ(e.mask[at + k + j], 1.f);
      EXPECT_EQ(e.tgt[at + k + j], payload_of[key]);
      keys.push_back(key);
    }
    asked.push_back(keys);
  }
  float masked = 0;
  for (int64_t t = 0; t < T; ++t) {
    masked += e.mask[t];
    if (e.mask[t] == 0.f) { EXPECT_EQ(e.tgt[t], 0); }
  }
  EXPECT_EQ(masked, static_cast<float>(k * Q)) << "the mask marks exactly the answers";
  return asked;
}

TEST(MultiKeyTest, EveryAnswerIsThePayloadOfARequestedContextKey) {
  // The tightest fit (T = 2N + 2kQ, vocab = 2N + 2) and a roomy one.
  for (const MultiKeySpec& s : {MultiKey(40, 8, 3, 4, 18), MultiKey(300, 8, 3, 4, 40),
                                MultiKey(64, 4, 4, 2, 64)}) {
    for (uint64_t index = 0; index < 30; ++index) {
      CheckMultiKey(s, MakeMultiKey(s, 2, index));
    }
  }
}

TEST(MultiKeyTest, DeterministicPerSeedAndIndexAndVaried) {
  const MultiKeySpec s = MultiKey(300, 8, 2, 4, 40);
  EXPECT_EQ(MakeMultiKey(s, 3, 7), MakeMultiKey(s, 3, 7));
  EXPECT_FALSE(MakeMultiKey(s, 3, 7) == MakeMultiKey(s, 3, 8));
  EXPECT_FALSE(MakeMultiKey(s, 3, 7) == MakeMultiKey(s, 4, 7));
  // The pairs move between examples (no positional shortcut) and the queries
  // ask for many different subsets.
  std::set<int64_t> first_pair;
  std::set<std::vector<int64_t>> subsets;
  for (uint64_t i = 0; i < 100; ++i) {
    const Example e = MakeMultiKey(s, 9, i);
    for (int64_t t = 0; t < 300; ++t) {
      if (e.in[t] != 0) {
        first_pair.insert(t);
        break;
      }
    }
    // Subsets as pair ranks in context order.
    std::vector<int32_t> order;
    for (int64_t t = 0; t < 300 - 16; t += 2) {
      if (e.in[t] != 0) order.push_back(e.in[t]);
    }
    for (const auto& keys : CheckMultiKey(s, e)) {
      std::vector<int64_t> ranks;
      for (int32_t key : keys) {
        ranks.push_back(std::find(order.begin(), order.end(), key) - order.begin());
      }
      subsets.insert(ranks);
    }
  }
  EXPECT_GT(first_pair.size(), 10u);
  EXPECT_EQ(subsets.size(), 28u);  // all C(8, 2) subsets over 400 queries
}

TEST(MultiKeyTest, BadSpecsAreRejected) {
  EXPECT_TRUE(CheckMultiKeySpec(MultiKey(40, 8, 3, 4, 18)).ok());
  EXPECT_FALSE(CheckMultiKeySpec(MultiKey(39, 8, 3, 4, 18)).ok());  // too short
  EXPECT_FALSE(CheckMultiKeySpec(MultiKey(40, 8, 3, 4, 17)).ok());  // too few tokens
  EXPECT_FALSE(CheckMultiKeySpec(MultiKey(400, 8, 9, 4, 64)).ok());  // k > N
  EXPECT_FALSE(CheckMultiKeySpec(MultiKey(400, 8, 0, 4, 64)).ok());
  EXPECT_FALSE(CheckMultiKeySpec(MultiKey(400, 8, 2, 0, 64)).ok());
  EXPECT_FALSE(CheckMultiKeySpec(MultiKey(400, 0, 1, 1, 64)).ok());
}

SubsetRoutingSpec Subset(int64_t T, int64_t k, int64_t Q, int64_t V) {
  SubsetRoutingSpec s;
  s.seq_len = T;
  s.landmarks = k;
  s.num_queries = Q;
  s.vocab = V;
  return s;
}

Example MakeSubset(const SubsetRoutingSpec& s, uint64_t seed, uint64_t index) {
  Example e{std::vector<int32_t>(s.seq_len, -1), std::vector<int32_t>(s.seq_len, -1),
            std::vector<float>(s.seq_len, -1.f)};
  MakeSubsetRoutingExample(s, seed, index, e.in.data(), e.tgt.data(), e.mask.data());
  return e;
}

// Answers every query from the landmarks by the task's rule (channel l is x_l
// when l is selected, else 0), checking the layout; returns the subsets asked
// for, as bit masks.
std::vector<int> CheckSubset(const SubsetRoutingSpec& s, const Example& e) {
  const int64_t T = s.seq_len, k = s.landmarks, Q = s.num_queries, context = T - 2 * k * Q;
  std::vector<int64_t> landmark;
  for (int64_t l = 0; l < k; ++l) landmark.push_back(SubsetLandmarkPosition(s, l));
  for (int64_t l = 0; l < k; ++l) {
    EXPECT_LT(landmark[l], context);
    if (l > 0) { EXPECT_LT(landmark[l - 1], landmark[l]); }
  }
  for (int64_t t = 0; t < context; ++t) {
    const bool is_landmark = std::count(landmark.begin(), landmark.end(), t) > 0;
    if (is_landmark) {
      EXPECT_GE(e.in[t], kSubsetFirstPayload);
      EXPECT_LT(e.in[t], s.vocab);
    } else {
      EXPECT_EQ(e.in[t], 0) << "non-landmark context position " << t;
    }
    EXPECT_EQ(e.mask[t], 0.f);
  }
  std::vector<int> asked;
  for (int64_t q = 0; q < Q; ++q) {
    const int64_t at = context + 2 * k * q;
    int bits = 0;
    for (int64_t l = 0; l < k; ++l) {
      const int32_t flag = e.in[at + l];
      EXPECT_TRUE(flag == kSubsetSelectToken || flag == kSubsetSkipToken) << flag;
      EXPECT_EQ(e.mask[at + l], 0.f);
      if (flag == kSubsetSelectToken) bits |= 1 << l;
      EXPECT_EQ(e.in[at + k + l], kTaskAnswerToken);
      EXPECT_EQ(e.mask[at + k + l], 1.f);
      EXPECT_EQ(e.tgt[at + k + l], flag == kSubsetSelectToken ? e.in[landmark[l]] : 0);
    }
    asked.push_back(bits);
  }
  float masked = 0;
  for (int64_t t = 0; t < T; ++t) {
    masked += e.mask[t];
    if (e.mask[t] == 0.f) { EXPECT_EQ(e.tgt[t], 0); }
  }
  EXPECT_EQ(masked, static_cast<float>(k * Q)) << "the mask marks exactly the answers";
  return asked;
}

TEST(SubsetRoutingTest, EveryAnswerIsTheRequestedLandmarkPayloadOrZero) {
  // The tightest fit (T = k + 2kQ: every context position a landmark) and roomy ones.
  for (const SubsetRoutingSpec& s :
       {Subset(36, 4, 4, 6), Subset(1024, 4, 8, 64), Subset(97, 6, 3, 20), Subset(3, 1, 1, 6)}) {
    for (uint64_t index = 0; index < 30; ++index) CheckSubset(s, MakeSubset(s, 2, index));
  }
}

TEST(SubsetRoutingTest, DeterministicPerSeedAndIndexAndVaried) {
  const SubsetRoutingSpec s = Subset(256, 4, 8, 64);
  EXPECT_EQ(MakeSubset(s, 3, 7), MakeSubset(s, 3, 7));
  EXPECT_FALSE(MakeSubset(s, 3, 7) == MakeSubset(s, 3, 8));
  EXPECT_FALSE(MakeSubset(s, 3, 7) == MakeSubset(s, 4, 7));
  // Payloads and subsets are resampled per example: all 2^4 subsets occur
  // over 800 queries, and the first landmark takes many payload values.
  std::set<int> subsets;
  std::set<int32_t> first_payload;
  for (uint64_t i = 0; i < 100; ++i) {
    const Example e = MakeSubset(s, 9, i);
    for (int bits : CheckSubset(s, e)) subsets.insert(bits);
    first_payload.insert(e.in[SubsetLandmarkPosition(s, 0)]);
  }
  EXPECT_EQ(subsets.size(), 16u);
  EXPECT_GT(first_payload.size(), 30u);
}

TEST(SubsetRoutingTest, BadSpecsAreRejected) {
  EXPECT_TRUE(CheckSubsetRoutingSpec(Subset(36, 4, 4, 6)).ok());
  EXPECT_FALSE(CheckSubsetRoutingSpec(Subset(35, 4, 4, 6)).ok());  // too short
  EXPECT_FALSE(CheckSubsetRoutingSpec(Subset(36, 4, 4, 5)).ok());  // one payload value
  EXPECT_FALSE(CheckSubsetRoutingSpec(Subset(36, 0, 4, 6)).ok());
  EXPECT_FALSE(CheckSubsetRoutingSpec(Subset(36, 4, 0, 6)).ok());
}

// The sampler serves both tasks by global sequence index, evaluation from a
// disjoint stream, and the validator names the offending field.
TEST(BatchSamplerTest, RoutingTasksComeFromTheirGenerators) {
  const std::string configs = std::string(SMAT_SOURCE_DIR) + "/configs/";
  for (const std::string name : {"multikey_cpu.textproto", "subset_cpu.textproto"}) {
    auto cfg = LoadConfig(configs + name);
    ASSERT_TRUE(cfg.ok()) << name << ": " << cfg.status();
    const DataConfig& d = cfg->data();
    auto sampler = BatchSampler::Create(d, cfg->model().vocab_size(), /*dp=*/2);
    ASSERT_TRUE(sampler.ok()) << sampler.status();
    auto batch = (*sampler)->TrainBatchAt(10, 1);  // sequences 10 + B ...
    auto eval = (*sampler)->EvalBatch(0);
    ASSERT_TRUE(batch.ok() && eval.ok());
    EXPECT_TRUE((*sampler)->has_eval());
    const int64_t T = d.seq_len(), g = 10 + d.batch_size() + 1;
    Example want{std::vector<int32_t>(T), std::vector<int32_t>(T), std::vector<float>(T)};
    if (d.kind() == DataConfig::MULTI_KEY) {
      MakeMultiKeyExample(MultiKey(T, d.num_pairs(), d.keys_per_query(), d.num_queries(), d.vocab()),
                          d.seed(), g, want.in.data(), want.tgt.data(), want.mask.data());
    } else {
      ASSERT_EQ(d.kind(), DataConfig::SUBSET_ROUTING);
      MakeSubsetRoutingExample(Subset(T, d.landmarks(), d.num_queries(), d.vocab()), d.seed(), g,
                               want.in.data(), want.tgt.data(), want.mask.data());
    }
    EXPECT_EQ(std::memcmp(batch->inputs.data<int32_t>() + T, want.in.data(), T * 4), 0);
    EXPECT_EQ(std::memcmp(batch->targets.data<int32_t>() + T, want.tgt.data(), T * 4), 0);
    EXPECT_EQ(std::memcmp(batch->loss_mask.data<float>() + T, want.mask.data(), T * 4), 0);
    EXPECT_NE(std::memcmp(eval->inputs.data<int32_t>(), batch->inputs.data<int32_t>(), T * 4), 0);
    EXPECT_EQ(BatchSampler::Create(d, d.vocab() - 1, 1).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  auto k_too_big = LoadConfig(configs + "multikey_cpu.textproto", {"data.keys_per_query=99"});
  EXPECT_TRUE(Contains(k_too_big.status(), "data.keys_per_query")) << k_too_big.status();
  auto too_short = LoadConfig(configs + "subset_cpu.textproto", {"data.seq_len=40"});
  EXPECT_TRUE(Contains(too_short.status(), "data.seq_len")) << too_short.status();
  auto no_landmarks = LoadConfig(configs + "subset_cpu.textproto", {"data.landmarks=0"});
  EXPECT_TRUE(Contains(no_landmarks.status(), "data.landmarks")) << no_landmarks.status();
  auto placed = LoadConfig(configs + "multikey_cpu.textproto", {"data.layout=PLACED"});
  EXPECT_TRUE(Contains(placed.status(), "data.layout")) << placed.status();
}

}  // namespace
}  // namespace smat
