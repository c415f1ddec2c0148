// The sharded server's manifest, shard identities and progress record (job_files.hpp).
#include "job_files.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <system_error>
#include <fstream>
#include <map>
#include <optional>
#include <span>
#include <random>
#include <sstream>

#include "codec/crc32.hpp"
#include "shard.hpp"
#include "softkv/error.hpp"
#include "storage/file.hpp"

namespace softkv::server {
namespace {

namespace fs = std::filesystem;

using Fields = std::multimap<std::string, std::string>;

std::string crc_hex(const std::string& body) {
  char hex[9];
  std::snprintf(hex, sizeof hex, "%08x", detail::crc32_of(std::as_bytes(std::span(body.data(), body.size()))));
  return hex;
}

// Writes "body" + "crc32 <hex of body>\n" to path whole and durably (storage's atomic replace).
void write_checked(const fs::path& path, const std::string& body) {
  const std::string text = body + "crc32 " + crc_hex(body) + "\n";
  detail::write_file_atomically(path, std::as_bytes(std::span(text.data(), text.size())));
}

// Opens path for reading: Error(invalid_argument) "is missing" when it does not exist, Error(io_error)
// with the reason when it exists but cannot be read (permissions: not to be mistaken for a missing file).
std::ifstream open_existing(const fs::path& path) {
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (in) return in;
  const int err = errno;
  std::error_code ec;
  if (!fs::exists(path, ec) && !ec) throw Error(ErrorCode::invalid_argument, path.string() + " is missing");
  throw Error(ErrorCode::io_error, "cannot read " + path.string() + ": " + std::strerror(err != 0 ? err : EACCES));
}

// The "key value" lines of a file written by write_checked, its CRC line checked.
Fields read_checked(const fs::path& path) {
  std::ifstream in = open_existing(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t at = text.rfind("crc32 ");
  if (at == std::string::npos || (at != 0 && text[at - 1] != '\n') || text.substr(at + 6) != crc_hex(text.substr(0, at)) + "\n")
    throw Error(ErrorCode::corrupt_file, path.string() + " is damaged (its CRC-32 does not match): restore the job directory from a backup");
  Fields fields;
  std::istringstream lines(text.substr(0, at));
  for (std::string line; std::getline(lines, line);) {
    const std::size_t space = line.find(' ');
    fields.emplace(line.substr(0, space), space == std::string::npos ? "" : line.substr(space + 1));
  }
  return fields;
}

std::string field(const Fields& fields, const std::string& key, const fs::path& path) {
  const auto it = fields.find(key);
  if (it == fields.end()) throw Error(ErrorCode::corrupt_file, path.string() + " has no '" + key + "' line");
  return it->second;
}

std::uint64_t number(const Fields& fields, const std::string& key, const fs::path& path) {
  const std::string text = field(fields, key, path);
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0) throw Error(ErrorCode::corrupt_file, path.string() + ": '" + key + "' is not a number");
  return v;
}

std::string new_job_id() {
  std::random_device device;
  std::string id;
  for (int i = 0; i < 4; ++i) {
    char hex[9];
    std::snprintf(hex, sizeof hex, "%08x", device());
    id += hex;
  }
  return id;
}

bool is_shard_dir(const std::string& name) {
  if (name.rfind("shard-", 0) != 0 || name.size() == 6) return false;
  return std::all_of(name.begin() + 6, name.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
}

fs::path shard_dir(const fs::path& dir, std::size_t rank) { return dir / ("shard-" + std::to_string(rank)); }

const char* const kManifestHead = "softkv sharded job\nversion 1\n";
const char* const kRestoreHint = "restore the whole job directory (every shard-R, shards, progress, commits) from one backup: docs/SHARDING.md";

// The manifest DIR/shards as a job, or nullopt when there is none; the format before identities (a bare
// count) is read as an upgraded job with a new id.
std::optional<JobManifest> read_manifest(const fs::path& file) {
  std::error_code ec;
  if (!fs::exists(file, ec)) return std::nullopt;
  std::ifstream in = open_existing(file);
  std::string first;
  std::getline(in, first);
  JobManifest job;
  if (first == "softkv sharded job") {
    const Fields f = read_checked(file);
    if (number(f, "version", file) != 1) throw Error(ErrorCode::corrupt_file, file.string() + " has a version this softkv does not know");
    job.shards = static_cast<std::size_t>(number(f, "shards", file));
    job.job = field(f, "job", file);
    if (job.shards < 2 || job.job.size() != 32) throw Error(ErrorCode::corrupt_file, file.string() + " does not describe a sharded job");
  } else {  // the format before identities: the count alone
    std::istringstream line(first);
    if (!(line >> job.shards) || job.shards < 2) throw Error(ErrorCode::corrupt_file, file.string() + " does not hold a shard count");
    job.upgraded = true;
    job.job = new_job_id();
  }
  return job;
}

void write_manifest(const fs::path& file, const JobManifest& job) {
  write_checked(file, kManifestHead + ("shards " + std::to_string(job.shards) + "\njob " + job.job + "\n"));
}

}  // namespace

void check_not_sharded(const fs::path& dir) {
  if (const std::optional<JobManifest> job = read_manifest(dir / "shards"))
    throw Error(ErrorCode::invalid_argument, dir.string() + " is a sharded database of " + std::to_string(job->shards) +
                                                 " shards: start it with mpirun -np " + std::to_string(job->shards) +
                                                 " softkv-server --data " + dir.string());
}

JobManifest open_job(const fs::path& dir, std::size_t ranks) {
  const fs::path file = dir / "shards";
  std::error_code ec;
  if (std::optional<JobManifest> found = read_manifest(file)) {
    JobManifest job = std::move(*found);
    if (job.shards != ranks)
      throw Error(ErrorCode::invalid_argument,
                  dir.string() + " holds " + std::to_string(job.shards) + " shards (" + file.string() + ") but this job has " +
                      std::to_string(ranks) + " ranks: restart with mpirun -np " + std::to_string(job.shards) +
                      " (resharding, moving rows between shards, is not supported)");
    for (const auto& e : fs::directory_iterator(dir, ec)) {  // a shard directory no rank of this job opens: renamed?
      const std::string name = e.path().filename().string();
      if (is_shard_dir(name) && (name.size() > 6 + 18 || std::stoull(name.substr(6)) >= job.shards))
        throw Error(ErrorCode::invalid_argument, (dir / name).string() + " is not a shard of this job of " + std::to_string(job.shards) +
                                                     " shards (shard-0 .. shard-" + std::to_string(job.shards - 1) +
                                                     "): a renamed shard? Move it back to shard-<its rank>");
    }
    if (job.upgraded) write_manifest(file, job);  // identities come next (check_shard_identity); progress after the start
    return job;
  }
  fs::create_directories(dir, ec);
  if (ec) throw Error(ErrorCode::io_error, "cannot create " + dir.string() + ": " + ec.message());
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name == "LOCK" || name.rfind("wal-", 0) == 0 || name.rfind("snapshot", 0) == 0)
      throw Error(ErrorCode::invalid_argument, dir.string() + " holds a single-process database (" + name +
                                                   "); a sharded server needs its own directory");
    if (is_shard_dir(name) || name == "progress" || name == "commits")
      throw Error(ErrorCode::invalid_argument, dir.string() + " holds " + name + " but no " + file.string() +
                                                   " (the job's manifest): refusing to guess what it was; " + kRestoreHint);
  }
  const JobManifest job{ranks, new_job_id(), true, false};
  write_progress(dir, job, std::vector<std::uint64_t>(ranks, 0));
  CommitLog::create(dir / "commits");
  write_manifest(file, job);  // the commit point
  return job;
}

