// Human-readable progress of a training run: one line per logged step, one per
// evaluation (the rank placement table at start-up comes from
// parallel/rank_placement.h). Rank 0 prints; every line is
// complete and newline-terminated (no carriage returns or cursor movement), so
// the same output reads well in a terminal, under mpirun's forwarding and in a
// log file (lines are flushed one by one, since a pipe or file is
// block-buffered). Lines are self-describing, so grep/awk over a log works:
//
//   step  50/200  loss 2.3142  lr 1.00e-03  gnorm 0.84  41.2k tok/s  198 ms/step  ETA 29.7 s  mem 182.5 MiB (act 96.0 MiB)
//   eval  50/200  loss 0.4123  acc 91.40% of 2048 answers  63/64 sequences fully correct
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace smat {

// "950 ms", "12.3 s", "4m05s", "2h13m".
std::string FormatDuration(double seconds);
// "812 B", "1.5 KiB", "182.5 MiB", "3.21 GiB".
std::string FormatBytes(double bytes);
// "950", "41.2k", "3.10M".
std::string FormatCount(double count);

// Resident set size of this process in bytes (Linux /proc/self/statm), 0 when
// unavailable.
int64_t ResidentBytes();

// What one logged training step shows.
struct ProgressLine {
  int64_t step = 0;          // steps completed
  int64_t total_steps = 0;
  double loss = 0;
  double learning_rate = 0;
  double grad_norm = 0;
  double tokens_per_second = 0;  // whole job
  double seconds_per_step = 0;   // mean over the steps since the last line
  double eta_seconds = 0;
  // This rank: the most memory the backend's allocator had in use at once
  // since the previous line (device memory on a GPU; host on the CPU).
  int64_t memory_bytes = 0;
  int64_t activation_bytes = 0;  // this rank: activations kept for backward
};
std::string FormatProgressLine(const ProgressLine& line);

// What one evaluation shows. Fields that do not apply are negative.
struct EvalLine {
  int64_t step = 0;
  int64_t total_steps = 0;
  double loss = 0;
  double bits_per_byte = -1;     // TEXT with a byte vocabulary
  double accuracy = -1;          // recall tasks: answer positions right
  double answers = 0;
  double sequences_correct = -1;  // sequences with every answer right
  double sequences = 0;
};
std::string FormatEvalLine(const EvalLine& line);

// Writes lines to `out` (not owned) when `enabled` (rank 0), nothing otherwise.
class ProgressPrinter {
 public:
  ProgressPrinter(std::FILE* out, bool enabled);

  void Line(const std::string& text);  // any line, e.g. the rank -> host map
  void Step(const ProgressLine& line);
  void Eval(const EvalLine& line);
  bool enabled() const { return enabled_; }

 private:
  std::FILE* out_;
  bool enabled_;
};

}  // namespace smat
