// Checkpoints on disk: the layout, verification, resume and retention
// (ARCHITECTURE.md section 7, docs/FAULT_TOLERANCE.md). Writing, including the
// asynchronous path and the commit protocol, is in trainer/checkpoint_writer.h.
//
// The library knows nothing of the model: a state is a list of named host
// tensors plus the scalars a resumed run needs (step, data cursor, RNG state,
// config text, grid). Layout under the checkpoint directory:
//
//   step_00001000/             one committed checkpoint (the name is the step)
//     manifest.pb              CheckpointManifestFile (core/checkpoint.proto)
//     shard_00000.bin          tensors written by world rank 0
//     shard_00001.bin          ... by rank 1 (one shard per writing rank)
//   step_00002000.tmp-1/       being written by attempt 1 (not a checkpoint)
//   latest                     "step_00002000\n": the newest commit, for tools
//
// A directory named exactly step_NNNNNNNN exists only after every shard and the
// manifest were written and fsynced: it is created by one rename. Resume does
// not trust that alone: FindLatestIntact checks every CRC-32 and falls back to
// an older checkpoint when the newest is damaged.
//
//   std::vector<std::string> skipped;
//   SMAT_ASSIGN_OR_RETURN(std::string path, FindLatestIntact(dir, &skipped));
//   SMAT_ASSIGN_OR_RETURN(CheckpointState state, LoadCheckpoint(path));
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/checkpoint.pb.h"
#include "core/tensor.h"

namespace smat {

// Bumped when the meaning of a manifest field or the shard layout changes.
inline constexpr uint32_t kCheckpointFormatVersion = 1;
inline constexpr char kManifestFileName[] = "manifest.pb";
inline constexpr char kLatestFileName[] = "latest";
// Tensors start at multiples of this in a shard (lets a reader mmap and use
// them in place with any dtype's alignment).
inline constexpr uint64_t kShardAlignment = 64;

struct NamedTensor {
  std::string name;  // unique within a state, e.g. "blocks.3.mixer.wq", "adam.m.blocks.3..."
  Tensor tensor;     // host memory
};

// Everything a run needs to continue from a step. Saved as is and returned
// as is by LoadCheckpoint (tensors in the same order).
struct CheckpointState {
  int64_t step = 0;
  int64_t sampler_cursor = 0;
  std::string rng_state;    // opaque bytes
  std::string config_text;  // ConfigToText of the run's config
  int dp = 1;
  int sp = 1;
  std::vector<NamedTensor> tensors;
};

// "step_00001000" (8 digits; longer when the step needs more).
std::string CheckpointDirName(int64_t step);
// dir + "/" + CheckpointDirName(step).
std::string CheckpointPath(const std::string& dir, int64_t step);
// Step of a committed checkpoint directory name ("step_00001000" -> 1000);
// -1 for anything else (temporaries, "latest", other files).
int64_t ParseCheckpointDirName(const std::string& name);
// "shard_00003.bin".
std::string ShardFileName(int shard);

// Steps of the committed checkpoint directories under `dir`, ascending (not
// verified). An absent `dir` has none.
absl::StatusOr<std::vector<int64_t>> ListCheckpoints(const std::string& dir);

// Reads and checks manifest.pb of the checkpoint at `path` (its CRC-32, the
// format version, the tensor table against the shard sizes), and every shard's
// size and CRC-32. kDataLoss names the file and what failed; kNotFound when
// `path` has no manifest.
absl::StatusOr<CheckpointManifest> VerifyCheckpoint(const std::string& path);

// Path of the newest checkpoint under `dir` that VerifyCheckpoint accepts.
// Every damaged one that is newer is skipped with its message appended to
// `skipped` (when non-null) and printed to stderr. kNotFound when none is
// intact (including an empty or absent `dir`).
absl::StatusOr<std::string> FindLatestIntact(const std::string& dir,
                                             std::vector<std::string>* skipped = nullptr);

// Loads the checkpoint at `path`, checking every CRC as it reads. The result
// does not depend on how many ranks wrote it: any grid may load it.
absl::StatusOr<CheckpointState> LoadCheckpoint(const std::string& path);

// Retention after a commit: keeps the newest `keep_last` checkpoints and every
// one whose step is a multiple of `keep_every` (when > 0); removes the rest.
// A removed checkpoint is first renamed to a temporary name (one atomic step),
// so a crash midway never leaves a half-deleted directory under a valid name.
absl::Status ApplyRetention(const std::string& dir, int keep_last, int64_t keep_every);

// Removes step_*.tmp-* directories (writes or deletions cut short by a
// crash) except those ending in ".tmp-<keep_attempt>" for the checkpoint
// being written now (keep_step; -1 keeps none). Call on one rank only, at a
// point where no other rank writes into a temporary of an earlier attempt.
absl::Status RemoveStaleTemporaries(const std::string& dir, int64_t keep_step = -1,
                                    const std::string& keep_attempt = "");

// Step recorded in `dir`/latest, or -1 when the file is absent or unreadable
// (the launcher's estimate of where a restart resumes; resume itself uses
// FindLatestIntact).
int64_t ReadLatestStep(const std::string& dir);

// --- durable file operations, shared with the writer ----------------------------------
// fsync of a directory, so a rename or creation inside it survives a crash.
absl::Status FsyncDirectory(const std::string& path);
// Writes `bytes` to `path` through path + ".tmp", fsyncs it, renames it over
// `path` and fsyncs the parent directory.
absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes);
// zlib crc32 of `size` bytes continuing from `crc` (0 to start).
uint32_t Crc32(uint32_t crc, const void* data, size_t size);

}  // namespace smat
