#!/usr/bin/env python3
"""softkv's certified IVF against FAISS's IndexIVFFlat, side by side (docs/PRUNING.md, "FAISS's IVF").

softkv replaced FAISS's IVF search by its own certified lists (exact top-k, guaranteed tail bound). This
measures whether FAISS's IVF still wins anywhere: on the same keys, values and queries, in one process, one
after the other (never at once: neither side's threads take the other's cores),

- softkv ivf: `top_k = 32` and `epsilon = 1e-3` (certified), and `exact=True` (the scan, the reference time);
- FAISS IndexIVFFlat (inner product, nlist = 4 sqrt(N), trained on the keys) at nprobe 1 to 256: its top 32,
  then the softmax over their scores and the blend of their values in numpy (what a user of FAISS would
  write; the time includes it).

Per query: time (median over queries), relative L2 error of the blended value against a float64 reference,
recall of the exact top 32. FAISS's answers carry no bound. Needs numpy, faiss and softkv's Python module
(PYTHONPATH=build/python).

    python3 bench/faiss_ivf_compare.py [--n 200000] [--queries 20] [--out bench/results/FAISS_IVF.txt]
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from centroid_estimate import Report, cpu_name, sized_args  # noqa: E402

try:
    import faiss
    import softkv
except ImportError as e:  # pragma: no cover
    sys.exit(f"faiss_ivf_compare.py needs python3-faiss and softkv's module (PYTHONPATH=build/python): {e}")


def regimes(n, d, nq, rng):
    centres = rng.standard_normal((n // 20, d), dtype=np.float32) * 3
    clustered = centres[np.arange(n) * 7 % len(centres)] + rng.standard_normal((n, d), dtype=np.float32) * 0.3
    uniform = rng.uniform(-1, 1, (n, d)).astype(np.float32)
    a, c = rng.integers(0, n, nq), rng.integers(0, n, nq)
    near = (clustered[a] + rng.standard_normal((nq, d), dtype=np.float32) * 0.1).astype(np.float32)
    ood = (0.5 * (clustered[a] + clustered[c]) + rng.standard_normal((nq, d), dtype=np.float32) * 2.0).astype(np.float32)
    gauss = rng.standard_normal((n, d), dtype=np.float32)
    yield "clustered keys, queries near keys, T = 0.1", clustered, uniform, near, 0.1
    yield "clustered keys, out-of-distribution queries, T = 0.1", clustered, uniform, ood, 0.1
    yield "Gaussian keys, values and queries, T = 1", gauss, rng.standard_normal((n, d), dtype=np.float32), \
        rng.standard_normal((nq, d), dtype=np.float32), 1.0


def reference(keys64, values64, q, scale):
    s = keys64 @ q.astype(np.float64) * scale
    w = np.exp(s - s.max())
    return (w @ values64) / w.sum(), set(np.argsort(-s, kind="stable")[:32].tolist())


def timed(f, reps=3):
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - t0)
    return best, out


def measure(name, keys, values, queries, temperature, out):
    n, d = keys.shape
    dv = values.shape[1]
    scale = 1.0 / (np.sqrt(d) * temperature)
    keys64, values64 = keys.astype(np.float64), values.astype(np.float64)
    refs = [reference(keys64, values64, q, scale) for q in queries]
    rows = []  # (method, times, errors, recalls, guaranteed)

    def rel(v, ref):
        return float(np.linalg.norm(v - ref) / max(np.linalg.norm(ref), 1e-300))

    t0 = time.time()
    c = softkv.Collection(d, dv, index="ivf")
    c.add_batch(keys, values)
    c.wait_until_indexed()
    built_softkv = time.time() - t0
    for label, kw in (("softkv exact scan", {"exact": True}), ("softkv ivf top_k 32", {"top_k": 32}),
                      ("softkv ivf epsilon 1e-3", {"epsilon": 1e-3})):
        times, errs, recalls, guaranteed = [], [], [], True
        for q, (ref, top) in zip(queries, refs):
            t, r = timed(lambda: c.query_soft(q, temperature=temperature, top_m=32, **kw))
            times.append(t)
            errs.append(rel(np.asarray(r.value, dtype=np.float64), ref))
            recalls.append(len(top & set(int(i) for i in r.top.ids[:32])) / 32)
            guaranteed = guaranteed and (r.tail_bound_guaranteed or label.endswith("scan"))
        rows.append((label, times, errs, recalls, "yes" if guaranteed else "no"))
    del c
    nlist = int(4 * np.sqrt(n))
    t0 = time.time()
    quantizer = faiss.IndexFlatIP(d)
    index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
    index.train(keys)
    index.add(keys)
    built_faiss = time.time() - t0
    for nprobe in (1, 4, 16, 64, 256):
        index.nprobe = nprobe
        times, errs, recalls = [], [], []
        for q, (ref, top) in zip(queries, refs):
            q2 = q.reshape(1, -1)

            def answer():
                dist, ids = index.search(q2, 32)
                ok = ids[0] >= 0
                s = dist[0][ok] * np.float32(scale)
                w = np.exp(s - s.max())
                return (w @ values[ids[0][ok]]) / w.sum(), ids[0][ok]

            t, (v, ids) = timed(answer)
            times.append(t)
            errs.append(rel(v.astype(np.float64), ref))
            recalls.append(len(top & set(ids.tolist())) / 32)
        rows.append((f"FAISS IVFFlat nprobe {nprobe}", times, errs, recalls, "no bound"))
    scan = np.median(rows[0][1])
    print(f"\n{name}: N = {n}, d = dv = {d}, {len(queries)} queries; built: softkv ivf {built_softkv:.0f} s, "
          f"FAISS IVFFlat (nlist {nlist}) {built_faiss:.0f} s", file=out)
    print(f"  {'method':<26} {'ms':>8} {'vs scan':>8} {'rel. L2 error median':>21} {'95th':>9} {'recall@32':>10} {'bound':>9}", file=out)
    for label, times, errs, recalls, bound in rows:
        ms = 1e3 * np.median(times)
        print(f"  {label:<26} {ms:8.3f} {scan / np.median(times):7.1f}x {np.median(errs):21.2e} {np.quantile(errs, 0.95):9.2e} "
              f"{np.mean(recalls):10.3f} {bound:>9}", file=out)
    out.flush()


def main():
    args = sized_args(__doc__, 20).parse_args()
    out = Report(args.out)
    print(f"softkv certified IVF against FAISS IndexIVFFlat; {cpu_name()}, {os.cpu_count()} CPUs, FAISS {faiss.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; times are the best of 3 calls per query, median over queries",
          file=out)
    for name, keys, values, queries, temperature in regimes(args.n, args.d, args.queries, np.random.default_rng(9)):
        measure(name, keys, values, queries, temperature, out)


if __name__ == "__main__":
    main()
