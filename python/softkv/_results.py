"""The answers of softkv queries as small classes holding numpy arrays, shared by the module and the client.

Every array is owned by Python (it aliases nothing inside a collection) and may be kept or modified.
"""

from __future__ import annotations

import numpy as np

_EMPTY_IDS = np.empty(0, dtype=np.uint64)
_EMPTY_FLOATS = np.empty(0, dtype=np.float32)
_EMPTY_IDS.flags.writeable = False  # shared by every answer without contributors: nothing may grow them
_EMPTY_FLOATS.flags.writeable = False


class Contributors:
    """The top-m entries of a soft answer, highest weight first: ``ids`` (uint64), ``weights`` and
    ``scores`` (float32), as three arrays of length m. Iterating yields ``(id, weight, score)`` tuples."""

    __slots__ = ("ids", "weights", "scores")

    def __init__(self, ids=_EMPTY_IDS, weights=_EMPTY_FLOATS, scores=_EMPTY_FLOATS):
        self.ids = ids
        self.weights = weights
        self.scores = scores

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple:
        return int(self.ids[i]), float(self.weights[i]), float(self.scores[i])

    def __iter__(self):
        return (self[i] for i in range(len(self.ids)))

    def __eq__(self, other) -> bool:
        return isinstance(other, Contributors) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"Contributors({list(self)!r})"


class SoftResult:
    """One soft answer: out = sum_i softmax(s)_i v_i.

    value: (dv,) float32 blended value; lse: log sum_i exp(s_i) over the candidates (float);
    max_score: the largest score; candidates: entries in the softmax (k when pruned); tail_bound: upper
    bound on the softmax mass outside the candidates (0: exact); tail_bound_guaranteed: proven (exact,
    flat) or an estimate (hnsw, ivf); searched_with: 'exact', 'flat', 'hnsw', 'ivf' or 'automatic';
    top: the top_m Contributors; mask_filtered_after_search: a masked pruned query whose index searched
    every entry, its masked candidates dropped afterwards; rows_scored: rows whose score was computed;
    error_estimate: for error_target queries, the estimated ||value - exact||_inf / max ||v_i||_inf at 95%
    confidence (0 otherwise).

    Multi-head collections (heads h > 1): head_lse (h,) float64, head_max_score (h,) float32 and head_top
    (h Contributors) hold each head's answer (lse, max_score and top repeat head 0's; value is the
    concatenation of the heads' slices); for h = 1 they are empty. Iterative retrieval: iterations_run
    (passes run) and last_change (||x_new - x_old|| / ||x_old|| of the last pass; 0 when iterations = 1).
    """

    __slots__ = ("value", "lse", "max_score", "candidates", "tail_bound", "tail_bound_guaranteed", "searched_with", "top",
                 "mask_filtered_after_search", "head_lse", "head_max_score", "head_top", "iterations_run", "last_change",
                 "rows_scored", "error_estimate")

    def __init__(self, value, lse, max_score, candidates, tail_bound=0.0, tail_bound_guaranteed=True,
                 searched_with="exact", top=None):
        self.value = value
        self.lse = lse
        self.max_score = max_score
        self.candidates = candidates
        self.tail_bound = tail_bound
        self.tail_bound_guaranteed = tail_bound_guaranteed
        self.searched_with = searched_with
        self.top = Contributors() if top is None else top
        self.mask_filtered_after_search = False
        self.head_lse = np.empty(0, dtype=np.float64)
        self.head_max_score = _EMPTY_FLOATS
        self.head_top = ()
        self.iterations_run = 1
        self.last_change = 0.0
        self.rows_scored = candidates
        self.error_estimate = 0.0

    def __repr__(self) -> str:
        return (f"SoftResult(value={self.value!r}, lse={self.lse!r}, max_score={self.max_score!r}, candidates={self.candidates}, "
                f"tail_bound={self.tail_bound!r}, searched_with={self.searched_with!r}, top={self.top!r})")


class HardResult:
    """One hard answer: the best-scoring entry's ``id`` (int; ties: the smallest id), its ``score``,
    its ``value`` ((dv,) float32) and ``searched_with`` (the exact scan or the index whose top-1 was taken).
    Multi-head collections (h > 1): ``head_ids`` (h,) uint64 and ``head_scores`` (h,) float32 are each
    head's winner (id and score repeat head 0's; value holds value slice j of head j's winner); empty for h = 1."""

    __slots__ = ("id", "score", "value", "searched_with", "head_ids", "head_scores")

    def __init__(self, id, score, value, searched_with="exact", head_ids=_EMPTY_IDS, head_scores=_EMPTY_FLOATS):  # noqa: A002
        self.id = id
        self.score = score
        self.value = value
        self.searched_with = searched_with
        self.head_ids = head_ids
        self.head_scores = head_scores

    def __repr__(self) -> str:
        return f"HardResult(id={self.id}, score={self.score!r}, value={self.value!r}, searched_with={self.searched_with!r})"


