// Reading Fashion-MNIST (the Debian package dataset-fashion-mnist: gzip idx files) for the example
// and the pruning bench's real-data regime.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace softkv::fashion_mnist {

/// Where the Debian package puts the four files.
inline constexpr const char* kDefaultDir = "/usr/share/datasets/fashion-mnist";
/// Pixels of an image (28 x 28) and classes of a label.
inline constexpr std::size_t kPixels = 784, kClasses = 10;

// Reads a whole gzip file; throws with the path on failure.
inline std::vector<unsigned char> read_gzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) throw std::runtime_error("cannot open " + path);
  std::vector<unsigned char> data;
  unsigned char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) data.insert(data.end(), buf, buf + n);
  const bool failed = n < 0;
  gzclose(f);
  if (failed) throw std::runtime_error("corrupt gzip data in " + path);
  return data;
}

inline std::uint32_t big_endian_u32(const unsigned char* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | p[3];
}

// An idx file: magic 0x0000080N (N dimensions of unsigned bytes), N big-endian sizes, then the bytes.
inline std::vector<unsigned char> read_idx(const std::string& path, std::uint32_t dims, std::size_t expect_count,
                                    std::size_t expect_item_size) {
  std::vector<unsigned char> raw = read_gzip(path);
  const std::size_t header = 4 + 4 * std::size_t{dims};
  if (raw.size() < header || big_endian_u32(raw.data()) != (0x800u | dims))
    throw std::runtime_error(path + " is not an idx file of " + std::to_string(dims) + " dimension(s)");
  std::size_t count = big_endian_u32(raw.data() + 4), item = 1;
  for (std::uint32_t i = 1; i < dims; ++i) item *= big_endian_u32(raw.data() + 4 + 4 * i);
  if (count != expect_count || item != expect_item_size || raw.size() != header + count * item)
    throw std::runtime_error(path + " has an unexpected size");
  return {raw.begin() + static_cast<std::ptrdiff_t>(header), raw.end()};
}

/// One split of the data set: images, labels and one-hot labels.
struct Split {
  std::vector<float> images;  // n x 784, pixels in [0, 1]
  std::vector<unsigned char> labels;
  std::vector<float> one_hot;  // n x 10
  [[nodiscard]] std::size_t size() const { return labels.size(); }
};

inline Split load(const std::string& dir, const std::string& prefix, std::size_t n) {
  Split s;
  const auto pixels = read_idx(dir + "/" + prefix + "-images-idx3-ubyte.gz", 3, n, kPixels);
  s.labels = read_idx(dir + "/" + prefix + "-labels-idx1-ubyte.gz", 1, n, 1);
  s.images.resize(pixels.size());
  std::transform(pixels.begin(), pixels.end(), s.images.begin(), [](unsigned char p) { return p / 255.0f; });
  s.one_hot.assign(n * kClasses, 0.0f);
  for (std::size_t i = 0; i < n; ++i) s.one_hot[i * kClasses + s.labels[i]] = 1.0f;
  return s;
}

}  // namespace softkv::fashion_mnist
