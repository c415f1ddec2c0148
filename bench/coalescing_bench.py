"""Coalesced queries under load: softkv-server with --coalesce on and off, side by side in one run.

For each N (default 300,000 and 1,000,000; d = dv = 128) a collection is loaded once; then two load
generators keep 1, 4, 16, 32 and 64 connections busy with single soft queries (each connection its
own query, closed loop), for each setting: the C++ load_gen, and the Python client (softkv.Client, one
thread per connection: a CPU-hungry client on the server's cores, as a Python application is). Hard
queries at 1 and 64 connections with load_gen. With coalescing on, the server's query_stats give the
queries per pass. Writes bench/results/COALESCING.md and coalescing.png.
Usage: coalescing_bench.py --build build [--n 300000,1000000] [--seconds 4] [--rounds 3]
"""
import argparse
from statistics import median
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from run_bench import free_port, wait_port, run

LINE = re.compile(r"([\d.]+) requests/s, p50 ([\d.]+) us, p99 ([\d.]+) us")
CONNECTIONS = (1, 4, 16, 32, 64)


def serve(build, data, port, coalesce):
    return subprocess.Popen([f"{build}/server/softkv-server", "--data", data, "--port", str(port), "--fsync", "never",
                             "--snapshot-after-mb", "0", "--coalesce", coalesce], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def load_gen(build, port, op, connections, seconds):
    out = run([f"{build}/bench/load_gen", "--port", str(port), "--op", op, "--connections", str(connections), "--seconds", str(seconds)])
    rate, p50, p99 = (float(x) for x in LINE.search(out).groups())
    return rate, p50 / 1e3, p99 / 1e3  # queries/s, ms, ms


def python_clients(softkv, port, connections, seconds, d=128):
    """Closed loop of `connections` threads, each with its own softkv.Client: queries/s, p50 ms, p99 ms."""
    import numpy as np
    latencies, stop = [], threading.Event()
    lock = threading.Lock()

    def client(seed):
        rng = np.random.default_rng(seed)
        c = softkv.Client("127.0.0.1", port)
        q = rng.standard_normal(d).astype(np.float32)
        mine = []
        while not stop.is_set():
            t0 = time.perf_counter()
            c.query_soft("load", q)
            mine.append(time.perf_counter() - t0)
        c.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(connections)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    latencies.sort()
    pick = lambda f: 1e3 * latencies[min(len(latencies) - 1, int(f * len(latencies)))]
    return len(latencies) / elapsed, pick(0.5), pick(0.99)


def passes(softkv, port, work):
    """Runs work() and returns the queries per pass the server's coalescer ran meanwhile."""
    c = softkv.Client("127.0.0.1", port)
    before = c.query_stats("load")
    result = work()
    after = c.query_stats("load")
    c.close()
    n, p = after["queries"] - before["queries"], after["passes"] - before["passes"]
    return result, (n / p if p else 0.0)


def measure_n(build, softkv, n, seconds, rounds):
    """Both servers run side by side (the idle one takes no CPU) and every measurement alternates between
    them, `rounds` times, with both servers started afresh for each round: a machine whose speed drifts (a
    shared VM) then weighs on both alike, and so does where each process's memory landed. Each
    figure is the round with the median rate; the case's on/off ratios, one per round (on and off measured
    back to back), are kept under the key ("ratios", client, op, connections)."""
    results = {}
    with tempfile.TemporaryDirectory() as root:
        dirs = {"on": os.path.join(root, "on"), "off": os.path.join(root, "off")}
        port = free_port()
        server = serve(build, dirs["on"], port, "on")
        try:
            wait_port(port, seconds=300)
            run([f"{build}/bench/load_gen", "--port", str(port), "--setup", "--n", str(n), "--d", "128", "--op", "ping",
                 "--connections", "1", "--seconds", "1"])
        finally:
            server.send_signal(signal.SIGINT)  # writes the snapshot both servers start from
            server.wait(timeout=300)
        shutil.copytree(dirs["on"], dirs["off"])
        cases = [("load_gen", "soft", c) for c in CONNECTIONS] + [("python", "soft", c) for c in CONNECTIONS] + \
                [("load_gen", "hard", c) for c in (1, 64)]
        for client, op, c in cases:
            for coalesce in ("on", "off"):
                results[(coalesce, client, op, c)] = []
        # Fresh server processes every round: where a process's memory landed (huge pages or not, which
        # NUMA node of the VM) moves its scan speed by a few percent for as long as it lives, and two
        # long-lived servers would carry that difference into every round of every case.
        for i in range(rounds):
            ports = {c: free_port() for c in ("on", "off")}
            servers = {c: serve(build, dirs[c], ports[c], c) for c in ("on", "off")}
            try:
                for c in ("on", "off"):
                    wait_port(ports[c], seconds=300)
                    load_gen(build, ports[c], "soft", 1, 2)  # warm the pages up before anything is timed
                for client, op, c in cases:
                    for coalesce in (("on", "off") if i % 2 == 0 else ("off", "on")):  # neither always goes first
                        p = ports[coalesce]
                        work = (lambda: load_gen(build, p, op, c, seconds)) if client == "load_gen" else \
                            (lambda: python_clients(softkv, p, c, seconds))
                        results[(coalesce, client, op, c)].append(passes(softkv, p, work))
            finally:
                for srv in servers.values():
                    srv.send_signal(signal.SIGINT)
                for srv in servers.values():
                    srv.wait(timeout=300)
        for client, op, c in cases:
            results[("ratios", client, op, c)] = [on[0][0] / off[0][0] for on, off in
                                                  zip(results[("on", client, op, c)], results[("off", client, op, c)])]
            for coalesce in ("on", "off"):
                runs = sorted(results[(coalesce, client, op, c)], key=lambda x: x[0][0])
                results[(coalesce, client, op, c)] = runs[len(runs) // 2]
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--n", default="300000,1000000", help="collection sizes, comma-separated")
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="alternating on/off measurements of each case (the median is kept)")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.abspath(a.build), "python"))
    import softkv
    sizes = [int(x) for x in a.n.split(",")]
    results = {n: measure_n(a.build, softkv, n, a.seconds, a.rounds) for n in sizes}
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown CPU")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    lines = [f"# Coalesced queries ({datetime.date.today()}, {cpu}, {os.cpu_count()} cores, kernel path {softkv.simd_path()})", "",
             "The latest run; runs kept from other CPU kinds are in [runs/](runs/) (bench/analysis.md compares them).", "",
             f"`bench/coalescing_bench.py --n {a.n} --seconds {a.seconds:g} --rounds {a.rounds}` (run by `make bench`): softkv-server "
             f"with `--coalesce on` and `off` side by side (each case measured on one, then the other, {a.rounds} times, both servers "
             "started afresh for each round; the round with the median rate kept), d = dv = 128, `--fsync never`; each connection sends its own single query as soon "
             "as its last is answered (closed loop), from the C++ `load_gen` or from the Python client (`softkv.Client`, one "
             "thread per connection, sharing the server's cores). \"per pass\": queries per coalesced pass (server "
             "`query_stats`). \"on / off\" is the median of the rounds' ratios (each round measures both back to back, "
             "on first in odd rounds, off first in even ones); \"rounds\" lists them. Coalescing counts as slower than off in a case only when it was slower in every "
             "round: with one connection both settings run the same code (a lone client is never held back), and "
             "their ratio then shows this machine's round-to-round noise.", ""]
    goals = []
    for n in sizes:
        r = results[n]
        lines += [f"## N = {n:,}", "",
                  "| client | query | connections | on: queries/s | p50 ms | p99 ms | per pass | off: queries/s | p50 ms | p99 ms | on / off | rounds |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for client, op, conns in (("load_gen", "soft", CONNECTIONS), ("python", "soft", CONNECTIONS), ("load_gen", "hard", (1, 64))):
            for c in conns:
                (on, per_pass), (off, _) = r[("on", client, op, c)], r[("off", client, op, c)]
                rounds = " ".join(f"{x:.2f}" for x in r[("ratios", client, op, c)])
                lines.append(f"| {client} | {op} | {c} | {on[0]:.1f} | {on[1]:.1f} | {on[2]:.1f} | {per_pass:.1f} | {off[0]:.1f} | "
                             f"{off[1]:.1f} | {off[2]:.1f} | {median(r[('ratios', client, op, c)]):.2f}x | {rounds} |")
        lines.append("")
        ratio = lambda client, c: median(r[("ratios", client, "soft", c)])
        worst = min((ratio(client, c), client, c) for client in ("load_gen", "python") for c in CONNECTIONS)
        lost = [(client, c) for client in ("load_gen", "python") for c in CONNECTIONS if max(r[("ratios", client, "soft", c)]) < 1.0]
        goals.append((f"N = {n:,}: coalescing never below off (every client, every connection count; below = slower in every round)",
                      not lost, f"lowest median {worst[0]:.2f}x ({worst[1]}, {worst[2]} connections)" +
                      (f"; slower in every round: {', '.join(f'{cl} at {c}' for cl, c in lost)}" if lost else "")))
        goals.append((f"N = {n:,}, load_gen, 32 connections: >= 5x off", ratio("load_gen", 32) >= 5, f"{ratio('load_gen', 32):.1f}x"))
        if n >= 1_000_000:
            s64 = r[("on", "load_gen", "soft", 64)][0]
            goals.append((f"N = {n:,}, 64 connections: >= 150 queries/s and p99 <= 0.5 s", s64[0] >= 150 and s64[2] <= 500,
                          f"{s64[0]:.1f}/s, p99 {s64[2]:.0f} ms"))
    lines += ["| goal | met | measured |", "|---|---|---|"] + [f"| {g} | {'yes' if ok else 'no'} | {m} |" for g, ok, m in goals]
    with open(os.path.join(out, "COALESCING.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for n in sizes:
            for client, style in (("load_gen", "-"), ("python", ":")):
                for coalesce, marker in (("on", "o"), ("off", "x")):
                    ax.plot(CONNECTIONS, [results[n][(coalesce, client, "soft", c)][0][0] for c in CONNECTIONS], style, marker=marker,
                            label=f"N={n:,} {client} {coalesce}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("connections")
        ax.set_ylabel("soft queries / s")
        ax.set_title("softkv-server, coalescing on and off, d = dv = 128")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "coalescing.png"), dpi=110)
    except ImportError:
        print("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
