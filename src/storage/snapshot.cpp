// Snapshot codec: a checked-blob header, then a cereal binary payload whose arrays are read with
// binary_data into buffers sized from counts already checked against the payload length.
#include "storage/snapshot.hpp"

#include <cereal/archives/binary.hpp>

#include <cstring>
#include <istream>
#include <ostream>
#include <sstream>
#include <streambuf>

#include "codec/bytes.hpp"
#include "codec/checked_blob.hpp"
#include "codec/config.hpp"
#include "codec/crc32.hpp"
#include "config_limits.hpp"
#include "precision.hpp"
#include "softkv/error.hpp"

namespace softkv::detail {
namespace {

constexpr std::string_view kSnapshotMagic = "SKVSNAP1";
constexpr std::string_view kIndexMagic = "SKVINDEX";
constexpr std::string_view kLegacyIndexMagic = "SKVINDX1";  // before format 2: magic, u64 sequence, u64 length, u32 CRC
constexpr std::uint32_t kIndexVersion = 2;
// The tags section (format 3 on) follows a collection's rows: u32 section version, u64 count (0 when
// every tag is 0, else the row count), then count u64 tags in row order. Its own version lets the
// section change without touching the rows before it.
constexpr std::uint32_t kTagsSectionVersion = 1;

// Reads from a byte span without copying it (cereal wants an istream).
struct SpanBuf : std::streambuf {
  explicit SpanBuf(std::span<const std::byte> b) {
    char* p = const_cast<char*>(reinterpret_cast<const char*>(b.data()));
    setg(p, p, p + b.size());
  }
  [[nodiscard]] std::size_t consumed() const { return static_cast<std::size_t>(gptr() - eback()); }
};

// Version 1 stored the configuration as cereal u64 fields.
template <class Archive>
CollectionConfig load_config_v1(Archive& ar) {
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

// Bytes one row of `width` elements takes in a version-3 snapshot (i8 rows carry their float scale).
std::uint64_t stored_row_bytes(Precision p, std::uint64_t width) {
  return width * element_bytes(p) + (p == Precision::i8 ? 4 : 0);
}

// n rows of floats (as stored: exactly representable at p) in their compact form: the elements, then
// the i8 scales. Encoding them again gives back the same bits (precision.hpp, i8_scale).
std::vector<std::byte> compact_rows(Precision p, const std::vector<float>& rows, std::size_t n, std::size_t width) {
  const std::size_t row_bytes = width * element_bytes(p);
  std::vector<std::byte> out(n * stored_row_bytes(p, width));
  for (std::size_t r = 0; r < n; ++r) {
    const float* x = rows.data() + r * width;
    const float scale = p == Precision::i8 ? i8_scale(x, width) : 1.0f;
    encode_row(p, x, width, scale, out.data() + r * row_bytes);
    if (p == Precision::i8) std::memcpy(out.data() + n * row_bytes + r * 4, &scale, 4);
  }
  return out;
}

std::vector<float> widen_rows(Precision p, const std::vector<std::byte>& bytes, std::size_t n, std::size_t width) {
  const std::size_t row_bytes = width * element_bytes(p);
  std::vector<float> out(n * width);
  for (std::size_t r = 0; r < n; ++r) {
    float scale = 1.0f;
    if (p == Precision::i8) std::memcpy(&scale, bytes.data() + n * row_bytes + r * 4, 4);
    decode_row(p, bytes.data() + r * row_bytes, width, scale, out.data() + r * width);
  }
  return out;
}

}  // namespace

std::vector<std::byte> encode_snapshot(const SnapshotImage& snapshot) {
  std::ostringstream payload_stream(std::ios::binary);
  {
    cereal::BinaryOutputArchive ar(payload_stream);
    ar(snapshot.sequence, std::uint64_t{snapshot.collections.size()});
    for (const NamedImage& c : snapshot.collections) {
      ar(std::uint16_t(c.name.size()), cereal::binary_data(c.name.data(), c.name.size()));
      ByteWriter config;
      const CollectionConfig& cc = c.image.config;
      put_config(config, cc, ConfigForm::snapshot);
      ar(std::uint16_t(config.bytes().size()), cereal::binary_data(config.bytes().data(), config.bytes().size()));
      const Rows& rows = c.image.rows;
      const std::size_t n = rows.ids.size();
      ar(c.image.next_id, std::uint64_t{n});
      ar(cereal::binary_data(rows.ids.data(), n * sizeof(std::uint64_t)));
      const std::vector<std::byte> keys = compact_rows(cc.key_precision, rows.keys, n, cc.dim);
      const std::vector<std::byte> values = compact_rows(cc.value_precision, rows.values, n, cc.value_dim);
      ar(cereal::binary_data(keys.data(), keys.size()), cereal::binary_data(values.data(), values.size()));
      // ---- tags section (format 3) ----
      ar(kTagsSectionVersion, std::uint64_t{rows.tags.size()});
      ar(cereal::binary_data(rows.tags.data(), rows.tags.size() * sizeof(std::uint64_t)));
    }
  }
  const std::string payload = std::move(payload_stream).str();
  return seal_blob(kSnapshotMagic, kSnapshotVersion,
                   std::span(reinterpret_cast<const std::byte*>(payload.data()), payload.size()));
}

SnapshotImage decode_snapshot(std::span<const std::byte> bytes, const std::string& file) {
  const OpenedBlob blob = open_blob(bytes, kSnapshotMagic, file);
  if (blob.version < 1 || blob.version > 3) corrupt(file, 8, "unsupported format version " + std::to_string(blob.version));
  const std::span<const std::byte> payload = blob.payload;
  SpanBuf buf(payload);
  std::istream in(&buf);
  SnapshotImage image;
  auto at = [&] { return kBlobHeaderSize + buf.consumed(); };
  try {
    cereal::BinaryInputArchive ar(in);
    std::uint64_t count = 0;
    ar(image.sequence, count);
    if (count > payload.size()) corrupt(file, at(), "implausible collection count");
    for (std::uint64_t c = 0; c < count; ++c) {
      NamedImage col;
      std::uint16_t name_size = 0;
      ar(name_size);
      if (name_size > payload.size() - buf.consumed()) corrupt(file, at(), "name runs past the end");
      col.name.resize(name_size);
      ar(cereal::binary_data(col.name.data(), name_size));
      CollectionConfig& config = col.image.config;
      if (blob.version == 1) {
        config = load_config_v1(ar);
      } else {
        std::uint16_t config_size = 0;
        ar(config_size);
        if (config_size > payload.size() - buf.consumed()) corrupt(file, at(), "configuration runs past the end");
        std::vector<std::byte> config_bytes(config_size);
        ar(cereal::binary_data(config_bytes.data(), config_size));
        ByteReader r(config_bytes);
        config = get_config(r, blob.version >= 3 ? ConfigForm::snapshot : ConfigForm::snapshot_v2);
        if (r.remaining() != 0) corrupt(file, at(), "unexpected bytes after the configuration");
      }
      config = fit_index_limits(config);  // index settings from before ConfigLimits (recovery logs them at replay)
      try {
        check_config(config);  // the limits of creation: anything else was never accepted
      } catch (const Error& e) {
        corrupt(file, at(), "collection '" + col.name + "': " + e.what());
      }
      std::uint64_t n = 0;
      ar(col.image.next_id, n);
      const std::uint64_t left = payload.size() - buf.consumed();
      const std::uint64_t d = config.dim, dv = config.value_dim;  // bounded by check_config: 4 (d + dv) + 8 cannot overflow
      const std::uint64_t key_bytes = stored_row_bytes(config.key_precision, d);
      const std::uint64_t value_bytes = stored_row_bytes(config.value_precision, dv);
      if (n > left / (8 + key_bytes + value_bytes)) corrupt(file, at(), "entry count or dimensions larger than the file");
      Rows& rows = col.image.rows;
      rows.ids.resize(n);
      std::vector<std::byte> keys(n * key_bytes), values(n * value_bytes);
      ar(cereal::binary_data(rows.ids.data(), n * sizeof(std::uint64_t)), cereal::binary_data(keys.data(), keys.size()),
         cereal::binary_data(values.data(), values.size()));
      rows.keys = widen_rows(config.key_precision, keys, n, d);
      rows.values = widen_rows(config.value_precision, values, n, dv);
      if (blob.version >= 3) {  // ---- tags section; older formats hold none: every tag is 0 ----
        std::uint32_t section = 0;
        std::uint64_t tag_count = 0;
        ar(section, tag_count);
        if (section != kTagsSectionVersion) corrupt(file, at(), "unsupported tags section version " + std::to_string(section));
        if (tag_count != 0 && tag_count != n) corrupt(file, at(), "tag count " + std::to_string(tag_count) + " for " + std::to_string(n) + " entries");
        if (tag_count > (payload.size() - buf.consumed()) / 8) corrupt(file, at(), "tags run past the end");
        rows.tags.resize(tag_count);
        ar(cereal::binary_data(rows.tags.data(), tag_count * sizeof(std::uint64_t)));
      }
      image.collections.push_back(std::move(col));
    }
  } catch (const cereal::Exception& e) {
    corrupt(file, at(), std::string("payload ends early: ") + e.what());
  }
  if (buf.consumed() != payload.size()) corrupt(file, at(), "unexpected bytes after the last collection");
  return image;
}

std::filesystem::path index_file_path(const std::filesystem::path& dir, std::string_view name) {
  return dir / ("index-" + std::string(name) + ".faiss");
}

std::vector<std::byte> encode_index_file(std::uint64_t sequence, std::span<const std::byte> index) {
  ByteWriter w;
  w.put(sequence);
  w.put_array(index);
  return seal_blob(kIndexMagic, kIndexVersion, w.bytes());
}

std::vector<std::byte> decode_index_file(std::span<const std::byte> bytes, std::uint64_t sequence, std::string& why) {
  std::uint64_t written_for = 0;
  std::span<const std::byte> index;
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kLegacyIndexMagic.data(), 8) == 0) {
    constexpr std::size_t kLegacyHeader = 8 + 8 + 8 + 4;
    std::uint64_t length = 0;
    std::uint32_t crc = 0;
    if (bytes.size() < kLegacyHeader) {
      why = "corrupt (shorter than its header)";
      return {};
    }
    std::memcpy(&written_for, bytes.data() + 8, 8);
    std::memcpy(&length, bytes.data() + 16, 8);
    std::memcpy(&crc, bytes.data() + 24, 4);
    index = bytes.subspan(kLegacyHeader);
    if (length != index.size() || crc32_of(index) != crc) {
      why = "corrupt (size or checksum mismatch)";
      return {};
    }
  } else {
    try {
      const OpenedBlob blob = open_blob(bytes, kIndexMagic, "index file");
      if (blob.version != kIndexVersion) {
        why = "of unsupported format version " + std::to_string(blob.version);
        return {};
      }
      ByteReader r(blob.payload);
      written_for = r.get<std::uint64_t>("snapshot sequence");
      index = blob.payload.subspan(8);
    } catch (const Error& e) {
      why = std::string("corrupt (") + e.what() + ")";
      return {};
    }
  }
  if (written_for != sequence) {
    why = "stale (written for snapshot sequence " + std::to_string(written_for) + ", the snapshot is at " + std::to_string(sequence) + ")";
    return {};
  }
  if (index.empty()) {
    why = "empty";
    return {};
  }
  return {index.begin(), index.end()};
}

}  // namespace softkv::detail
