#!/usr/bin/env python3
"""The middle of an estimated soft answer: centroid-only (as RetroInfer estimates it) against sampling.

An error_target query over inverted lists scores a head of lists exactly and estimates the rest. Two ways to
estimate the rest are compared here on the same lists, the same head and the same queries, against a float64
reference:

- centroid: every list c not in the head counts as n_c rows scoring q.mu_c, holding the list's mean value
  (Z_c ~ n_c e^{s(q.mu_c)}, V_c ~ Z_c vbar_c): no row read, biased (e^{E s} < E e^s).
- lists by mass: whole lists drawn independently with probability proportional to n_c e^{s(q.mu_c)}
  (capped at 1), Horvitz-Thompson totals: unbiased; reads the drawn lists' rows.
- rows: rows of the rest drawn uniformly, Horvitz-Thompson totals: unbiased.
- oracle head: the query's best rows by true score as the head (what no index knows without scoring every
  row), the rest drawn uniformly: the best a head-plus-sample design reaches with these rows; also at 10%
  of the rows in all.

The sampled estimators read `--budget` of the rows beyond the head. The error of an answer is
max_j |v_j - v_exact_j| / max_i ||v_i||_inf (the error_target's measure). docs/PRUNING.md, "Estimated answers",
cites the result. Needs numpy and faiss (python3-faiss), both in `make bench`'s packages.

    python3 bench/centroid_estimate.py [--n 200000] [--queries 40]
"""
import argparse
import gzip
import os
import platform
import sys
import time

import numpy as np

try:
    import faiss
except ImportError:  # pragma: no cover - the bench's packages include it
    sys.exit("centroid_estimate.py needs python3-faiss (make bench installs it)")


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


class Report:
    """Standard output, and also the file at `path` when one is given (a results file beside the console)."""

    def __init__(self, path=None):
        self.outs = [sys.stdout] + ([open(path, "w")] if path else [])

    def write(self, s):
        for o in self.outs:
            o.write(s)

    def flush(self):
        for o in self.outs:
            o.flush()


