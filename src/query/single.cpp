// One query on its own (paths.hpp): the soft query's pruned, estimated or exact path with the
// planner's budget (docs/PRUNING.md, "The planner"), and the hard query through an index or the scan.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <limits>
#include <new>
#include <optional>
#include <span>
#include <utility>

#include "collection_impl.hpp"
#include "estimate.hpp"
#include "mask.hpp"
#include "pruning.hpp"
#include "query/paths.hpp"
#include "scan.hpp"
#include "score_range.hpp"
#include "simd/kernel_table.hpp"

namespace softkv::detail {
namespace {

// Candidates an approximate index is asked for when a hard query goes through it: rescored with our
// kernel, the best wins with ties to the smallest id, so up to this many tied keys are ordered right.
constexpr std::size_t kHardCandidates = 64;

// Rows of up to k candidates for a masked pruned query. filter_after false (flat, and certified lists under a
// mask keeping less than half the rows): flat's fused top-k pass runs over the eligible rows only, so they
// are exactly the top k eligible rows. filter_after (an hnsw graph without its lists): over-fetch
// and filter (flags marks eligible rows): ask for k * rows / eligible, then 4x more until k eligible
// ones come back; past a quarter of the rows a search costs about what the exact masked scan does,
// so none then (pruned_soft runs the exact scan of its scope).
std::vector<std::size_t> masked_candidates(const CollectionImpl& impl, const KernelTable& kernels, const float* q, float f,
                                           const EligibleRows& mask, const std::vector<std::uint8_t>& flags, std::size_t k,
                                           std::size_t parts, const QueryOptions& options, bool filter_after) {
  const RowSpan span = impl.span();
  std::vector<std::size_t> kept;
  if (!filter_after) {
    for (const auto& item : top_k_scan(kernels, q, f, span, k, parts, &mask)) kept.push_back(*impl.row_of(item.id));
    return kept;
  }
  for (std::size_t ask = std::max(k, k * span.rows / mask.count);; ask *= 4) {
    if (ask > span.rows / 4) return {};
    kept.clear();
    for (std::size_t row : impl.index_rows(q, f, ask, options)) {
      if (flags[row] == 0) continue;
      kept.push_back(row);
      if (kept.size() == k) break;
    }
    if (kept.size() == k) return kept;
  }
}

}  // namespace

void check_best(const ArgMax& best) {
  if (best.overflow)
    throw Error(ErrorCode::numeric_overflow, "a score left the float range; use a smaller scale or a larger temperature");
  if (best.row == ArgMax::kNoRow) throw EveryScoreBelowRange();
}

std::vector<float> scaled_queries(const CollectionImpl& impl, std::span<const float> queries, float scale, std::vector<float>& factors) {
  std::size_t count = 0;
  std::vector<float> q = impl.prepare_queries(queries, count);
  const std::size_t d = impl.dim();
  factors.resize(count);
  for (std::size_t b = 0; b < count; ++b) factors[b] = split_scale(std::span<float>(q.data() + b * d, d), scale);
  return q;
}

std::vector<float> head_queries(const CollectionImpl& impl, std::span<const float> queries, float scale, std::vector<float>& factors) {
  std::size_t count = 0;
  std::vector<float> q = impl.prepare_queries(queries, count);
  const std::size_t d = impl.dim(), h = impl.heads(), dh = d / h;
  factors.resize(count * h);
  for (std::size_t b = 0; b < count; ++b)
    for (std::size_t j = 0; j < h; ++j) factors[b * h + j] = split_scale(std::span<float>(q.data() + b * d + j * dh, dh), scale);
  return q;
}

std::optional<PrunedSoft> estimate_through_lists(const CollectionImpl& impl, const float* q, float f, double target, std::size_t top_m,
                                                 std::vector<std::size_t>& stratum, const double* bounds,
                                                 const std::uint32_t* live, ListScorer* scorer, const BoundsSummary* summary,
                                                 std::size_t* apart) {
  const RowSpan span = impl.span();
  const KernelTable& kernels = detail::kernels();
  const CertifiedLists& lists = *impl.index()->lists();
  const std::size_t budget = prune_budget(span.rows, impl.row_bytes());
  const auto row_of = [&](std::uint64_t id) { return *impl.row_of(id); };
  // (A collection too small for the planner's budget is walked to the end: its sample would be its scan.)
  ListHead head;
  const bool small = budget == std::numeric_limits<std::size_t>::max();
  ListTarget walk{0, target / 2, budget / 8};
  walk.bounds = bounds;
  walk.live = live;
  walk.summary = summary;
  walk.scorer = scorer;
  std::optional<PrunedSoft> answer = certified_soft(kernels, lists, q, f, span, row_of, walk, top_m, small ? nullptr : &head);
  if (answer) answer->error_estimate = std::min(2.0, 2 * answer->tail_bound);  // (no blend is further than 2 max|v| from another)
  else if (!head.spread && !head.rows.empty())
    answer = estimate_over_lists(kernels, lists, q, f, span, row_of, head,
                                 {target, impl.value_max(), budget, seed_of(q, impl.dim(), span.rows), std::min(top_m, span.rows), scorer});
  if (!answer) stratum = std::move(head.rows);  // (the lists of largest bound: the block sample's exact stratum)
  if (apart != nullptr) *apart = answer ? 0 : head.apart;
  return answer;
}

namespace {

// Takes the rows `excluded` (sorted, distinct, each counted in out) out of totals out, which then hold
// `rows` rows: their values, squares and (if out has them and the products fit the query's budget,
// key_sums_fit) key sums are subtracted one by one, and each subtraction's rounding (at most 2^-53 of its
// partial total, itself at most (rows + excluded) x value_max; the key sums: at most key_value_abs, and
// rows x key_norm_max for sum k, their rows' largest ||k|| still holding) joins the bounds. Empty totals
// if a bound leaves the double range.
EligibleTotals without_rows(const CollectionImpl& impl, EligibleTotals out, const std::vector<std::size_t>& excluded, std::size_t rows,
                            std::size_t loose_limit) {
  const std::size_t d = impl.dim(), dv = impl.value_dim();
  if (!key_sums_fit(excluded.size(), loose_limit, d, dv)) {  // (their products past the query's budget: no key sums)
    out.key_value.clear(), out.key_sum.clear();
    out.key_value_error = out.key_value_abs = out.key_sum_error = out.key_norm_max = 0;
  }
  const bool keys = !out.key_value.empty();
  const double m = impl.value_max(), n = static_cast<double>(excluded.size()), all = static_cast<double>(out.rows);
  for (const std::size_t row : excluded) {
    const std::vector<float> v = impl.value_of(row);
    for (std::size_t k = 0; k < dv; ++k) out.value_sum[k] -= v[k], out.value_square[k] -= static_cast<double>(v[k]) * v[k];
    if (!keys) continue;
    const std::vector<float> key = impl.key_of(row);
    for (std::size_t i = 0; i < d; ++i) {
      for (std::size_t k = 0; k < dv; ++k) out.key_value[i * dv + k] -= static_cast<double>(key[i]) * v[k];
      out.key_sum[i] -= key[i];
    }
  }
  out.value_error += 1.01 * n * 0x1p-53 * all * m;
  out.value_square_error += 1.01 * n * 0x1p-53 * all * m * m;
  if (keys) {
    out.key_value_error += 1.01 * n * 0x1p-53 * out.key_value_abs;
    out.key_value_abs += 1.01 * n * 0x1p-53 * out.key_value_abs;
    out.key_sum_error += 1.01 * n * 0x1p-53 * all * out.key_norm_max;
  }
  out.rows = rows;
  if (!std::isfinite(out.value_error) || !std::isfinite(out.value_square_error)) return {};
  return out;
}

// The rows of exclude_ids that `holds` admits (sorted, distinct; an id given twice or absent counts once or
// not at all).
template <class Holds>
std::vector<std::size_t> excluded_rows(const CollectionImpl& impl, const QueryOptions& options, Holds&& holds) {
  std::vector<std::size_t> excluded;
  for (const std::uint64_t id : options.exclude_ids)
    if (const std::optional<std::size_t> row = impl.row_of(id); row && holds(*row)) excluded.push_back(*row);
  std::sort(excluded.begin(), excluded.end());
  excluded.erase(std::unique(excluded.begin(), excluded.end()), excluded.end());
  return excluded;
}

// The totals of a mask of tags_any (and exclude_ids: at most loose_limit of them) from the per-tag sums:
// the excluded rows that hold one of the tags are taken out of them one by one.
EligibleTotals tag_mask_totals(const CollectionImpl& impl, const EligibleRows& mask, const QueryOptions& options, std::size_t loose_limit,
                               std::size_t sweep_limit) {
  if (options.exclude_ids.size() > loose_limit) return {};
  std::vector<std::uint64_t> wanted(options.tags_any);
  std::sort(wanted.begin(), wanted.end());
  const std::vector<std::size_t> excluded =
      excluded_rows(impl, options, [&](std::size_t row) { return std::binary_search(wanted.begin(), wanted.end(), impl.tags()[row]); });
  EligibleTotals out = impl.tag_totals(options.tags_any, mask.count + excluded.size(), sweep_limit);
  if (out.rows == 0 || excluded.empty()) return out;
  return without_rows(impl, std::move(out), excluded, mask.count, loose_limit);
}

// The distinct tags of mask's rows (sorted), or none if there are more than most.
std::vector<std::uint64_t> tags_in(const CollectionImpl& impl, const EligibleRows& mask, std::size_t most) {
  std::vector<std::uint64_t> found;  // sorted
  const std::span<const std::uint64_t> tags = impl.tags();
  for (const RowRun& run : mask.runs)
    for (std::size_t row = run.begin; row < run.begin + run.count; ++row) {
      const auto at = std::lower_bound(found.begin(), found.end(), tags[row]);
      if (at != found.end() && *at == tags[row]) continue;
      if (found.size() == most) return {};
      found.insert(at, tags[row]);
    }
  return found;
}

// The rows of mask outside whole chunks of ValueChunks::kRows (those a chunk total cannot hold).
std::size_t loose_rows(const EligibleRows& mask) {
  constexpr std::size_t c = ValueChunks::kRows;
  std::size_t loose = 0;
  for (const RowRun& run : mask.runs) {
    const std::size_t first = (run.begin + c - 1) / c, last = (run.begin + run.count) / c;  // whole chunks [first, last)
    loose += run.count - (last > first ? (last - first) * c : 0);
  }
  return loose;
}

}  // namespace

EligibleTotals masked_totals(const CollectionImpl& impl, const EligibleRows& mask, const QueryOptions& options) {
  try {
    // tags_any without tag_range: the sums of its tags, wherever their rows lie. Otherwise the base mask
    // (the tag_range's rows, or every row, excluded ids included): the chunks its runs cover when they
    // are long; the sums of its tags when they are short runs (tags interleaved) of at most 64 tags.
    // Either way exclude_ids come out one by one afterwards (cut into the mask's runs, a few ids in
    // different chunks would leave those chunks' rows loose).
    // (Rows outside whole chunks, or excluded ids, summed at the query: at most loose_limit; stale sums
    // brought up to date: at most summed_limit rows a query, by one of the two.)
    const std::size_t loose_limit = std::max(2 * ValueChunks::kRows, mask.count / kBudgetDivisor);
    const std::size_t summed_limit = std::max(16 * ValueChunks::kRows, mask.count / 8);
    if (!options.tags_any.empty() && !options.tag_range) return tag_mask_totals(impl, mask, options, loose_limit, summed_limit);
    if (!options.tags_any.empty() || options.exclude_ids.size() > loose_limit) return impl.eligible_totals(mask, loose_limit, summed_limit);
    EligibleRows base;
    if (options.exclude_ids.empty()) base = mask;
    else if (options.tag_range) {
      QueryOptions range_only;
      range_only.tag_range = options.tag_range;
      base = impl.eligible_or_none(range_only);
    }
    else base = EligibleRows{{RowRun{0, impl.rows()}}, impl.rows()};
    if (loose_rows(base) > loose_limit) {  // short runs: a tag_range over interleaved tags
      if (!options.tag_range) return {};
      QueryOptions as_tags;
      const TagRange range = *options.tag_range;
      if (range.hi - range.lo < TagTotals::kSweepTags)  // (its tags, held by rows or not: a tag no row holds sums to nothing)
        for (std::uint64_t t = range.lo;; ++t) {
          as_tags.tags_any.push_back(t);
          if (t == range.hi) break;
        }
      else as_tags.tags_any = tags_in(impl, base, TagTotals::kSweepTags);
      if (as_tags.tags_any.empty()) return {};
      as_tags.exclude_ids = options.exclude_ids;
      return tag_mask_totals(impl, mask, as_tags, loose_limit, summed_limit);
    }
    EligibleTotals out = impl.eligible_totals(base, loose_limit, summed_limit);
    if (out.rows == 0 || options.exclude_ids.empty()) return out;
    const std::vector<std::size_t> excluded =
        excluded_rows(impl, options, [&](std::size_t row) { return run_holding(base, row) < base.runs.size(); });
    if (base.count - excluded.size() != mask.count) return {};
    return without_rows(impl, std::move(out), excluded, mask.count, loose_limit);
  } catch (const std::bad_alloc&) {  // (the sample runs without totals, as before it had them)
    return {};
  }
}

// One soft query on its own (prepared and split: q, f), pruned or exact, contributors included.
SoftResult soft_one(const CollectionImpl& impl, const float* q, float f, const QueryOptions& options, SinglePath path) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const RowSpan span = impl.span();
  const std::size_t parts = impl.parts_for(options, impl.dim() + impl.value_dim());
  const KernelTable& kernels = detail::kernels();
  const bool prune = path == SinglePath::pruned && impl.use_index(options);  // not built yet: the scan
  const PruningIndex* index = impl.index();
  // The planner's budget: what a pruned path may spend before the exact scan costs less (pruning.hpp).
  const std::size_t budget = prune_budget(span.rows, impl.row_bytes());
  // The exact scan, timed: the calibration's measure of a scanned row on this machine (pruning.hpp).
  auto exact = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    PrunedSoft all = exact_soft(kernels, q, f, span, options.top_m, parts);
    impl.calibration().note_scan(elapsed_ns(t0), span.rows);
    return all;
  };
  // flat with epsilon: every search reads all keys, so after a first cheap try (k = 16) one pass
  // fetches everything the doubling could still ask for (up to a quarter of the rows or the budget,
  // best first) and later k take its prefixes, which are exactly the top-k of a fresh pass.
  std::vector<std::size_t> best_first;
  const bool reuse = prune && options.epsilon && index->exact_top_k() && index->lists() == nullptr;
  // A mask: the scans visit eligible rows only (scope.exact); candidates come from masked_candidates.
  std::optional<EligibleRows> mask;
  std::vector<std::uint8_t> flags;
  PruneScope scope;
  if (has_mask(options)) {
    mask = impl.eligible(options);
    scope.n = mask->count;
    scope.exact = [&] {
      PrunedSoft r{soft_scan_split(kernels, q, f, span, parts, options.top_m, &*mask), {}, mask->count, 0.0};
      r.value = blended_value(kernels, q, f, span, r.scan.state, &*mask);
      return r;
    };
  }
  // Certified lists (ivf, automatic, hnsw's lists): a masked query walks them only when the mask keeps at
  // least half the rows. The walk's fixed cost (every list's bound; ~1/15 of a full scan at 1M rows) and its
  // budget would otherwise outweigh the masked scan it must beat (measured: a mask keeping 10% of 1M
  // clustered rows, top_k 32: the walk gave up and the answer cost 1.9x the masked scan); narrower masks get
  // flat's fused top-k pass over the eligible rows (exact, reading their keys).
  const bool listed = prune && index->lists() != nullptr;
  const bool walk_mask = listed && mask && 2 * mask->count >= span.rows;
  // hnsw's graph alone (lists not trained): over-fetch and filter, an estimate.
  const bool filter_after = prune && mask && !index->exact_top_k() && !listed;
  // The candidates are the exact top-k: the index's own, or flat's pass over the eligible rows.
  const bool exact_candidates = prune && (index->exact_top_k() || (mask && !filter_after));
  if (filter_after || walk_mask) {  // to filter candidates, or a walk's rows
    flags = eligible_flags(*mask, span.rows);
    if (filter_after) scope.flags = &flags;
  }
  const CandidateFinder index_find = [&](std::size_t k) {
    if (!reuse) return impl.index_rows(q, f, k, options);
    if (best_first.size() < k)
      best_first = impl.index_rows(q, f, best_first.empty() ? k : std::max(k, std::min(span.rows / 4, budget)), options);
    return std::vector<std::size_t>(best_first.begin(), best_first.begin() + static_cast<std::ptrdiff_t>(std::min(k, best_first.size())));
  };
  const CandidateFinder masked_find = [&](std::size_t k) {
    return masked_candidates(impl, kernels, q, f, *mask, flags, k, parts, options, filter_after);
  };
  const CandidateFinder& find = mask ? masked_find : index_find;
  const PruneScope* in_scope = mask ? &scope : nullptr;
  const std::size_t check = prune && !exact_candidates ? options.check_sample : 0;
  // What a round of the pruned path costs in row-equivalents (pruning.hpp): the keys it reads (flat: all
  // of them, hnsw: 2M neighbours of ef graph nodes), and the candidates and sampled rows it gathers out of order.
  const double key_share = static_cast<double>(impl.key_row_bytes()) / static_cast<double>(impl.row_bytes());
  const RoundCost model{[&](std::size_t k) -> std::size_t {
                                 const std::size_t gathered = (k + check) * kRandomRowCost;
                                 if (index->exact_top_k()) return static_cast<std::size_t>(key_share * static_cast<double>(span.rows)) + gathered;
                                 // HNSW's search reads up to 2M neighbours of each of its ef closest nodes, out of order.
                                 const std::size_t nodes = 2 * std::max(options.ef_search, k) * impl.config().index.hnsw_m;
                                 return nodes * kRandomRowCost + gathered;
                               },
                               budget};
  // The model's row-equivalents times what one has cost here, measured (1 until measured): a constant
  // chosen on one CPU would misjudge another (FAISS's graph search against softkv's scan).
  const double factor = prune && !index->exact_top_k() ? impl.calibration().factor() : 1.0;
  const RoundCost cost{[&](std::size_t k) { return static_cast<std::size_t>(static_cast<double>(model(k)) * factor); }, budget};
  // One attempt the planner remembers (PlannerCalibration::skip) on unmasked queries under its budget:
  // nullopt when the planner skips it, else run's answer (nullopt: a miss), its outcome and time recorded.
  const bool remembered = !mask && budget != std::numeric_limits<std::size_t>::max();
  // (always: made whatever the memory says, its outcome still recorded.)
  const auto attempt = [&](PlannerCalibration::Attempt kind, auto&& run, bool always = false) -> std::optional<PrunedSoft> {
    if (!remembered) return run();
    if (!always && impl.calibration().skip(kind)) return std::nullopt;
    const auto t0 = std::chrono::steady_clock::now();
    std::optional<PrunedSoft> answer = run();
    impl.calibration().note(kind, answer.has_value(), elapsed_ns(t0), span.rows);
    return answer;
  };
  bool walked_lists = false;  // answered by a certified walk (or an estimate over certified lists)
  auto plan = [&]() -> PrunedSoft {
    if (path == SinglePath::estimated) {
      const double target = *options.error_target;
      // Certified lists first: a walk whose guaranteed tail bound is <= target / 2 answers within the
      // target for sure (dropping a share tau of the mass moves the blend by at most 2 tau max ||v||_inf),
      // reading only the lists that hold the mass (peaked attention), within 1/256 of the rows. A walk
      // that falls short leaves its rows as the head of an estimate when they hold the mass
      // (estimate_over_lists: the head exact, the other lists sampled); where the visited lists show the
      // mass spread over the lists (or the head's estimate fails), the sample below draws the rows with
      // the walk's rows as its exact stratum. Both attempts are remembered: walks that answer nothing,
      // themselves or through the sample they hand their rows to, and a stream the sample cannot
      // estimate (peaked attention without lists, collections this small) stop being paid for.
      // The exact scan's answer, whose error is 0.
      const auto scanned = [&] {
        PrunedSoft all = mask ? scope.exact() : exact();
        all.error_estimate = 0.0;
        return all;
      };
      std::vector<std::size_t> stratum;  // a walk's rows that did not answer: the sample's exact stratum
      std::size_t apart = 0;             // and the rows it scored that are not in the stratum
      double handed_ns = -1;            // a walk that handed its rows to the sample: its time, judged by the sample's answer
      if (!mask && impl.use_index(options) && index->lists() != nullptr) {  // (step 1b draws whole lists: no mask)
        // A walk that leaves its rows to the sample counts as useful when the sample then answers: without
        // them a sample of blocks in a storage order that follows the keys may miss the rows that hold the
        // mass. Where the sample then fails too (attention too peaked for a sample, bounds too loose for a
        // walk), both are misses and both come to be skipped.
        std::optional<PrunedSoft> walked;
        if (!remembered || !impl.calibration().skip(PlannerCalibration::Attempt::estimate_walk)) {
          const auto t0 = std::chrono::steady_clock::now();
          walked = estimate_through_lists(impl, q, f, target, options.top_m, stratum, nullptr, nullptr, nullptr, nullptr, &apart);
          if (remembered) {
            if (walked.has_value() || stratum.empty())
              impl.calibration().note(PlannerCalibration::Attempt::estimate_walk, walked.has_value(), elapsed_ns(t0), span.rows);
            else
              handed_ns = elapsed_ns(t0);
          }
        } else {
          // The walk skipped: the sample would run without its stratum, and on lists whose walks keep
          // failing a sample that answers without it cannot be trusted (rows stored by similarity): the scan.
          return scanned();
        }
        if (walked) {
          walked_lists = true;
          return std::move(*walked);
        }
      }
      // Then a sample of blocks of rows (spread attention), up to an eighth of the rows over all rounds; the
      // rounds give up as soon as their error says the target needs more, and the exact scan answers.
      // (Small collections too: a sample past an eighth of the rows would cost more than the scan.) With a
      // mask, the sample draws from the eligible rows and the budget is an eighth of them.
      const std::size_t rows = mask ? mask->count : span.rows;
      // top_m clamped to the rows it could list (a TopScores reserves room for all of them).
      EstimateTarget sample{target, impl.value_max(), rows / 8, seed_of(q, impl.dim(), rows), std::min(options.top_m, rows)};
      // The control variates' totals (summed at the first such query, before the attempt's timing starts);
      // with a mask, the eligible rows' value sums from the collection's tag or chunk sums (masked_totals).
      const EligibleTotals eligible = mask ? masked_totals(impl, *mask, options) : EligibleTotals{};
      const MomentTotals totals = mask ? eligible.view() : impl.moment_totals();
      if (totals.rows > 0) sample.moments = &totals;
      // A walk that handed its rows on is judged by this sample, which then runs whatever the sample's own
      // memory says (else the walk's one try in 16 would meet the sample's one in 16 once in 256 queries).
      // (The walk is charged the sample's time too: what it cost to hand the query on, or to answer it.)
      const auto sample_t0 = std::chrono::steady_clock::now();
      std::optional<PrunedSoft> estimated = attempt(
          PlannerCalibration::Attempt::sample,
          [&] { return estimated_soft(kernels, q, f, span, sample, mask ? &*mask : nullptr, stratum.empty() ? nullptr : &stratum); },
          handed_ns >= 0);
      if (handed_ns >= 0)
        impl.calibration().note(PlannerCalibration::Attempt::estimate_walk, estimated.has_value(), handed_ns + elapsed_ns(sample_t0),
                                span.rows);
      if (!estimated) return scanned();
      estimated->rows_scored += apart;  // (a row the walk scored and the sample drew again counts twice)
      return std::move(*estimated);
    }
    if (!prune) return mask ? scope.exact() : exact();
    if (index->lists() != nullptr && (!mask || walk_mask)) {  // certified lists: the walk keeps to the budget itself
      // top_k gets half the budget: whether the k-th score will beat the next bound shows only by walking
      // (the bounds alone rarely rule it out), so a hopeless walk wastes what it may spend. With a mask the
      // walk scores every row of the lists it visits and keeps the eligible ones, within a budget taken from
      // the masked scan it must beat (which reads the eligible rows only).
      const std::size_t walk_budget = mask && budget != std::numeric_limits<std::size_t>::max() ? mask->count / kBudgetDivisor : budget;
      const ListTarget target{options.top_k.value_or(0), options.epsilon.value_or(0.0f), options.top_k ? walk_budget / 2 : walk_budget,
                              mask ? &flags : nullptr, mask ? mask->count : 0};
      // Walks that keep falling back are remembered (attempt): 15 queries in 16 then go to the scan
      // without paying for a walk that would fail too. Only a query that would walk asks. (top_k and
      // epsilon apart: a top_k beyond the lists' reach says nothing of an epsilon walk.)
      std::optional<PrunedSoft> walked;
      const PlannerCalibration::Attempt kind = options.top_k ? PlannerCalibration::Attempt::top_k_walk : PlannerCalibration::Attempt::epsilon_walk;
      if (!options.top_k || *options.top_k < (mask ? mask->count : span.rows))
        walked = attempt(kind, [&] {
          return certified_soft(kernels, *index->lists(), q, f, span, [&](std::uint64_t id) { return *impl.row_of(id); },
                                target, options.top_m);
        });
      walked_lists = walked.has_value();
      if (walked) return std::move(*walked);
      return mask ? scope.exact() : exact();
    }
    if (options.top_k) {
      // A single round: when it alone costs more than the exact scan would, the scan answers.
      const bool small = budget == std::numeric_limits<std::size_t>::max();
      if (!mask && !small && cost(*options.top_k) >= span.rows && (model(*options.top_k) >= span.rows || !impl.calibration().explore()))
        return exact();
      const auto t0 = std::chrono::steady_clock::now();
      PrunedSoft pruned = pruned_soft(kernels, q, f, span, *options.top_k, options.top_m, parts, find, check, in_scope);
      if (!mask && !index->exact_top_k() && pruned.k < span.rows)  // an index round, as the model costed it
        impl.calibration().note_pruned(elapsed_ns(t0), model(*options.top_k));
      return pruned;
    }
    return adaptive_soft(kernels, q, f, span, *options.epsilon, options.top_m, parts, find, check, in_scope,
                                 mask ? RoundCost{} : cost);
  };
  PrunedSoft pruned = plan();

  const bool estimated = pruned.error_estimate.has_value();
  SoftResult result = soft_result(std::move(pruned));
  const bool scanned_all = result.candidates == (mask ? mask->count : span.rows);
  if (estimated) {  // error_target: a walk's guaranteed tail bound, or a sample's (nothing dropped: 0)
    result.searched_with = walked_lists && !scanned_all ? IndexKind::ivf : IndexKind::exact;
    result.tail_bound_guaranteed = true;
  } else if (walked_lists) {  // certified lists chose the candidates (ivf, automatic, and hnsw's lists beside its graph)
    result.searched_with = scanned_all ? IndexKind::exact : IndexKind::ivf;
    result.tail_bound_guaranteed = true;
  } else {
    // (a masked query's candidates from flat's pass over the eligible rows say flat, whatever the index)
    result.searched_with = scanned_all ? IndexKind::exact : mask && !filter_after ? IndexKind::flat : index->kind();
    result.mask_filtered_after_search = filter_after && !scanned_all;
    result.tail_bound_guaranteed = scanned_all || exact_candidates;
  }
  return result;
}

