// Tests for trainer/data.h and tools/smat_data: token file layout and every
// kind of damaged file, the byte corpus split, MQAR, multi-key retrieval and
// subset routing examples (structure, answers recoverable by each task's rule,
// determinism), and the batch sampler's determinism across dp layouts.
#include "trainer/data.h"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/config.h"
#include "gtest/gtest.h"

namespace smat {
namespace {

namespace fs = std::filesystem;

bool Contains(const absl::Status& s, const std::string& needle) {
  return std::string(s.message()).find(needle) != std::string::npos;
}

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "/data_test_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string WriteBytes(const std::string& name, const std::string& bytes) const {
    const std::string p = Path(name);
    fs::create_directories(fs::path(p).parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  static std::string ReadAll(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  // Tokens of a token file.
  static std::vector<int32_t> Tokens(const std::string& path) {
    auto f = TokenFile::Open(path);
    EXPECT_TRUE(f.ok()) << f.status();
    if (!f.ok()) return {};
    std::vector<int32_t> out(static_cast<size_t>(f->size()));
    EXPECT_TRUE(f->Read(0, f->size(), out.data()).ok());
    return out;
  }

  std::string dir_;
};

TEST(ByteTokenizerTest, RoundTripAndRejectsNonBytes) {
  const std::string text("h\xc3\xa9llo\0\xff", 8);
  const std::vector<int32_t> t = EncodeBytes(text);
  ASSERT_EQ(t.size(), 8u);
  EXPECT_EQ(t[1], 0xc3);
  EXPECT_EQ(t[6], 0);
  EXPECT_EQ(t[7], 255);
  auto back = DecodeBytes(t);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, text);
  const std::vector<int32_t> bad = {65, 256};
  EXPECT_EQ(DecodeBytes(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(DataTest, TokenFileLayoutAndRoundTripAtEachWidth) {
  for (uint64_t vocab : {200ull, 256ull, 50000ull, 100000ull}) {
    std::vector<int32_t> tokens;
    for (int i = 0; i < 1001; ++i) tokens.push_back(static_cast<int32_t>((i * 7919) % vocab));
    const std::string p = Path("t.bin");
    ASSERT_TRUE(WriteTokenFile(p, tokens, vocab).ok());
    const int width = vocab <= 256 ? 1 : vocab <= 65536 ? 2 : 4;
    const std::string raw = ReadAll(p);
    ASSERT_EQ(raw.size(), 32u + 1001u * width);
    EXPECT_EQ(raw.substr(0, 8), "SMATTOK1");
    EXPECT_EQ(raw[8], 1);       // version, little-endian
    EXPECT_EQ(raw[12], width);  // token width
    uint64_t v = 0, n = 0;
    std::memcpy(&v, raw.data() + 16, 8);
    std::memcpy(&n, raw.data() + 24, 8);
    EXPECT_EQ(v, vocab);
    EXPECT_EQ(n, 1001u);
    EXPECT_EQ(Tokens(p), tokens);
  }
}

TEST_F(DataTest, WriterLeavesNothingWithoutFinishAndChecksTokens) {
  {
    auto w = TokenFileWriter::Create(Path("partial.bin"), 10);
    ASSERT_TRUE(w.ok());
    const std::vector<int32_t> ok = {1, 2, 9};
    ASSERT_TRUE(w->Append(ok).ok());
    const std::vector<int32_t> bad = {10};
    const absl::Status s = w->Append(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(s, "token 10 is outside the vocabulary [0, 10)")) << s;
  }
  EXPECT_TRUE(fs::is_empty(dir_));  // no final file, no temporary left behind
}

TEST_F(DataTest, DamagedAndMismatchedFilesGiveSpecificErrors) {
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5};
  const std::string good_path = Path("good.bin");
  ASSERT_TRUE(WriteTokenFile(good_path, tokens, 300).ok());  // 2-byte tokens
  const std::string good = ReadAll(good_path);

  struct Case {
    std::string name, bytes;
    absl::StatusCode code;
    std::string needle;
  };
  std::string version2 = good;
  version2[8] = 2;
  std::string width3 = good;
  width3[12] = 3;
  std::string big_vocab = good;  // vocabulary 2^20 cannot be 2-byte tokens
  big_vocab[16] = 0;
  big_vocab[17] = 0;
  big_vocab[18] = 0x10;
  const std::vector<Case> cases = {
      {"magic.bin", "GPT2TOK1" + good.substr(8), absl::StatusCode::kInvalidArgument,
       "not a smat token file"},
      {"empty.bin", "", absl::StatusCode::kInvalidArgument, "not a smat token file"},
      {"header.bin", good.substr(0, 20), absl::StatusCode::kDataLoss, "truncated header: 20 bytes"},
      {"short.bin", good.substr(0, good.size() - 1), absl::StatusCode::kDataLoss,
       "header says 5 tokens of 2 bytes, file has 9 bytes of tokens (truncated)"},
      {"long.bin", good + "xx", absl::StatusCode::kDataLoss, "(trailing bytes)"},
      {"version.bin", version2, absl::StatusCode::kInvalidArgument, "format version 2"},
      {"width.bin", width3, absl::StatusCode::kDataLoss, "token width 3"},
      {"vocab.bin", big_vocab, absl::StatusCode::kDataLoss, "vocabulary size 1048576 does not fit"},
  };
  for (const Case& c : cases) {
    auto f = TokenFile::Open(WriteBytes(c.name, c.bytes));
    ASSERT_FALSE(f.ok()) << c.name;
    EXPECT_EQ(f.status().code(), c.code) << c.name << ": " << f.status();
    EXPECT_TRUE(Contains(f.status(), c.needle)) << c.name << ": " << f.status();
    EXPECT_TRUE(Contains(f.status(), c.name)) << "does not name the file: " << f.status();
  }
  // Vocabulary larger than the model's.
  auto f = TokenFile::Open(good_path, 256);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(f.status(), "vocabulary size 300 exceeds model.vocab_size = 256"))
      << f.status();
  EXPECT_EQ(TokenFile::Open(Path("missing.bin")).status().code(), absl::StatusCode::kNotFound);

  // A token beyond the vocabulary is caught when read.
  std::string bad_token = good;
  bad_token[32 + 2 * 3] = static_cast<char>(0x2c);  // token 3 = 300
  bad_token[32 + 2 * 3 + 1] = 0x01;
  auto damaged = TokenFile::Open(WriteBytes("token.bin", bad_token));
  ASSERT_TRUE(damaged.ok()) << damaged.status();
  int32_t out[5];
  const absl::Status s = damaged->Read(0, 5, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(s, "token 3 = 300 is outside the vocabulary")) << s;
}

TEST_F(DataTest, ByteCorpusSplitsEachFileTailAndIsReproducible) {
  WriteBytes("in/b/second.txt", "0123456789");                // 10 bytes: 2 held out at 0.25
  WriteBytes("in/a.txt", "abcdefgh");                         // 8 bytes: 2 held out
  WriteBytes("in/b/c/third.txt", "XYZ");                      // 3 bytes: 0 held out
  const std::string extra = WriteBytes("extra.txt", "!!!!");  // 4 bytes: 1 held out
  const std::string out = Path("in/corpus.bin");              // inside an input dir on purpose
  const std::string held = DefaultHeldoutPath(out);
  EXPECT_EQ(held, Path("in/corpus.heldout.bin"));
  for (int run = 0; run < 2; ++run) {  // the second run must skip its own outputs
    auto stats = WriteByteCorpus({Path("in"), extra}, out, held, 0.25);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->files, 4);
    EXPECT_EQ(stats->train_tokens, 6u + 8u + 3u + 3u);
    EXPECT_EQ(stats->heldout_tokens, 2u + 2u + 0u + 1u);
    // Sorted by path: extra.txt, in/a.txt, in/b/c/third.txt, in/b/second.txt.
    auto train = DecodeBytes(Tokens(out));
    auto heldout = DecodeBytes(Tokens(held));
    ASSERT_TRUE(train.ok() && heldout.ok());
    EXPECT_EQ(*train, "!!!abcdefXYZ01234567");
    EXPECT_EQ(*heldout, "!gh89");
  }
  EXPECT_EQ(WriteByteCorpus({Path("nope")}, out, held, 0.1).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(WriteByteCorpus({extra}, out, held, 1.0).status().code(),
            absl::StatusCode::kInvalidArgument);
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

DataConfig MqarConfig(int batch) {
  DataConfig d;
  d.set_kind(DataConfig::MQAR);
  d.set_seq_len(128);
  d.set_batch_size(batch);
  d.set_num_pairs(8);
  d.set_vocab(64);
  d.set_seed(11);
  return d;
}

bool SameRow(const Tensor& a, int64_t ra, const Tensor& b, int64_t rb) {
  const int64_t T = a.dim(1);
  return std::memcmp(a.data<int32_t>() + ra * T, b.data<int32_t>() + rb * T, T * 4) == 0;
}

// The stream seen through the cursor: a step at cursor c on dp ranks of batch
// B reads sequences [c, c + dp * B), rank k the contiguous share from c + k * B,
// whatever the grid; so a resume on another dp continues at the cursor with
// no sequence skipped or repeated.
TEST(BatchSamplerTest, TrainBatchAtReadsTheGlobalStreamFromTheCursor) {
  auto one = BatchSampler::Create(MqarConfig(4), 64, /*dp=*/1);
  auto two = BatchSampler::Create(MqarConfig(2), 64, /*dp=*/2);
  auto small = BatchSampler::Create(MqarConfig(2), 64, /*dp=*/1);
  ASSERT_TRUE(one.ok() && two.ok() && small.ok());
  EXPECT_EQ((*one)->GlobalBatchSequences(), 4);
  EXPECT_EQ((*two)->GlobalBatchSequences(), 4);
  // Cursor 6 (not a multiple of either global batch: a run that changed grid).
  auto a = (*one)->TrainBatchAt(6, 0);       // sequences 6..9
  auto r0 = (*two)->TrainBatchAt(6, 0);      // 6, 7
  auto r1 = (*two)->TrainBatchAt(6, 1);      // 8, 9
  auto next = (*small)->TrainBatchAt(8, 0);  // 8, 9 as the next step of batch 2
  ASSERT_TRUE(a.ok() && r0.ok() && r1.ok() && next.ok());
  for (int64_t b = 0; b < 2; ++b) {
    EXPECT_TRUE(SameRow(a->inputs, b, r0->inputs, b));
    EXPECT_TRUE(SameRow(a->inputs, 2 + b, r1->inputs, b));
    EXPECT_TRUE(SameRow(a->targets, 2 + b, r1->targets, b));
    EXPECT_TRUE(SameRow(r1->inputs, b, next->inputs, b));
  }
  EXPECT_FALSE(SameRow(a->inputs, 0, a->inputs, 1));
  // The step form is the cursor form of a run that kept its grid.
  auto step3 = (*two)->TrainBatch(3, 1);
  auto at12 = (*two)->TrainBatchAt(12, 1);
  ASSERT_TRUE(step3.ok() && at12.ok());
  EXPECT_TRUE(SameRow(step3->inputs, 1, at12->inputs, 1));
  EXPECT_EQ((*two)->TrainBatchAt(-1, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*two)->TrainBatchAt(0, 2).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BatchSamplerTest, MqarBatchesDependOnlyOnTheGlobalSequenceIndex) {
  auto one = BatchSampler::Create(MqarConfig(4), 64, /*dp=*/1);
  auto two = BatchSampler::Create(MqarConfig(2), 64, /*dp=*/2);
  ASSERT_TRUE(one.ok() && two.ok()) << one.status() << two.status();
  // Step 3 of one rank with batch 4 holds global sequences 12..15; with dp = 2
  // and batch 2, rank 1 of step 3 holds (3 * 2 + 1) * 2 = 14, 15.
  auto a = (*one)->TrainBatch(3, 0);
  auto b = (*two)->TrainBatch(3, 1);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(SameRow(a->inputs, 2, b->inputs, 0));
  EXPECT_TRUE(SameRow(a->targets, 3, b->targets, 1));
  EXPECT_FALSE(SameRow(a->inputs, 0, b->inputs, 0));
  // Repeatable; evaluation examples are not training examples.
  auto again = (*one)->TrainBatch(3, 0);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(SameRow(a->inputs, 1, again->inputs, 1));
  auto eval = (*one)->EvalBatch(3);
  ASSERT_TRUE(eval.ok());
  EXPECT_FALSE(SameRow(a->inputs, 0, eval->inputs, 0));
  EXPECT_EQ(eval->inputs.shape(), Shape({4, 128}));
  EXPECT_EQ((*one)->TrainBatch(0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  // Loss only at the 8 query positions of each sequence.
  double mask_sum = 0;
  for (int64_t i = 0; i < 4 * 128; ++i) mask_sum += a->loss_mask.data<float>()[i];
  EXPECT_EQ(mask_sum, 4 * 8);
}

TEST_F(DataTest, TextBatchesAreShiftedWindowsOfTheFile) {
  std::vector<int32_t> tokens(5000);
  for (int i = 0; i < 5000; ++i) tokens[i] = i % 251;
  ASSERT_TRUE(WriteTokenFile(Path("train.bin"), tokens, 256).ok());
  ASSERT_TRUE(WriteTokenFile(Path("held.bin"),
                             std::vector<int32_t>(tokens.begin(), tokens.begin() + 700), 256)
                  .ok());
  DataConfig d;
  d.set_kind(DataConfig::TEXT);
  d.set_path(Path("train.bin"));
  d.set_heldout_path(Path("held.bin"));
  d.set_seq_len(99);
  d.set_batch_size(3);
  d.set_seed(2);
  auto s = BatchSampler::Create(d, 256, 1);
  ASSERT_TRUE(s.ok()) << s.status();
  auto b = (*s)->TrainBatch(5, 0);
  ASSERT_TRUE(b.ok());
  const int32_t* in = b->inputs.data<int32_t>();
  const int32_t* tg = b->targets.data<int32_t>();
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t t = 0; t < 99; ++t) {
      EXPECT_EQ(tg[r * 99 + t], (in[r * 99 + t] + 1) % 251);  // next token of the file
      EXPECT_EQ(b->loss_mask.data<float>()[r * 99 + t], 1.f);
    }
  }
  EXPECT_NE(in[0], in[99]);  // different random windows (equal with prob. 1/251)
  // Evaluation reads consecutive windows of seq_len + 1 tokens: 700 / 100 = 7
  // windows, 2 batches of 3.
  EXPECT_EQ((*s)->NumEvalBatches(), 2);
  auto e = (*s)->EvalBatch(0);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->inputs.data<int32_t>()[0], 0);
  EXPECT_EQ(e->inputs.data<int32_t>()[99], 100);

  // Too short a file, too small a model vocabulary, and kinds without a generator.
  d.set_seq_len(5000);
  EXPECT_TRUE(Contains(BatchSampler::Create(d, 256, 1).status(), "fewer than data.seq_len + 1"));
  d.set_seq_len(99);
  EXPECT_EQ(BatchSampler::Create(d, 128, 1).status().code(), absl::StatusCode::kInvalidArgument);
  d.set_kind(DataConfig::SUBSET_ROUTING);  // no landmarks set
  EXPECT_TRUE(Contains(BatchSampler::Create(d, 256, 1).status(), "SUBSET_ROUTING"));
}

// The shipped configs drive the sampler as the trainer will: LoadConfig, then
// BatchSampler::Create with the model's vocabulary and the dp size.
TEST_F(DataTest, ShippedConfigsDriveTheSampler) {
  const std::string configs = std::string(SMAT_SOURCE_DIR) + "/configs/";
  std::vector<int32_t> tokens(4000);
  for (int i = 0; i < 4000; ++i) tokens[i] = (i * 31) % 256;
  ASSERT_TRUE(WriteTokenFile(Path("b.bin"), tokens, 256).ok());
  ASSERT_TRUE(WriteTokenFile(Path("b.heldout.bin"), tokens, 256).ok());
  auto text =
      LoadConfig(configs + "bytes_cpu.textproto",
                 {"data.path=" + Path("b.bin"), "data.heldout_path=" + Path("b.heldout.bin")});
  ASSERT_TRUE(text.ok()) << text.status();
  auto demo = LoadConfig(configs + "demo_cpu.textproto");
  ASSERT_TRUE(demo.ok()) << demo.status();
  for (const TrainConfig& cfg : {*text, *demo}) {
    auto sampler = BatchSampler::Create(cfg.data(), cfg.model().vocab_size(), cfg.parallel().dp());
    ASSERT_TRUE(sampler.ok()) << sampler.status();
    auto batch = (*sampler)->TrainBatch(0, 0);
    ASSERT_TRUE(batch.ok()) << batch.status();
    EXPECT_EQ(batch->inputs.shape(), Shape({cfg.data().batch_size(), cfg.data().seq_len()}));
    EXPECT_TRUE((*sampler)->has_eval());
  }
}

#ifdef SMAT_DATA_BIN
int RunTool(const std::string& cmd) {
  const int rc = std::system((cmd + " >/dev/null 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

TEST_F(DataTest, SmatDataToolWritesAndDescribesTokenFiles) {
  WriteBytes("docs/one.txt", std::string(100, 'a'));
  WriteBytes("docs/two.txt", std::string(50, 'b'));
  const std::string bin = SMAT_DATA_BIN;
  ASSERT_EQ(RunTool(bin + " bytes --input " + Path("docs") + " --output " + Path("d.bin") +
                    " --heldout_fraction 0.1"),
            0);
  EXPECT_EQ(Tokens(Path("d.bin")).size(), 90u + 45u);
  EXPECT_EQ(Tokens(Path("d.heldout.bin")).size(), 10u + 5u);
  EXPECT_EQ(RunTool(bin + " info " + Path("d.bin")), 0);
  // Output folders are created.
  ASSERT_EQ(RunTool(bin + " bytes --output " + Path("new/sub/e.bin") + " " + Path("docs/one.txt")),
            0);
  EXPECT_EQ(Tokens(Path("new/sub/e.bin")).size(), 100u);
  EXPECT_EQ(RunTool(bin + " info " + Path("docs/one.txt")), 1);     // not a token file
  EXPECT_EQ(RunTool(bin + " bytes --output " + Path("x.bin")), 2);  // no inputs
  EXPECT_EQ(RunTool(bin + " shuffle"), 2);
}
#endif

}  // namespace
}  // namespace smat
