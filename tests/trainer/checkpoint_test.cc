// Checkpoints on real files with real fsync: round trip over dtypes and shard
// counts, byte-identical saves of the same state, damage detection (flipped
// byte, truncated manifest) and fallback to the previous checkpoint, a crash
// (SIGKILL from the fault injection) at every phase of the commit protocol in
// a forked child, retention, asynchronous saves racing the caller's writes,
// and the preemption signal flags.
//
// Several ranks are simulated by threads of one process: each thread runs its
// own CheckpointWriter and the exchange is a shared barrier, which is exactly
// the contract the MPI exchange fulfils.
#include "trainer/checkpoint.h"

#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "trainer/checkpoint_writer.h"
#include "trainer/preemption.h"

namespace smat {
namespace {

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/smat_ckpt_test_XXXXXX";
    path_ = mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf '" + path_ + "'").c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// A state whose every byte depends on `seed` (integer-valued floats, so no
// value is accidentally equal across seeds), with odd sizes, a scalar, an
// empty tensor and every dtype a trainer saves.
CheckpointState MakeState(int64_t step, int seed) {
  CheckpointState s;
  s.step = step;
  s.sampler_cursor = step * 16 + seed;
  s.rng_state = std::string("\x01\x00\xffrng", 6) + std::to_string(seed);
  s.config_text = "run { name: \"ckpt_test\" steps: 100 }\n";
  s.dp = 2;
  s.sp = 3;
  auto add = [&](const std::string& name, Shape shape, DType dtype) {
    Tensor t = Tensor::Zeros(shape, dtype).value();
    auto* bytes = static_cast<unsigned char*>(t.raw());
    for (size_t i = 0; i < t.nbytes(); ++i)
      bytes[i] = static_cast<unsigned char>(i * 7 + seed * 13 + name.size());
    if (dtype == DType::kF32) {
      for (int64_t i = 0; i < t.numel(); ++i)
        t.data<float>()[i] = static_cast<float>((i * 31 + seed) % 1001 - 500);
    }
    s.tensors.push_back({name, std::move(t)});
  };
  add("embedding", {257, 33}, DType::kF32);
  add("blocks.0.norm", {33}, DType::kF32);
  add("blocks.0.mixer.wq", {33, 65}, DType::kBF16);
  add("adam_m/embedding", {257, 33}, DType::kF32);
  add("adam_v/embedding", {257, 33}, DType::kF64);
  add("counts", {5, 3}, DType::kI64);
  add("types", {1031}, DType::kI32);
  add("scale", {}, DType::kF32);
  add("empty", {0, 4}, DType::kF32);
  return s;
}

void ExpectSameState(const CheckpointState& a, const CheckpointState& b) {
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.sampler_cursor, b.sampler_cursor);
  EXPECT_EQ(a.rng_state, b.rng_state);
  EXPECT_EQ(a.config_text, b.config_text);
  EXPECT_EQ(a.dp, b.dp);
  EXPECT_EQ(a.sp, b.sp);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const Tensor& x = a.tensors[i].tensor;
    const Tensor& y = b.tensors[i].tensor;
    EXPECT_EQ(a.tensors[i].name, b.tensors[i].name);
    EXPECT_EQ(x.dtype(), y.dtype()) << a.tensors[i].name;
    EXPECT_EQ(x.shape(), y.shape()) << a.tensors[i].name;
    ASSERT_EQ(x.nbytes(), y.nbytes()) << a.tensors[i].name;
    EXPECT_EQ(0, std::memcmp(x.raw(), y.raw(), x.nbytes())) << a.tensors[i].name;
  }
}

// Barrier-and-gather among `n` threads: the exchange each simulated rank's
// writer uses.
class ThreadExchange {
 public:
  explicit ThreadExchange(int n) : n_(n), values_(n) {}
  CheckpointExchange For(int rank) {
    return [this, rank](int64_t v) -> absl::StatusOr<std::vector<int64_t>> {
      std::unique_lock<std::mutex> lock(mu_);
      const int64_t gen = generation_;
      values_[rank] = v;
      if (++arrived_ == n_) {
        result_ = values_;
        arrived_ = 0;
        ++generation_;
        cv_.notify_all();
      } else {
        cv_.wait(lock, [&] { return generation_ != gen; });
      }
      return result_;
    };
  }

