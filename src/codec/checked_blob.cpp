// Checked blobs: header written and verified in one place for every file format that uses it.
#include "codec/checked_blob.hpp"

#include <cstring>

#include "codec/crc32.hpp"
#include "softkv/error.hpp"

namespace softkv::detail {
namespace {

[[noreturn]] void corrupt(const std::string& file, std::size_t offset, const std::string& what) {
  throw Error(ErrorCode::corrupt_file, file + " at byte " + std::to_string(offset) + ": " + what);
}

}  // namespace

std::vector<std::byte> seal_blob(std::string_view magic, std::uint32_t version, std::span<const std::byte> payload) {
  std::vector<std::byte> out(kBlobHeaderSize + payload.size());
  const std::uint64_t length = payload.size();
  const std::uint32_t crc = crc32_of(payload);
  std::memcpy(out.data(), magic.data(), 8);
  std::memcpy(out.data() + 8, &version, 4);
  std::memcpy(out.data() + 12, &length, 8);
  std::memcpy(out.data() + 20, &crc, 4);
  if (!payload.empty()) std::memcpy(out.data() + kBlobHeaderSize, payload.data(), payload.size());
  return out;
}

OpenedBlob open_blob(std::span<const std::byte> bytes, std::string_view magic, const std::string& file) {
  if (bytes.size() < kBlobHeaderSize) corrupt(file, 0, "shorter than the file header");
  if (std::memcmp(bytes.data(), magic.data(), 8) != 0) corrupt(file, 0, "bad magic (not a " + std::string(magic) + " file)");
  OpenedBlob blob;
  std::uint64_t length = 0;
  std::uint32_t crc = 0;
  std::memcpy(&blob.version, bytes.data() + 8, 4);
  std::memcpy(&length, bytes.data() + 12, 8);
  std::memcpy(&crc, bytes.data() + 20, 4);
  if (length != bytes.size() - kBlobHeaderSize)
    corrupt(file, 12, "payload length " + std::to_string(length) + " does not match the file size");
  blob.payload = bytes.subspan(kBlobHeaderSize);
  if (crc32_of(blob.payload) != crc) corrupt(file, kBlobHeaderSize, "payload checksum mismatch");
  return blob;
}

}  // namespace softkv::detail
