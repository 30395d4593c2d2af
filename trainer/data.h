// Training data: token files, the byte-level tokenizer, and the deterministic
// batch sampler over token files and synthetic tasks (MQAR, multi-key retrieval,
// subset routing).
//
// Token file (written by `smat_data bytes`, read by TokenFile), little-endian:
//   offset  size  field
//        0     8  magic "SMATTOK1"
//        8     4  uint32 version (1)
//       12     4  uint32 token width in bytes: 1 (uint8), 2 (uint16) or 4 (int32)
//       16     8  uint64 vocabulary size V (every token is in [0, V))
//       24     8  uint64 token count N
//       32  N*w  tokens
// The file size must be exactly 32 + N * w: anything else is a damaged file.
//
// Determinism: the training data is one stream of sequences indexed by their
// global sequence index g = 0, 1, 2, ...; sequence g draws its randomness from
// Philox (core/rng.h) with key data.seed and stream g, whatever the grid. A step
// consumes the next G = dp * batch_size sequences from the cursor c (the index
// of the next unread sequence), dp rank k taking the contiguous share
// [c + k * batch_size, c + (k + 1) * batch_size), and the cursor moves to c + G.
// Contiguous rather than strided: one dp rank on batch 2B reads exactly what
// ranks 0 and 1 of a dp = 2, batch B grid read, in the same order. The cursor is
// what a checkpoint stores, so a run resumed on another grid (another dp, hence
// another G) continues at the next unread sequence: none skipped, none repeated.
// On one grid from step 0 the cursor is step * G.
//
//   SMAT_ASSIGN_OR_RETURN(auto sampler, BatchSampler::Create(cfg.data(), cfg.model().vocab_size(),
//                                                            cfg.parallel().dp()));
//   SMAT_ASSIGN_OR_RETURN(Batch b, sampler->TrainBatchAt(cursor, dp_rank));
//   cursor += sampler->GlobalBatchSequences();
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/config.pb.h"
#include "core/tensor.h"
#include "trainer/tasks.h"

namespace smat {

inline constexpr char kTokenFileMagic[8] = {'S', 'M', 'A', 'T', 'T', 'O', 'K', '1'};
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr int64_t kTokenFileHeaderBytes = 32;

// --- byte-level tokenizer: token = byte value, vocabulary 256 --------------------
inline constexpr int64_t kByteVocab = 256;
std::vector<int32_t> EncodeBytes(const std::string& text);
// Tokens outside [0, 256) are an error (they did not come from EncodeBytes).
absl::StatusOr<std::string> DecodeBytes(absl::Span<const int32_t> tokens);

// Smallest token width (1, 2 or 4 bytes) that holds every token below vocab_size.
int TokenWidthForVocab(uint64_t vocab_size);

// Streams tokens into a token file: header first (count patched on Finish),
// written to a temporary name and renamed onto `path` by Finish, so a crash
// never leaves a file that looks complete.
class TokenFileWriter {
 public:
  static absl::StatusOr<TokenFileWriter> Create(const std::string& path, uint64_t vocab_size);
  TokenFileWriter(TokenFileWriter&& other) noexcept;
  TokenFileWriter& operator=(TokenFileWriter&& other) noexcept;
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;
  ~TokenFileWriter();  // without Finish: removes the temporary file

  // Appends tokens; each must be in [0, vocab_size).
  absl::Status Append(absl::Span<const int32_t> tokens);
  // Appends raw bytes as tokens (byte tokenizer; needs a 1-byte token width).
  absl::Status AppendBytes(const char* data, size_t n);
  // Writes the count, flushes to disk and renames onto the final path.
  absl::Status Finish();
  uint64_t count() const { return count_; }

 private:
  TokenFileWriter() = default;
  absl::Status WriteRaw(const void* data, size_t n);

  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  uint64_t vocab_size_ = 0;
  int width_ = 1;
  uint64_t count_ = 0;
};

// Writes a whole token file at once (tests, small outputs).
absl::Status WriteTokenFile(const std::string& path, absl::Span<const int32_t> tokens,
                            uint64_t vocab_size);

// A token file mapped read-only into memory. Movable, not copyable.
class TokenFile {
 public:
  // Opens and validates the header and size. max_vocab > 0 additionally requires
  // the file's vocabulary to fit the model (file V <= max_vocab). Errors:
  // kNotFound, kInvalidArgument (not a token file, vocabulary too large),
  // kDataLoss (unknown version or width, truncated or oversized).
  static absl::StatusOr<TokenFile> Open(const std::string& path, uint64_t max_vocab = 0);
  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  const std::string& path() const { return path_; }
  int64_t size() const { return static_cast<int64_t>(count_); }
  uint64_t vocab_size() const { return vocab_size_; }
  int token_width() const { return width_; }

