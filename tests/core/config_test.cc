// Tests for core/config.h: every shipped config in configs/ loads and validates,
// defaults fill only what is unset, overrides apply (including explicit zeros),
// and each kind of bad config gives an error that names the problem: unknown
// field with its line, wrong type, out-of-range value, syntax error, missing
// file, bad --set path, bad --set value, and cross-field rules.
#include "core/config.h"

#include <dirent.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

#ifndef SMAT_SOURCE_DIR
#error "SMAT_SOURCE_DIR must be defined by tests/core/CMakeLists.txt"
#endif

namespace smat {
namespace {

bool Contains(const absl::Status& s, const std::string& needle) {
  return std::string(s.message()).find(needle) != std::string::npos;
}

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "/config_test_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (const std::string& p : written_) std::remove(p.c_str());
    ::rmdir(dir_.c_str());
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string p = dir_ + "/" + name;
    std::ofstream(p) << text;
    written_.push_back(p);
    return p;
  }
  // Loads `text` as a file expecting kInvalidArgument mentioning every needle.
  void ExpectInvalid(const std::string& text, const std::vector<std::string>& needles,
                     const std::vector<std::string>& overrides = {}) {
    const std::string path = Write("bad.textproto", text);
    auto cfg = LoadConfig(path, overrides);
    ASSERT_FALSE(cfg.ok()) << "accepted:\n" << text;
    EXPECT_EQ(cfg.status().code(), absl::StatusCode::kInvalidArgument) << cfg.status();
    for (const std::string& n : needles) {
      EXPECT_TRUE(Contains(cfg.status(), n)) << "missing '" << n << "' in:\n"
                                             << cfg.status().message();
    }
  }

  std::string dir_;
  std::vector<std::string> written_;
};

// A valid base that the error tests modify one thing at a time.
const char kBase[] = R"pb(
  data { kind: MQAR seq_len: 512 num_pairs: 8 vocab: 64 }
  model { vocab_size: 64 width: 32 heads: 2 layers: 1 }
)pb";

TEST_F(ConfigTest, EveryShippedConfigLoadsAndValidates) {
  const std::string dir = std::string(SMAT_SOURCE_DIR) + "/configs";
  DIR* d = ::opendir(dir.c_str());
  ASSERT_NE(d, nullptr) << dir;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.size() > 10 && n.substr(n.size() - 10) == ".textproto") names.push_back(n);
  }
  ::closedir(d);
  ASSERT_GE(names.size(), 2u);
  for (const std::string& n : names) {
    auto cfg = LoadConfig(dir + "/" + n);
    EXPECT_TRUE(cfg.ok()) << n << ": " << cfg.status();
    if (!cfg.ok()) continue;
    // The effective config survives a text round trip exactly.
    auto back = ParseConfigText(ConfigToText(*cfg), n);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->SerializeAsString(), cfg->SerializeAsString()) << n;
  }
  auto demo = LoadConfig(dir + "/demo_cpu.textproto");
  ASSERT_TRUE(demo.ok()) << demo.status();
  EXPECT_EQ(demo->parallel().sp(), 2);
  EXPECT_EQ(demo->data().seq_len(), 4096);
  EXPECT_EQ(demo->smat().d(), 2);
  EXPECT_EQ(demo->data().kind(), DataConfig::MQAR);
  auto tiny = LoadConfig(dir + "/tiny_cpu.textproto");
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_EQ(tiny->parallel().device(), "cpu");
}

TEST_F(ConfigTest, DefaultsFillOnlyUnsetFields) {
  auto cfg = ParseConfigText(
      "run { name: \"r1\" steps: 50 }\noptimizer { weight_decay: 0 lr: 1e-3 }", "<inline>");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  ApplyDefaults(*cfg);
  EXPECT_EQ(cfg->optimizer().weight_decay(), 0.f);    // explicit zero kept
  EXPECT_FLOAT_EQ(cfg->optimizer().min_lr(), 1e-4f);  // derived: lr / 10
  EXPECT_EQ(cfg->optimizer().total_steps(), 50);      // derived: run.steps
  EXPECT_FLOAT_EQ(cfg->optimizer().beta2(), 0.95f);
  EXPECT_EQ(cfg->model().width(), 256);
  EXPECT_EQ(cfg->model().head_dim_qk(), 64);  // width / heads
  EXPECT_EQ(cfg->model().mlp_hidden(), 1024);
  EXPECT_TRUE(cfg->model().tied_embeddings());
  EXPECT_EQ(cfg->run().dir(), "runs/r1");
  EXPECT_EQ(cfg->checkpoint().dir(), "runs/r1/checkpoints");
  EXPECT_EQ(cfg->checkpoint().resume(), "auto");
  EXPECT_EQ(cfg->metrics().job_name(), "r1");
  EXPECT_EQ(cfg->parallel().device(), "cpu");
  EXPECT_EQ(cfg->smat().d(), 2);
  // Idempotent.
  TrainConfig again = *cfg;
  ApplyDefaults(again);
  EXPECT_EQ(again.SerializeAsString(), cfg->SerializeAsString());
}

