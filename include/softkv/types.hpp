// softkv's vocabulary types: configurations, query options and results, entries and images. Plain
// structs with no behaviour, shared by the library, the codecs, the server and both clients; the
// classes that use them (Collection, Database, Client) include this header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "softkv/precision.hpp"

namespace softkv {

/// The one id no entry may have: it keeps "next id = largest id + 1" from wrapping.
inline constexpr std::uint64_t kReservedId = ~std::uint64_t{0};

/// How a query is compared with a key.
enum class Metric : std::uint8_t {
  dot = 0,     ///< inner product q . k
  cosine = 1,  ///< inner product of unit vectors: keys normalised at insert, queries at query time
};

/// How a collection finds the candidates of a pruned query (top_k or epsilon).
enum class IndexKind : std::uint8_t {
  exact = 0,      ///< no pruning index: every query scans every entry (the default)
  flat = 1,       ///< exact top-k by softkv's own fused score + top-k pass over the stored keys; the tail bound is a guarantee
  hnsw = 2,       ///< FAISS HNSW graph (inner product) for hard queries, certified lists beside it (as ivf) for soft ones
  ivf = 3,        ///< softkv's certified inverted lists (docs/PRUNING.md): exact top-k and a guaranteed tail bound; trained once ivf_train_size entries exist
  automatic = 4,  ///< exact scan below auto_threshold entries, IVF from there on
};

/// The pruning index of a collection and its build parameters.
struct IndexConfig {
  IndexKind kind = IndexKind::exact;     ///< which index
  std::size_t hnsw_m = 32;               ///< HNSW links per node
  std::size_t hnsw_ef_construction = 80; ///< HNSW candidate list while building
  std::size_t ivf_nlist = 0;             ///< IVF (and hnsw's) lists at training; 0: entries / 32 (then lists holding several clusters are split, and the lists are retrained when the entries grow 4x)
  std::size_t ivf_train_size = 0;        ///< entries needed before IVF (or hnsw's lists) train; 0: 39 * max(ivf_nlist, 16); hnsw at 2^32: the graph alone
  std::size_t auto_threshold = 10000;    ///< automatic: entries from which IVF replaces the scan (2x the measured crossover)
  float rebuild_fraction = 0.25f;        ///< HNSW/IVF rebuild once dead entries exceed this fraction of live ones
};

/// Fixed shape and defaults of a collection.
struct CollectionConfig {
  std::size_t dim = 0;              ///< key (and query) dimension d, >= 1
  std::size_t value_dim = 0;        ///< value dimension dv, >= 1
  Metric metric = Metric::dot;      ///< similarity used for scores
  std::optional<float> scale;       ///< default score scale; unset means 1 / sqrt(d)
  IndexConfig index;                ///< pruning index used by queries with top_k or epsilon
  // Compact storage (issue 14).
  Precision key_precision = Precision::f32;    ///< how keys are stored: f32, f16, bf16 or i8
  Precision value_precision = Precision::f32;  ///< how values are stored: f32, f16 or bf16
  /// Attention heads h (issue 15): d and dv split into h equal slices, each head with its own softmax
  /// (default scale 1 / sqrt(d / h)). 1 .. ConfigLimits::kMaxHeads; d and dv divisible by h; h > 1
  /// needs IndexKind::exact (no pruning index) and normalises each key slice for cosine.
  std::size_t heads = 1;
};

/// The accepted range of every CollectionConfig field. check_config enforces it at creation, and every
/// loader (log replay, snapshots, the wire) checks through the same function, so a configuration that
/// was accepted once always loads again.
struct ConfigLimits {
  static constexpr std::size_t kMaxDimension = std::size_t{1} << 24;       ///< dim and value_dim: 1 .. 2^24
  static constexpr std::size_t kMaxHnswM = 256;                           ///< hnsw_m: at most 256 (memory grows with m per row), >= 2 for hnsw
  static constexpr std::size_t kMaxHnswEfConstruction = std::size_t{1} << 16;  ///< hnsw_ef_construction: at most 65536, >= 1 for hnsw
  static constexpr std::size_t kMaxIvfNlist = std::size_t{1} << 16;      ///< ivf_nlist: 0 (automatic) .. 65536
  static constexpr std::size_t kMaxIvfTrainSize = std::size_t{1} << 32;  ///< ivf_train_size: 0 (automatic), or ivf_nlist .. 2^32
  static constexpr float kMaxRebuildFraction = 1000.0f;                    ///< rebuild_fraction: (0, 1000]
  static constexpr std::size_t kMaxHeads = 1024;                          ///< heads: 1 .. 1024, dividing dim and value_dim
};

/// Throws Error(invalid_argument) naming the first field of config outside ConfigLimits (or an unknown
/// metric, index kind or precision, i8 values, or a scale that is not finite and > 0); returns normally otherwise.
void check_config(const CollectionConfig& config);

/// An inclusive range of tags [lo, hi] (a causal mask over time stamps: [0, t]).
struct TagRange {
  std::uint64_t lo = 0;                        ///< smallest tag kept
  std::uint64_t hi = ~std::uint64_t{0};        ///< largest tag kept, >= lo
};

/// Per-query knobs. Scores are s_i = scale * sim(q, k_i).
struct QueryOptions {
  /// Temperature T > 0: scale = 1 / (sqrt(d) * T). Unset: the collection's default scale.
  std::optional<float> temperature;
  /// Explicit scale (Hopfield's beta), finite and > 0. Exclusive with temperature.
  std::optional<float> scale;
  /// How many top contributors (id, weight, score) to report; 0 reports none.
  std::size_t top_m = 0;
  /// Threads one query may use to split its scan; 0 picks from the collection size.
  std::size_t threads = 0;
  /// Pruned soft retrieval: softmax over the top_k keys only (>= 1; needs a pruning index).
  std::optional<std::size_t> top_k;
  /// Adaptive pruning, in (0, 1); exclusive with top_k: the fewest candidates whose tail_bound is <= epsilon
  /// (ivf, hnsw: certified lists visited until the bound is met; flat: k doubles from 16). When that would cost more
  /// than the planner's budget (docs/PRUNING.md), the exact scan answers.
  std::optional<float> epsilon;
  /// Estimated soft retrieval: the answer within this error, relative to max_i ||v_i||_inf, at 95%
  /// confidence (SoftResult::error_estimate), reading as few rows as the data allow (docs/PRUNING.md,
  /// "Estimated answers"). Finite and >= 0 (0: the exact answer); exclusive with top_k and epsilon; not on
  /// multi-head collections; with a mask only the eligible entries are sampled. When the target needs more
  /// rows than the planner's budget, the exact scan answers.
  std::optional<float> error_target;
  /// HNSW: candidate list size of the graph search (>= top_k is useful; 64 at least is advised);
  /// any value is accepted and clamped to [k, index size].
  std::size_t ef_search = 64;
  /// Unused since the IVF became certified (it visits the lists its bounds require); accepted for compatibility.
  std::size_t nprobe = 16;
  /// Pruning by an HNSW graph (soft queries on an hnsw collection whose certified lists are not trained yet):
  /// rows sampled outside the candidates and scored exactly to check the tail estimate (docs/PRUNING.md,
  /// "Sampled check"); with epsilon, k grows until the checked value meets it. 0: no check (the bound is then
  /// the bare estimate). Ignored wherever the bound is a guarantee (flat, certified lists).
  std::size_t check_sample = 256;
  /// Hard retrieval: scan every key even when the collection has an index.
  bool exact = false;

