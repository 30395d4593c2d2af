// Checkpoint layout, verification, resume and retention (trainer/checkpoint.h).
#include "trainer/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "core/status.h"

namespace smat {
namespace {

constexpr char kStepPrefix[] = "step_";
constexpr char kTempMarker[] = ".tmp-";

std::string ErrnoText(int err) { return std::strerror(err); }

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads all of `path`. kNotFound when absent, kDataLoss for read errors (an
// unreadable checkpoint file is a damaged one as far as resume is concerned).
absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("no file '", path, "'"));
    return absl::DataLossError(absl::StrCat("cannot open '", path, "': ", ErrnoText(err)));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return absl::DataLossError(absl::StrCat("cannot stat '", path, "': ", ErrnoText(errno)));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(fd.get(), out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::DataLossError(absl::StrCat("reading '", path, "' failed: ", ErrnoText(errno)));
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  out.resize(done);
  return out;
}

absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return names;
    return absl::UnavailableError(
        absl::StrCat("checkpoint: cannot list '", dir, "': ", ErrnoText(errno)));
  }
  while (struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

// rm -r of `path` (a checkpoint directory holds plain files only, but nested
// directories are handled so that nothing is left behind).
absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("cannot stat '", path, "': ", ErrnoText(errno)));
  }
  if (S_ISDIR(st.st_mode)) {
    SMAT_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDirectory(path));
    for (const std::string& name : names) SMAT_RETURN_IF_ERROR(RemoveTree(path + "/" + name));
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT) {
      return absl::UnavailableError(absl::StrCat("cannot remove '", path, "': ", ErrnoText(errno)));
    }
  } else if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::UnavailableError(absl::StrCat("cannot remove '", path, "': ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

std::string ParentDirectory(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Parses and checks manifest.pb of `path`; `file` is its path, for messages.
absl::StatusOr<CheckpointManifest> ReadManifest(const std::string& path) {
  const std::string file = path + "/" + kManifestFileName;
  absl::StatusOr<std::string> bytes = ReadWholeFile(file);
  if (!bytes.ok()) {
    if (absl::IsNotFound(bytes.status())) {
      return absl::NotFoundError(absl::StrCat("checkpoint '", path, "' has no ", kManifestFileName,
                                              " (not a checkpoint, or written by a crashed save)"));
    }
    return bytes.status();
  }
  CheckpointManifestFile envelope;
  if (!envelope.ParseFromString(*bytes)) {
    return absl::DataLossError(absl::StrCat("checkpoint manifest '", file, "' (", bytes->size(),
                                            " bytes) does not parse: truncated or overwritten"));
  }
  const uint32_t crc = Crc32(0, envelope.manifest().data(), envelope.manifest().size());
  if (crc != envelope.crc32()) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint manifest '%s': CRC-32 mismatch (stored %08x, computed %08x over %d bytes): "
        "the file is damaged",
        file, envelope.crc32(), crc, envelope.manifest().size()));
  }
  CheckpointManifest manifest;
  if (!manifest.ParseFromString(envelope.manifest())) {
    return absl::DataLossError(absl::StrCat("checkpoint manifest '", file,
                                            "': CRC matches but the manifest does not "
                                            "parse (written by an incompatible smat?)"));
  }
  if (manifest.format_version() != kCheckpointFormatVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint manifest '", file, "' has format version ",
                     manifest.format_version(), "; this smat reads version ",
                     kCheckpointFormatVersion, ": load it with the smat that wrote it"));
  }
  // The tensor table must fit in the shards it names.
  for (const CheckpointTensor& t : manifest.tensors()) {
    absl::StatusOr<DType> dtype = ParseDType(t.dtype());
    const bool bad_shard = t.shard() < 0 || t.shard() >= manifest.shards_size();
    int64_t numel = 1;
    bool bad_shape = false;
    for (int64_t d : t.shape()) {
      if (d < 0) bad_shape = true;
      numel *= d;
    }
    if (!dtype.ok() || bad_shard || bad_shape ||
        t.nbytes() != static_cast<uint64_t>(numel) * DTypeSize(*dtype) ||
        t.offset() + t.nbytes() > manifest.shards(t.shard()).bytes()) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint manifest '", file, "': tensor '", t.name(), "' does not fit its shard ",
          t.shard(), " (dtype ", t.dtype(), ", offset ", t.offset(), ", ", t.nbytes(), " bytes)"));
    }
  }
  return manifest;
}

