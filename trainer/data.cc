// Token files, the byte tokenizer and the batch sampler (trainer/data.h).
#include "trainer/data.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "core/rng.h"
#include "core/status.h"

namespace smat {
namespace {

std::string ErrnoText(int err) {
  char buf[256];
  return std::string(strerror_r(err, buf, sizeof(buf)));
}

absl::Status FileError(const std::string& what, const std::string& path, int err) {
  const std::string msg = absl::StrCat(what, " '", path, "': ", ErrnoText(err));
  if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::InternalError(msg);
}

void PutLe(unsigned char* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint64_t GetLe(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

std::atomic<uint64_t> temp_counter{0};

// Synthetic evaluation examples come from streams with the top bit set, disjoint from
// the training streams (global sequence indices stay far below 2^63).
constexpr uint64_t kEvalStream = uint64_t{1} << 63;

}  // namespace

// --- byte tokenizer ------------------------------------------------------------------

std::vector<int32_t> EncodeBytes(const std::string& text) {
  std::vector<int32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

absl::StatusOr<std::string> DecodeBytes(absl::Span<const int32_t> tokens) {
  std::string out(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= kByteVocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("DecodeBytes: token ", i, " = ", tokens[i], " is not a byte (0..255)"));
    }
    out[i] = static_cast<char>(tokens[i]);
  }
  return out;
}

int TokenWidthForVocab(uint64_t vocab_size) {
  if (vocab_size <= 256) return 1;
  if (vocab_size <= 65536) return 2;
  return 4;
}

// --- TokenFileWriter ---------------------------------------------------------------------

absl::StatusOr<TokenFileWriter> TokenFileWriter::Create(const std::string& path,
                                                        uint64_t vocab_size) {
  if (vocab_size < 1 || vocab_size > (uint64_t{1} << 31)) {
    return absl::InvalidArgumentError(absl::StrCat("token file '", path, "': vocabulary size ",
                                                   vocab_size, " is out of range 1..2^31"));
  }
  TokenFileWriter w;
  w.path_ = path;
  w.tmp_path_ = absl::StrCat(path, ".tmp.", ::getpid(), ".", temp_counter.fetch_add(1));
  w.vocab_size_ = vocab_size;
  w.width_ = TokenWidthForVocab(vocab_size);
  w.fd_ = ::open(w.tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w.fd_ < 0) return FileError("cannot create", w.tmp_path_, errno);
  unsigned char header[kTokenFileHeaderBytes] = {0};
  std::memcpy(header, kTokenFileMagic, 8);
  PutLe(header + 8, kTokenFileVersion, 4);
  PutLe(header + 12, static_cast<uint64_t>(w.width_), 4);
  PutLe(header + 16, vocab_size, 8);
  PutLe(header + 24, 0, 8);  // count, patched by Finish
  SMAT_RETURN_IF_ERROR(w.WriteRaw(header, sizeof(header)));
  return w;
}

TokenFileWriter::TokenFileWriter(TokenFileWriter&& o) noexcept { *this = std::move(o); }

TokenFileWriter& TokenFileWriter::operator=(TokenFileWriter&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(tmp_path_.c_str());
    }
    path_ = std::move(o.path_);
    tmp_path_ = std::move(o.tmp_path_);
    fd_ = o.fd_;
    vocab_size_ = o.vocab_size_;
    width_ = o.width_;
    count_ = o.count_;
    o.fd_ = -1;
  }
  return *this;
}

TokenFileWriter::~TokenFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_path_.c_str());
  }
}

absl::Status TokenFileWriter::WriteRaw(const void* data, size_t n) {
  if (fd_ < 0) return absl::FailedPreconditionError("token file writer is finished or moved");
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = ::write(fd_, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return FileError("writing", tmp_path_, errno);
    p += put;
    n -= static_cast<size_t>(put);
  }
  return absl::OkStatus();
}

