// Snapshot codec: a fixed header checked by hand, then a cereal binary payload whose arrays are read
// with binary_data into buffers sized from counts already checked against the payload length.
#include "storage/snapshot.hpp"

#include <cereal/archives/binary.hpp>

#include <cstring>
#include <istream>
#include <ostream>
#include <sstream>
#include <streambuf>

#include "softkv/error.hpp"
#include "storage/wal.hpp"

namespace softkv::detail {
namespace {

constexpr char kMagic[8] = {'S', 'K', 'V', 'S', 'N', 'A', 'P', '1'};
constexpr std::size_t kHeaderSize = 8 + 4 + 8 + 4;
constexpr std::uint64_t kMaxDimension = 1u << 24;  // far above any embedding; keeps size arithmetic exact

// Reads from a byte span without copying it (cereal wants an istream).
struct SpanBuf : std::streambuf {
  explicit SpanBuf(std::span<const std::byte> b) {
    char* p = const_cast<char*>(reinterpret_cast<const char*>(b.data()));
    setg(p, p, p + b.size());
  }
  [[nodiscard]] std::size_t consumed() const { return static_cast<std::size_t>(gptr() - eback()); }
};

template <class Archive>
void save_config(Archive& ar, const CollectionConfig& c) {
  const std::uint8_t has_scale = c.scale.has_value();
  const float scale = c.scale.value_or(0.0f);
  ar(std::uint64_t{c.dim}, std::uint64_t{c.value_dim}, static_cast<std::uint8_t>(c.metric), has_scale, scale);
  const IndexConfig& i = c.index;
  ar(static_cast<std::uint8_t>(i.kind), std::uint64_t{i.hnsw_m}, std::uint64_t{i.hnsw_ef_construction}, std::uint64_t{i.ivf_nlist},
     std::uint64_t{i.ivf_train_size}, std::uint64_t{i.auto_threshold}, i.rebuild_fraction);
}

template <class Archive>
CollectionConfig load_config(Archive& ar) {
  CollectionConfig c;
  std::uint64_t dim = 0, value_dim = 0;
  std::uint8_t metric = 0, has_scale = 0, kind = 0;
  float scale = 0;
  ar(dim, value_dim, metric, has_scale, scale);
  std::uint64_t m = 0, efc = 0, nlist = 0, train = 0, threshold = 0;
  ar(kind, m, efc, nlist, train, threshold, c.index.rebuild_fraction);
  c.dim = dim, c.value_dim = value_dim;
  c.metric = static_cast<Metric>(metric);
  if (has_scale) c.scale = scale;
  c.index.kind = static_cast<IndexKind>(kind);
  c.index.hnsw_m = m, c.index.hnsw_ef_construction = efc, c.index.ivf_nlist = nlist;
  c.index.ivf_train_size = train, c.index.auto_threshold = threshold;
  return c;
}

[[noreturn]] void corrupt(const std::string& file, std::size_t offset, const std::string& what) {
  throw Error(ErrorCode::corrupt_file, file + " at byte " + std::to_string(offset) + ": " + what);
}

}  // namespace

std::vector<std::byte> encode_snapshot(const SnapshotImage& image) {
  std::ostringstream payload_stream(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(payload_stream);
    ar(image.sequence, std::uint64_t{image.collections.size()});
    for (const CollectionImage& c : image.collections) {
      ar(std::uint16_t(c.name.size()), cereal::binary_data(c.name.data(), c.name.size()));
      save_config(ar, c.config);
      ar(c.next_id, std::uint64_t{c.ids.size()});
      ar(cereal::binary_data(c.ids.data(), c.ids.size() * sizeof(std::uint64_t)),
         cereal::binary_data(c.keys.data(), c.keys.size() * sizeof(float)),
         cereal::binary_data(c.values.data(), c.values.size() * sizeof(float)));
    }
  }
  const std::string payload = std::move(payload_stream).str();
  const std::span<const std::byte> pb(reinterpret_cast<const std::byte*>(payload.data()), payload.size());
  std::vector<std::byte> out(kHeaderSize);
  const std::uint64_t length = payload.size();
  const std::uint32_t crc = crc32_of(pb);
  std::memcpy(out.data(), kMagic, 8);
  std::memcpy(out.data() + 8, &kSnapshotVersion, 4);
  std::memcpy(out.data() + 12, &length, 8);
  std::memcpy(out.data() + 20, &crc, 4);
  out.insert(out.end(), pb.begin(), pb.end());
  return out;
}

SnapshotImage decode_snapshot(std::span<const std::byte> bytes, const std::string& file) {
  if (bytes.size() < kHeaderSize) corrupt(file, 0, "shorter than the snapshot header");
  if (std::memcmp(bytes.data(), kMagic, 8) != 0) corrupt(file, 0, "not a softkv snapshot (bad magic)");
  std::uint32_t version = 0, crc = 0;
  std::uint64_t length = 0;
  std::memcpy(&version, bytes.data() + 8, 4);
  std::memcpy(&length, bytes.data() + 12, 8);
  std::memcpy(&crc, bytes.data() + 20, 4);
  if (version != kSnapshotVersion) corrupt(file, 8, "unsupported format version " + std::to_string(version));
  if (length != bytes.size() - kHeaderSize)
    corrupt(file, 12, "payload length " + std::to_string(length) + " does not match the file size");
  const std::span<const std::byte> payload = bytes.subspan(kHeaderSize);
  if (crc32_of(payload) != crc) corrupt(file, kHeaderSize, "payload checksum mismatch");

  SpanBuf buf(payload);
  std::istream in(&buf);
  SnapshotImage image;
  try {
    cereal::BinaryInputArchive ar(in);
    std::uint64_t count = 0;
    ar(image.sequence, count);
    if (count > payload.size()) corrupt(file, kHeaderSize + buf.consumed(), "implausible collection count");
    for (std::uint64_t c = 0; c < count; ++c) {
      CollectionImage col;
      std::uint16_t name_size = 0;
      ar(name_size);
      if (name_size > payload.size() - buf.consumed()) corrupt(file, kHeaderSize + buf.consumed(), "name runs past the end");
      col.name.resize(name_size);
      ar(cereal::binary_data(col.name.data(), name_size));
      col.config = load_config(ar);
      std::uint64_t n = 0;
      ar(col.next_id, n);
      const std::uint64_t left = payload.size() - buf.consumed();
      const std::uint64_t d = col.config.dim, dv = col.config.value_dim;
      // Each entry takes 8 + 4 (d + dv) bytes: refuse counts the remaining payload cannot hold. Dimensions
      // are bounded first so that 4 (d + dv) cannot overflow; an empty collection needs no bytes at all.
      if (d == 0 || dv == 0 || d > kMaxDimension || dv > kMaxDimension || n > left / (8 + 4 * (d + dv)))
        corrupt(file, kHeaderSize + buf.consumed(), "entry count or dimensions larger than the file");
      col.ids.resize(n);
      col.keys.resize(n * d);
      col.values.resize(n * dv);
      ar(cereal::binary_data(col.ids.data(), n * sizeof(std::uint64_t)), cereal::binary_data(col.keys.data(), n * d * sizeof(float)),
         cereal::binary_data(col.values.data(), n * dv * sizeof(float)));
      image.collections.push_back(std::move(col));
    }
  } catch (const cereal::Exception& e) {
    corrupt(file, kHeaderSize + buf.consumed(), std::string("payload ends early: ") + e.what());
  }
  if (buf.consumed() != payload.size()) corrupt(file, kHeaderSize + buf.consumed(), "unexpected bytes after the last collection");
  return image;
}

}  // namespace softkv::detail
