#!/usr/bin/env python3
"""Per-list bounds on q.k: centroid and radius against per-dimension boxes (docs/PRUNING.md, "Certified lists").

A certified walk visits lists in decreasing upper bound on their members' scores and stops once the bound on
everything unvisited is small enough. Two bounds are compared on the same k-means lists (N/32, FAISS) and the
same queries, in float64:

- ball: q.mu_c + ||q|| r_c (r_c the largest distance of a member from the centroid), softkv's bound: d
  numbers a list, one dot product a query;
- box: sum_j max(q_j lo_cj, q_j hi_cj) over the members' per-dimension minimum and maximum: 2d numbers a
  list, twice the work a query, tighter where a few dimensions carry most of the spread;
- min: the smaller of the two (3d numbers a list).

The lists here are plain k-means lists: softkv also splits lists much wider than most (list_store.hpp,
refine), which matters where clusters are smaller than a list (the clustered regimes: a list here spans
one or two clusters of 20, and both bounds are far above its rows). The comparison is between the bounds
of the same lists; the rows read are not softkv's (bench/results/PRUNING_REGIMES.txt has those).

For each regime it reports how far above its best member's score a list's bound is (nats, after the
temperature: median and 95th percentile over the lists, and over the lists holding the query's best 1% of
rows), and the rows an epsilon = 1e-3 walk reads with each bound (it stops when the unvisited lists' bounded
mass sum n_c e^{ub_c} is at most epsilon of the visited rows' mass), as a share of N. Needs numpy and faiss.

    python3 bench/list_bounds.py [--n 200000] [--queries 20] [--out bench/results/LIST_BOUNDS.txt]
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from centroid_estimate import Report, cpu_name, fashion_mnist, gaussian, sized_args  # noqa: E402

try:
    import faiss
except ImportError:  # pragma: no cover
    sys.exit("list_bounds.py needs python3-faiss (make bench installs it)")


def clustered(n, d, nq, rng, near):
    centres = rng.standard_normal((n // 20, d), dtype=np.float32) * 3
    keys = centres[np.arange(n) * 7 % len(centres)] + rng.standard_normal((n, d), dtype=np.float32) * 0.3
    a, c = rng.integers(0, n, nq), rng.integers(0, n, nq)
    if near:
        q = keys[a] + rng.standard_normal((nq, d), dtype=np.float32) * 0.1
        return "clustered keys (clusters of 20), queries near keys, T = 0.1", keys, None, q.astype(np.float32), 0.1
    q = 0.5 * (keys[a] + keys[c]) + rng.standard_normal((nq, d), dtype=np.float32) * 2.0
    return "clustered keys, out-of-distribution queries, T = 0.1", keys, None, q.astype(np.float32), 0.1


def heavy_tailed(n, d, nq, rng):
    keys = rng.standard_normal((n, d), dtype=np.float32) + 2.0
    keys[:, :3] *= 25.0
    return "heavy-tailed keys (offset 2, three channels x25), Gaussian queries, T = 1", keys, None, \
        rng.standard_normal((nq, d), dtype=np.float32), 1.0


def walk_rows(ub, log_mass, sizes, eps):
    """Rows an epsilon walk reads: lists by decreasing ub, stopping once sum_unvisited n e^ub <= eps visited mass.

    ub in nats; log_mass: the log of each list's true sum of e^s, what a walk knows of what it visited. In logs:
    bounds may lie hundreds of nats above every score.
    """
    order = np.argsort(-ub)
    log_bounded = np.log(sizes[order]) + ub[order]
    log_after = np.append(np.logaddexp.accumulate(log_bounded[::-1])[::-1][1:], -np.inf)  # lists after the i-th
    log_visited = np.logaddexp.accumulate(log_mass[order])
    i = int(np.argmax(log_after <= np.log(eps) + log_visited))  # the last is always true (nothing after it)
    return np.cumsum(sizes[order])[i]


def measure(name, keys, queries, temperature, out, eps=1e-3):
    n, d = keys.shape
    nlist = max(1, n // 32)
    t0 = time.time()
    km = faiss.Kmeans(d, nlist, niter=10, seed=1, max_points_per_centroid=64)
    km.train(keys)
    _, assign = km.index.search(keys, 1)
    assign = assign[:, 0]
    order = np.argsort(assign, kind="stable")
    k64 = keys[order].astype(np.float64)
    a_sorted = assign[order]
    starts = np.searchsorted(a_sorted, np.arange(nlist))
    sizes = np.bincount(assign, minlength=nlist).astype(np.float64)
    live = sizes > 0
    starts, sizes = starts[live], sizes[live]
    mu = np.add.reduceat(k64, starts, axis=0) / sizes[:, None]  # the members' mean, as softkv's lists keep it
    dist = np.linalg.norm(k64 - np.repeat(mu, sizes.astype(int), axis=0), axis=1)
    radius = np.maximum.reduceat(dist, starts)
    lo = np.minimum.reduceat(k64, starts, axis=0)
    hi = np.maximum.reduceat(k64, starts, axis=0)
    scale = 1.0 / (np.sqrt(d) * temperature)
    slack = {"ball": [], "box": [], "min": []}
    slack_top = {"ball": [], "box": [], "min": []}
    rows = {"ball": [], "box": [], "min": [], "best-first (an oracle's order and stop)": []}
    for q in queries.astype(np.float64):
        s = (k64 @ q) * scale
        best = np.maximum.reduceat(s, starts)
        shift = s.max()
        log_mass = np.log(np.add.reduceat(np.exp(s - shift), starts)) + shift
        ball = (mu @ q + np.linalg.norm(q) * radius) * scale
        box = np.maximum(lo * q, hi * q).sum(axis=1) * scale
        bounds = {"ball": ball, "box": box, "min": np.minimum(ball, box)}
        cut = np.quantile(s, 0.99)
        top = best >= cut  # lists holding one of the query's best 1% of rows
        for k, ub in bounds.items():
            slack[k].append(ub - best)
            slack_top[k].append((ub - best)[top])
            rows[k].append(walk_rows(ub, log_mass, sizes, eps) / n)
        # An oracle: lists in order of their best member, stopping on the unvisited lists' true mass.
        order = np.argsort(-best)
        log_after = np.append(np.logaddexp.accumulate(log_mass[order][::-1])[::-1][1:], -np.inf)
        i = int(np.argmax(log_after <= np.log(eps) + np.logaddexp.accumulate(log_mass[order])))
        rows["best-first (an oracle's order and stop)"].append(np.cumsum(sizes[order])[i] / n)
    print(f"\n{name}: N = {n}, d = {d}, {len(sizes)} lists, {len(queries)} queries (lists built in {time.time() - t0:.0f} s)", file=out)
    print(f"  {'bound':<8} {'nats above the best member: median':>36} {'95th':>7} {'top-1% lists median':>20} "
          f"{'epsilon 1e-3 walk: rows read (median)':>38} {'95th':>7}", file=out)
    for k in ("ball", "box", "min"):
        a, t = np.concatenate(slack[k]), np.concatenate(slack_top[k])
        r = np.array(rows[k])
        print(f"  {k:<8} {np.median(a):36.2f} {np.quantile(a, 0.95):7.2f} {np.median(t):20.2f} "
              f"{100 * np.median(r):37.2f}% {100 * np.quantile(r, 0.95):6.2f}%", file=out)
    r = np.array(rows["best-first (an oracle's order and stop)"])
    print(f"  (lists in order of their best member, stopping on their true masses: {100 * np.median(r):.2f}% / "
          f"{100 * np.quantile(r, 0.95):.2f}% of the rows)", file=out)
    out.flush()


def main():
    args = sized_args(__doc__, 20).parse_args()
    faiss.omp_set_num_threads(os.cpu_count() or 1)
    rng = np.random.default_rng(5)
    out = Report(args.out)
    print(f"list bounds: ball (centroid + radius) against boxes (per-dimension min / max); {cpu_name()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", file=out)
    regimes = [gaussian(args.n, args.d, args.queries, rng), clustered(args.n, args.d, args.queries, rng, True),
               clustered(args.n, args.d, args.queries, rng, False), heavy_tailed(args.n, args.d, args.queries, rng)]
    fm = fashion_mnist(args.queries)
    if fm is not None:
        regimes.append(fm)
    for name, keys, _, queries, temperature in regimes:
        measure(name, keys, queries, temperature, out)


if __name__ == "__main__":
    main()