void check_shard_identity(const fs::path& dir, const JobManifest& job, std::size_t rank) {
  const fs::path mine = shard_dir(dir, rank), file = mine / "IDENTITY";
  const std::string body = "softkv shard\nversion 1\njob " + job.job + "\nrank " + std::to_string(rank) + "\nshards " +
                           std::to_string(job.shards) + "\n";
  std::error_code ec;
  const bool present = fs::exists(file, ec);
  if (!present && (job.created || job.upgraded)) {
    fs::create_directories(mine, ec);
    if (ec) throw Error(ErrorCode::io_error, "cannot create " + mine.string() + ": " + ec.message());
    write_checked(file, body);
    return;
  }
  const std::string name = "shard " + std::to_string(rank) + " (" + mine.string() + ")";
  if (!present)
    throw Error(ErrorCode::invalid_argument, name + " has no IDENTITY file: this job's shard " + std::to_string(rank) +
                                                 " is missing, emptied or replaced, and serving without it would lose its rows; " +
                                                 kRestoreHint);
  const Fields f = read_checked(file);
  if (field(f, "job", file) != job.job)
    throw Error(ErrorCode::invalid_argument, name + " belongs to another job (" + field(f, "job", file) + ", not " + job.job + "); " +
                                                 kRestoreHint);
  const std::uint64_t r = number(f, "rank", file);
  if (r != rank)
    throw Error(ErrorCode::invalid_argument, name + " holds this job's shard " + std::to_string(r) +
                                                 ": shard directories were swapped or renamed; move each back to shard-<its rank>");
  if (number(f, "shards", file) != job.shards)
    throw Error(ErrorCode::invalid_argument, name + " was written by a job of " + std::to_string(number(f, "shards", file)) + " shards");
}

std::vector<std::uint64_t> read_progress(const fs::path& dir, const JobManifest& job) {
  const fs::path file = dir / "progress";
  const Fields f = read_checked(file);
  if (field(f, "job", file) != job.job) throw Error(ErrorCode::corrupt_file, file.string() + " belongs to another job; " + kRestoreHint);
  std::vector<std::uint64_t> applied;
  for (std::size_t r = 0; r < job.shards; ++r) applied.push_back(number(f, "shard-" + std::to_string(r), file));
  return applied;
}

void write_progress(const fs::path& dir, const JobManifest& job, const std::vector<std::uint64_t>& applied) {
  std::string body = "softkv progress\nversion 1\njob " + job.job + "\n";
  for (std::size_t r = 0; r < applied.size(); ++r) body += "shard-" + std::to_string(r) + " " + std::to_string(applied[r]) + "\n";
  write_checked(dir / "progress", body);
}

std::vector<std::string> behind_progress(const std::vector<std::uint64_t>& recorded, const std::vector<std::uint64_t>& applied) {
  std::vector<std::string> out;
  for (std::size_t r = 0; r < std::min(recorded.size(), applied.size()); ++r)
    if (applied[r] < recorded[r])
      out.push_back("shard " + std::to_string(r) + " has applied " + std::to_string(applied[r]) + " logged writes, but the job recorded " +
                    std::to_string(recorded[r]) + " at its last start or stop: it was restored from an older copy or lost its log, "
                    "and serving it would lose acknowledged writes; " + kRestoreHint);
  return out;
}

}  // namespace softkv::server
