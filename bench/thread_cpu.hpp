// CPU time taken by the process's threads that are not softkv's, read from /proc/self/task: the
// benchmark's check that no other library's threads (OpenBLAS, OpenMP) run while softkv is timed.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace softkv::bench {

/// Seconds of CPU (user + system) used so far by every thread of this process except the calling
/// thread and softkv's scan workers (named "softkv-scan"). Threads that ended are not counted.
inline double foreign_cpu_seconds() {
  const long self = ::syscall(SYS_gettid);
  const double tick = static_cast<double>(::sysconf(_SC_CLK_TCK));
  double total = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    if (std::stol(task.path().filename().string()) == self) continue;
    std::ifstream comm(task.path() / "comm");
    std::string name;
    std::getline(comm, name);
    if (name == "softkv-scan") continue;
    std::ifstream stat(task.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');  // the name may hold spaces: fields restart after ')'
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    std::string field;
    long utime = 0, stime = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i) {
      if (i == 14) utime = std::stol(field);
      if (i == 15) stime = std::stol(field);
    }
    total += static_cast<double>(utime + stime) / tick;
  }
  return total;
}

}  // namespace softkv::bench
