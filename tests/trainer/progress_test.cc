// Progress lines: units, line layout, and that lines written to a
// file are plain newline-terminated text (no carriage returns).
#include "trainer/progress.h"

#include <cstdio>
#include <string>

#include "gtest/gtest.h"

namespace smat {
namespace {

TEST(ProgressTest, Units) {
  EXPECT_EQ(FormatDuration(0.1984), "198 ms");
  EXPECT_EQ(FormatDuration(12.34), "12.3 s");
  EXPECT_EQ(FormatDuration(245), "4m05s");
  EXPECT_EQ(FormatDuration(7980), "2h13m");
  EXPECT_EQ(FormatDuration(-1), "?");
  EXPECT_EQ(FormatBytes(812), "812 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(182.5 * 1024 * 1024), "182.5 MiB");
  EXPECT_EQ(FormatCount(950), "950");
  EXPECT_EQ(FormatCount(41234), "41.2k");
  EXPECT_EQ(FormatCount(3.1e6), "3.10M");
}

TEST(ProgressTest, Lines) {
  ProgressLine p;
  p.step = 50;
  p.total_steps = 200;
  p.loss = 2.31416;
  p.learning_rate = 1e-3;
  p.grad_norm = 0.84;
  p.tokens_per_second = 41234;
  p.seconds_per_step = 0.198;
  p.eta_seconds = 29.7;
  p.memory_bytes = 182.5 * 1024 * 1024;
  p.activation_bytes = 96 * 1024 * 1024;
  EXPECT_EQ(FormatProgressLine(p),
            "step  50/200  loss 2.3142  lr 1.00e-03  gnorm 0.84  41.2k tok/s  198 ms/step  "
            "ETA 29.7 s  mem 182.5 MiB (act 96.0 MiB)");
  EvalLine e;
  e.step = 50;
  e.total_steps = 200;
  e.loss = 0.4123;
  e.accuracy = 0.914;
  e.answers = 2048;
  e.sequences_correct = 63;
  e.sequences = 64;
  EXPECT_EQ(FormatEvalLine(e), "eval  50/200  loss 0.4123  acc 91.40% of 2048 answers  63/64 "
                               "sequences fully correct");
  EvalLine text;
  text.step = 7;
  text.total_steps = 9;
  text.loss = 1.0;
  text.bits_per_byte = 1.4427;
  EXPECT_EQ(FormatEvalLine(text), "eval 7/9  loss 1.0000  bpb 1.4427");
}

TEST(ProgressTest, FileOutputIsPlainLines) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  ProgressPrinter printer(f, /*enabled=*/true);
  ProgressLine p;
  p.step = 1;
  p.total_steps = 2;
  printer.Step(p);
  printer.Line("hello");
  ProgressPrinter silent(f, /*enabled=*/false);
  silent.Line("must not appear");
  std::rewind(f);
  std::string text;
  char buf[512];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  std::fclose(f);
  EXPECT_EQ(text.find('\r'), std::string::npos);
  EXPECT_EQ(text.find("must not appear"), std::string::npos);
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n');
  EXPECT_NE(text.find("step 1/2"), std::string::npos);
  EXPECT_NE(text.find("\nhello\n"), std::string::npos);
}

}  // namespace
}  // namespace smat