 private:
  const int n_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  std::vector<int64_t> values_, result_;
};

// Saves `states` in order on `ranks` simulated ranks; returns rank 0's first error.
absl::Status SaveOnRanks(const std::string& dir, int ranks,
                         const std::vector<CheckpointState>& states, bool async,
                         int keep_last = 0) {
  ThreadExchange exchange(ranks);
  std::vector<absl::Status> results(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      CheckpointWriterOptions o;
      o.dir = dir;
      o.rank = r;
      o.world_size = ranks;
      o.async = async;
      o.keep_last = keep_last;
      CheckpointWriter w(o, exchange.For(r));
      for (const CheckpointState& s : states) {
        results[r] = w.Save(s);
        if (!results[r].ok()) return;
      }
      results[r] = w.Finish();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 1; r < ranks; ++r) EXPECT_EQ(results[r].code(), results[0].code()) << "rank " << r;
  return results[0];
}

TEST(Checkpoint, NamesAndSteps) {
  EXPECT_EQ(CheckpointDirName(1000), "step_00001000");
  EXPECT_EQ(CheckpointDirName(123456789), "step_123456789");
  EXPECT_EQ(ParseCheckpointDirName("step_00001000"), 1000);
  EXPECT_EQ(ParseCheckpointDirName("step_123456789"), 123456789);
  EXPECT_EQ(ParseCheckpointDirName("step_00001000.tmp-0"), -1);
  EXPECT_EQ(ParseCheckpointDirName("step_1000"), -1);
  EXPECT_EQ(ParseCheckpointDirName("latest"), -1);
}

TEST(Checkpoint, ShardSplitBalancesBytesAndIsDeterministic) {
  CheckpointState s = MakeState(1, 0);
  const std::vector<int> a = AssignShards(s.tensors, 3);
  EXPECT_EQ(a, AssignShards(s.tensors, 3));
  std::vector<uint64_t> load(3, 0);
  uint64_t largest = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    load[a[i]] += s.tensors[i].tensor.nbytes();
    largest = std::max<uint64_t>(largest, s.tensors[i].tensor.nbytes());
  }
  // Largest-first onto the least-loaded shard: no shard is empty and the
  // spread is at most one tensor (plus 64-byte padding per tensor).
  const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
  EXPECT_GT(*lo, 0u);
  EXPECT_LE(*hi - *lo, largest + 64 * s.tensors.size());
  EXPECT_NE(a[0], a[3]) << "the two largest fp32 tensors share a shard";
  for (int x : AssignShards(s.tensors, 1)) EXPECT_EQ(x, 0);
}

TEST(Checkpoint, RoundTripOnOneAndThreeRanksSyncAndAsync) {
  for (int ranks : {1, 3}) {
    for (bool async : {false, true}) {
      TempDir dir;
      const CheckpointState s = MakeState(20, 5);
      ASSERT_TRUE(SaveOnRanks(dir.path(), ranks, {MakeState(10, 4), s}, async).ok());
      absl::StatusOr<std::string> path = FindLatestIntact(dir.path());
      ASSERT_TRUE(path.ok()) << path.status();
      EXPECT_EQ(*path, CheckpointPath(dir.path(), 20));
      EXPECT_EQ(ReadLatestStep(dir.path()), 20);
      absl::StatusOr<CheckpointManifest> m = VerifyCheckpoint(*path);
      ASSERT_TRUE(m.ok()) << m.status();
      EXPECT_EQ(m->writer_ranks(), ranks);
      EXPECT_EQ(m->shards_size(), ranks);
      absl::StatusOr<CheckpointState> loaded = LoadCheckpoint(*path);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      ExpectSameState(s, *loaded);
      // Exactly the manifest and one shard per rank; no temporaries left.
      std::vector<std::string> expect = {"manifest.pb"};
      for (int r = 0; r < ranks; ++r) expect.push_back(ShardFileName(r));
      EXPECT_EQ(ListDir(*path), expect);
      EXPECT_EQ(ListDir(dir.path()),
                (std::vector<std::string>{"latest", "step_00000010", "step_00000020"}));
    }
  }
}

