// Progress lines of a training run (progress.h).
#include "trainer/progress.h"

#include <unistd.h>

#include <cmath>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace smat {

std::string FormatDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  if (seconds < 1.0) return absl::StrFormat("%.0f ms", seconds * 1e3);
  if (seconds < 60.0) return absl::StrFormat("%.1f s", seconds);
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
}

std::string FormatBytes(double bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  if (u == 0) return absl::StrFormat("%.0f B", bytes);
  return absl::StrFormat(bytes < 10 ? "%.2f %s" : "%.1f %s", bytes, kUnits[u]);
}

std::string FormatCount(double count) {
  if (count < 1e3) return absl::StrFormat("%.0f", count);
  if (count < 1e6) return absl::StrFormat("%.1fk", count / 1e3);
  if (count < 1e9) return absl::StrFormat("%.2fM", count / 1e6);
  return absl::StrFormat("%.2fG", count / 1e9);
}

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

std::string FormatProgressLine(const ProgressLine& l) {
  const int width = static_cast<int>(absl::StrCat(l.total_steps).size());
  std::string s = absl::StrFormat("step %*d/%d  loss %.4f  lr %.2e  gnorm %.3g  %s tok/s  %s/step",
                                  width, l.step, l.total_steps, l.loss, l.learning_rate,
                                  l.grad_norm, FormatCount(l.tokens_per_second),
                                  FormatDuration(l.seconds_per_step));
  absl::StrAppend(&s, "  ETA ", FormatDuration(l.eta_seconds), "  mem ",
                  FormatBytes(static_cast<double>(l.memory_bytes)));
  if (l.activation_bytes > 0) {
    absl::StrAppend(&s, " (act ", FormatBytes(static_cast<double>(l.activation_bytes)), ")");
  }
  return s;
}

std::string FormatEvalLine(const EvalLine& l) {
  const int width = static_cast<int>(absl::StrCat(l.total_steps).size());
  std::string s = absl::StrFormat("eval %*d/%d  loss %.4f", width, l.step, l.total_steps, l.loss);
  if (l.bits_per_byte >= 0) absl::StrAppend(&s, absl::StrFormat("  bpb %.4f", l.bits_per_byte));
  if (l.accuracy >= 0) {
    absl::StrAppend(&s, absl::StrFormat("  acc %.2f%% of %.0f answers", 100.0 * l.accuracy,
                                        l.answers));
  }
  if (l.sequences_correct >= 0) {
    absl::StrAppend(&s, absl::StrFormat("  %.0f/%.0f sequences fully correct",
                                        l.sequences_correct, l.sequences));
  }
  return s;
}

ProgressPrinter::ProgressPrinter(std::FILE* out, bool enabled) : out_(out), enabled_(enabled) {}

void ProgressPrinter::Line(const std::string& text) {
  if (!enabled_ || out_ == nullptr) return;
  std::fprintf(out_, "%s\n", text.c_str());
  // Flushed per line: a pipe or file is block-buffered by default, and a
  // progress line that sits in a buffer for minutes is no progress line.
  std::fflush(out_);
}

void ProgressPrinter::Step(const ProgressLine& line) { Line(FormatProgressLine(line)); }
void ProgressPrinter::Eval(const EvalLine& line) { Line(FormatEvalLine(line)); }

}  // namespace smat
