// Tests for trainer/data.h and tools/smat_data: token file layout and every
// kind of damaged file, the byte corpus split, and the batch sampler's
// determinism across dp layouts. The synthetic tasks' generators are tested in
// tasks_test.cc.
#include "trainer/data.h"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
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