TEST(Checkpoint, SameStateGivesByteIdenticalFiles) {
  TempDir a, b;
  ASSERT_TRUE(SaveOnRanks(a.path(), 3, {MakeState(7, 1)}, /*async=*/true).ok());
  ASSERT_TRUE(SaveOnRanks(b.path(), 3, {MakeState(7, 1)}, /*async=*/false).ok());
  const std::string pa = CheckpointPath(a.path(), 7), pb = CheckpointPath(b.path(), 7);
  const std::vector<std::string> files = ListDir(pa);
  ASSERT_EQ(files, ListDir(pb));
  ASSERT_EQ(files.size(), 4u);
  for (const std::string& f : files) {
    const std::string x = ReadFile(pa + "/" + f);
    EXPECT_FALSE(x.empty()) << f;
    EXPECT_EQ(x, ReadFile(pb + "/" + f)) << f << " differs between two saves of one state";
  }
  // A different state must differ (the comparison above can fail).
  TempDir c;
  ASSERT_TRUE(SaveOnRanks(c.path(), 3, {MakeState(7, 2)}, false).ok());
  EXPECT_NE(ReadFile(pa + "/manifest.pb"), ReadFile(CheckpointPath(c.path(), 7) + "/manifest.pb"));
}

TEST(Checkpoint, FlippedByteInShardIsDataLossAndResumeFallsBack) {
  TempDir dir;
  ASSERT_TRUE(SaveOnRanks(dir.path(), 2, {MakeState(10, 1), MakeState(20, 2)}, false).ok());
  const std::string shard = CheckpointPath(dir.path(), 20) + "/" + ShardFileName(1);
  std::string bytes = ReadFile(shard);
  ASSERT_GT(bytes.size(), 100u);
  bytes[bytes.size() / 2] ^= 0x10;
  WriteFile(shard, bytes);

  absl::StatusOr<CheckpointManifest> m = VerifyCheckpoint(CheckpointPath(dir.path(), 20));
  ASSERT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  EXPECT_TRUE(absl::StrContains(m.status().message(), shard)) << m.status();
  EXPECT_TRUE(absl::StrContains(m.status().message(), "CRC-32 mismatch")) << m.status();
  EXPECT_EQ(LoadCheckpoint(CheckpointPath(dir.path(), 20)).status().code(),
            absl::StatusCode::kDataLoss);

  std::vector<std::string> skipped;
  absl::StatusOr<std::string> latest = FindLatestIntact(dir.path(), &skipped);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, CheckpointPath(dir.path(), 10));
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_TRUE(absl::StrContains(skipped[0], shard)) << skipped[0];
  absl::StatusOr<CheckpointState> s = LoadCheckpoint(*latest);
  ASSERT_TRUE(s.ok()) << s.status();
  ExpectSameState(MakeState(10, 1), *s);
}

TEST(Checkpoint, TruncatedOrMissingFilesAreDataLoss) {
  TempDir dir;
  ASSERT_TRUE(
      SaveOnRanks(dir.path(), 2, {MakeState(10, 1), MakeState(20, 2), MakeState(30, 3)}, false)
          .ok());
  const std::string manifest = CheckpointPath(dir.path(), 30) + "/manifest.pb";
  const std::string bytes = ReadFile(manifest);
  WriteFile(manifest, bytes.substr(0, bytes.size() / 2));
  absl::StatusOr<CheckpointManifest> m = VerifyCheckpoint(CheckpointPath(dir.path(), 30));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  EXPECT_TRUE(absl::StrContains(m.status().message(), manifest)) << m.status();

  const std::string shard = CheckpointPath(dir.path(), 20) + "/" + ShardFileName(0);
  const std::string shard_bytes = ReadFile(shard);
  WriteFile(shard, shard_bytes.substr(0, shard_bytes.size() - 1));
  m = VerifyCheckpoint(CheckpointPath(dir.path(), 20));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  EXPECT_TRUE(absl::StrContains(m.status().message(), "truncated")) << m.status();

  std::vector<std::string> skipped;
  absl::StatusOr<std::string> latest = FindLatestIntact(dir.path(), &skipped);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, CheckpointPath(dir.path(), 10));
  EXPECT_EQ(skipped.size(), 2u);

  ASSERT_EQ(unlink((CheckpointPath(dir.path(), 10) + "/" + ShardFileName(1)).c_str()), 0);
  EXPECT_EQ(FindLatestIntact(dir.path()).status().code(), absl::StatusCode::kNotFound);
}

