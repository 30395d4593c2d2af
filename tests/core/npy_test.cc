// Tests for core/npy.h and core/convert.h: round trips of every supported dtype
// at odd shapes (0-d, zero-length axes), headers byte-identical to numpy's, files
// laid out by hand the way numpy writes them (1.0 modern and legacy, 2.0, 3.0),
// and one specific message for each kind of damaged or unsupported file. Bad
// files are written by the test into a fresh temporary directory.
#include "core/npy.h"

#include <dirent.h>
#include <stdlib.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/convert.h"
#include "gtest/gtest.h"

namespace smat {
namespace {

class NpyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "/npy_test_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    for (const std::string& name : ListDir()) std::remove((dir_ + "/" + name).c_str());
    ::rmdir(dir_.c_str());
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string WriteBytes(const std::string& name, const std::string& bytes) const {
    const std::string p = Path(name);
    std::ofstream f(p, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }
  std::vector<std::string> ListDir() const {
    std::vector<std::string> names;
    DIR* d = ::opendir(dir_.c_str());
    if (d == nullptr) return names;
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(d);
    return names;
  }
  // A v1.0 file with the given dict text (padded to 64) followed by `data`.
  static std::string V1File(const std::string& dict, const std::string& data) {
    std::string h = dict;
    while ((10 + h.size() + 1) % 64 != 0) h.push_back(' ');
    h.push_back('\n');
    std::string out("\x93NUMPY\x01\x00", 8);
    out.push_back(static_cast<char>(h.size() & 0xff));
    out.push_back(static_cast<char>(h.size() >> 8));
    return out + h + data;
  }
  // Reads `path` expecting an error with `code` whose message contains `needle`.
  void ExpectError(const std::string& path, absl::StatusCode code, const std::string& needle) {
    auto t = ReadNpy(path);
    ASSERT_FALSE(t.ok()) << path << " read without error";
    EXPECT_EQ(t.status().code(), code) << t.status();
    const std::string msg(t.status().message());
    EXPECT_NE(msg.find(needle), std::string::npos) << "message: " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << "message does not name the file: " << msg;
  }

  std::string dir_;
};

// Fills t with distinct, non-zero byte patterns so a mix-up of elements shows.
void FillPattern(Tensor& t) {
  unsigned char* p = static_cast<unsigned char*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(i * 37 + 11);
}

TEST_F(NpyTest, RoundTripEveryDtypeAndOddShapes) {
  const std::vector<Shape> shapes = {{}, {0}, {3, 0, 2}, {7}, {3, 5, 2}, {1, 1031}, {2, 1, 3, 1}};
  for (DType dt : {DType::kF32, DType::kF64, DType::kI32, DType::kI64, DType::kU16}) {
    for (const Shape& shape : shapes) {
      auto t = Tensor::Empty(shape, dt);
      ASSERT_TRUE(t.ok());
      FillPattern(*t);
      const std::string p = Path("rt.npy");
      ASSERT_TRUE(WriteNpy(p, *t).ok());
      auto back = ReadNpy(p);
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(back->dtype(), dt);
      EXPECT_EQ(back->shape(), shape) << ShapeToString(shape);
      ASSERT_EQ(back->nbytes(), t->nbytes());
      if (t->nbytes() > 0) {
        EXPECT_EQ(std::memcmp(back->raw(), t->raw(), t->nbytes()), 0);
      }
      // Data starts on a 64-byte boundary, as numpy >= 1.14 writes it.
      std::ifstream f(p, std::ios::binary | std::ios::ate);
      EXPECT_EQ((static_cast<size_t>(f.tellg()) - t->nbytes()) % 64, 0u);
    }
  }
}

TEST_F(NpyTest, ZeroDimensionalTensorHasOneElement) {
  auto t = Tensor::Empty({}, DType::kF64);
  ASSERT_TRUE(t.ok());
  t->data<double>()[0] = -2.75;
  ASSERT_TRUE(WriteNpy(Path("s.npy"), *t).ok());
  auto back = ReadNpy(Path("s.npy"));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->rank(), 0);
  EXPECT_EQ(back->data<double>()[0], -2.75);
}

// np.save of np.array([[1, 2, 3], [4, 5, 6]], dtype='<i4') with numpy >= 1.23:
// the dict, 20 spare spaces for growing axis 0, padding to 64, '\n'.
TEST_F(NpyTest, HeaderIsByteIdenticalToNumpy) {
  const std::string dict =
      "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }" + std::string(20, ' ');
  const std::string expected =
      std::string("\x93NUMPY\x01\x00\x76\x00", 10) + dict + std::string(38, ' ') + "\n";
  auto h = NpyHeader(DType::kI32, {2, 3});
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(*h, expected);
  EXPECT_EQ(h->size(), 128u);

  // 1-d shapes are written as "(n,)"; 0-d as "()" with no spare spaces.
  auto h1 = NpyHeader(DType::kF32, {5});
  ASSERT_TRUE(h1.ok());
  EXPECT_NE(h1->find("'shape': (5,), }"), std::string::npos);
  auto h0 = NpyHeader(DType::kF32, {});
  ASSERT_TRUE(h0.ok());
  EXPECT_NE(h0->find("'shape': (), }  "), std::string::npos);  // only alignment padding
}

TEST_F(NpyTest, ReadsTheNumpyLayoutWrittenByHand) {
  const std::string dict =
      "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }" + std::string(20, ' ');
  std::string bytes =
      std::string("\x93NUMPY\x01\x00\x76\x00", 10) + dict + std::string(38, ' ') + "\n";
  for (int32_t v : {1, 2, 3, 4, 5, -6}) bytes.append(reinterpret_cast<const char*>(&v), 4);
  auto t = ReadNpy(WriteBytes("numpy.npy", bytes));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype(), DType::kI32);
  EXPECT_EQ(t->shape(), Shape({2, 3}));
  EXPECT_EQ(t->data<int32_t>()[0], 1);
  EXPECT_EQ(t->data<int32_t>()[4], 5);
  EXPECT_EQ(t->data<int32_t>()[5], -6);
}