def sized_args(doc, queries):
    """The options these Python benches share: --n, --d, --queries and --out (a results file)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--n", type=int, default=200000)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--queries", type=int, default=queries)
    ap.add_argument("--out", default=None, help="also write the report to this file")
    return ap


def gaussian(n, d, nq, rng):
    return "Gaussian keys, values and queries, T = 1", rng.standard_normal((n, d), dtype=np.float32), \
        rng.standard_normal((n, d), dtype=np.float32), rng.standard_normal((nq, d), dtype=np.float32), 1.0


def gaussian_self(n, d, nq, rng):
    keys = rng.standard_normal((n, d), dtype=np.float32)
    return "Gaussian keys and queries, values = keys (the blend follows the query), T = 1", keys, keys, \
        rng.standard_normal((nq, d), dtype=np.float32), 1.0


def clustered_ood(n, d, nq, rng):
    centres = rng.standard_normal((n // 20, d), dtype=np.float32) * 3
    keys = centres[np.arange(n) * 7 % len(centres)] + rng.standard_normal((n, d), dtype=np.float32) * 0.3
    a, c = rng.integers(0, n, nq), rng.integers(0, n, nq)
    queries = 0.5 * (keys[a] + keys[c]) + rng.standard_normal((nq, d), dtype=np.float32) * 2.0
    return "clustered keys (clusters of 20), out-of-distribution queries, T = 0.1", keys, \
        rng.standard_normal((n, d), dtype=np.float32), queries.astype(np.float32), 0.1


def fashion_mnist(nq):
    root = "/usr/share/datasets/fashion-mnist"

    def idx(name, offset):
        with gzip.open(os.path.join(root, name)) as f:
            return np.frombuffer(f.read(), dtype=np.uint8, offset=offset)

    try:
        train = idx("train-images-idx3-ubyte.gz", 16).reshape(-1, 784).astype(np.float32)
        labels = idx("train-labels-idx1-ubyte.gz", 8)
        test = idx("t10k-images-idx3-ubyte.gz", 16).reshape(-1, 784).astype(np.float32)
    except OSError:
        return None
    keys = train / np.maximum(np.linalg.norm(train, axis=1, keepdims=True), 1e-30)
    values = np.eye(10, dtype=np.float32)[labels]
    q = test[np.arange(nq) * 97 % len(test)].copy()
    q[:, 392:] = 0
    q /= np.maximum(np.linalg.norm(q, axis=1, keepdims=True), 1e-30)
    return "Fashion-MNIST, half-blanked test images, T = 0.002", keys, values, q, 0.002


def measure(name, keys, values, queries, temperature, budget, head_share, rng, out):
    n, d = keys.shape
    lists = max(1, n // 32)
    t0 = time.time()
    km = faiss.Kmeans(d, lists, niter=10, seed=1, verbose=False, max_points_per_centroid=n)
    km.train(keys)
    _, assign = km.index.search(keys, 1)
    assign = assign.ravel()
    order = np.argsort(assign, kind="stable")
    starts = np.searchsorted(assign[order], np.arange(lists + 1))
    sizes = np.diff(starts)
    centroids = km.centroids
    vbar = np.zeros((lists, values.shape[1]))
    np.add.at(vbar, assign, values.astype(np.float64))
    vbar /= np.maximum(sizes, 1)[:, None]
    vmax = np.abs(values).max()
    scale = 1.0 / (np.sqrt(d) * temperature)
    print(f" {name}: N = {n}, d = {d}, {lists} lists (k-means {time.time() - t0:.0f} s)", file=out)
    errors = {"centroid": [], "lists by mass": [], "rows": []}
    read = {"centroid": [], "lists by mass": [], "rows": []}
    for q in queries:
        s = scale * (keys.astype(np.float64) @ q.astype(np.float64))
        m = s.max()
        w = np.exp(s - m)
        exact = (w @ values) / w.sum()
        cs = scale * (centroids.astype(np.float64) @ q.astype(np.float64))
        # The head: lists by decreasing centroid score until head_share of the rows.
        by = np.argsort(-cs)
        head_lists = by[: np.searchsorted(np.cumsum(sizes[by]), head_share * n) + 1]
        in_head = np.zeros(lists, bool)
        in_head[head_lists] = True
        head_rows = in_head[assign]
        z_head, v_head = w[head_rows].sum(), w[head_rows] @ values[head_rows]
        rest = ~in_head & (sizes > 0)

        def answer(z, v):
            return np.abs((v_head + v) / (z_head + z) - exact).max() / vmax

        # centroid-only
        zc = sizes[rest] * np.exp(cs[rest] - m)
        errors["centroid"].append(answer(zc.sum(), zc @ vbar[rest]))
        read["centroid"].append(head_rows.sum())
        # whole lists drawn by their centroid mass, capped at 1, Poisson sampling at the row budget
        rows_budget = budget * n
        mass = sizes * np.exp(cs - cs.max())
        mass[~rest] = 0
        lo, hi = 0.0, 1e30
        for _ in range(100):  # lambda: sum of min(1, lambda mass) sizes = rows_budget
            lam = np.sqrt(lo * hi) if lo > 0 else hi / 1e6 if hi < 1e30 else 1.0
            got = (np.minimum(1, lam * mass) * sizes).sum()
            if got > rows_budget:
                hi = lam
            else:
                lo = lam
            if hi < 1e30 and lo > 0 and hi / lo < 1.001:
                break
            if lo == 0 and hi == 1e30:
                lo = 1.0
        pi = np.minimum(1, lo * mass)
        drawn = rng.random(lists) < pi
        z = v = 0.0
        rows_read = head_rows.sum()
        for c in np.nonzero(drawn & rest)[0]:
            members = order[starts[c]:starts[c + 1]]
            z = z + w[members].sum() / pi[c]
            v = v + (w[members] @ values[members]) / pi[c]
            rows_read += len(members)
        errors["lists by mass"].append(answer(z, v))
        read["lists by mass"].append(rows_read)
        # rows drawn uniformly from the rest
        rest_rows = np.nonzero(~head_rows)[0]
        take = min(len(rest_rows), int(rows_budget))
        pick = rng.choice(rest_rows, take, replace=False)
        f = len(rest_rows) / take
        errors["rows"].append(answer(w[pick].sum() * f, (w[pick] @ values[pick]) * f))
        read["rows"].append(head_rows.sum() + take)
        # An oracle's head: the query's best rows by their true scores (no index can know them without
        # scoring every row), the rest drawn uniformly: what a head-plus-sample design could reach at
        # best with these rows, at the same budget and at 10% of the rows in all.
        best_first = np.argsort(-s, kind="stable")
        for label, total in (("oracle head", head_share + budget), ("oracle, 10%", 0.10)):
            h = int(head_share * n)
            head_idx, rest_idx = best_first[:h], best_first[h:]
            take = min(len(rest_idx), int((total - head_share) * n))
            pick = rng.choice(rest_idx, take, replace=False)
            f = len(rest_idx) / take
            zo = w[head_idx].sum() + w[pick].sum() * f
            vo = w[head_idx] @ values[head_idx] + (w[pick] @ values[pick]) * f
            errors.setdefault(label, []).append(np.abs(vo / zo - exact).max() / vmax)
            read.setdefault(label, []).append(h + take)
    for k in errors:
        e = np.array(errors[k])
        print(f"   {k:14s} rows read {np.mean(read[k]) / n * 100:6.2f}%   error median {np.median(e):.2e}   "
              f"p95 {np.percentile(e, 95):.2e}   max {e.max():.2e}", file=out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200000)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--queries", type=int, default=40)
    ap.add_argument("--budget", type=float, default=0.015, help="share of the rows the sampled estimators read beyond the head")
    ap.add_argument("--head", type=float, default=0.005, help="share of the rows in the head (lists by centroid score)")
    args = ap.parse_args()
    rng = np.random.default_rng(7)
    out = sys.stdout
    print(f"centroid-only vs sampled middle estimates; {cpu_name()}, {os.cpu_count()} CPUs; head {args.head:.1%} of the rows, "
          f"samples {args.budget:.1%} more", file=out)
    regimes = [gaussian(args.n, args.d, args.queries, rng), gaussian_self(args.n, args.d, args.queries, rng),
               clustered_ood(args.n, args.d, args.queries, rng)]
    fm = fashion_mnist(args.queries)
    if fm is not None:
        regimes.append(fm)
    else:
        print(" (Fashion-MNIST skipped: /usr/share/datasets/fashion-mnist not found)", file=out)
    for name, keys, values, queries, t in regimes:
        measure(name, keys, values, queries, t, args.budget, args.head, rng, out)


if __name__ == "__main__":
    main()