  // Copies tokens [start, start + n) into out, checking each is below the
  // vocabulary (a token outside it means the file is damaged: kDataLoss).
  absl::Status Read(int64_t start, int64_t n, int32_t* out) const;

 private:
  TokenFile() = default;
  void Release();

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  uint64_t vocab_size_ = 0;
  uint64_t count_ = 0;
  int width_ = 1;
};

// --- byte corpus (smat_data bytes) ----------------------------------------------------

struct ByteCorpusStats {
  int64_t files = 0;
  uint64_t train_tokens = 0;
  uint64_t heldout_tokens = 0;
};

// Byte-tokenizes files into token files (vocabulary 256). `inputs` are files or
// directories (walked recursively; regular files only, in sorted path order, so
// the output is reproducible; the outputs themselves are skipped). From each
// file the last floor(size * heldout_fraction) bytes go to `heldout_path`, the
// rest to `train_path`, so every document contributes to both sides and no
// text is in both. heldout_fraction in [0, 1); 0 writes no held-out file.
//   WriteByteCorpus({"books/"}, "data/books.bin", "data/books.heldout.bin", 0.01)
absl::StatusOr<ByteCorpusStats> WriteByteCorpus(const std::vector<std::string>& inputs,
                                                const std::string& train_path,
                                                const std::string& heldout_path,
                                                double heldout_fraction);

// "data/books.bin" -> "data/books.heldout.bin"; other names get ".heldout" appended.
std::string DefaultHeldoutPath(const std::string& train_path);

// --- batches -----------------------------------------------------------------------

// One step's data for one data-parallel rank. Position t of sequence b predicts
// targets[b, t] from inputs[b, 0..t]; the loss is averaged over loss_mask.
struct Batch {
  Tensor inputs;     // int32 (B, T)
  Tensor targets;    // int32 (B, T); 0 where loss_mask is 0
  Tensor loss_mask;  // fp32 (B, T); 1 where the loss counts, else 0
};

class BatchSampler {
 public:
  // TEXT opens data.path (and data.heldout_path when set) with the model's
  // vocabulary as the limit; MQAR, MULTI_KEY and SUBSET_ROUTING need no files.
  static absl::StatusOr<std::unique_ptr<BatchSampler>> Create(const DataConfig& data,
                                                              int64_t model_vocab, int dp);

  // Training batch of dp rank `dp_rank` for the step whose first global
  // sequence is `cursor`: sequences [cursor + dp_rank * B, cursor + (dp_rank + 1) * B)
  // with B = data.batch_size.
  absl::StatusOr<Batch> TrainBatchAt(int64_t cursor, int dp_rank) const;
  // Step `step` of a run that kept one grid since step 0:
  // TrainBatchAt(step * GlobalBatchSequences(), dp_rank).
  absl::StatusOr<Batch> TrainBatch(int64_t step, int dp_rank) const;
  // Sequences one step consumes over all dp ranks: dp * data.batch_size.
  int64_t GlobalBatchSequences() const { return dp_ * data_.batch_size(); }
  // Evaluation batch `index` (same size): TEXT reads consecutive, non-overlapping
  // windows of the held-out file (wrapping around); the synthetic tasks draw
  // fresh examples from a stream disjoint from training.
  absl::StatusOr<Batch> EvalBatch(int64_t index) const;
  // Number of distinct evaluation batches before TEXT windows repeat (synthetic
  // tasks: 0, unbounded); 0 also when there is no held-out file.
  int64_t NumEvalBatches() const;
  bool has_eval() const;

 private:
  BatchSampler() = default;
  absl::StatusOr<Batch> TextBatch(const TokenFile& file, int64_t first_sequence, bool random) const;
  absl::StatusOr<Batch> SyntheticBatch(uint64_t first_example, uint64_t stream_base) const;

  DataConfig data_;
  int dp_ = 1;
  std::unique_ptr<TokenFile> train_;
  std::unique_ptr<TokenFile> heldout_;
};

}  // namespace smat