// numpy < 1.14 aligned to 16 bytes and wrote no spare spaces.
TEST_F(NpyTest, ReadsLegacyNumpyHeaders) {
  std::string bytes = std::string("\x93NUMPY\x01\x00\x46\x00", 10) +
                      "{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }" +
                      std::string(12, ' ') + "\n";
  for (double v : {0.5, -1.0, 1e300}) bytes.append(reinterpret_cast<const char*>(&v), 8);
  auto t = ReadNpy(WriteBytes("legacy.npy", bytes));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->shape(), Shape({3}));
  EXPECT_EQ(t->data<double>()[2], 1e300);

  // Python 2 wrote longs as "3L".
  auto py2 = ReadNpy(
      WriteBytes("py2.npy", V1File("{'descr': '<u2', 'fortran_order': False, 'shape': (2L, 1L), }",
                                   std::string("\x01\x00\x02\x00", 4))));
  ASSERT_TRUE(py2.ok()) << py2.status();
  EXPECT_EQ(py2->shape(), Shape({2, 1}));
  EXPECT_EQ(py2->data<uint16_t>()[1], 2);
}

TEST_F(NpyTest, ReadsVersion2And3Headers) {
  for (char major : {'\x02', '\x03'}) {
    std::string dict = "{\"shape\": (2,), \"fortran_order\": False, \"descr\": \"<i8\"}";
    while ((12 + dict.size() + 1) % 64 != 0) dict.push_back(' ');
    dict.push_back('\n');
    std::string bytes("\x93NUMPY", 6);
    bytes.push_back(major);
    bytes.push_back('\0');
    const uint32_t len = static_cast<uint32_t>(dict.size());
    bytes.append(reinterpret_cast<const char*>(&len), 4);
    bytes += dict;
    for (int64_t v : {int64_t{-1}, int64_t{1} << 40})
      bytes.append(reinterpret_cast<const char*>(&v), 8);
    auto t = ReadNpy(WriteBytes("v2.npy", bytes));
    ASSERT_TRUE(t.ok()) << "version " << int(major) << ": " << t.status();
    EXPECT_EQ(t->data<int64_t>()[0], -1);
    EXPECT_EQ(t->data<int64_t>()[1], int64_t{1} << 40);
  }
}