absl::Status TokenFileWriter::Append(absl::Span<const int32_t> tokens) {
  std::vector<unsigned char> buf(tokens.size() * static_cast<size_t>(width_));
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || static_cast<uint64_t>(tokens[i]) >= vocab_size_) {
      return absl::InvalidArgumentError(absl::StrCat("token file '", path_, "': token ", tokens[i],
                                                     " is outside the vocabulary [0, ", vocab_size_,
                                                     ")"));
    }
    PutLe(buf.data() + i * width_, static_cast<uint64_t>(tokens[i]), width_);
  }
  SMAT_RETURN_IF_ERROR(WriteRaw(buf.data(), buf.size()));
  count_ += tokens.size();
  return absl::OkStatus();
}

absl::Status TokenFileWriter::AppendBytes(const char* data, size_t n) {
  if (width_ != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "token file '", path_, "': raw bytes need 1-byte tokens, vocabulary is ", vocab_size_));
  }
  if (vocab_size_ < 256) {
    for (size_t i = 0; i < n; ++i) {
      if (static_cast<unsigned char>(data[i]) >= vocab_size_) {
        return absl::InvalidArgumentError(absl::StrCat("token file '", path_, "': byte ",
                                                       static_cast<unsigned char>(data[i]),
                                                       " is outside the vocabulary"));
      }
    }
  }
  SMAT_RETURN_IF_ERROR(WriteRaw(data, n));
  count_ += n;
  return absl::OkStatus();
}

absl::Status TokenFileWriter::Finish() {
  if (fd_ < 0) return absl::FailedPreconditionError("token file writer is finished or moved");
  unsigned char count[8];
  PutLe(count, count_, 8);
  if (::pwrite(fd_, count, 8, 24) != 8 || ::fsync(fd_) != 0) {
    return FileError("finishing", tmp_path_, errno);
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp_path_.c_str());
    return FileError("closing", tmp_path_, err);
  }
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_path_.c_str());
    return FileError("cannot rename temporary file onto", path_, err);
  }
  return absl::OkStatus();
}

absl::Status WriteTokenFile(const std::string& path, absl::Span<const int32_t> tokens,
                            uint64_t vocab_size) {
  SMAT_ASSIGN_OR_RETURN(TokenFileWriter w, TokenFileWriter::Create(path, vocab_size));
  SMAT_RETURN_IF_ERROR(w.Append(tokens));
  return w.Finish();
}

// --- TokenFile -------------------------------------------------------------------------

absl::StatusOr<TokenFile> TokenFile::Open(const std::string& path, uint64_t max_vocab) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return FileError("token file: cannot open", path, errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return FileError("token file: cannot stat", path, err);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  TokenFile f;
  f.path_ = path;
  if (size > 0) {
    f.map_ = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (f.map_ == MAP_FAILED) {
      const int err = errno;
      f.map_ = nullptr;
      ::close(fd);
      return FileError("token file: cannot map", path, err);
    }
    f.map_bytes_ = size;
  }
  ::close(fd);  // the mapping keeps the file open
  const unsigned char* p = static_cast<const unsigned char*>(f.map_);
  const std::string where = absl::StrCat("token file '", path, "'");

  const size_t magic_len = std::min<uint64_t>(size, 8);
  if (magic_len < 8 || std::memcmp(p, kTokenFileMagic, 8) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": not a smat token file (no \"SMATTOK1\" magic); make one with smat_data"));
  }
  if (size < static_cast<uint64_t>(kTokenFileHeaderBytes)) {
    return absl::DataLossError(
        absl::StrCat(where, ": truncated header: ", size, " bytes, need ", kTokenFileHeaderBytes));
  }
  const uint64_t version = GetLe(p + 8, 4);
  if (version != kTokenFileVersion) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": format version ", version,
                                                   " is not supported (this build reads ",
                                                   kTokenFileVersion, ")"));
  }
  const uint64_t width = GetLe(p + 12, 4);
  if (width != 1 && width != 2 && width != 4) {
    return absl::DataLossError(
        absl::StrCat(where, ": token width ", width, " is not 1, 2 or 4 bytes"));
  }
  f.width_ = static_cast<int>(width);
  f.vocab_size_ = GetLe(p + 16, 8);
  f.count_ = GetLe(p + 24, 8);
  if (f.vocab_size_ < 1 || f.vocab_size_ > (uint64_t{1} << (8 * width - (width == 4 ? 1 : 0)))) {
    return absl::DataLossError(absl::StrCat(where, ": vocabulary size ", f.vocab_size_,
                                            " does not fit ", width, "-byte tokens"));
  }
  const uint64_t have = size - kTokenFileHeaderBytes;
  if (f.count_ > have / width || f.count_ * width != have) {
    return absl::DataLossError(absl::StrCat(
        where, ": header says ", f.count_, " tokens of ", width, " bytes, file has ", have,
        " bytes of tokens (", have < f.count_ * width ? "truncated" : "trailing bytes", ")"));
  }
  if (max_vocab > 0 && f.vocab_size_ > max_vocab) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": vocabulary size ", f.vocab_size_,
                                                   " exceeds model.vocab_size = ", max_vocab,
                                                   "; raise model.vocab_size or retokenize"));
  }
  f.tokens_ = p + kTokenFileHeaderBytes;
  return f;
}

