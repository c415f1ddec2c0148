// libFuzzer target: write-ahead log replay. The input becomes a log segment and a Database opens it.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "softkv/database.hpp"
#include "softkv/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("softkv-fuzz-wal-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir / "wal-00000000000000000001.log", std::ios::binary);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  softkv::DatabaseOptions options;
  options.fsync = softkv::FsyncPolicy::never;
  options.log = [](std::string_view) {};
  try {
    softkv::Database db(dir, options);
    for (const auto& name : db.list_collections()) (void)db.collection(name)->size();
  } catch (const softkv::Error&) {
  }
  return 0;
}
