// .npy reading and writing (core/npy.h), following numpy's format description
// (numpy/lib/format.py): magic "\x93NUMPY", major and minor version bytes, the
// header length (uint16 for 1.0, uint32 for 2.0 and 3.0), then a Python dict
// literal {'descr': ..., 'fortran_order': ..., 'shape': (...), } padded with
// spaces and ended by '\n' so the data starts at a multiple of 64 bytes.
#include "core/npy.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cstdio>
#include <cstring>
#include <map>
#include <variant>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace smat {
namespace {

static_assert(std::endian::native == std::endian::little,
              ".npy I/O copies little-endian data as is; a big-endian host needs byte swaps");

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
constexpr size_t kAlign = 64;                // numpy's ARRAY_ALIGN
constexpr size_t kGrowthAxisMaxDigits = 21;  // numpy pads the header for in-place growth

struct DTypeCode {
  const char* descr;
  DType dtype;
};
constexpr DTypeCode kCodes[] = {
    {"<f4", DType::kF32}, {"<f8", DType::kF64}, {"<i4", DType::kI32},
    {"<i8", DType::kI64}, {"<u2", DType::kU16},
};

std::string Quote(absl::string_view s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
  return out;
}

// --- header dict parsing ----------------------------------------------------------
// A small parser for the subset of Python literals numpy writes: strings, True,
// False and tuples of integers (Python 2 files may suffix integers with 'L').

using HeaderValue = std::variant<std::string, bool, std::vector<int64_t>>;

class HeaderParser {
 public:
  explicit HeaderParser(absl::string_view text) : text_(text) {}

  // Parses the whole dict; on failure returns a description of what is wrong.
  absl::StatusOr<std::map<std::string, HeaderValue>> ParseDict() {
    std::map<std::string, HeaderValue> dict;
    SkipSpace();
    if (!Consume('{')) return Error("expected '{'");
    SkipSpace();
    while (!Consume('}')) {
      SMAT_ASSIGN_OR_RETURN(std::string key, ParseString());
      SkipSpace();
      if (!Consume(':')) return Error("expected ':' after key '" + key + "'");
      SkipSpace();
      SMAT_ASSIGN_OR_RETURN(HeaderValue value, ParseValue(key));
      if (!dict.emplace(key, std::move(value)).second) return Error("duplicate key '" + key + "'");
      SkipSpace();
      if (Consume(',')) {
        SkipSpace();
      } else if (Peek() != '}') {
        return Error("expected ',' or '}'");
      }
    }
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected text after the closing '}'");
    return dict;
  }

 private:
  char Peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  bool Consume(char c) {
    if (Peek() != c || pos_ >= text_.size()) return false;
    ++pos_;
    return true;
  }
  void SkipSpace() {
    while (pos_ < text_.size() && absl::ascii_isspace(static_cast<unsigned char>(text_[pos_]))) {
      ++pos_;
    }
  }
  absl::Status Error(const std::string& what) const {
    return absl::DataLossError(
        absl::StrCat("malformed header dict at character ", pos_, ": ", what, " in \"",
                     Quote(absl::StripTrailingAsciiWhitespace(text_)), "\""));
  }

  absl::StatusOr<std::string> ParseString() {
    const char quote = Peek();
    if (quote != '\'' && quote != '"') return Error("expected a quoted string");
    ++pos_;
    const size_t end = text_.find(quote, pos_);
    if (end == absl::string_view::npos) return Error("unterminated string");
    std::string s(text_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return s;
  }

  absl::StatusOr<int64_t> ParseInt() {
    const size_t start = pos_;
    if (Peek() == '-') ++pos_;
    if (!absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) {
      pos_ = start;
      return Error("expected an integer");
    }
    int64_t v = 0;
    while (absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) {
      if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, Peek() - '0', &v)) {
        return Error("integer too large");
      }
      ++pos_;
    }
    if (Peek() == 'L') ++pos_;  // Python 2 long literal
    return text_[start] == '-' ? -v : v;
  }

