// libFuzzer target: the snapshot loader on arbitrary bytes.
#include <cstddef>
#include <cstdint>
#include <span>

#include "softkv/error.hpp"
#include "storage/snapshot.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    (void)softkv::detail::decode_snapshot(std::span(reinterpret_cast<const std::byte*>(data), size), "fuzz");
  } catch (const softkv::Error&) {
  }
  return 0;
}
