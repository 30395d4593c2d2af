// CheckpointWriter (trainer/checkpoint_writer.h): shard split, background
// write, commit protocol and fault injection.
#include "trainer/checkpoint_writer.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/status.h"
#include "parallel/communicator.h"

namespace smat {
namespace {

enum class FaultPhase : int {
  kNone = 0,
  kWritingShards,
  kAfterShards,
  kAfterManifest,
  kAfterRename
};

struct CheckpointFault {
  FaultPhase phase = FaultPhase::kNone;
  int64_t step = -1;
  int rank = -1;  // -1: every rank
};

// `attempt`: this run's launch attempt; a plan naming another attempt is
// parsed (so typos are still caught) but never fires.
absl::StatusOr<CheckpointFault> ParseCheckpointFault(const std::string& spec,
                                                     const std::string& attempt) {
  CheckpointFault f;
  if (spec.empty()) return f;
  const std::vector<std::string> parts = absl::StrSplit(spec, ':');
  static const std::pair<const char*, FaultPhase> kPhases[] = {
      {"writing_shards", FaultPhase::kWritingShards},
      {"after_shards", FaultPhase::kAfterShards},
      {"after_manifest", FaultPhase::kAfterManifest},
      {"after_rename", FaultPhase::kAfterRename}};
  for (const auto& [name, phase] : kPhases) {
    if (parts[0] == name) f.phase = phase;
  }
  int64_t only_attempt = -1;
  const bool ok = f.phase != FaultPhase::kNone && parts.size() >= 2 && parts.size() <= 4 &&
                  absl::SimpleAtoi(parts[1], &f.step) &&
                  (parts.size() < 3 || absl::SimpleAtoi(parts[2], &f.rank)) &&
                  (parts.size() < 4 || absl::SimpleAtoi(parts[3], &only_attempt));
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("SMAT_FAULT_CHECKPOINT='", spec,
                     "': expected phase:step[:rank[:attempt]] with phase one of writing_shards, "
                     "after_shards, after_manifest, after_rename (e.g. after_manifest:20, or "
                     "after_manifest:20:-1:0 for every rank in the first launch attempt only)"));
  }
  if (parts.size() == 4 && absl::StrCat(only_attempt) != attempt) f.phase = FaultPhase::kNone;
  return f;
}

// Kills this process when `fault` fires here: SIGKILL, like a node failure,
// so no destructor, flush or handler runs.
void MaybeInjectFault(const CheckpointFault& fault, FaultPhase phase, int64_t step, int rank) {
  if (fault.phase != phase || fault.step != step || (fault.rank >= 0 && fault.rank != rank)) {
    return;
  }
  std::fprintf(stderr, "smat: injecting checkpoint fault (SIGKILL) at step %lld on rank %d\n",
               static_cast<long long>(step), rank);
  std::fflush(stderr);
  std::raise(SIGKILL);
}

std::string ErrnoText(int err) { return std::strerror(err); }

absl::Status MakeDirectories(const std::string& path) {
  std::string prefix;
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    prefix = prefix.empty() && path[0] == '/' ? absl::StrCat("/", part)
             : prefix.empty()                 ? std::string(part)
                                              : absl::StrCat(prefix, "/", part);
    if (part.empty()) continue;
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::UnavailableError(
          absl::StrCat("checkpoint: cannot create directory '", prefix, "': ", ErrnoText(errno)));
    }
  }
  return absl::OkStatus();
}

// Writes all of `bytes` to `fd`; `path` names it in errors.
absl::Status WriteAll(int fd, const char* bytes, size_t size, const std::string& path) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, bytes + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::UnavailableError(absl::StrCat("checkpoint: writing '", path,
                                                 "' failed: ", ErrnoText(errno), " (disk full?)"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Creates `path` with `bytes` and fsyncs it (inside a temporary directory: the
// directory's rename is what makes it visible, so no rename per file).
absl::Status WriteDurableFile(const std::string& path, const char* bytes, size_t size,
                              const std::function<void()>& halfway = nullptr) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("checkpoint: cannot create '", path, "': ", ErrnoText(errno)));
  }
  const size_t half = size / 2;
  absl::Status s = WriteAll(fd, bytes, half, path);
  if (s.ok() && halfway) halfway();
  if (s.ok()) s = WriteAll(fd, bytes + half, size - half, path);
  if (s.ok() && ::fsync(fd) != 0) {
    s = absl::UnavailableError(
        absl::StrCat("checkpoint: fsync of '", path, "' failed: ", ErrnoText(errno)));
  }
  if (::close(fd) != 0 && s.ok()) {
    s = absl::UnavailableError(
        absl::StrCat("checkpoint: closing '", path, "' failed: ", ErrnoText(errno)));
  }
  return s;
}