  absl::StatusOr<HeaderValue> ParseValue(const std::string& key) {
    const char c = Peek();
    if (c == '\'' || c == '"') {
      SMAT_ASSIGN_OR_RETURN(std::string s, ParseString());
      return HeaderValue(std::move(s));
    }
    if (text_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return HeaderValue(true);
    }
    if (text_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return HeaderValue(false);
    }
    if (c == '(') {
      ++pos_;
      std::vector<int64_t> dims;
      SkipSpace();
      while (!Consume(')')) {
        SMAT_ASSIGN_OR_RETURN(int64_t d, ParseInt());
        dims.push_back(d);
        SkipSpace();
        if (Consume(',')) {
          SkipSpace();
        } else if (Peek() != ')') {
          return Error("expected ',' or ')' in the shape tuple");
        }
      }
      return HeaderValue(std::move(dims));
    }
    if (c == '[') {
      // A list descr is a structured dtype: report it as such rather than as noise.
      return absl::InvalidArgumentError(
          absl::StrCat("structured dtype in '", key,
                       "' is not supported; save a plain numeric array (one of <f4, <f8, <i4, "
                       "<i8, <u2)"));
    }
    return Error("unsupported value for key '" + key + "'");
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

struct ParsedHeader {
  DType dtype;
  Shape shape;
};

absl::StatusOr<ParsedHeader> InterpretHeader(absl::string_view text) {
  SMAT_ASSIGN_OR_RETURN(auto dict, HeaderParser(text).ParseDict());
  for (const char* key : {"descr", "fortran_order", "shape"}) {
    if (!dict.count(key)) {
      return absl::DataLossError(absl::StrCat("malformed header dict: no '", key, "' key in \"",
                                              Quote(absl::StripTrailingAsciiWhitespace(text)),
                                              "\""));
    }
  }
  if (dict.size() != 3) {
    std::vector<std::string> keys;
    for (const auto& [k, v] : dict) keys.push_back(k);
    return absl::DataLossError(absl::StrCat("malformed header dict: keys are ",
                                            absl::StrJoin(keys, ", "),
                                            "; expected exactly descr, fortran_order, shape"));
  }
  const auto* descr = std::get_if<std::string>(&dict["descr"]);
  const auto* fortran = std::get_if<bool>(&dict["fortran_order"]);
  const auto* shape = std::get_if<std::vector<int64_t>>(&dict["shape"]);
  if (descr == nullptr)
    return absl::DataLossError("malformed header dict: 'descr' is not a string");
  if (fortran == nullptr) {
    return absl::DataLossError("malformed header dict: 'fortran_order' is not True or False");
  }
  if (shape == nullptr) return absl::DataLossError("malformed header dict: 'shape' is not a tuple");

  ParsedHeader h;
  bool known = false;
  for (const DTypeCode& code : kCodes) {
    if (*descr == code.descr) {
      h.dtype = code.dtype;
      known = true;
    }
  }
  if (!known) {
    if (!descr->empty() && (*descr)[0] == '>') {
      return absl::InvalidArgumentError(absl::StrCat("big-endian dtype '", *descr,
                                                     "' is not supported; save with arr.astype('<",
                                                     descr->substr(1), "')"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "unsupported dtype '", *descr,
        "'; smat reads <f4 (fp32), <f8 (fp64), <i4 (int32), <i8 (int64) and <u2 (uint16)"));
  }
  if (*fortran) {
    return absl::InvalidArgumentError(
        "fortran_order is True; smat reads C-ordered arrays only: save "
        "np.ascontiguousarray(arr)");
  }
  for (int64_t d : *shape) {
    if (d < 0) {
      return absl::DataLossError(
          absl::StrCat("shape ", ShapeToString(*shape), " has a negative entry"));
    }
  }
  h.shape = *shape;
  return h;
}

std::string ErrnoMessage(int err) {
  char buf[256];
  // GNU strerror_r returns the message pointer (possibly not buf).
  return std::string(strerror_r(err, buf, sizeof(buf)));
}

absl::Status OpenError(const std::string& what, const std::string& path, int err) {
  const std::string msg = absl::StrCat(what, " '", path, "': ", ErrnoMessage(err));
  if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  return absl::InvalidArgumentError(msg);
}

// Reads exactly n bytes at the file's current position; false on a short read.
bool ReadFully(int fd, void* dst, size_t n) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = ::read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

bool WriteFully(int fd, const void* src, size_t n) {
  const char* p = static_cast<const char*>(src);
  while (n > 0) {
    const ssize_t put = ::write(fd, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put;
    n -= static_cast<size_t>(put);
  }
  return true;
}

class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

std::string ShapeRepr(const Shape& shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

absl::StatusOr<Tensor> ReadNpyImpl(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return OpenError("cannot open", path, errno);
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) return OpenError("cannot stat", path, errno);
  if (S_ISDIR(st.st_mode)) return absl::InvalidArgumentError("is a directory, not a .npy file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);

  // Magic first, so a file that is not .npy at all says so rather than "truncated".
  char magic[kMagicLen] = {0};
  const size_t magic_got = std::min<uint64_t>(file_size, kMagicLen);
  if (!ReadFully(fd, magic, magic_got)) return absl::DataLossError("read error in the magic bytes");
  if (magic_got < kMagicLen || std::memcmp(magic, kMagic, kMagicLen) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("not a .npy file: starts with \"",
                                                   Quote(absl::string_view(magic, magic_got)),
                                                   "\", expected \"\\x93NUMPY\""));
  }
  unsigned char version[2];
  if (!ReadFully(fd, version, 2)) {
    return absl::DataLossError("truncated header: file ends before the format version");
  }
  size_t len_bytes;
  if (version[0] == 1) {
    len_bytes = 2;
  } else if (version[0] == 2 || version[0] == 3) {
    len_bytes = 4;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unsupported .npy format version ", version[0],
                                                   ".", version[1],
                                                   "; smat reads 1.0, 2.0 and 3.0"));
  }
  unsigned char len_le[4] = {0};
  if (!ReadFully(fd, len_le, len_bytes)) {
    return absl::DataLossError("truncated header: file ends inside the header length");
  }
  const uint64_t header_len = static_cast<uint64_t>(len_le[0]) | (uint64_t{len_le[1]} << 8) |
                              (uint64_t{len_le[2]} << 16) | (uint64_t{len_le[3]} << 24);
  const uint64_t preamble = kMagicLen + 2 + len_bytes;
  if (preamble + header_len > file_size) {
    return absl::DataLossError(absl::StrCat("truncated header: expected ", header_len,
                                            " bytes of header, file has ", file_size - preamble));
  }
  std::string header(header_len, '\0');
  if (!ReadFully(fd, header.data(), header_len)) {
    return absl::DataLossError("read error in the header");
  }
  SMAT_ASSIGN_OR_RETURN(ParsedHeader h, InterpretHeader(header));

  int64_t numel = 1;
  for (int64_t d : h.shape) {
    if (__builtin_mul_overflow(numel, d, &numel)) {
      return absl::DataLossError(absl::StrCat("shape ", ShapeToString(h.shape), " is too large"));
    }
  }
  uint64_t expected = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), DTypeSize(h.dtype), &expected)) {
    return absl::DataLossError(absl::StrCat("shape ", ShapeToString(h.shape), " is too large"));
  }
  const uint64_t available = file_size - preamble - header_len;
  if (available < expected) {
    return absl::DataLossError(absl::StrCat("truncated data: expected ", expected,
                                            " bytes of data for ", DTypeName(h.dtype),
                                            ShapeToString(h.shape), ", file has ", available));
  }
  if (available > expected) {
    return absl::DataLossError(absl::StrCat(
        "expected ", expected, " bytes of data for ", DTypeName(h.dtype), ShapeToString(h.shape),
        ", file has ", available, " (trailing bytes after the array)"));
  }
  SMAT_ASSIGN_OR_RETURN(Tensor t, Tensor::Empty(h.shape, h.dtype));
  if (expected > 0 && !ReadFully(fd, t.raw(), expected)) {
    return absl::DataLossError("read error in the data");
  }
  return t;
}

