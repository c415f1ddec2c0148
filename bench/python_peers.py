"""The Python peers of softkv_bench: numpy and PyTorch doing softmax(q K^T s) V and argmax, same sizes.

Usage: python_peers.py [--n 1000000] [--d 128] [--dv 128] [--batch 64] [--reps 5]
Prints one line per measurement; bench/run_bench.py puts them into RESULTS.md next to softkv_bench's.
"""
import argparse
import time

import numpy as np


def median_ms(reps, fn):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--dv", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    rng = np.random.default_rng(1)
    K = rng.uniform(-1, 1, (a.n, a.d)).astype(np.float32)
    V = rng.uniform(-1, 1, (a.n, a.dv)).astype(np.float32)
    Q = rng.uniform(-1, 1, (a.batch, a.d)).astype(np.float32)
    q = Q[0]
    s = np.float32(1.0 / np.sqrt(a.d))
    gib = a.n * (a.d + a.dv) * 4 / 2**30
    print(f"python peers, N = {a.n}, d = {a.d}, dv = {a.dv} ({gib:.2f} GiB per soft query), median of {a.reps}")

    def np_soft():
        z = (K @ q) * s
        w = np.exp(z - z.max())
        return (w / w.sum()) @ V

    def np_soft_batch():
        z = (Q @ K.T) * s
        w = np.exp(z - z.max(axis=1, keepdims=True))
        return (w / w.sum(axis=1, keepdims=True)) @ V

    print(f"numpy soft 1 query: {median_ms(a.reps, np_soft):.2f} ms")
    print(f"numpy soft batch of {a.batch}: {median_ms(max(1, a.reps // 2), np_soft_batch):.2f} ms")
    print(f"numpy hard 1 query (argmax): {median_ms(a.reps, lambda: int(np.argmax(K @ q))):.2f} ms")
    try:
        import torch
    except ImportError:
        print("torch: not installed (apt install python3-torch)")
        return
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tK, tV, tQ = torch.from_numpy(K), torch.from_numpy(V), torch.from_numpy(Q)
    tq = tQ[0]
    with torch.no_grad():
        print(f"torch soft 1 query: {median_ms(a.reps, lambda: torch.softmax((tK @ tq) * s, 0) @ tV):.2f} ms")
        print(f"torch soft batch of {a.batch}: {median_ms(max(1, a.reps // 2), lambda: torch.softmax((tQ @ tK.T) * s, 1) @ tV):.2f} ms")
        print(f"torch hard 1 query (argmax): {median_ms(a.reps, lambda: int(torch.argmax(tK @ tq))):.2f} ms")


if __name__ == "__main__":
    main()