uint64_t AlignUp(uint64_t x) {
  return (x + kShardAlignment - 1) / kShardAlignment * kShardAlignment;
}

}  // namespace

CheckpointExchange SingleProcessExchange() {
  return [](int64_t v) -> absl::StatusOr<std::vector<int64_t>> { return std::vector<int64_t>{v}; };
}

CheckpointExchange ExchangeOverCommunicator(Communicator& comm) {
  return [&comm](int64_t v) -> absl::StatusOr<std::vector<int64_t>> {
    std::vector<int64_t> all(comm.size());
    Tensor send = Tensor::Wrap(&v, {1}, DType::kI64);
    Tensor recv = Tensor::Wrap(all.data(), {comm.size()}, DType::kI64);
    SMAT_RETURN_IF_ERROR(Annotate(comm.AllGather(send, recv), "checkpoint commit exchange"));
    return all;
  };
}

CheckpointWriterOptions CheckpointWriterOptions::FromEnvironment(std::string dir, int rank,
                                                                 int world_size) {
  CheckpointWriterOptions o;
  o.dir = std::move(dir);
  o.rank = rank;
  o.world_size = world_size;
  if (const char* a = std::getenv("SMAT_RESTART_COUNT"); a != nullptr && *a != '\0') o.attempt = a;
  if (const char* f = std::getenv("SMAT_FAULT_CHECKPOINT"); f != nullptr) o.fault = f;
  return o;
}

std::vector<int> AssignShards(const std::vector<NamedTensor>& tensors, int shards) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const size_t na = tensors[a].tensor.nbytes(), nb = tensors[b].tensor.nbytes();
    if (na != nb) return na > nb;
    return tensors[a].name < tensors[b].name;
  });
  std::vector<uint64_t> load(std::max(shards, 1), 0);
  std::vector<int> assignment(tensors.size(), 0);
  for (size_t i : order) {
    const int s = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    assignment[i] = s;
    load[s] += AlignUp(tensors[i].tensor.nbytes());
  }
  return assignment;
}

struct CheckpointWriter::Pending {
  int64_t step = 0;
  int rank = 0;
  std::string dir, tmp_path, final_path;
  CheckpointManifest manifest;  // without CRCs until the commit
  std::string shard;            // this rank's shard file, byte for byte
  CheckpointFault fault;
  // Set by WriteShard; `written` last, so a reader that sees it sees the rest.
  absl::Status write_status;
  uint32_t crc = 0;
  double write_seconds = 0;  // CRC, write and fsyncs of this rank's shard
  std::atomic<bool> written{false};
};

CheckpointWriter::CheckpointWriter(CheckpointWriterOptions options, CheckpointExchange exchange)
    : options_(std::move(options)), exchange_(std::move(exchange)) {}

CheckpointWriter::~CheckpointWriter() {
  if (thread_.joinable()) thread_.join();
}

void CheckpointWriter::WriteShard(Pending* p) {
  const auto t0 = std::chrono::steady_clock::now();
  p->write_status = [p]() -> absl::Status {
    SMAT_RETURN_IF_ERROR(MakeDirectories(p->tmp_path));
    const std::string file = p->tmp_path + "/" + ShardFileName(p->rank);
    p->crc = Crc32(0, p->shard.data(), p->shard.size());
    SMAT_RETURN_IF_ERROR(WriteDurableFile(file, p->shard.data(), p->shard.size(), [p] {
      MaybeInjectFault(p->fault, FaultPhase::kWritingShards, p->step, p->rank);
    }));
    SMAT_RETURN_IF_ERROR(FsyncDirectory(p->tmp_path));
    MaybeInjectFault(p->fault, FaultPhase::kAfterShards, p->step, p->rank);
    return absl::OkStatus();
  }();
  p->write_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  p->written.store(true, std::memory_order_release);
}