std::atomic<uint64_t> temp_counter{0};

}  // namespace

absl::StatusOr<std::string> NpyHeader(DType dtype, const Shape& shape) {
  const char* descr = nullptr;
  for (const DTypeCode& code : kCodes) {
    if (code.dtype == dtype) descr = code.descr;
  }
  if (descr == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dtype ", DTypeName(dtype),
        " has no .npy equivalent; convert to fp32 first (ToFloat32 in core/convert.h)"));
  }
  // numpy's _write_array_header: keys sorted, repr of each value, then spare
  // spaces so the first axis can grow in place, then padding to kAlign.
  std::string dict = absl::StrCat("{'descr': '", descr,
                                  "', 'fortran_order': False, 'shape': ", ShapeRepr(shape), ", }");
  if (!shape.empty()) {
    const size_t digits = absl::StrCat(shape[0]).size();
    if (digits < kGrowthAxisMaxDigits) dict.append(kGrowthAxisMaxDigits - digits, ' ');
  }
  const size_t hlen = dict.size() + 1;  // + '\n'
  int major = 1;
  size_t len_bytes = 2;
  size_t padlen = kAlign - (kMagicLen + 2 + len_bytes + hlen) % kAlign;
  if (hlen + padlen > 0xffff) {
    major = 2;
    len_bytes = 4;
    padlen = kAlign - (kMagicLen + 2 + len_bytes + hlen) % kAlign;
  }
  const uint32_t total = static_cast<uint32_t>(hlen + padlen);
  std::string out(kMagic, kMagicLen);
  out.push_back(static_cast<char>(major));
  out.push_back('\0');
  for (size_t b = 0; b < len_bytes; ++b)
    out.push_back(static_cast<char>((total >> (8 * b)) & 0xff));
  out += dict;
  out.append(padlen, ' ');
  out.push_back('\n');
  return out;
}