TEST(Checkpoint, NoCheckpointIsNotFound) {
  TempDir dir;
  EXPECT_EQ(FindLatestIntact(dir.path()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FindLatestIntact(dir.path() + "/absent").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ReadLatestStep(dir.path()), -1);
}

// The child saves step 10, then step 20 with the fault armed, and is killed by
// it; returns the child's wait status.
int SaveInKilledChild(const std::string& dir, const std::string& fault, bool async) {
  const pid_t child = fork();
  if (child == 0) {
    CheckpointWriterOptions o;
    o.dir = dir;
    o.async = async;
    o.fault = fault;
    CheckpointWriter w(o, SingleProcessExchange());
    bool ok = w.Save(MakeState(10, 1)).ok() && w.Save(MakeState(20, 2)).ok() && w.Finish().ok();
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  return status;
}

TEST(Checkpoint, CrashAtEveryPhaseLeavesTheLastCommittedCheckpoint) {
  struct Case {
    const char* phase;
    int64_t expect_latest;  // what resume must find
    bool expect_temporary;  // the crashed write's directory is left behind
  };
  const Case cases[] = {{"writing_shards", 10, true},
                        {"after_shards", 10, true},
                        {"after_manifest", 10, true},
                        {"after_rename", 20, false}};
  for (const Case& c : cases) {
    for (bool async : {false, true}) {
      SCOPED_TRACE(absl::StrCat(c.phase, async ? " async" : " sync"));
      TempDir dir;
      const int status = SaveInKilledChild(dir.path(), absl::StrCat(c.phase, ":20"), async);
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;

      absl::StatusOr<std::string> latest = FindLatestIntact(dir.path());
      ASSERT_TRUE(latest.ok()) << latest.status();
      EXPECT_EQ(*latest, CheckpointPath(dir.path(), c.expect_latest));
      absl::StatusOr<CheckpointState> s = LoadCheckpoint(*latest);
      ASSERT_TRUE(s.ok()) << s.status();
      ExpectSameState(MakeState(c.expect_latest, c.expect_latest == 10 ? 1 : 2), *s);
      // `latest` moves only after the rename: it lags by one at most.
      EXPECT_EQ(ReadLatestStep(dir.path()), 10);
      // Nothing partial under a committed name.
      absl::StatusOr<std::vector<int64_t>> steps = ListCheckpoints(dir.path());
      ASSERT_TRUE(steps.ok());
      EXPECT_EQ(*steps,
                (c.expect_latest == 10 ? std::vector<int64_t>{10} : std::vector<int64_t>{10, 20}));
      const std::string tmp = CheckpointPath(dir.path(), 20) + ".tmp-0";
      struct stat st;
      EXPECT_EQ(stat(tmp.c_str(), &st) == 0, c.expect_temporary);
      if (c.expect_temporary && std::string(c.phase) != "after_manifest") {
        EXPECT_FALSE(LoadCheckpoint(tmp).ok()) << "a partial checkpoint loads";
      }

      // The next attempt saves over it and removes the stale temporary.
      CheckpointWriterOptions o;
      o.dir = dir.path();
      o.attempt = "1";
      CheckpointWriter w(o, SingleProcessExchange());
      ASSERT_TRUE(w.Save(MakeState(30, 3)).ok());
      ASSERT_TRUE(w.Finish().ok());
      EXPECT_NE(stat(tmp.c_str(), &st), 0) << "stale temporary left behind";
      latest = FindLatestIntact(dir.path());
      ASSERT_TRUE(latest.ok());
      EXPECT_EQ(*latest, CheckpointPath(dir.path(), 30));
    }
  }
}

TEST(Checkpoint, FaultOnOneRankFailsNoOtherRankSilently) {
  // Rank 1 of 2 cannot write (its file name is taken by a directory): both
  // ranks report the failure, nothing is committed.
  TempDir dir;
  const std::string tmp = CheckpointPath(dir.path(), 5) + ".tmp-0";
  ASSERT_EQ(mkdir(tmp.c_str(), 0755), 0);
  ASSERT_EQ(mkdir((tmp + "/" + ShardFileName(1)).c_str(), 0755), 0);
  absl::Status s = SaveOnRanks(dir.path(), 2, {MakeState(5, 1)}, true);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 1")) << s;
  EXPECT_EQ(FindLatestIntact(dir.path()).status().code(), absl::StatusCode::kNotFound);
}

TEST(Checkpoint, RetentionKeepsLastKAndEveryM) {
  TempDir dir;
  CheckpointWriterOptions o;
  o.dir = dir.path();
  o.keep_last = 2;
  o.keep_every = 4;
  CheckpointWriter w(o, SingleProcessExchange());
  for (int step = 1; step <= 10; ++step) ASSERT_TRUE(w.Save(MakeState(step, step)).ok());
  ASSERT_TRUE(w.Finish().ok());
  absl::StatusOr<std::vector<int64_t>> steps = ListCheckpoints(dir.path());
  ASSERT_TRUE(steps.ok());
  EXPECT_EQ(*steps, (std::vector<int64_t>{4, 8, 9, 10}));
  EXPECT_EQ(ListDir(dir.path()).size(), 5u) << "temporaries left: " << ListDir(dir.path()).size();
  for (int64_t step : *steps) EXPECT_TRUE(VerifyCheckpoint(CheckpointPath(dir.path(), step)).ok());
}

TEST(Checkpoint, AsyncSaveIsNotDisturbedByTheCallerChangingItsTensors) {
  TempDir dir;
  CheckpointState s = MakeState(3, 1);
  // 32 MiB, so the write is still in flight while the caller scribbles.
  s.tensors.push_back({"big", Tensor::Zeros({8 << 20}, DType::kF32).value()});
  float* big = s.tensors.back().tensor.data<float>();
  for (int64_t i = 0; i < (8 << 20); ++i) big[i] = static_cast<float>(i % 4099);
  const CheckpointState expect = [&] {
    CheckpointState c = s;
    for (NamedTensor& t : c.tensors) {
      Tensor copy = Tensor::Empty(t.tensor.shape(), t.tensor.dtype()).value();
      if (t.tensor.nbytes() > 0) std::memcpy(copy.raw(), t.tensor.raw(), t.tensor.nbytes());
      t.tensor = copy;
    }
    return c;
  }();
  CheckpointWriterOptions o;
  o.dir = dir.path();
  CheckpointWriter w(o, SingleProcessExchange());
  ASSERT_TRUE(w.Save(s).ok());
  for (NamedTensor& t : s.tensors) std::memset(t.tensor.raw(), 0xAB, t.tensor.nbytes());
  ASSERT_TRUE(w.Finish().ok());
  absl::StatusOr<CheckpointState> loaded = LoadCheckpoint(CheckpointPath(dir.path(), 3));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ExpectSameState(expect, *loaded);
}

TEST(Checkpoint, PollCommitsOnceEveryRankHasWritten) {
  TempDir dir;
  ThreadExchange exchange(3);
  std::vector<int> polls(3, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      CheckpointWriterOptions o;
      o.dir = dir.path();
      o.rank = r;
      o.world_size = 3;
      CheckpointWriter w(o, exchange.For(r));
      ASSERT_TRUE(w.Save(MakeState(7, 1)).ok());
      // Steps of the loop: the commit happens in the Poll of the same
      // iteration on every rank (it is collective), so all leave together.
      for (int i = 0; i < 5000 && w.last_committed_step() != 7; ++i) {
        ASSERT_TRUE(w.Poll().ok());
        ++polls[r];
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      EXPECT_EQ(w.last_committed_step(), 7);
      ASSERT_TRUE(w.Poll().ok());  // nothing in flight: no exchange
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(polls[0], polls[1]);
  EXPECT_EQ(polls[0], polls[2]);
  // Committed before any Finish.
  absl::StatusOr<std::string> latest = FindLatestIntact(dir.path());
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, CheckpointPath(dir.path(), 7));
}

TEST(Checkpoint, BadStateAndFaultSpecAreInvalidArgument) {
  TempDir dir;
  CheckpointWriterOptions o;
  o.dir = dir.path();
  o.async = false;
  {
    CheckpointWriter w(o, SingleProcessExchange());
    CheckpointState s = MakeState(1, 1);
    s.tensors.push_back(s.tensors[0]);
    EXPECT_EQ(w.Save(s).code(), absl::StatusCode::kInvalidArgument);
    float x = 0;
    CheckpointState d;
    d.tensors.push_back({"on_gpu", Tensor::Wrap(&x, {1}, DType::kF32, Device::Cuda(0))});
    absl::Status st = w.Save(d);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(st.message(), "host memory")) << st;
  }
  o.fault = "after_lunch:3";
  CheckpointWriter w(o, SingleProcessExchange());
  absl::Status st = w.Save(MakeState(1, 1));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(st.message(), "SMAT_FAULT_CHECKPOINT")) << st;
}

TEST(Checkpoint, FaultForAnotherAttemptDoesNotFire) {
  TempDir dir;
  CheckpointWriterOptions o;
  o.dir = dir.path();
  o.attempt = "1";
  o.fault = "writing_shards:1:-1:0";  // attempt 0 only: this process lives on
  CheckpointWriter w(o, SingleProcessExchange());
  ASSERT_TRUE(w.Save(MakeState(1, 1)).ok());
  ASSERT_TRUE(w.Finish().ok());
  EXPECT_TRUE(VerifyCheckpoint(CheckpointPath(dir.path(), 1)).ok());
  o.fault = "writing_shards:1:-1:first";
  CheckpointWriter bad(o, SingleProcessExchange());
  EXPECT_EQ(bad.Save(MakeState(2, 1)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Checkpoint, UnwritableDirectoryIsUnavailableOnFinish) {
  TempDir dir;
  const std::string file = dir.path() + "/not_a_dir";
  WriteFile(file, "x");
  CheckpointWriterOptions o;
  o.dir = file + "/ckpt";
  CheckpointWriter w(o, SingleProcessExchange());
  ASSERT_TRUE(w.Save(MakeState(1, 1)).ok());  // async: the error comes with the commit
  absl::Status s = w.Finish();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), file)) << s;
}

TEST(Preemption, SignalsSetFlagsTheLoopReads) {
  ASSERT_TRUE(InstallPreemptionHandlers().ok());
  ClearStopRequests();
  EXPECT_EQ(TakeLocalStopRequest(), StopRequest::kNone);
  ASSERT_EQ(raise(SIGUSR1), 0);
  EXPECT_EQ(TakeLocalStopRequest(), StopRequest::kCheckpoint);
  EXPECT_EQ(TakeLocalStopRequest(), StopRequest::kNone) << "SIGUSR1 is served once";
  ASSERT_EQ(raise(SIGTERM), 0);  // the handler runs: the process lives on
  EXPECT_EQ(TakeLocalStopRequest(), StopRequest::kPreempt);
  EXPECT_EQ(TakeLocalStopRequest(), StopRequest::kPreempt) << "preemption is not forgotten";
  ClearStopRequests();
  signal(SIGTERM, SIG_DFL);
  signal(SIGUSR1, SIG_DFL);
}

}  // namespace
}  // namespace smat
