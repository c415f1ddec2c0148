// .npy (format 1.0/2.0/3.0, '<f4', C order) and .fvecs ([i32 d][d x f32] per vector) readers, .npy writer.
#include "vector_files.hpp"

#include <cstring>
#include <fstream>
#include <regex>
#include <string>

#include "softkv/error.hpp"

namespace softkv::cli {
namespace {

[[noreturn]] void bad(const std::filesystem::path& path, const std::string& what) {
  throw Error(ErrorCode::invalid_argument, path.string() + ": " + what);
}

std::vector<char> slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) bad(path, "cannot open");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

Matrix read_npy(const std::filesystem::path& path) {
  const std::vector<char> f = slurp(path);
  if (f.size() < 10 || std::memcmp(f.data(), "\x93NUMPY", 6) != 0) bad(path, "not a .npy file");
  const int major = static_cast<unsigned char>(f[6]);
  std::size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(f[8]) | (static_cast<std::size_t>(static_cast<unsigned char>(f[9])) << 8);
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (f.size() < 12) bad(path, "truncated header");
    std::uint32_t n;
    std::memcpy(&n, f.data() + 8, 4);
    header_len = n;
    offset = 12;
  } else {
    bad(path, "unsupported .npy version " + std::to_string(major));
  }
  if (f.size() < offset + header_len) bad(path, "truncated header");
  const std::string header(f.data() + offset, header_len);
  if (header.find("'descr': '<f4'") == std::string::npos) bad(path, "only little-endian float32 ('<f4') arrays are supported");
  if (header.find("'fortran_order': False") == std::string::npos) bad(path, "only C-order arrays are supported");
  std::smatch m;
  if (!std::regex_search(header, m, std::regex(R"('shape': \((\d+),\s*(\d*)\))"))) bad(path, "only 1-D and 2-D arrays are supported");
  Matrix out;
  const std::size_t a = std::stoull(m[1]);
  const std::size_t b = m[2].length() ? std::stoull(m[2]) : 0;
  out.rows = b ? a : 1;
  out.cols = b ? b : a;
  const std::size_t bytes = out.rows * out.cols * sizeof(float);
  if (f.size() - offset - header_len != bytes) bad(path, "data size does not match the shape");
  out.data.resize(out.rows * out.cols);
  std::memcpy(out.data.data(), f.data() + offset + header_len, bytes);
  return out;
}

Matrix read_fvecs(const std::filesystem::path& path) {
  const std::vector<char> f = slurp(path);
  Matrix out;
  std::size_t at = 0;
  while (at < f.size()) {
    if (f.size() - at < 4) bad(path, "truncated vector header");
    std::int32_t d;
    std::memcpy(&d, f.data() + at, 4);
    if (d <= 0 || (out.cols && std::size_t(d) != out.cols)) bad(path, "inconsistent dimension " + std::to_string(d));
    out.cols = std::size_t(d);
    if (f.size() - at - 4 < out.cols * 4) bad(path, "truncated vector");
    const std::size_t old = out.data.size();
    out.data.resize(old + out.cols);
    std::memcpy(out.data.data() + old, f.data() + at + 4, out.cols * 4);
    at += 4 + out.cols * 4;
    ++out.rows;
  }
  return out;
}

}  // namespace

Matrix read_matrix(const std::filesystem::path& path) {
  const auto ext = path.extension().string();
  if (ext == ".npy") return read_npy(path);
  if (ext == ".fvecs") return read_fvecs(path);
  bad(path, "unknown file type (expected .npy or .fvecs)");
}

void write_npy(const std::filesystem::path& path, const Matrix& m) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(m.rows) + ", " + std::to_string(m.cols) + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) bad(path, "cannot create");
  out.write("\x93NUMPY\x01\x00", 8);
  const char len[2] = {static_cast<char>(header.size() & 0xFF), static_cast<char>(header.size() >> 8)};
  out.write(len, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(m.data.data()), static_cast<std::streamsize>(m.data.size() * sizeof(float)));
  if (!out) bad(path, "write failed");
}

}  // namespace softkv::cli
