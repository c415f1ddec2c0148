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
    every entry, its masked candidates dropped afterwards.
    """

    __slots__ = ("value", "lse", "max_score", "candidates", "tail_bound", "tail_bound_guaranteed", "searched_with", "top",
                 "mask_filtered_after_search")

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

    def __repr__(self) -> str:
        return (f"SoftResult(value={self.value!r}, lse={self.lse!r}, max_score={self.max_score!r}, candidates={self.candidates}, "
                f"tail_bound={self.tail_bound!r}, searched_with={self.searched_with!r}, top={self.top!r})")


class HardResult:
    """One hard answer: the best-scoring entry's ``id`` (int; ties: the smallest id), its ``score``,
    its ``value`` ((dv,) float32) and ``searched_with`` (the exact scan or the index whose top-1 was taken)."""

    __slots__ = ("id", "score", "value", "searched_with")

    def __init__(self, id, score, value, searched_with="exact"):  # noqa: A002 - the entry's id
        self.id = id
        self.score = score
        self.value = value
        self.searched_with = searched_with

    def __repr__(self) -> str:
        return f"HardResult(id={self.id}, score={self.score!r}, value={self.value!r}, searched_with={self.searched_with!r})"


class SoftBatchResult:
    """Soft answers for B queries as arrays: ``values`` (B, dv) float32, ``lse`` (B,) float64,
    ``max_score`` (B,) float32, ``candidates`` (B,) uint64, ``tail_bound`` (B,) float64,
    ``tail_bound_guaranteed`` (B,) bool, ``searched_with`` (B strings) and ``top`` (B Contributors).
    ``len(batch)`` is B and ``batch[i]`` is query i's SoftResult."""

    __slots__ = ("values", "lse", "max_score", "candidates", "tail_bound", "tail_bound_guaranteed", "searched_with", "top")

    def __init__(self, values, lse, max_score, candidates, tail_bound, tail_bound_guaranteed, searched_with, top):
        self.values = values
        self.lse = lse
        self.max_score = max_score
        self.candidates = candidates
        self.tail_bound = tail_bound
        self.tail_bound_guaranteed = tail_bound_guaranteed
        self.searched_with = searched_with
        self.top = top

    @classmethod
    def from_results(cls, results, value_dim: int) -> "SoftBatchResult":
        """Stacks single answers (e.g. one per query from the server) into one batch."""
        values = np.stack([r.value for r in results]) if results else np.empty((0, value_dim), dtype=np.float32)
        return cls(values, np.array([r.lse for r in results], dtype=np.float64),
                   np.array([r.max_score for r in results], dtype=np.float32),
                   np.array([r.candidates for r in results], dtype=np.uint64),
                   np.array([r.tail_bound for r in results], dtype=np.float64),
                   np.array([r.tail_bound_guaranteed for r in results], dtype=bool),
                   tuple(r.searched_with for r in results), tuple(r.top for r in results))

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int) -> SoftResult:
        return SoftResult(self.values[i], float(self.lse[i]), float(self.max_score[i]), int(self.candidates[i]),
                          float(self.tail_bound[i]), bool(self.tail_bound_guaranteed[i]), self.searched_with[i], self.top[i])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"SoftBatchResult(B={len(self)}, values={self.values!r}, lse={self.lse!r})"


class HardBatchResult:
    """Hard answers for B queries as arrays: ``ids`` (B,) uint64, ``scores`` (B,) float32, ``values``
    (B, dv) float32 and ``searched_with`` (B strings). ``batch[i]`` is query i's HardResult."""

    __slots__ = ("ids", "scores", "values", "searched_with")

    def __init__(self, ids, scores, values, searched_with):
        self.ids = ids
        self.scores = scores
        self.values = values
        self.searched_with = searched_with

    @classmethod
    def from_results(cls, results, value_dim: int) -> "HardBatchResult":
        """Stacks single answers into one batch."""
        values = np.stack([r.value for r in results]) if results else np.empty((0, value_dim), dtype=np.float32)
        return cls(np.array([r.id for r in results], dtype=np.uint64), np.array([r.score for r in results], dtype=np.float32),
                   values, tuple(r.searched_with for r in results))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> HardResult:
        return HardResult(int(self.ids[i]), float(self.scores[i]), self.values[i], self.searched_with[i])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"HardBatchResult(B={len(self)}, ids={self.ids!r}, scores={self.scores!r})"


__all__ = ["Contributors", "SoftResult", "HardResult", "SoftBatchResult", "HardBatchResult"]