TokenFile::TokenFile(TokenFile&& o) noexcept { *this = std::move(o); }

TokenFile& TokenFile::operator=(TokenFile&& o) noexcept {
  if (this != &o) {
    Release();
    path_ = std::move(o.path_);
    map_ = o.map_;
    map_bytes_ = o.map_bytes_;
    tokens_ = o.tokens_;
    vocab_size_ = o.vocab_size_;
    count_ = o.count_;
    width_ = o.width_;
    o.map_ = nullptr;
    o.map_bytes_ = 0;
    o.tokens_ = nullptr;
  }
  return *this;
}

TokenFile::~TokenFile() { Release(); }

void TokenFile::Release() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
  tokens_ = nullptr;
}

absl::Status TokenFile::Read(int64_t start, int64_t n, int32_t* out) const {
  SMAT_CHECK(start >= 0 && n >= 0 && static_cast<uint64_t>(start + n) <= count_);
  const unsigned char* p = tokens_ + static_cast<size_t>(start) * width_;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t v = GetLe(p + i * width_, width_);
    if (v >= vocab_size_) {
      return absl::DataLossError(absl::StrCat("token file '", path_, "': token ", start + i, " = ",
                                              v, " is outside the vocabulary [0, ", vocab_size_,
                                              "); the file is damaged"));
    }
    out[i] = static_cast<int32_t>(v);
  }
  return absl::OkStatus();
}

// --- byte corpus ---------------------------------------------------------------------------

std::string DefaultHeldoutPath(const std::string& train_path) {
  const std::string ext = ".bin";
  if (train_path.size() > ext.size() &&
      train_path.compare(train_path.size() - ext.size(), ext.size(), ext) == 0) {
    return absl::StrCat(train_path.substr(0, train_path.size() - ext.size()), ".heldout.bin");
  }
  return absl::StrCat(train_path, ".heldout");
}