TEST_F(NpyTest, WritesVersion2WhenTheHeaderIsLong) {
  // 30000 axes of length 1 ("1, " each) make a 90 KB dict: more than the 65535
  // bytes a 1.0 header length can hold, so the writer must switch to 2.0.
  Shape shape(30000, 1);
  auto h = NpyHeader(DType::kF32, shape);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ((*h)[6], '\x02');
  EXPECT_EQ(h->size() % 64, 0u);
  auto t = Tensor::Empty(shape, DType::kF32);
  ASSERT_TRUE(t.ok());
  t->data<float>()[0] = 3.5f;
  ASSERT_TRUE(WriteNpy(Path("long.npy"), *t).ok());
  auto back = ReadNpy(Path("long.npy"));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->rank(), 30000);
  EXPECT_EQ(back->data<float>()[0], 3.5f);
}

TEST_F(NpyTest, MissingFileIsNotFound) {
  ExpectError(Path("nope.npy"), absl::StatusCode::kNotFound, "cannot open");
}

TEST_F(NpyTest, BadMagic) {
  ExpectError(WriteBytes("magic.npy", "PK\x03\x04 this is a zip"),
              absl::StatusCode::kInvalidArgument, "not a .npy file");
  ExpectError(WriteBytes("empty.npy", ""), absl::StatusCode::kInvalidArgument, "not a .npy file");
}

TEST_F(NpyTest, TruncatedHeader) {
  const std::string full = V1File("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", "");
  ExpectError(WriteBytes("th.npy", full.substr(0, 40)), absl::StatusCode::kDataLoss,
              "truncated header: expected 118 bytes of header, file has 30");
  ExpectError(WriteBytes("th2.npy", full.substr(0, 9)), absl::StatusCode::kDataLoss,
              "truncated header");
}

TEST_F(NpyTest, TruncatedAndTrailingData) {
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  ExpectError(WriteBytes("td.npy", V1File(dict, std::string(20, 'x'))), absl::StatusCode::kDataLoss,
              "expected 24 bytes of data for fp32[2, 3], file has 20");
  ExpectError(WriteBytes("tr.npy", V1File(dict, std::string(25, 'x'))), absl::StatusCode::kDataLoss,
              "trailing bytes");
}

TEST_F(NpyTest, FortranOrderIsRefused) {
  ExpectError(
      WriteBytes("f.npy", V1File("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }",
                                 std::string(16, 'x'))),
      absl::StatusCode::kInvalidArgument, "fortran_order is True");
}

TEST_F(NpyTest, BigEndianAndUnsupportedDtypesAreNamed) {
  ExpectError(
      WriteBytes("be.npy", V1File("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }",
                                  std::string(4, 'x'))),
      absl::StatusCode::kInvalidArgument, "big-endian dtype '>f4'");
  ExpectError(
      WriteBytes("f2.npy", V1File("{'descr': '<f2', 'fortran_order': False, 'shape': (1,), }",
                                  std::string(2, 'x'))),
      absl::StatusCode::kInvalidArgument, "unsupported dtype '<f2'");
  ExpectError(
      WriteBytes("b1.npy", V1File("{'descr': '|b1', 'fortran_order': False, 'shape': (1,), }",
                                  std::string(1, 'x'))),
      absl::StatusCode::kInvalidArgument, "unsupported dtype '|b1'");
  ExpectError(
      WriteBytes("rec.npy",
                 V1File("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }",
                        std::string(4, 'x'))),
      absl::StatusCode::kInvalidArgument, "structured dtype");
}

TEST_F(NpyTest, MalformedHeaderDict) {
  ExpectError(
      WriteBytes("m1.npy", V1File("{'descr' '<f4', 'fortran_order': False, 'shape': (1,), }",
                                  std::string(4, 'x'))),
      absl::StatusCode::kDataLoss, "malformed header dict at character 9: expected ':'");
  ExpectError(
      WriteBytes("m2.npy", V1File("{'descr': '<f4', 'shape': (1,), }", std::string(4, 'x'))),
      absl::StatusCode::kDataLoss, "no 'fortran_order' key");
  ExpectError(
      WriteBytes("m3.npy", V1File("{'descr': '<f4', 'fortran_order': False, 'shape': (1, x), }",
                                  std::string(4, 'x'))),
      absl::StatusCode::kDataLoss, "expected an integer");
  ExpectError(WriteBytes("m4.npy", V1File("{'descr': '<f4', 'fortran_order': 0, 'shape': (1,), }",
                                          std::string(4, 'x'))),
              absl::StatusCode::kDataLoss, "unsupported value for key 'fortran_order'");
  ExpectError(WriteBytes("m5.npy", V1File("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), "
                                          "'extra': True}",
                                          std::string(4, 'x'))),
              absl::StatusCode::kDataLoss, "expected exactly descr, fortran_order, shape");
}