// Reads shard `i` of `manifest` under `path` and checks its size and CRC.
absl::StatusOr<std::string> ReadShard(const std::string& path, const CheckpointManifest& manifest,
                                      int i) {
  const CheckpointShard& shard = manifest.shards(i);
  const std::string file = path + "/" + shard.file();
  absl::StatusOr<std::string> bytes = ReadWholeFile(file);
  if (!bytes.ok()) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint shard '", file, "' listed in the manifest: ", bytes.status().message()));
  }
  if (bytes->size() != shard.bytes()) {
    return absl::DataLossError(absl::StrCat("checkpoint shard '", file, "' has ", bytes->size(),
                                            " bytes, the manifest says ", shard.bytes(),
                                            ": truncated or overwritten"));
  }
  const uint32_t crc = Crc32(0, bytes->data(), bytes->size());
  if (crc != shard.crc32()) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint shard '%s': CRC-32 mismatch (manifest %08x, computed %08x over %d bytes): "
        "the file is damaged",
        file, shard.crc32(), crc, bytes->size()));
  }
  return bytes;
}

}  // namespace

uint32_t Crc32(uint32_t crc, const void* data, size_t size) {
  // zlib's crc32 takes a uInt length: feed large buffers in pieces.
  const auto* p = static_cast<const Bytef*>(data);
  uLong c = crc;
  while (size > 0) {
    const size_t n = std::min<size_t>(size, 1u << 30);
    c = ::crc32(c, p, static_cast<uInt>(n));
    p += n;
    size -= n;
  }
  return static_cast<uint32_t>(c);
}

std::string CheckpointDirName(int64_t step) { return absl::StrFormat("step_%08d", step); }

std::string CheckpointPath(const std::string& dir, int64_t step) {
  return dir + "/" + CheckpointDirName(step);
}

int64_t ParseCheckpointDirName(const std::string& name) {
  absl::string_view rest = name;
  if (!absl::ConsumePrefix(&rest, kStepPrefix) || rest.size() < 8) return -1;
  for (char c : rest) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return -1;
  }
  int64_t step = -1;
  if (!absl::SimpleAtoi(rest, &step)) return -1;
  return step;
}

std::string ShardFileName(int shard) { return absl::StrFormat("shard_%05d.bin", shard); }

absl::StatusOr<std::vector<int64_t>> ListCheckpoints(const std::string& dir) {
  SMAT_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDirectory(dir));
  std::vector<int64_t> steps;
  for (const std::string& name : names) {
    const int64_t step = ParseCheckpointDirName(name);
    if (step >= 0) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::StatusOr<CheckpointManifest> VerifyCheckpoint(const std::string& path) {
  SMAT_ASSIGN_OR_RETURN(CheckpointManifest manifest, ReadManifest(path));
  for (int i = 0; i < manifest.shards_size(); ++i) {
    SMAT_ASSIGN_OR_RETURN(std::string bytes, ReadShard(path, manifest, i));
  }
  return manifest;
}

absl::StatusOr<std::string> FindLatestIntact(const std::string& dir,
                                             std::vector<std::string>* skipped) {
  SMAT_ASSIGN_OR_RETURN(std::vector<int64_t> steps, ListCheckpoints(dir));
  for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
    const std::string path = CheckpointPath(dir, *it);
    absl::StatusOr<CheckpointManifest> m = VerifyCheckpoint(path);
    if (m.ok() && m->step() == *it) return path;
    const std::string why = m.ok() ? absl::StrCat("checkpoint '", path, "' holds step ", m->step(),
                                                  ", not the step of its name")
                                   : std::string(m.status().message());
    std::fprintf(stderr, "smat: skipping damaged checkpoint: %s\n", why.c_str());
    if (skipped != nullptr) skipped->push_back(why);
  }
  return absl::NotFoundError(absl::StrCat("no intact checkpoint under '", dir, "' (", steps.size(),
                                          " checkpoint directories found)"));
}