absl::Status CheckpointWriter::Save(const CheckpointState& state) {
  SMAT_RETURN_IF_ERROR(Commit());
  if (options_.dir.empty()) {
    return absl::InvalidArgumentError("checkpoint: no directory (set checkpoint.dir)");
  }
  if (state.step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint: step ", state.step, " < 0"));
  }
  std::set<std::string> names;
  for (const NamedTensor& t : state.tensors) {
    if (t.name.empty() || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint: tensor names must be unique and non-empty; got '", t.name,
                       "' twice or empty"));
    }
    if (!t.tensor.device().is_cpu() || (!t.tensor.defined() && t.tensor.numel() != 0)) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint: tensor '", t.name, "' is ",
                                                     t.tensor.DebugString(),
                                                     "; copy it to host memory before saving"));
    }
  }
  SMAT_ASSIGN_OR_RETURN(CheckpointFault fault,
                        ParseCheckpointFault(options_.fault, options_.attempt));

  auto p = std::make_unique<Pending>();
  p->step = state.step;
  p->rank = options_.rank;
  p->dir = options_.dir;
  p->final_path = CheckpointPath(options_.dir, state.step);
  p->tmp_path = absl::StrCat(p->final_path, ".tmp-", options_.attempt);
  p->fault = fault;

  CheckpointManifest& m = p->manifest;
  m.set_format_version(kCheckpointFormatVersion);
  m.set_step(state.step);
  m.set_sampler_cursor(state.sampler_cursor);
  m.set_rng_state(state.rng_state);
  m.set_config_text(state.config_text);
  m.set_dp(state.dp);
  m.set_sp(state.sp);
  m.set_writer_ranks(options_.world_size);
  const std::vector<int> shard_of = AssignShards(state.tensors, options_.world_size);
  std::vector<uint64_t> shard_bytes(options_.world_size, 0);
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    const Tensor& t = state.tensors[i].tensor;
    CheckpointTensor* e = m.add_tensors();
    e->set_name(state.tensors[i].name);
    e->set_dtype(DTypeName(t.dtype()));
    for (int64_t d : t.shape()) e->add_shape(d);
    e->set_shard(shard_of[i]);
    uint64_t& end = shard_bytes[shard_of[i]];
    end = AlignUp(end);
    e->set_offset(end);
    e->set_nbytes(t.nbytes());
    end += t.nbytes();
  }
  for (int s = 0; s < options_.world_size; ++s) {
    CheckpointShard* shard = m.add_shards();
    shard->set_file(ShardFileName(s));
    shard->set_bytes(shard_bytes[s]);
  }
  // The copy: the caller's only stall. Padding stays zero, so equal states
  // give equal bytes.
  p->shard.assign(shard_bytes[options_.rank], '\0');
  for (size_t i = 0; i < state.tensors.size(); ++i) {
    if (shard_of[i] != options_.rank || m.tensors(i).nbytes() == 0) continue;
    std::memcpy(p->shard.data() + m.tensors(i).offset(), state.tensors[i].tensor.raw(),
                m.tensors(i).nbytes());
  }

  pending_ = std::move(p);
  if (options_.async) {
    thread_ = std::thread(&CheckpointWriter::WriteShard, pending_.get());
    return absl::OkStatus();
  }
  WriteShard(pending_.get());
  return Commit();
}

absl::Status CheckpointWriter::Finish() { return Commit(); }

absl::Status CheckpointWriter::Poll() {
  // Every rank has a save in flight or none (Save and Commit are collective),
  // so the ranks agree on whether to exchange at all.
  if (pending_ == nullptr) return absl::OkStatus();
  const bool written = pending_->written.load(std::memory_order_acquire);
  SMAT_ASSIGN_OR_RETURN(std::vector<int64_t> done, exchange_(written ? 1 : 0));
  for (int64_t d : done) {
    if (d == 0) return absl::OkStatus();  // a rank is still writing: next step
  }
  return Commit();
}