TEST_F(ConfigTest, OverridesApplyBeforeDefaults) {
  const std::string path = Write("ok.textproto",
                                 "data { kind: MQAR seq_len: 512 num_pairs: 8 vocab: 64 seed: 5 }\n"
                                 "model { vocab_size: 64 width: 32 heads: 2 layers: 1 }\n");
  auto cfg = LoadConfig(path, {"optimizer.lr=3e-4", "run.name=demo2", "data.seed=0",
                               "model.gated=true", "data.layout=PLACED", "run.dir='/tmp/x y'"});
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_FLOAT_EQ(cfg->optimizer().lr(), 3e-4f);
  EXPECT_FLOAT_EQ(cfg->optimizer().min_lr(), 3e-5f);
  EXPECT_EQ(cfg->run().name(), "demo2");
  EXPECT_EQ(cfg->metrics().job_name(), "demo2");
  EXPECT_EQ(cfg->data().seed(), 0);  // an explicit zero overrides 5
  EXPECT_TRUE(cfg->model().gated());
  EXPECT_EQ(cfg->data().layout(), DataConfig::PLACED);
  EXPECT_EQ(cfg->run().dir(), "/tmp/x y");
  EXPECT_EQ(cfg->data().num_pairs(), 8);  // untouched by the overrides
}

TEST_F(ConfigTest, MissingFileIsNotFound) {
  auto cfg = LoadConfig(dir_ + "/nope.textproto");
  EXPECT_EQ(cfg.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Contains(cfg.status(), "nope.textproto")) << cfg.status();
}

TEST_F(ConfigTest, UnknownFieldNamesFileLineColumnAndMessage) {
  const std::string path = Write("typo.textproto",
                                 "run { name: \"x\" }\n"
                                 "optimizer {\n"
                                 "  lerning_rate: 3e-4\n"
                                 "}\n");
  auto cfg = LoadConfig(path);
  ASSERT_FALSE(cfg.ok());
  EXPECT_EQ(cfg.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      Contains(cfg.status(), path + ":3:3: unknown field 'lerning_rate' in smat.OptimizerConfig"))
      << cfg.status();
  // A close misspelling gets a suggestion.
  ExpectInvalid("model {\n  widht: 3\n}\n",
                {":2:3: unknown field 'widht' in smat.ModelConfig", "did you mean 'width'?"});
}

TEST_F(ConfigTest, WrongTypeNamesTheField) {
  ExpectInvalid("model {\n  width: \"wide\"\n}\n",
                {"bad.textproto:2:10:", "'width'", "Expected integer"});
  ExpectInvalid("data { kind: BOOKS }",
                {":1:14:", "Unknown enumeration value of \"BOOKS\"", "\"kind\""});
  ExpectInvalid("model { width: 3000000000 }", {":1:16:", "'width'", "out of range"});
}

TEST_F(ConfigTest, SyntaxErrorHasPosition) {
  ExpectInvalid("model {\n  width: 32\n", {"bad.textproto:3:1:", "is a closing '}' missing?"});
  ExpectInvalid("model { width: 32 width: 64 }",
                {":1:24:", "\"width\" is specified multiple times"});
  ExpectInvalid("model { width 32 }", {"bad.textproto:1:15:", "Expected \":\""});
}

TEST_F(ConfigTest, OutOfRangeValuesNameFieldAndValue) {
  ExpectInvalid(std::string(kBase) + "smat { d: 9 }",
                {"config: smat.d = 9 is out of range; expected 1..8"});
  ExpectInvalid(std::string(kBase) + "optimizer { lr: 0 }",
                {"config: optimizer.lr = 0 must be > 0"});
  ExpectInvalid(std::string(kBase) + "smat { chunk: 0 }",
                {"config: smat.chunk = 0 must be at least 1"});
  ExpectInvalid(std::string(kBase) + "parallel { dp: 0 }",
                {"config: parallel.dp = 0 must be at least 1"});
  ExpectInvalid(std::string(kBase) + "smat { q: 6 }", {"config: smat.q = 6 is not prime"});
  ExpectInvalid(std::string(kBase) + "optimizer { beta2: 1 }",
                {"config: optimizer.beta2 = 1 is out of range"});
  ExpectInvalid(std::string(kBase) + "parallel { device: \"tpu\" }",
                {"config: parallel.device = \"tpu\" is not a device"});
}