TEST_F(NpyTest, NegativeShapeEntry) {
  ExpectError(
      WriteBytes("neg.npy",
                 V1File("{'descr': '<f4', 'fortran_order': False, 'shape': (3, -1), }", "")),
      absl::StatusCode::kDataLoss, "shape [3, -1] has a negative entry");
}

TEST_F(NpyTest, UnsupportedFormatVersion) {
  std::string bytes = V1File("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", "abcd");
  bytes[6] = '\x04';
  ExpectError(WriteBytes("v4.npy", bytes), absl::StatusCode::kInvalidArgument,
              "unsupported .npy format version 4.0");
}

TEST_F(NpyTest, Bf16IsRefusedWithAConversionHint) {
  auto t = Tensor::Zeros({2}, DType::kBF16);
  ASSERT_TRUE(t.ok());
  const absl::Status s = WriteNpy(Path("bf.npy"), *t);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("convert to fp32 first"), std::string::npos) << s;
  EXPECT_TRUE(ListDir().empty());  // nothing left behind
}

TEST_F(NpyTest, WriteReplacesAtomicallyAndLeavesNoTemporaryFiles) {
  auto a = Tensor::Zeros({4}, DType::kI32);
  auto b = Tensor::Zeros({2, 2}, DType::kF32);
  ASSERT_TRUE(a.ok() && b.ok());
  a->data<int32_t>()[3] = 9;
  b->data<float>()[1] = 0.25f;
  ASSERT_TRUE(WriteNpy(Path("x.npy"), *a).ok());
  ASSERT_TRUE(WriteNpy(Path("x.npy"), *b).ok());
  EXPECT_EQ(ListDir(), std::vector<std::string>{"x.npy"});
  auto back = ReadNpy(Path("x.npy"));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->dtype(), DType::kF32);
  EXPECT_EQ(back->data<float>()[1], 0.25f);

  const absl::Status s = WriteNpy(Path("no/such/dir/x.npy"), *a);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
}

TEST(ConvertTest, Bf16AndFp32RoundTrip) {
  auto f = Tensor::Empty({5}, DType::kF32);
  ASSERT_TRUE(f.ok());
  const float vals[5] = {1.0f, -2.5f, 1.0f + 1.0f / 256, 3.0e38f, 1e-3f};
  std::memcpy(f->raw(), vals, sizeof(vals));
  auto b = ToBf16(*f);
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->dtype(), DType::kBF16);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(b->data<uint16_t>()[i], FloatToBf16(vals[i]));
  auto back = ToFloat32(*b);
  ASSERT_TRUE(back.ok());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(back->data<float>()[i], Bf16ToFloat(FloatToBf16(vals[i])));
  EXPECT_EQ(back->data<float>()[2], 1.0f);  // tie rounded to even
}

TEST(ConvertTest, IntegersAreCheckedAndFloatsToIntsRefused) {
  auto i64 = Tensor::Empty({3}, DType::kI64);
  ASSERT_TRUE(i64.ok());
  i64->data<int64_t>()[0] = -7;
  i64->data<int64_t>()[1] = 65535;
  i64->data<int64_t>()[2] = int64_t{1} << 31;
  auto i32 = ConvertDType(*i64, DType::kI32);
  ASSERT_FALSE(i32.ok());
  EXPECT_NE(std::string(i32.status().message()).find("element 2 = 2147483648 does not fit int32"),
            std::string::npos)
      << i32.status();
  i64->data<int64_t>()[2] = 12;
  auto ok32 = ConvertDType(*i64, DType::kI32);
  ASSERT_TRUE(ok32.ok());
  EXPECT_EQ(ok32->data<int32_t>()[0], -7);
  EXPECT_EQ(ConvertDType(*i64, DType::kU16).status().code(), absl::StatusCode::kInvalidArgument);
  auto f = ConvertDType(*i64, DType::kF64);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->data<double>()[1], 65535.0);
  EXPECT_EQ(ConvertDType(*f, DType::kI32).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace smat