SoftResult soft_result(PrunedSoft&& p) {
  SoftResult r;
  r.lse = p.scan.state.lse();
  CollectionImpl::check_lse(r.lse);
  r.max_score = p.scan.state.max;
  r.candidates = p.k;
  r.tail_bound = p.tail_bound;
  r.rows_scored = p.rows_scored != 0 ? p.rows_scored : p.k;
  r.error_estimate = p.error_estimate.value_or(0.0);
  r.value = std::move(p.value);
  r.top.reserve(p.scan.top.size());
  for (const auto& item : p.scan.top)
    r.top.push_back({item.id, static_cast<float>(std::exp(static_cast<double>(item.score) - r.lse)), item.score});
  return r;
}

// One hard query on its own: through an approximate index when it has one, else the exact scan.
HardResult hard_one(const CollectionImpl& impl, const float* q, float f, const QueryOptions& options) {
  const auto lock = impl.read_lock();
  impl.require_entries();
  const RowSpan span = impl.span();
  const KernelTable& kernels = detail::kernels();
  ArgMax best;
  HardResult result;
  const IndexKind index_kind = impl.use_index(options) ? impl.index()->kind() : IndexKind::exact;
  std::optional<EligibleRows> mask;
  std::vector<std::uint8_t> flags;
  if (has_mask(options)) mask = impl.eligible(options);
  if (index_kind == IndexKind::hnsw || index_kind == IndexKind::ivf) {
    // The index's best candidates (hnsw: approximate; ivf: the exact top 1), rescored with our kernel (ties to the smallest id); flat would
    // read every key like the scan below, so it gains nothing here. A mask over-fetches and filters.
    std::size_t ask = impl.index()->exact_top_k() ? 1 : kHardCandidates;  // certified lists: the true best
    if (mask) {
      flags = eligible_flags(*mask, span.rows);
      ask = std::max(ask, ask * span.rows / mask->count);
      if (ask > span.rows / 4) ask = 0;  // a search that large costs what the exact masked scan does
    }
    for (std::size_t row : ask == 0 ? std::vector<std::size_t>{} : impl.index_rows(q, f, ask, options)) {
      if (mask && flags[row] == 0) continue;
      const RowSpan one = span.sub(row, 1);
      ArgMax candidate;
      kernels.hard_scan(q, f, one, candidate);
      if (candidate.row != ArgMax::kNoRow) candidate.row = row;
      merge_argmax(candidate, span.ids, best);
    }
    result.searched_with = index_kind;
  }
  if (best.row == ArgMax::kNoRow && !best.overflow) {
    const std::size_t parts = impl.parts_for(options, impl.dim());
    best = hard_scan_split(kernels, q, f, span, parts, mask ? &*mask : nullptr);
    result.searched_with = IndexKind::exact;
  }
  check_best(best);
  result.id = span.ids[best.row];
  result.score = best.score;
  result.value = value_vector(span, best.row);
  return result;
}

}  // namespace softkv::detail