absl::StatusOr<ByteCorpusStats> WriteByteCorpus(const std::vector<std::string>& inputs,
                                                const std::string& train_path,
                                                const std::string& heldout_path,
                                                double heldout_fraction) {
  namespace fs = std::filesystem;
  if (!(heldout_fraction >= 0.0 && heldout_fraction < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("heldout_fraction = ", heldout_fraction, " is out of range; expected [0, 1)"));
  }
  if (heldout_fraction > 0 && heldout_path.empty()) {
    return absl::InvalidArgumentError("heldout_fraction > 0 needs a held-out output path");
  }
  if (inputs.empty()) return absl::InvalidArgumentError("no inputs given");
  std::vector<fs::path> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    const fs::file_status st = fs::status(in, ec);
    if (ec || !fs::exists(st)) {
      return absl::NotFoundError(absl::StrCat("input '", in, "' does not exist"));
    }
    if (fs::is_directory(st)) {
      for (auto it = fs::recursive_directory_iterator(in, ec); !ec && it != fs::end(it);
           it.increment(ec)) {
        if (it->is_regular_file()) files.push_back(it->path());
      }
      if (ec) return absl::InternalError(absl::StrCat("walking '", in, "': ", ec.message()));
    } else if (fs::is_regular_file(st)) {
      files.push_back(in);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("input '", in, "' is not a file or directory"));
    }
  }
  // Sorted and deduplicated by canonical path; previous outputs are not inputs.
  std::vector<std::pair<std::string, fs::path>> keyed;
  for (const fs::path& f : files) {
    std::error_code ec;
    keyed.emplace_back(fs::weakly_canonical(f, ec).string(), f);
  }
  std::sort(keyed.begin(), keyed.end());
  keyed.erase(std::unique(keyed.begin(), keyed.end(),
                          [](const auto& a, const auto& b) { return a.first == b.first; }),
              keyed.end());
  std::error_code ec;
  const std::string train_canon = fs::weakly_canonical(train_path, ec).string();
  const std::string heldout_canon =
      heldout_path.empty() ? "" : fs::weakly_canonical(heldout_path, ec).string();
  std::erase_if(keyed,
                [&](const auto& k) { return k.first == train_canon || k.first == heldout_canon; });
  if (keyed.empty()) return absl::InvalidArgumentError("no input files found");

  // Output folders are created, like `mkdir -p`, so "--output data/x.bin" just works.
  for (const std::string& out : {train_path, heldout_path}) {
    const fs::path parent = fs::path(out).parent_path();
    if (out.empty() || parent.empty()) continue;
    fs::create_directories(parent, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot create the folder of '", out, "': ", ec.message()));
    }
  }
  SMAT_ASSIGN_OR_RETURN(TokenFileWriter train, TokenFileWriter::Create(train_path, kByteVocab));
  std::unique_ptr<TokenFileWriter> heldout;
  if (heldout_fraction > 0) {
    SMAT_ASSIGN_OR_RETURN(TokenFileWriter h, TokenFileWriter::Create(heldout_path, kByteVocab));
    heldout = std::make_unique<TokenFileWriter>(std::move(h));
  }
  ByteCorpusStats stats;
  std::vector<char> buf(1 << 20);
  for (const auto& [canon, file] : keyed) {
    const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return FileError("cannot open input", file.string(), errno);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return FileError("cannot stat input", file.string(), err);
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    const uint64_t to_heldout =
        heldout ? static_cast<uint64_t>(static_cast<double>(size) * heldout_fraction) : 0;
    uint64_t done = 0;
    absl::Status status;
    while (status.ok() && done < size) {
      const ssize_t got = ::read(fd, buf.data(), std::min<uint64_t>(buf.size(), size - done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        status = got == 0 ? absl::DataLossError(
                                absl::StrCat("input '", file.string(), "' shrank while being read"))
                          : FileError("reading input", file.string(), errno);
        break;
      }
      // Split the block at the train / held-out boundary of this file.
      const uint64_t boundary = size - to_heldout;
      const uint64_t n = static_cast<uint64_t>(got);
      const uint64_t train_n = done >= boundary ? 0 : std::min(n, boundary - done);
      if (train_n > 0) status = train.AppendBytes(buf.data(), train_n);
      if (status.ok() && n > train_n)
        status = heldout->AppendBytes(buf.data() + train_n, n - train_n);
      done += n;
    }
    ::close(fd);
    SMAT_RETURN_IF_ERROR(status);
    ++stats.files;
  }
  stats.train_tokens = train.count();
  SMAT_RETURN_IF_ERROR(train.Finish());
  if (heldout) {
    stats.heldout_tokens = heldout->count();
    SMAT_RETURN_IF_ERROR(heldout->Finish());
  }
  return stats;
}

