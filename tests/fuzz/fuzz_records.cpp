// libFuzzer target: log-record payload decoding. Byte 0 is the record type, the rest its payload.
#include <cstddef>
#include <cstdint>
#include <span>

#include "codec/records.hpp"
#include "softkv/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const auto type = static_cast<softkv::detail::RecordType>(data[0]);
  const std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(data) + 1, size - 1);
  // Legacy upserts need a collection's shape: every name is a 3 x 2 collection here.
  const softkv::detail::DimensionsOf dims = [](const std::string&) { return std::optional(std::pair<std::size_t, std::size_t>{3, 2}); };
  try {
    const softkv::detail::Mutation m = softkv::detail::decode_mutation(type, payload, dims);
    // What decodes must encode to a payload that decodes to the same thing (legacy upserts re-encode as put).
    const auto again = softkv::detail::encode_mutation(m);
    (void)softkv::detail::decode_mutation(again.type, again.payload, dims);
  } catch (const softkv::Error&) {
  }
  return 0;
}