absl::StatusOr<Tensor> ReadNpy(const std::string& path) {
  auto t = ReadNpyImpl(path);
  if (!t.ok()) return Annotate(t.status(), "npy: ", path);
  return t;
}

absl::Status WriteNpy(const std::string& path, const Tensor& t) {
  if (!t.device().is_cpu()) {
    return absl::InvalidArgumentError(absl::StrCat("npy: ", path, ": tensor ", t.DebugString(),
                                                   " is not in host memory; copy it first"));
  }
  auto header = NpyHeader(t.dtype(), t.shape());
  if (!header.ok()) return Annotate(header.status(), "npy: ", path);

  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", temp_counter.fetch_add(1));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Annotate(OpenError("cannot create", tmp, errno), "npy");
  FdCloser closer(fd);
  const bool ok = WriteFully(fd, header->data(), header->size()) &&
                  (t.nbytes() == 0 || WriteFully(fd, t.raw(), t.nbytes())) && ::fsync(fd) == 0;
  const int write_errno = errno;
  const int close_result = ::close(closer.release());
  if (!ok || close_result != 0) {
    ::unlink(tmp.c_str());
    return absl::InternalError(absl::StrCat("npy: writing '", tmp,
                                            "' failed: ", ErrnoMessage(ok ? errno : write_errno),
                                            " (disk full or not writable?)"));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return Annotate(OpenError("cannot rename temporary file onto", path, err), "npy");
  }
  return absl::OkStatus();
}

}  // namespace smat