absl::Status CheckpointWriter::Commit() {
  if (pending_ == nullptr) return absl::OkStatus();
  if (thread_.joinable()) thread_.join();
  std::unique_ptr<Pending> p = std::move(pending_);
  const std::string what = absl::StrCat("checkpoint step ", p->step);

  SMAT_ASSIGN_OR_RETURN(
      std::vector<int64_t> crcs,
      exchange_(p->write_status.ok() ? static_cast<int64_t>(p->crc) : int64_t{-1}));
  if (static_cast<int>(crcs.size()) != options_.world_size) {
    return absl::InternalError(absl::StrCat(what, ": the exchange returned ", crcs.size(),
                                            " values for ", options_.world_size, " ranks"));
  }
  absl::Status status = p->write_status;
  for (int r = 0; r < options_.world_size && status.ok(); ++r) {
    if (crcs[r] < 0) {
      status = absl::UnavailableError(
          absl::StrCat(what, ": rank ", r, " could not write its shard (see its log)"));
    }
  }
  if (status.ok() && options_.rank == 0) {
    status = [&]() -> absl::Status {
      for (int r = 0; r < options_.world_size; ++r) {
        p->manifest.mutable_shards(r)->set_crc32(static_cast<uint32_t>(crcs[r]));
      }
      CheckpointManifestFile envelope;
      if (!p->manifest.SerializeToString(envelope.mutable_manifest())) {
        return absl::InternalError(absl::StrCat(what, ": manifest does not serialize"));
      }
      envelope.set_crc32(Crc32(0, envelope.manifest().data(), envelope.manifest().size()));
      const std::string bytes = envelope.SerializeAsString();
      SMAT_RETURN_IF_ERROR(
          WriteDurableFile(p->tmp_path + "/" + kManifestFileName, bytes.data(), bytes.size()));
      SMAT_RETURN_IF_ERROR(FsyncDirectory(p->tmp_path));
      MaybeInjectFault(p->fault, FaultPhase::kAfterManifest, p->step, p->rank);
      // Saving a step that is already committed (a run resumed there and saved
      // again): the old copy moves aside first, since rename cannot replace a
      // non-empty directory. Older checkpoints stay valid meanwhile.
      struct stat st;
      if (::stat(p->final_path.c_str(), &st) == 0) {
        const std::string aside = p->final_path + ".tmp-replaced";
        SMAT_RETURN_IF_ERROR(RemoveStaleTemporaries(p->dir, p->step, options_.attempt));
        if (::rename(p->final_path.c_str(), aside.c_str()) != 0) {
          return absl::UnavailableError(absl::StrCat(what, ": cannot move the existing '",
                                                     p->final_path, "' aside: ", ErrnoText(errno)));
        }
      }
      if (::rename(p->tmp_path.c_str(), p->final_path.c_str()) != 0) {
        return absl::UnavailableError(absl::StrCat(what, ": commit rename of '", p->tmp_path,
                                                   "' failed: ", ErrnoText(errno)));
      }
      SMAT_RETURN_IF_ERROR(FsyncDirectory(p->dir));
      MaybeInjectFault(p->fault, FaultPhase::kAfterRename, p->step, p->rank);
      SMAT_RETURN_IF_ERROR(
          WriteFileAtomically(p->dir + "/" + kLatestFileName, CheckpointDirName(p->step) + "\n"));
      SMAT_RETURN_IF_ERROR(ApplyRetention(p->dir, options_.keep_last, options_.keep_every));
      return RemoveStaleTemporaries(p->dir);
    }();
    if (!status.ok()) std::fprintf(stderr, "smat: %s\n", std::string(status.message()).c_str());
  }
  // Every rank learns rank 0's verdict, so all of them fail or none does.
  SMAT_ASSIGN_OR_RETURN(std::vector<int64_t> verdicts, exchange_(status.ok() ? 0 : 1));
  if (status.ok() && verdicts[0] != 0) {
    status =
        absl::UnavailableError(absl::StrCat(what, ": rank 0 could not commit it (see its log)"));
  }
  if (!status.ok()) return status;
  last_committed_step_ = p->step;
  last_shard_bytes_ = p->shard.size();
  last_write_seconds_ = p->write_seconds;
  return absl::OkStatus();
}

}  // namespace smat
