// QueryOptions in bytes (options.hpp). Layout, in order (docs/PROTOCOL.md, "QueryOptions"):
//   v1: u8 flags (1 temperature, 2 scale, 4 top_k, 8 epsilon, 16 exact), f32 temperature, f32 scale,
//       u32 top_m, u32 top_k, f32 epsilon, u32 ef_search, u32 nprobe
//   v2: u32 n + n x u64 tags_any, u8 has_tag_range, u64 lo, u64 hi, u32 n + n x u64 exclude_ids,
//       u32 iterations, f32 tolerance
//   v3: u8 has_error_target, f32 error_target, u32 check_sample
//   full: u64 threads
#include "codec/options.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <string_view>

#include "softkv/error.hpp"

namespace softkv::detail {
namespace {

[[noreturn]] void malformed(const ByteReader& r, const std::string& what) { throw Error(r.code(), what); }

// A field a form before `needed` cannot carry is refused rather than dropped: the answer would silently differ.
void require(OptionsForm form, OptionsForm needed, bool used, std::string_view what) {
  if (!used || form >= needed) return;
  const int version = needed == OptionsForm::wire_v2 ? 2 : 3;
  const int speaks = form == OptionsForm::wire_v1 ? 1 : 2;
  throw Error(ErrorCode::unsupported, std::string(what) + (version == 2 ? " need" : " needs") + " protocol version " +
                                          std::to_string(version) + "; this connection speaks " + std::to_string(speaks));
}

// A count that must fit its u32 field.
std::uint32_t narrow(std::size_t value, std::string_view what) {
  if (value > std::numeric_limits<std::uint32_t>::max())
    throw Error(ErrorCode::invalid_argument, std::string(what) + " = " + std::to_string(value) + " does not fit its u32 field (at most 4294967295)");
  return static_cast<std::uint32_t>(value);
}

// A value whose every setting above u32 means the same as u32's largest (a check of more rows than
// there are; iterations above the limit, refused by the collection either way): clamped.
std::uint32_t clamp(std::size_t value) { return static_cast<std::uint32_t>(std::min<std::size_t>(value, 0xFFFFFFFFu)); }

}  // namespace

void put_query_options(ByteWriter& w, const QueryOptions& o, OptionsForm form) {
  require(form, OptionsForm::wire_v2, !o.tags_any.empty() || o.tag_range || !o.exclude_ids.empty(),
          "query masks (tags_any, tag_range, exclude_ids)");
  require(form, OptionsForm::wire_v2, o.iterations != 1 || o.tolerance != 0.0f, "iterations and tolerance");
  require(form, OptionsForm::wire_v3, o.error_target.has_value(), "error_target");
  require(form, OptionsForm::wire_v3, o.check_sample != QueryOptions{}.check_sample, "a check_sample other than the default");
  const std::uint8_t flags = (o.temperature ? 1 : 0) | (o.scale ? 2 : 0) | (o.top_k ? 4 : 0) | (o.epsilon ? 8 : 0) | (o.exact ? 16 : 0);
  w.put(flags);
  w.put(o.temperature.value_or(0.0f));
  w.put(o.scale.value_or(0.0f));
  w.put(narrow(o.top_m, "top_m"));
  w.put(narrow(o.top_k.value_or(0), "top_k"));
  w.put(o.epsilon.value_or(0.0f));
  w.put(narrow(o.ef_search, "ef_search"));
  w.put(narrow(o.nprobe, "nprobe"));
  if (form == OptionsForm::wire_v1) return;
  w.put(narrow(o.tags_any.size(), "the tags_any count"));
  w.put_array(std::span<const std::uint64_t>(o.tags_any));
  w.put(static_cast<std::uint8_t>(o.tag_range.has_value()));
  const TagRange range = o.tag_range.value_or(TagRange{});
  w.put(range.lo), w.put(range.hi);
  w.put(narrow(o.exclude_ids.size(), "the exclude_ids count"));
  w.put_array(std::span<const std::uint64_t>(o.exclude_ids));
  w.put(clamp(o.iterations));
  w.put(o.tolerance);
  if (form == OptionsForm::wire_v2) return;
  w.put(static_cast<std::uint8_t>(o.error_target.has_value()));
  w.put(o.error_target.value_or(0.0f));
  w.put(clamp(o.check_sample));
  if (form == OptionsForm::wire_v3) return;
  w.put(static_cast<std::uint64_t>(o.threads));
}

QueryOptions get_query_options(ByteReader& r, OptionsForm form) {
  QueryOptions o;
  const auto flags = r.get<std::uint8_t>("option flags");
  const auto temperature = r.get<float>("temperature");
  const auto scale = r.get<float>("scale");
  o.top_m = r.get<std::uint32_t>("top_m");
  const auto top_k = r.get<std::uint32_t>("top_k");
  const auto epsilon = r.get<float>("epsilon");
  o.ef_search = r.get<std::uint32_t>("ef_search");
  o.nprobe = r.get<std::uint32_t>("nprobe");
  constexpr std::uint8_t kKnownFlags = 1 | 2 | 4 | 8 | 16;
  if ((flags & ~kKnownFlags) != 0) malformed(r, "option flags " + std::to_string(int(flags)) + " set bits other than 0-4");
  if (flags & 1) o.temperature = temperature;
  if (flags & 2) o.scale = scale;
  if (flags & 4) o.top_k = top_k;
  if (flags & 8) o.epsilon = epsilon;
  o.exact = (flags & 16) != 0;
  if (form == OptionsForm::wire_v1) return o;
  // The mask's limits are the collection's (check_mask): the frame bounds the arrays.
  const auto any = r.get<std::uint32_t>("tags_any count");
  o.tags_any = to_vector<std::uint64_t>(r.take_array<std::uint64_t>(any, "tags_any"));
  const auto has_range = r.get<std::uint8_t>("tag range flag");
  TagRange range;
  range.lo = r.get<std::uint64_t>("tag range lo");
  range.hi = r.get<std::uint64_t>("tag range hi");
  if (has_range > 1) malformed(r, "tag range flag " + std::to_string(int(has_range)) + " is neither 0 nor 1");
  if (has_range == 1) o.tag_range = range;
  const auto excluded = r.get<std::uint32_t>("exclude_ids count");
  o.exclude_ids = to_vector<std::uint64_t>(r.take_array<std::uint64_t>(excluded, "exclude_ids"));
  o.iterations = r.get<std::uint32_t>("iterations");
  o.tolerance = r.get<float>("tolerance");
  if (form == OptionsForm::wire_v2) return o;
  const auto has_target = r.get<std::uint8_t>("error_target flag");
  const auto target = r.get<float>("error_target");
  if (has_target > 1) malformed(r, "error_target flag " + std::to_string(int(has_target)) + " is neither 0 nor 1");
  if (has_target == 1) o.error_target = target;
  o.check_sample = r.get<std::uint32_t>("check_sample");
  if (form == OptionsForm::wire_v3) return o;
  o.threads = static_cast<std::size_t>(r.get<std::uint64_t>("threads"));
  return o;
}

}  // namespace softkv::detail