  // ---- masks: which entries the query may see (all given fields must hold: AND). A masked entry is
  // as if absent: no weight, never a contributor or the hard answer, not counted in the tail bound's N.
  // No eligible entry is Error(empty_collection). docs/ATTENTION.md, "Masks", says how masked scans are run.
  /// Most tags tags_any may hold.
  static constexpr std::size_t kMaxTagsAny = 1024;
  /// Most ids exclude_ids may hold.
  static constexpr std::size_t kMaxExcludeIds = 65536;
  /// Keep only entries whose tag is one of these; empty keeps every tag. At most kMaxTagsAny.
  std::vector<std::uint64_t> tags_any;
  /// Keep only entries with lo <= tag <= hi; unset keeps every tag.
  std::optional<TagRange> tag_range;
  /// Drop the entries with these ids (ids no entry has are ignored). At most kMaxExcludeIds.
  std::vector<std::uint64_t> exclude_ids;

  // ---- iterative (Hopfield) retrieval: soft queries only, dv == d. docs/ATTENTION.md, "Iterative (Hopfield) retrieval".
  /// Most iterations a query may ask for.
  static constexpr std::size_t kMaxIterations = 1000;
  /// Passes at most (1 .. kMaxIterations): after each, the blended value becomes the next query
  /// (normalised for cosine, per head slice) until the relative change is <= tolerance.
  std::size_t iterations = 1;
  /// Stop once ||x_new - x_old|| / ||x_old|| <= tolerance (finite, >= 0; 0 runs every iteration
  /// unless a fixed point is reached exactly).
  float tolerance = 0.0f;
};

/// One entry's share of a soft answer.
struct Contributor {
  std::uint64_t id = 0;  ///< the entry
  float weight = 0;      ///< its softmax weight in [0, 1]
  float score = 0;       ///< its score s_i
};

/// One head's share of a multi-head soft answer (its value slice is in SoftResult::value).
struct HeadResult {
  double lse = 0;                 ///< log sum_i exp(s_ij) of head j's scores
  float max_score = 0;            ///< head j's largest score
  std::vector<Contributor> top;   ///< head j's top_m contributors, highest weight first
};

/// The answer of a soft query: out = sum_i softmax(s)_i v_i.
struct SoftResult {
  std::vector<float> value;            ///< the blended value, dv floats
  double lse = 0;                      ///< log sum_i exp(s_i) over the candidates
  float max_score = 0;                 ///< the largest score s_i
  std::size_t candidates = 0;          ///< how many entries took part in the softmax (k when pruned)
  double tail_bound = 0;               ///< upper bound on the softmax mass outside the candidates (0: exact)
  bool tail_bound_guaranteed = true;   ///< true when the bound is proven (exact, flat, certified lists), false for an hnsw graph's estimate
  IndexKind searched_with = IndexKind::exact;  ///< what chose the candidates; exact when every entry took part
  /// A masked query pruned by an hnsw graph: the index searched every entry and masked candidates were
  /// dropped afterwards (over-fetch and filter). False for scans, flat and walks of certified lists.
  bool mask_filtered_after_search = false;
  /// Rows whose score was computed: every eligible row for a scan, the visited lists' rows of a walk of
  /// certified lists, the candidates of flat and of an hnsw graph, and the rows of every sampling round of
  /// an error_target query.
  std::size_t rows_scored = 0;
  /// error_target queries: the estimated ||value - exact value||_inf / max_i ||v_i||_inf at 95% confidence
  /// (0 when every row was scored); 0 for other queries, whose accuracy tail_bound states.
  double error_estimate = 0;
  std::vector<Contributor> top;        ///< the top_m contributors, highest weight first
  /// Multi-head collections (h > 1): h entries, head j's lse, max score and contributors (lse,
  /// max_score and top above then repeat head 0's). Empty for h = 1.
  std::vector<HeadResult> heads;
  std::size_t iterations_run = 1;      ///< passes run (QueryOptions::iterations; fewer when tolerance was met)
  double last_change = 0;              ///< ||x_new - x_old|| / ||x_old|| of the last pass (inf for a zero query that moved)
};

/// The answer of a hard query: the value of the best-scoring key.
struct HardResult {
  std::uint64_t id = 0;         ///< the winning entry (ties: the smallest id)
  float score = 0;              ///< its score, scaled like soft scores (equals SoftResult::max_score)
  std::vector<float> value;     ///< its value, dv floats
  IndexKind searched_with = IndexKind::exact;  ///< exact scan, or the index whose top-1 was taken
  /// Multi-head collections (h > 1): head j's winning id and score (id and score above repeat head 0's);
  /// value is the concatenation of value slice j of head j's winner. Empty for h = 1.
  std::vector<std::uint64_t> head_ids;
  std::vector<float> head_scores;      ///< h > 1: head j's winning score
};

/// How a collection's single queries were served by coalescing (Collection::coalescing_stats).
struct CoalescingStats {
  std::uint64_t queries = 0;    ///< single queries served through the coalescer
  std::uint64_t passes = 0;     ///< passes over the rows that served them (a query that ran alone is a pass of one)
  std::uint64_t max_batch = 0;  ///< the most queries one pass served
};

/// Soft answers for B queries, row-major.
struct SoftBatchResult {
  std::vector<float> values;        ///< B x dv blended values
  std::vector<double> lse;          ///< B log-sum-exp values
  std::vector<float> max_score;     ///< B largest scores
  std::vector<double> head_lse;     ///< h > 1: B x h per-head lse (lse above holds head 0's); empty for h = 1
  std::vector<float> head_max_score;  ///< h > 1: B x h per-head largest scores; empty for h = 1
};

/// Hard answers for B queries, row-major.
struct HardBatchResult {
  std::vector<std::uint64_t> ids;   ///< B winning ids
  std::vector<float> scores;        ///< B winning scores
  std::vector<float> values;        ///< B x dv winning values (h > 1: head j's winner's slice j)
  std::vector<std::uint64_t> head_ids;  ///< h > 1: B x h per-head winning ids (ids above hold head 0's); empty for h = 1
  std::vector<float> head_scores;   ///< h > 1: B x h per-head winning scores; empty for h = 1
};

/// Which answer a query wants.
enum class Retrieval : std::uint8_t {
  soft = 0,  ///< the softmax-weighted blend of the values
  hard = 1,  ///< the value of the best key
};

/// Answers to n queries, in query order: one shape for the library, the server and the clients.
struct QueryResults {
  std::vector<SoftResult> soft;  ///< n results for Retrieval::soft (empty for hard)
  std::vector<HardResult> hard;  ///< n results for Retrieval::hard (empty for soft)
};

/// One stored entry, as returned by get().
struct Entry {
  std::uint64_t id = 0;          ///< its id
  std::vector<float> key;        ///< its key as stored (unit length for cosine collections; rounded to the key precision)
  std::vector<float> value;      ///< its value as stored (rounded to the value precision)
  std::uint64_t tag = 0;         ///< its tag (0 unless given at add/upsert): what query masks test
};

/// n entries, row-major: the unit of a write (see Collection::prepare and Collection::apply).
struct Rows {
  std::vector<std::uint64_t> ids;  ///< n ids
  std::vector<float> keys;         ///< n x d keys
  std::vector<float> values;       ///< n x dv values
  std::vector<std::uint64_t> tags; ///< n tags, or empty when every tag is 0
};

/// A collection's entries at one moment, keys and values as stored (rounded to the collection's
/// precisions, each exactly representable in it): what a snapshot keeps (Collection::image).
struct CollectionImage {
  CollectionConfig config;        ///< its configuration
  std::uint64_t next_id = 0;      ///< the id add() assigns next
  Rows rows;                      ///< every entry, in storage order
  std::vector<std::byte> index;   ///< the pruning index's saved form; empty when there is none worth keeping
};

}  // namespace softkv
