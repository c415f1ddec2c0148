"""softkv from Python (the native module) next to numpy, PyTorch and FAISS-python, in one process.

Usage: PYTHONPATH=build/python python_module_bench.py [--n 1000000] [--d 128] [--dv 128] [--batch 64] [--reps 5]
Prints one line per measurement (bench/run_bench.py puts them into RESULTS.md):
- the module's per-call overhead at N = 1,000 (and on a 1-entry collection): a Python call against the
  same C++ call timed in C++;
- at N: softkv soft/hard, single and batch, then numpy (softmax(q K^T s) V, argmax), PyTorch and FAISS
  IndexFlatIP top-1 (hard) when importable. softkv runs first: BLAS and OpenMP worker threads of the
  baselines busy-wait after their work and would slow softkv's threads down (bench/analysis.md).
"""
import argparse
import time

import numpy as np

import softkv


def median_ms(reps, fn):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def per_call_us(fn, calls=3000):
    """Median time of one call in microseconds, each call timed alone (a mean would be ruled by the
    preemptions of a shared machine)."""
    for _ in range(200):
        fn()
    clock = time.perf_counter
    times = []
    for _ in range(calls):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def overhead(d, dv):
    """The module's cost per call: the median Python call minus the median C++ call on the same data
    (both timed per call, alternated five times); also on a 1-entry collection, the binding alone."""
    rng = np.random.default_rng(2)
    for n, dim, vdim in ((1000, d, dv), (1, 1, 1)):
        keys = rng.uniform(-1, 1, (n, dim)).astype(np.float32)
        values = rng.uniform(-1, 1, (n, vdim)).astype(np.float32)
        c = softkv.Collection(dim, vdim)
        c.add_batch(keys, values)
        q = keys[0].copy()
        for kind, call, hard in (("soft", lambda: c.query_soft(q), False), ("hard", lambda: c.query_hard(q), True)):
            py, native = [], []
            for _ in range(5):  # alternate, so drift on a shared machine hits both alike
                py.append(per_call_us(call))
                native.append(c._time_native(q, 3000, hard) * 1e6)
            p, nat = sorted(py)[2], sorted(native)[2]
            print(f"overhead {kind} N = {n}, d = {dim}: python {p:.2f} us, C++ {nat:.2f} us, overhead {p - nat:.2f} us per call")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    print(f"python module, N = {a.n}, d = {a.d}, dv = {a.dv}, batch {a.batch}, median of {a.reps}; kernel {softkv.simd_path()}")
    overhead(a.d, a.dv)

    rng = np.random.default_rng(1)
    K = rng.uniform(-1, 1, (a.n, a.d)).astype(np.float32)
    V = rng.uniform(-1, 1, (a.n, a.dv)).astype(np.float32)
    Q = rng.uniform(-1, 1, (a.batch, a.d)).astype(np.float32)
    q = Q[0].copy()
    s = np.float32(1.0 / np.sqrt(a.d))
    c = softkv.Collection(a.d, a.dv)
    c.add_batch(K, V)
    batch_reps = max(1, a.reps // 2)
    print(f"softkv soft 1 query: {median_ms(a.reps, lambda: c.query_soft(q)):.2f} ms")
    print(f"softkv soft batch of {a.batch}: {median_ms(batch_reps, lambda: c.query_soft_batch(Q)):.2f} ms")
    print(f"softkv hard 1 query: {median_ms(a.reps, lambda: c.query_hard(q)):.2f} ms")
    print(f"softkv hard batch of {a.batch}: {median_ms(batch_reps, lambda: c.query_hard_batch(Q)):.2f} ms")

    def np_soft():
        z = (K @ q) * s
        w = np.exp(z - z.max())
        return (w / w.sum()) @ V

    def np_soft_batch():
        z = (Q @ K.T) * s
        w = np.exp(z - z.max(axis=1, keepdims=True))
        return (w / w.sum(axis=1, keepdims=True)) @ V

    print(f"numpy soft 1 query: {median_ms(a.reps, np_soft):.2f} ms")
    print(f"numpy soft batch of {a.batch}: {median_ms(batch_reps, np_soft_batch):.2f} ms")
    print(f"numpy hard 1 query: {median_ms(a.reps, lambda: int(np.argmax(K @ q))):.2f} ms")
    print(f"numpy hard batch of {a.batch}: {median_ms(batch_reps, lambda: np.argmax(Q @ K.T, axis=1)):.2f} ms")
    try:
        import torch
    except ImportError:
        print("torch: not installed (apt install python3-torch)")
    else:
        tK, tV, tQ = torch.from_numpy(K), torch.from_numpy(V), torch.from_numpy(Q)
        tq = tQ[0]
        with torch.no_grad():
            print(f"torch soft 1 query: {median_ms(a.reps, lambda: torch.softmax((tK @ tq) * s, 0) @ tV):.2f} ms")
            print(f"torch soft batch of {a.batch}: {median_ms(batch_reps, lambda: torch.softmax((tQ @ tK.T) * s, 1) @ tV):.2f} ms")
            print(f"torch hard 1 query: {median_ms(a.reps, lambda: int(torch.argmax(tK @ tq))):.2f} ms")
            print(f"torch hard batch of {a.batch}: {median_ms(batch_reps, lambda: torch.argmax(tQ @ tK.T, 1)):.2f} ms")
    try:
        import faiss
    except ImportError:
        print("faiss: not installed (apt install python3-faiss)")
    else:
        index = faiss.IndexFlatIP(a.d)
        index.add(K)
        print(f"faiss hard 1 query: {median_ms(a.reps, lambda: index.search(Q[:1], 1)):.2f} ms")
        print(f"faiss hard batch of {a.batch}: {median_ms(batch_reps, lambda: index.search(Q, 1)):.2f} ms")


if __name__ == "__main__":
    main()