// --- BatchSampler ----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<BatchSampler>> BatchSampler::Create(const DataConfig& data,
                                                                   int64_t model_vocab, int dp) {
  if (dp < 1 || data.seq_len() < 1 || data.batch_size() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data: dp = ", dp, ", seq_len = ", data.seq_len(),
                     ", batch_size = ", data.batch_size(), " must all be >= 1"));
  }
  std::unique_ptr<BatchSampler> s(new BatchSampler());
  s->data_ = data;
  s->dp_ = dp;
  switch (data.kind()) {
    case DataConfig::TEXT: {
      const int64_t need = data.seq_len() + 1;  // inputs plus the shifted targets
      SMAT_ASSIGN_OR_RETURN(TokenFile train,
                            TokenFile::Open(data.path(), static_cast<uint64_t>(model_vocab)));
      if (train.size() < need) {
        return absl::InvalidArgumentError(
            absl::StrCat("data.path '", data.path(), "' has ", train.size(),
                         " tokens, fewer than data.seq_len + 1 = ", need));
      }
      s->train_ = std::make_unique<TokenFile>(std::move(train));
      if (!data.heldout_path().empty()) {
        SMAT_ASSIGN_OR_RETURN(
            TokenFile heldout,
            TokenFile::Open(data.heldout_path(), static_cast<uint64_t>(model_vocab)));
        if (heldout.size() < need) {
          return absl::InvalidArgumentError(
              absl::StrCat("data.heldout_path '", data.heldout_path(), "' has ", heldout.size(),
                           " tokens, fewer than data.seq_len + 1 = ", need));
        }
        s->heldout_ = std::make_unique<TokenFile>(std::move(heldout));
      }
      return s;
    }
    case DataConfig::MQAR:
      SMAT_RETURN_IF_ERROR(
          CheckMqarSpec({data.seq_len(), data.num_pairs(), data.vocab(), data.layout()}));
      break;
    case DataConfig::MULTI_KEY:
      SMAT_RETURN_IF_ERROR(CheckMultiKeySpec(
          {data.seq_len(), data.num_pairs(), data.keys_per_query(), data.num_queries(),
           data.vocab()}));
      break;
    case DataConfig::SUBSET_ROUTING:
      SMAT_RETURN_IF_ERROR(CheckSubsetRoutingSpec(
          {data.seq_len(), data.landmarks(), data.num_queries(), data.vocab()}));
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("data.kind = ", static_cast<int>(data.kind()), " is not a known kind"));
  }
  if (data.vocab() > model_vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.vocab = ", data.vocab(), " exceeds model.vocab_size = ", model_vocab));
  }
  return s;
}

namespace {
absl::StatusOr<Batch> EmptyBatch(int64_t B, int64_t T) {
  Batch b;
  SMAT_ASSIGN_OR_RETURN(b.inputs, Tensor::Empty({B, T}, DType::kI32));
  SMAT_ASSIGN_OR_RETURN(b.targets, Tensor::Empty({B, T}, DType::kI32));
  SMAT_ASSIGN_OR_RETURN(b.loss_mask, Tensor::Empty({B, T}, DType::kF32));
  return b;
}
}  // namespace

absl::StatusOr<Batch> BatchSampler::TextBatch(const TokenFile& file, int64_t first_sequence,
                                              bool random) const {
  const int64_t B = data_.batch_size(), T = data_.seq_len();
  SMAT_ASSIGN_OR_RETURN(Batch batch, EmptyBatch(B, T));
  std::vector<int32_t> window(static_cast<size_t>(T + 1));
  const int64_t starts = file.size() - T;  // valid starts [0, size - T - 1]
  const int64_t windows = file.size() / (T + 1);
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t g = static_cast<uint64_t>(first_sequence + b);
    const int64_t start =
        random
            ? static_cast<int64_t>(PhiloxStream(data_.seed(), g).Next64() % static_cast<uint64_t>(starts))
            : static_cast<int64_t>(g % static_cast<uint64_t>(windows)) * (T + 1);
    SMAT_RETURN_IF_ERROR(file.Read(start, T + 1, window.data()));
    std::copy(window.begin(), window.end() - 1, batch.inputs.data<int32_t>() + b * T);
    std::copy(window.begin() + 1, window.end(), batch.targets.data<int32_t>() + b * T);
    std::fill(batch.loss_mask.data<float>() + b * T, batch.loss_mask.data<float>() + (b + 1) * T,
              1.f);
  }
  return batch;
}

