// libFuzzer target: the part files of the sharded server's cross-shard writes. The input is tried as a
// whole file, and sealed as a part's payload (so the checksum holds and the fields behind it are reached).
#include <cstddef>
#include <cstdint>
#include <span>

#include "codec/checked_blob.hpp"
#include "codec/parts.hpp"
#include "softkv/error.hpp"

namespace {

void decode(std::span<const std::byte> bytes) {
  try {
    const softkv::detail::Part part = softkv::detail::decode_part(bytes, "fuzz");
    // What decodes must encode to bytes that decode to the same tag and encode the same again.
    const auto again = softkv::detail::encode_part(part.mutation, part.tag);
    const softkv::detail::Part back = softkv::detail::decode_part(again, "fuzz again");
    if (!(back.tag == part.tag) || softkv::detail::encode_part(back.mutation, back.tag) != again) __builtin_trap();
  } catch (const softkv::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  decode(bytes);
  decode(softkv::detail::seal_blob("skvpart1", 1, bytes));
  return 0;
}
