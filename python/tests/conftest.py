"""Shared fixtures of the softkv Python module's tests: data, float64 references, every kernel path."""

import numpy as np
import pytest

import softkv


@pytest.fixture(params=softkv.available_simd_paths())
def kernel_path(request):
    """Runs a test once per kernel path this CPU has (scalar, sse2, avx2, avx512), then restores the widest."""
    softkv.force_simd_path(request.param)
    yield request.param
    softkv.force_simd_path(softkv.available_simd_paths()[-1])


def reference_soft(keys, values, query, scale, candidates=None):
    """softmax(scale * K q) V in float64 over the candidate rows (all by default): (value, lse, max, scores)."""
    k, v, q = keys.astype(np.float64), values.astype(np.float64), query.astype(np.float64)
    s = scale * (k @ q)
    c = np.arange(len(s)) if candidates is None else np.asarray(candidates)
    m = s[c].max()
    w = np.exp(s[c] - m)
    lse = m + np.log(w.sum())
    return (w / w.sum()) @ v[c], lse, m, s


def unit_rows(a):
    a = a.astype(np.float64)
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


@pytest.fixture
def data():
    rng = np.random.default_rng(2026)
    n, d, dv = 1500, 24, 7
    keys = rng.standard_normal((n, d)).astype(np.float32)
    values = rng.standard_normal((n, dv)).astype(np.float32)
    queries = rng.standard_normal((9, d)).astype(np.float32)
    return keys, values, queries