absl::StatusOr<Batch> BatchSampler::SyntheticBatch(uint64_t first_example,
                                                   uint64_t stream_base) const {
  const int64_t B = data_.batch_size(), T = data_.seq_len();
  SMAT_ASSIGN_OR_RETURN(Batch batch, EmptyBatch(B, T));
  const uint64_t seed = static_cast<uint64_t>(data_.seed());
  const MqarSpec mqar{T, data_.num_pairs(), data_.vocab(), data_.layout()};
  const MultiKeySpec multi_key{T, data_.num_pairs(), data_.keys_per_query(),
                               data_.num_queries(), data_.vocab()};
  const SubsetRoutingSpec subset{T, data_.landmarks(), data_.num_queries(), data_.vocab()};
  for (int64_t b = 0; b < B; ++b) {
    const uint64_t index = stream_base | (first_example + static_cast<uint64_t>(b));
    int32_t* in = batch.inputs.data<int32_t>() + b * T;
    int32_t* tg = batch.targets.data<int32_t>() + b * T;
    float* mask = batch.loss_mask.data<float>() + b * T;
    switch (data_.kind()) {
      case DataConfig::MULTI_KEY: MakeMultiKeyExample(multi_key, seed, index, in, tg, mask); break;
      case DataConfig::SUBSET_ROUTING:
        MakeSubsetRoutingExample(subset, seed, index, in, tg, mask);
        break;
      default: MakeMqarExample(mqar, seed, index, in, tg, mask);
    }
  }
  return batch;
}

absl::StatusOr<Batch> BatchSampler::TrainBatchAt(int64_t cursor, int dp_rank) const {
  // Training streams must stay below kEvalStream (top bit), which no real
  // cursor approaches.
  if (cursor < 0 || cursor >= (int64_t{1} << 62) || dp_rank < 0 || dp_rank >= dp_) {
    return absl::InvalidArgumentError(absl::StrCat("TrainBatchAt: cursor ", cursor, ", dp_rank ",
                                                   dp_rank, " outside [0, ", dp_, ")"));
  }
  const int64_t first = cursor + dp_rank * data_.batch_size();
  if (data_.kind() == DataConfig::TEXT) return TextBatch(*train_, first, /*random=*/true);
  return SyntheticBatch(static_cast<uint64_t>(first), 0);
}

absl::StatusOr<Batch> BatchSampler::TrainBatch(int64_t step, int dp_rank) const {
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat("TrainBatch: step ", step, " < 0"));
  return TrainBatchAt(step * GlobalBatchSequences(), dp_rank);
}

absl::StatusOr<Batch> BatchSampler::EvalBatch(int64_t index) const {
  if (index < 0) return absl::InvalidArgumentError("EvalBatch: negative index");
  const int64_t first = index * data_.batch_size();
  if (data_.kind() == DataConfig::TEXT) {
    if (heldout_ == nullptr) {
      return absl::FailedPreconditionError("EvalBatch: no data.heldout_path was configured");
    }
    return TextBatch(*heldout_, first, /*random=*/false);
  }
  return SyntheticBatch(static_cast<uint64_t>(first), kEvalStream);
}

int64_t BatchSampler::NumEvalBatches() const {
  if (data_.kind() != DataConfig::TEXT || heldout_ == nullptr) return 0;
  const int64_t windows = heldout_->size() / (data_.seq_len() + 1);
  return std::max<int64_t>(1, windows / data_.batch_size());
}

bool BatchSampler::has_eval() const {
  return data_.kind() != DataConfig::TEXT || heldout_ != nullptr;
}

}  // namespace smat
