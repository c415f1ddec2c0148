// A fresh, uniquely named directory under the system temp dir, removed when the test is done.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>

namespace softkv::test {

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() / ("softkv-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

}  // namespace softkv::test