class SoftBatchResult:
    """Soft answers for B queries as arrays: ``values`` (B, dv) float32, ``lse`` (B,) float64,
    ``max_score`` (B,) float32, ``candidates`` (B,) uint64, ``tail_bound`` (B,) float64,
    ``tail_bound_guaranteed`` (B,) bool, ``searched_with`` (B strings) and ``top`` (B Contributors);
    ``head_lse`` (B, h) float64 and ``head_max_score`` (B, h) float32 (h = 0 columns for a single-head
    collection), ``iterations_run`` (B,) uint64, ``last_change`` (B,) float64 and
    ``mask_filtered_after_search`` (B,) bool, ``rows_scored`` (B,) uint64 and ``error_estimate`` (B,) float64.
    ``len(batch)`` is B and ``batch[i]`` is query i's SoftResult."""

    __slots__ = ("values", "lse", "max_score", "candidates", "tail_bound", "tail_bound_guaranteed", "searched_with", "top",
                 "head_lse", "head_max_score", "head_top", "iterations_run", "last_change", "mask_filtered_after_search",
                 "rows_scored", "error_estimate")

    def __init__(self, values, lse, max_score, candidates, tail_bound, tail_bound_guaranteed, searched_with, top,
                 head_lse=None, head_max_score=None, head_top=None, iterations_run=None, last_change=None,
                 mask_filtered_after_search=None, rows_scored=None, error_estimate=None):
        self.values = values
        self.lse = lse
        self.max_score = max_score
        self.candidates = candidates
        self.tail_bound = tail_bound
        self.tail_bound_guaranteed = tail_bound_guaranteed
        self.searched_with = searched_with
        self.top = top
        b = len(values)
        self.head_lse = np.empty((b, 0), dtype=np.float64) if head_lse is None else head_lse
        self.head_max_score = np.empty((b, 0), dtype=np.float32) if head_max_score is None else head_max_score
        self.head_top = tuple(() for _ in range(b)) if head_top is None else head_top
        self.iterations_run = np.ones(b, dtype=np.uint64) if iterations_run is None else iterations_run
        self.last_change = np.zeros(b, dtype=np.float64) if last_change is None else last_change
        self.mask_filtered_after_search = (np.zeros(b, dtype=bool) if mask_filtered_after_search is None
                                           else mask_filtered_after_search)
        self.rows_scored = np.asarray(candidates, dtype=np.uint64) if rows_scored is None else rows_scored
        self.error_estimate = np.zeros(b, dtype=np.float64) if error_estimate is None else error_estimate

    @classmethod
    def from_results(cls, results, value_dim: int) -> "SoftBatchResult":
        """Stacks single answers (e.g. one per query from the server) into one batch."""
        values = np.stack([r.value for r in results]) if results else np.empty((0, value_dim), dtype=np.float32)
        return cls(values, np.array([r.lse for r in results], dtype=np.float64),
                   np.array([r.max_score for r in results], dtype=np.float32),
                   np.array([r.candidates for r in results], dtype=np.uint64),
                   np.array([r.tail_bound for r in results], dtype=np.float64),
                   np.array([r.tail_bound_guaranteed for r in results], dtype=bool),
                   tuple(r.searched_with for r in results), tuple(r.top for r in results),
                   np.array([r.head_lse for r in results], dtype=np.float64).reshape(len(results), -1) if results else None,
                   np.array([r.head_max_score for r in results], dtype=np.float32).reshape(len(results), -1) if results else None,
                   tuple(r.head_top for r in results),
                   np.array([r.iterations_run for r in results], dtype=np.uint64),
                   np.array([r.last_change for r in results], dtype=np.float64),
                   np.array([r.mask_filtered_after_search for r in results], dtype=bool),
                   np.array([r.rows_scored for r in results], dtype=np.uint64),
                   np.array([r.error_estimate for r in results], dtype=np.float64))

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> SoftResult:
        r = SoftResult(self.values[i], float(self.lse[i]), float(self.max_score[i]), int(self.candidates[i]),
                       float(self.tail_bound[i]), bool(self.tail_bound_guaranteed[i]), self.searched_with[i], self.top[i])
        r.head_lse, r.head_max_score, r.head_top = self.head_lse[i], self.head_max_score[i], self.head_top[i]
        r.iterations_run, r.last_change = int(self.iterations_run[i]), float(self.last_change[i])
        r.mask_filtered_after_search = bool(self.mask_filtered_after_search[i])
        r.rows_scored, r.error_estimate = int(self.rows_scored[i]), float(self.error_estimate[i])
        return r

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"SoftBatchResult(B={len(self)}, values={self.values!r}, lse={self.lse!r})"


class HardBatchResult:
    """Hard answers for B queries as arrays: ``ids`` (B,) uint64, ``scores`` (B,) float32, ``values``
    (B, dv) float32 and ``searched_with`` (B strings); ``head_ids`` (B, h) uint64 and ``head_scores``
    (B, h) float32 (h = 0 columns for a single-head collection). ``batch[i]`` is query i's HardResult."""

    __slots__ = ("ids", "scores", "values", "searched_with", "head_ids", "head_scores")

    def __init__(self, ids, scores, values, searched_with, head_ids=None, head_scores=None):
        self.ids = ids
        self.scores = scores
        self.values = values
        self.searched_with = searched_with
        self.head_ids = np.empty((len(ids), 0), dtype=np.uint64) if head_ids is None else head_ids
        self.head_scores = np.empty((len(ids), 0), dtype=np.float32) if head_scores is None else head_scores

    @classmethod
    def from_results(cls, results, value_dim: int) -> "HardBatchResult":
        """Stacks single answers into one batch."""
        values = np.stack([r.value for r in results]) if results else np.empty((0, value_dim), dtype=np.float32)
        return cls(np.array([r.id for r in results], dtype=np.uint64), np.array([r.score for r in results], dtype=np.float32),
                   values, tuple(r.searched_with for r in results),
                   np.array([r.head_ids for r in results], dtype=np.uint64).reshape(len(results), -1) if results else None,
                   np.array([r.head_scores for r in results], dtype=np.float32).reshape(len(results), -1) if results else None)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> HardResult:
        return HardResult(int(self.ids[i]), float(self.scores[i]), self.values[i], self.searched_with[i], self.head_ids[i],
                          self.head_scores[i])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"HardBatchResult(B={len(self)}, ids={self.ids!r}, scores={self.scores!r})"


__all__ = ["Contributors", "SoftResult", "HardResult", "SoftBatchResult", "HardBatchResult"]
