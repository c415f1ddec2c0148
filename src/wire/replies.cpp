// The wire codec's replies: every field little-endian, in the order docs/PROTOCOL.md gives.
#include <algorithm>
#include <cstring>

#include "codec/options.hpp"
#include "wire/fields.hpp"

namespace softkv::wire {

std::vector<std::byte> encode_reply(Opcode request, std::uint64_t request_id, const Reply& reply, std::uint16_t version) {
  ByteWriter w;
  std::uint8_t opcode = static_cast<std::uint8_t>(request) | kReplyBit;
  std::visit(Overloaded{
                 [&](const HelloReply& m) {
                   w.put(m.version);
                   w.put_string(m.server_version);
                   w.put(static_cast<std::uint8_t>(m.auth_required));
                 },
                 [&](const Ack&) {},
                 [&](const NamesReply& m) {
                   w.put(static_cast<std::uint32_t>(m.names.size()));
                   for (const auto& n : m.names) w.put_string(n);
                 },
                 [&](const DescribeReply& m) {
                   w.put_string(m.stats.name);
                   w.put(std::uint64_t{m.stats.size});
                   w.put(static_cast<std::uint32_t>(m.stats.dim));
                   w.put(static_cast<std::uint32_t>(m.stats.value_dim));
                   w.put(static_cast<std::uint8_t>(m.stats.metric));
                   w.put(static_cast<std::uint8_t>(m.stats.index));
                   w.put(m.stats.bytes_in_memory);
                   w.put(m.stats.bytes_on_disk);
                   if (version >= 2) {  // (v2) compact storage
                     w.put(static_cast<std::uint8_t>(m.stats.key_precision));
                     w.put(static_cast<std::uint8_t>(m.stats.value_precision));
                     w.put(static_cast<std::uint32_t>(m.stats.heads));  // (v2) heads
                   }
                 },
                 [&](const IdsReply& m) { put_array(w, m.ids); },
                 [&](const QueryStatsReply& m) { w.put(m.stats.queries), w.put(m.stats.passes), w.put(m.stats.max_batch); },
                 [&](const GetReply& m) {
                   w.put(m.entry.id), put_array(w, m.entry.key), put_array(w, m.entry.value);
                   if (version >= 2) w.put(m.entry.tag);
                 },
                 [&](const SoftReply& m) {
                   w.put(static_cast<std::uint32_t>(m.results.size()));
                   for (const SoftResult& s : m.results) {
                     w.put(s.lse);
                     w.put(s.max_score);
                     w.put(std::uint64_t{s.candidates});
                     w.put(s.tail_bound);
                     w.put(static_cast<std::uint8_t>(s.tail_bound_guaranteed));
                     w.put(static_cast<std::uint8_t>(s.searched_with));
                     put_contributors(w, s.top);
                     put_array(w, s.value);
                     if (version < 2) continue;
                     w.put(static_cast<std::uint8_t>(s.mask_filtered_after_search));
                     // (v2) iterations and per-head answers (head count 0 for a single-head collection)
                     w.put(static_cast<std::uint32_t>(s.iterations_run));
                     w.put(s.last_change);
                     w.put(static_cast<std::uint32_t>(s.heads.size()));
                     for (const HeadResult& head : s.heads) {
                       w.put(head.lse);
                       w.put(head.max_score);
                       put_contributors(w, head.top);
                     }
                     if (version < 3) continue;
                     w.put(std::uint64_t{s.rows_scored});  // (v3) rows scored and the estimate's error
                     w.put(s.error_estimate);
                   }
                 },
                 [&](const HardReply& m) {
                   w.put(static_cast<std::uint32_t>(m.results.size()));
                   for (const HardResult& h : m.results) {
                     w.put(h.id);
                     w.put(h.score);
                     w.put(static_cast<std::uint8_t>(h.searched_with));
                     put_array(w, h.value);
                     if (version < 2) continue;
                     // (v2) per-head winners (count 0 for a single-head collection)
                     w.put(static_cast<std::uint32_t>(h.head_ids.size()));
                     for (std::size_t j = 0; j < h.head_ids.size(); ++j) w.put(h.head_ids[j]), w.put(h.head_scores[j]);
                   }
                 },
                 [&](const StatsReply& m) {
                   w.put_string(m.server_version);
                   w.put_string(m.simd_path);
                   w.put(m.collections), w.put(m.connections), w.put(m.requests), w.put(m.last_sequence);
                 },
                 [&](const ErrorReply& m) {
                   opcode = kErrorOpcode;
                   w.put(static_cast<std::uint16_t>(m.code));
                   w.put_string(wire_message(m.message));
                 },
             },
             reply);
  return frame_of(opcode, request_id, w);
}

Reply decode_reply(Opcode request, const Frame& frame, QueryKind kind, std::uint16_t version) {
  ByteReader r = reader(frame);
  Reply out;
  if (frame.opcode == kErrorOpcode) {
    ErrorReply e;
    e.code = static_cast<ErrorCode>(r.get<std::uint16_t>("error code"));
    e.message = r.get_string("error message");
    out = std::move(e);
  } else {
    if (frame.opcode != (static_cast<std::uint8_t>(request) | kReplyBit))
      malformed("reply opcode " + std::to_string(frame.opcode) + " does not answer request " + std::to_string(int(request)));
    switch (request) {
      case Opcode::hello: {
        HelloReply m;
        m.version = r.get<std::uint16_t>("version");
        m.server_version = r.get_string("server version");
        m.auth_required = r.get<std::uint8_t>("auth flag") != 0;
        out = std::move(m);
        break;
      }
      case Opcode::list: {
        NamesReply m;
        const auto n = r.get<std::uint32_t>("name count");
        if (n > r.remaining() / 2) malformed("name count larger than the frame");
        for (std::uint32_t i = 0; i < n; ++i) m.names.push_back(r.get_string("name"));
        out = std::move(m);
        break;
      }
      case Opcode::describe: {
        DescribeReply m;
        m.stats.name = r.get_string("name");
        m.stats.size = r.get<std::uint64_t>("size");
        m.stats.dim = r.get<std::uint32_t>("dim");
        m.stats.value_dim = r.get<std::uint32_t>("value_dim");
        m.stats.metric = static_cast<Metric>(r.get<std::uint8_t>("metric"));
        m.stats.index = static_cast<IndexKind>(r.get<std::uint8_t>("index"));
        m.stats.bytes_in_memory = r.get<std::uint64_t>("bytes in memory");
        m.stats.bytes_on_disk = r.get<std::uint64_t>("bytes on disk");
        if (version >= 2) {  // (v2) compact storage
          m.stats.key_precision = static_cast<Precision>(r.get<std::uint8_t>("key_precision"));
          m.stats.value_precision = static_cast<Precision>(r.get<std::uint8_t>("value_precision"));
          m.stats.heads = r.get<std::uint32_t>("heads");
        }
        out = std::move(m);
        break;
      }
      case Opcode::add: out = IdsReply{get_array<std::uint64_t>(r, "ids")}; break;
      case Opcode::query_stats: {
        QueryStatsReply m;
        m.stats.queries = r.get<std::uint64_t>("queries");
        m.stats.passes = r.get<std::uint64_t>("passes");
        m.stats.max_batch = r.get<std::uint64_t>("max batch");
        out = m;
        break;
      }
      case Opcode::get: {
        GetReply m;
        m.entry.id = r.get<std::uint64_t>("id");
        m.entry.key = get_array<float>(r, "key");
        m.entry.value = get_array<float>(r, "value");
        if (version >= 2) m.entry.tag = r.get<std::uint64_t>("tag");
        out = std::move(m);
        break;
      }
      case Opcode::query: {
        const auto n = r.get<std::uint32_t>("result count");
        if (kind == QueryKind::soft) {
          SoftReply m;
          for (std::uint32_t i = 0; i < n; ++i) {  // no reserve: every read is bounded by the frame
            SoftResult s;
            s.lse = r.get<double>("lse");
            s.max_score = r.get<float>("max score");
            s.candidates = r.get<std::uint64_t>("candidates");
            s.tail_bound = r.get<double>("tail bound");
            s.tail_bound_guaranteed = r.get<std::uint8_t>("guarantee flag") != 0;
            s.searched_with = static_cast<IndexKind>(r.get<std::uint8_t>("searched with"));
            s.top = get_contributors(r, "contributor count");
            s.value = get_array<float>(r, "value");
            if (version >= 2) {
              const auto filtered = r.get<std::uint8_t>("mask filter flag");
              if (filtered > 1) malformed("mask filter flag " + std::to_string(int(filtered)) + " is neither 0 nor 1");
              s.mask_filtered_after_search = filtered == 1;
              s.iterations_run = r.get<std::uint32_t>("iterations run");
              s.last_change = r.get<double>("last change");
              const auto heads = r.get<std::uint32_t>("head count");
              for (std::uint32_t j = 0; j < heads; ++j) {  // bounded by the frame: each head reads 16 bytes at least
                HeadResult head;
                head.lse = r.get<double>("head lse");
                head.max_score = r.get<float>("head max score");
                head.top = get_contributors(r, "head contributor count");
                s.heads.push_back(std::move(head));
              }
            }
            if (version >= 3) {
              s.rows_scored = r.get<std::uint64_t>("rows scored");
              s.error_estimate = r.get<double>("error estimate");
            } else {
              s.rows_scored = s.candidates;  // what a version-1/2 reply can say
            }
            m.results.push_back(std::move(s));
          }
          out = std::move(m);
        } else {
          HardReply m;
          for (std::uint32_t i = 0; i < n; ++i) {
            HardResult h;
            h.id = r.get<std::uint64_t>("id");
            h.score = r.get<float>("score");
            h.searched_with = static_cast<IndexKind>(r.get<std::uint8_t>("searched with"));
            h.value = get_array<float>(r, "value");
            if (version >= 2) {
              const auto heads = r.get<std::uint32_t>("head count");
              for (std::uint32_t j = 0; j < heads; ++j) {
                h.head_ids.push_back(r.get<std::uint64_t>("head id"));
                h.head_scores.push_back(r.get<float>("head score"));
              }
            }
            m.results.push_back(std::move(h));
          }
          out = std::move(m);
        }
        break;
      }
      case Opcode::stats: {
        StatsReply m;
        m.server_version = r.get_string("server version");
        m.simd_path = r.get_string("simd path");
        m.collections = r.get<std::uint64_t>("collections");
        m.connections = r.get<std::uint64_t>("connections");
        m.requests = r.get<std::uint64_t>("requests");
        m.last_sequence = r.get<std::uint64_t>("last sequence");
        out = std::move(m);
        break;
      }
      default: out = Ack{};
    }
  }
  expect_end(r);
  return out;
}

}  // namespace softkv::wire