absl::StatusOr<CheckpointState> LoadCheckpoint(const std::string& path) {
  SMAT_ASSIGN_OR_RETURN(CheckpointManifest manifest, ReadManifest(path));
  std::vector<std::string> shards(manifest.shards_size());
  for (int i = 0; i < manifest.shards_size(); ++i) {
    SMAT_ASSIGN_OR_RETURN(shards[i], ReadShard(path, manifest, i));
  }
  CheckpointState state;
  state.step = manifest.step();
  state.sampler_cursor = manifest.sampler_cursor();
  state.rng_state = manifest.rng_state();
  state.config_text = manifest.config_text();
  state.dp = manifest.dp();
  state.sp = manifest.sp();
  std::set<std::string> names;
  for (const CheckpointTensor& t : manifest.tensors()) {
    if (!names.insert(t.name()).second) {
      return absl::DataLossError(absl::StrCat("checkpoint manifest '", path, "/", kManifestFileName,
                                              "' lists tensor '", t.name(), "' twice"));
    }
    SMAT_ASSIGN_OR_RETURN(DType dtype, ParseDType(t.dtype()));
    SMAT_ASSIGN_OR_RETURN(Tensor tensor,
                          Tensor::Empty(Shape(t.shape().begin(), t.shape().end()), dtype));
    if (t.nbytes() > 0)
      std::memcpy(tensor.raw(), shards[t.shard()].data() + t.offset(), t.nbytes());
    state.tensors.push_back({t.name(), std::move(tensor)});
  }
  return state;
}

absl::Status ApplyRetention(const std::string& dir, int keep_last, int64_t keep_every) {
  SMAT_ASSIGN_OR_RETURN(std::vector<int64_t> steps, ListCheckpoints(dir));
  const size_t keep_from = keep_last <= 0 || static_cast<size_t>(keep_last) >= steps.size()
                               ? 0
                               : steps.size() - static_cast<size_t>(keep_last);
  for (size_t i = 0; i < keep_from; ++i) {
    if (keep_every > 0 && steps[i] % keep_every == 0) continue;
    const std::string path = CheckpointPath(dir, steps[i]);
    const std::string trash = path + kTempMarker + "deleted";
    SMAT_RETURN_IF_ERROR(RemoveTree(trash));  // left by an earlier crash
    if (::rename(path.c_str(), trash.c_str()) != 0) {
      return absl::UnavailableError(absl::StrCat("checkpoint retention: cannot rename '", path,
                                                 "' for removal: ", ErrnoText(errno)));
    }
    SMAT_RETURN_IF_ERROR(RemoveTree(trash));
  }
  return FsyncDirectory(dir);
}

absl::Status RemoveStaleTemporaries(const std::string& dir, int64_t keep_step,
                                    const std::string& keep_attempt) {
  SMAT_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDirectory(dir));
  const std::string keep =
      keep_step >= 0 ? absl::StrCat(CheckpointDirName(keep_step), kTempMarker, keep_attempt)
                     : std::string();
  for (const std::string& name : names) {
    if (!absl::StartsWith(name, kStepPrefix) || !absl::StrContains(name, kTempMarker)) continue;
    if (name == keep) continue;
    SMAT_RETURN_IF_ERROR(Annotate(RemoveTree(dir + "/" + name), "checkpoint: stale temporary"));
  }
  return absl::OkStatus();
}

int64_t ReadLatestStep(const std::string& dir) {
  absl::StatusOr<std::string> text = ReadWholeFile(dir + "/" + kLatestFileName);
  if (!text.ok()) return -1;
  return ParseCheckpointDirName(std::string(absl::StripAsciiWhitespace(*text)));
}

absl::Status FsyncDirectory(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0 || ::fsync(fd.get()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("checkpoint: fsync of directory '", path, "' failed: ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  {
    Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) {
      return absl::UnavailableError(
          absl::StrCat("checkpoint: cannot create '", tmp, "': ", ErrnoText(errno)));
    }
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        return absl::UnavailableError(absl::StrCat(
            "checkpoint: writing '", tmp, "' failed: ", ErrnoText(errno), " (disk full?)"));
      }
      done += static_cast<size_t>(n);
    }
    if (::fsync(fd.get()) != 0) {
      return absl::UnavailableError(
          absl::StrCat("checkpoint: fsync of '", tmp, "' failed: ", ErrnoText(errno)));
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("checkpoint: cannot rename '", tmp, "' to '", path, "': ", ErrnoText(errno)));
  }
  return FsyncDirectory(ParentDirectory(path));
}

}  // namespace smat
