// Recovery and snapshot writing over the files of a data directory (snapshot.skv, wal-*.log, index-*.faiss).
#include "storage/directory.hpp"

#include <fcntl.h>

#include "softkv/error.hpp"
#include "storage/file.hpp"
#include "storage/wal.hpp"

namespace softkv::detail {
namespace {

// The snapshot's collections handed to `restore`, each with its index file's bytes when they are current.
std::uint64_t restore_snapshot(const std::filesystem::path& dir, const RecoveryHandlers& h, RecoveredLog& out) {
  const auto path = dir / kSnapshotFile;
  if (!std::filesystem::exists(path)) return 0;
  SnapshotImage snapshot = decode_snapshot(read_file(path), path.string());
  for (NamedImage& c : snapshot.collections) {
    const Rows& rows = c.image.rows;
    out.snapshot_bytes[c.name] = rows.ids.size() * 8 + (rows.keys.size() + rows.values.size()) * 4 + c.name.size() + 64;
    const auto index_path = index_file_path(dir, c.name);
    if (std::filesystem::exists(index_path)) {
      std::string why;
      c.image.index = decode_index_file(read_file(index_path), snapshot.sequence, why);
      if (c.image.index.empty()) h.log("index file " + index_path.filename().string() + " is " + why + "; it is not used");
    }
    h.restore(c.name, std::move(c.image));
  }
  return snapshot.sequence;
}

}  // namespace

RecoveredLog recover_directory(const std::filesystem::path& dir, bool repair, const RecoveryHandlers& h) {
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".tmp") std::filesystem::remove(e.path());  // an interrupted atomic write
  RecoveredLog out;
  std::uint64_t& sequence = out.sequence;
  sequence = restore_snapshot(dir, h, out);

  const auto segs = list_segments(dir);
  for (std::size_t i = 0; i < segs.size(); ++i) {
    const auto& [first, path] = segs[i];
    // Segments are named by their first sequence number: one that starts past the next record means
    // records (a whole segment) are missing. Neither replay nor repair can make them up.
    if (first > sequence + 1)
      throw Error(ErrorCode::corrupt_file, path.string() + " starts at sequence " + std::to_string(first) + " but the state ends at " +
                                               std::to_string(sequence) + ": a log segment is missing");
    const auto bytes = read_file(path);
    const LogScan scan = scan_log(bytes);
    for (const RecordView& rec : scan.records) {
      if (rec.sequence <= sequence) continue;  // already in the snapshot
      const std::string where = path.string() + " at byte " + std::to_string(rec.offset);
      if (rec.sequence != sequence + 1)
        throw Error(ErrorCode::corrupt_file, where + ": sequence " + std::to_string(rec.sequence) + " follows " +
                                                 std::to_string(sequence) + " (records are missing)");
      try {
        h.replay(decode_mutation(rec.type, rec.payload, h.dimensions));
      } catch (const Error& e) {
        throw Error(ErrorCode::corrupt_file, where + ": record cannot be applied: " + e.what());
      }
      sequence = rec.sequence;
    }
    out.segment = path;
    out.valid_bytes = scan.valid_bytes;
    if (scan.end == LogScan::End::clean) continue;
    const bool is_last = i + 1 == segs.size();
    const std::string where = path.string() + " at byte " + std::to_string(scan.valid_bytes) + ": " + scan.problem;
    if (scan.end == LogScan::End::torn && (is_last || segs[i + 1].first == sequence + 1)) {
      // A torn record the next segment's first sequence number reuses was never acknowledged (its
      // append failed); it is cut here so that the segment ends on a record boundary.
      h.log("cut a torn record off the log, " + where);
      if (!is_last) File(path, O_WRONLY).truncate(scan.valid_bytes);
      continue;
    }
    if (!repair) throw Error(ErrorCode::corrupt_file, where);
    h.log("repair: keeping the valid prefix of " + where + "; later segments are set aside as .corrupt");
    for (std::size_t j = i + 1; j < segs.size(); ++j) {
      auto aside = segs[j].second;
      aside += ".corrupt";
      std::filesystem::rename(segs[j].second, aside);
    }
    break;
  }
  if (out.segment.empty()) {
    out.segment = dir / segment_name(sequence + 1);
    out.valid_bytes = 0;
  }
  return out;
}

std::uint64_t write_snapshot(const std::filesystem::path& dir, const SnapshotImage& image,
                             const std::map<std::string, std::vector<std::byte>, std::less<>>& indexes, std::uint64_t first_kept) {
  // Index files first: a crash before the snapshot's rename leaves them sealed with a sequence the
  // old snapshot does not have, so they are treated as stale and rebuilt, never trusted.
  for (const auto& [name, saved] : indexes) write_file_atomically(index_file_path(dir, name), encode_index_file(image.sequence, saved));
  const auto bytes = encode_snapshot(image);
  write_file_atomically(dir / kSnapshotFile, bytes);
  for (const auto& e : std::filesystem::directory_iterator(dir)) {  // index files of dropped or unindexed collections
    const std::string file = e.path().filename().string();
    if (file.rfind("index-", 0) == 0 && e.path().extension() == ".faiss" && !indexes.contains(file.substr(6, file.size() - 6 - 6)))
      std::filesystem::remove(e.path());
  }
  for (const auto& [first, path] : list_segments(dir))
    if (first < first_kept) std::filesystem::remove(path);  // wholly covered by the snapshot
  sync_directory(dir);
  return bytes.size();
}

}  // namespace softkv::detail
