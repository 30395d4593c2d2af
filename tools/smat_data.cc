// smat_data: prepares training data as smat token files (format in trainer/data.h).
//
//   smat_data bytes --input books/,extra.txt --output data/books.bin [--heldout_fraction 0.01]
//                   [--heldout_output data/books.heldout.bin]
//   smat_data bytes --output data/books.bin books/*.txt      (inputs may also follow)
//   smat_data info data/books.bin                             (prints the header)
//
// `bytes` tokenizes at the byte level (vocabulary 256): directories are walked
// recursively in sorted order, and from each file the last heldout_fraction of
// its bytes goes to the held-out file (default name: X.bin -> X.heldout.bin).
// Exit status: 0 on success, 1 when the data cannot be written or read, 2 for
// bad usage.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "trainer/data.h"

ABSL_FLAG(std::vector<std::string>, input, {},
          "bytes: comma-separated files or directories (walked recursively)");
ABSL_FLAG(std::string, output, "", "bytes: training token file to write");
ABSL_FLAG(double, heldout_fraction, 0.0,
          "bytes: fraction in [0, 1) of each file's tail that goes to the held-out file");
ABSL_FLAG(std::string, heldout_output, "",
          "bytes: held-out token file (default: --output with .bin -> .heldout.bin)");

namespace smat {
namespace {

constexpr char kUsage[] =
    "prepares smat token files.\n"
    "  smat_data bytes --input A,B --output OUT.bin [--heldout_fraction F] "
    "[--heldout_output H.bin] [more inputs...]\n"
    "  smat_data info FILE.bin";

int RunBytes(const std::vector<std::string>& extra_inputs) {
  std::vector<std::string> inputs = absl::GetFlag(FLAGS_input);
  inputs.insert(inputs.end(), extra_inputs.begin(), extra_inputs.end());
  const std::string output = absl::GetFlag(FLAGS_output);
  const double fraction = absl::GetFlag(FLAGS_heldout_fraction);
  if (inputs.empty() || output.empty()) {
    std::fprintf(stderr, "smat_data bytes: needs --input and --output\n%s\n", kUsage);
    return 2;
  }
  std::string heldout = absl::GetFlag(FLAGS_heldout_output);
  if (heldout.empty() && fraction > 0) heldout = DefaultHeldoutPath(output);
  absl::StatusOr<ByteCorpusStats> stats = WriteByteCorpus(inputs, output, heldout, fraction);
  if (!stats.ok()) {
    std::fprintf(stderr, "smat_data bytes: %s\n", std::string(stats.status().message()).c_str());
    return stats.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::printf("smat_data: %lld files -> %s (%llu tokens)", static_cast<long long>(stats->files),
              output.c_str(), static_cast<unsigned long long>(stats->train_tokens));
  if (fraction > 0) {
    std::printf(", %s (%llu tokens)", heldout.c_str(),
                static_cast<unsigned long long>(stats->heldout_tokens));
  }
  std::printf("\n");
  return 0;
}

int RunInfo(const std::vector<std::string>& files) {
  if (files.empty()) {
    std::fprintf(stderr, "smat_data info: name at least one token file\n%s\n", kUsage);
    return 2;
  }
  int rc = 0;
  for (const std::string& path : files) {
    absl::StatusOr<TokenFile> f = TokenFile::Open(path);
    if (!f.ok()) {
      std::fprintf(stderr, "smat_data info: %s\n", std::string(f.status().message()).c_str());
      rc = 1;
      continue;
    }
    std::printf("%s: %lld tokens, vocabulary %llu, %d byte(s) per token\n", path.c_str(),
                static_cast<long long>(f->size()), static_cast<unsigned long long>(f->vocab_size()),
                f->token_width());
  }
  return rc;
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) {
    std::fprintf(stderr, "smat_data: expected a command (bytes, info)\n%s\n", kUsage);
    return 2;
  }
  const std::string command = args[1];
  const std::vector<std::string> rest(args.begin() + 2, args.end());
  if (command == "bytes") return RunBytes(rest);
  if (command == "info") return RunInfo(rest);
  std::fprintf(stderr, "smat_data: unknown command '%s'\n%s\n", command.c_str(), kUsage);
  return 2;
}

}  // namespace
}  // namespace smat

int main(int argc, char** argv) { return smat::Main(argc, argv); }