TEST_F(ConfigTest, CrossFieldRules) {
  // 384 / 6 = 64 is fine; 384 / 7 is not.
  EXPECT_TRUE(LoadConfig(Write("ok.textproto",
                               "data { kind: MQAR seq_len: 512 num_pairs: 8 vocab: 64 }\n"
                               "model { vocab_size: 64 width: 384 heads: 6 }"))
                  .ok());
  ExpectInvalid(
      "data { kind: MQAR seq_len: 512 num_pairs: 8 vocab: 64 }\n"
      "model { vocab_size: 64 width: 384 heads: 7 }",
      {"config: model.heads = 7 does not divide model.width = 384"});
  ExpectInvalid(
      std::string(kBase) + "parallel { sp: 16 } smat { chunk: 64 }",
      {"data.seq_len = 512 has 8 chunks of smat.chunk = 64, fewer than parallel.sp = 16"});
  ExpectInvalid(std::string(kBase) + "parallel { sp: 2 } smat { chunk: 100 }",
                {"data.seq_len = 512 is not a multiple of smat.chunk = 100"});
  ExpectInvalid(kBase, {"data.vocab = 128 exceeds model.vocab_size = 64"}, {"data.vocab=128"});
  ExpectInvalid(kBase, {"data.num_pairs = 200 does not fit data.seq_len = 512"},
                {"data.num_pairs=200"});
  // A message given twice in a file is refused like a scalar given twice.
  ExpectInvalid(std::string(kBase) + "data { seed: 3 }", {"\"data\" is specified multiple times"});
  ExpectInvalid(std::string(kBase) + "smat { d: 7 }",
                {"smat.d = 7", "does not fit data.seq_len = 512"});
  ExpectInvalid("data { kind: TEXT }", {"data.path is empty"});
  ExpectInvalid("data { kind: TEXT path: \"a.bin\" } run { eval_every: 10 }",
                {"run.eval_every = 10 needs data.heldout_path"});
  // Several problems are reported together, one per line.
  ExpectInvalid(std::string(kBase) + "optimizer { lr: -1 } run { steps: 0 }",
                {"optimizer.lr = -1 must be > 0", "\nconfig: run.steps = 0 must be at least 1"});
}

TEST_F(ConfigTest, BadOverridePath) {
  const std::string base = std::string(kBase);
  ExpectInvalid(base,
                {"--set optimizer.lerning_rate=1: unknown field 'lerning_rate' in "
                 "smat.OptimizerConfig"},
                {"optimizer.lerning_rate=1"});
  ExpectInvalid(base,
                {"--set optimiser.lr=1: unknown field 'optimiser' in smat.TrainConfig",
                 "did you mean 'optimizer'?"},
                {"optimiser.lr=1"});
  ExpectInvalid(base, {"--set model=3: 'model' is a message"}, {"model=3"});
  ExpectInvalid(base, {"--set run.name.x=1: 'name' in smat.RunConfig is a value"},
                {"run.name.x=1"});
  ExpectInvalid(base, {"--set optimizer.lr: expected path.to.field=value"}, {"optimizer.lr"});
}

TEST_F(ConfigTest, BadOverrideValue) {
  const std::string base = std::string(kBase);
  ExpectInvalid(base, {"--set optimizer.lr=fast: field 'lr': Expected double, got: fast"},
                {"optimizer.lr=fast"});
  ExpectInvalid(base, {"--set data.kind=BOOKS:", "Unknown enumeration value of \"BOOKS\""},
                {"data.kind=BOOKS"});
  ExpectInvalid(base, {"is not a single number, enum name or true/false"},
                {"optimizer.lr=1 } model { width: 3"});
  // A value that parses but is out of range is caught by validation.
  ExpectInvalid(base, {"config: smat.d = 0 is out of range"}, {"smat.d=0"});

  // ApplyOverride leaves the config untouched on error.
  TrainConfig cfg;
  cfg.mutable_optimizer()->set_lr(0.5f);
  EXPECT_FALSE(ApplyOverride(cfg, "optimizer.lr=oops").ok());
  EXPECT_EQ(cfg.optimizer().lr(), 0.5f);
}

}  // namespace
}  // namespace smat
