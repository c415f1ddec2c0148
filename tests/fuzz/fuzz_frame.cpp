// libFuzzer target: the wire frame decoder (frames, requests, replies) on arbitrary bytes, and the
// escaping of error messages (any bytes in: valid UTF-8 of bounded length out).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "softkv/error.hpp"
#include "wire/protocol.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace softkv::wire;
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  while (!bytes.empty()) {  // every frame in the input, as a connection would see them
    const FrameScan scan = scan_frame(bytes, kDefaultMaxFrame);
    if (scan.status != FrameScan::Status::complete) break;
    try {
      (void)decode_request(scan.frame);
    } catch (const softkv::Error&) {
    }
    for (const Opcode op : {Opcode::hello, Opcode::list, Opcode::describe, Opcode::add, Opcode::get, Opcode::query, Opcode::stats})
      for (const QueryKind kind : {QueryKind::soft, QueryKind::hard}) {
        try {
          (void)decode_reply(op, scan.frame, kind);
        } catch (const softkv::Error&) {
        }
      }
    bytes = bytes.subspan(scan.size);
  }
  // A payload as a message: the result must be valid UTF-8 (escaping it again changes nothing) and
  // fit the limit, and every limit must be honoured.
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::size_t limit = size % (kMaxErrorMessage + 1);
  const std::string message = wire_message(text, limit);
  if (message.size() > limit || wire_message(message, message.size()) != message) __builtin_trap();
  return 0;
}
