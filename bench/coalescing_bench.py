"""Coalesced queries under load: softkv-server with --coalesce on and off, side by side in one run.

A 1M-entry collection (d = dv = 128) is loaded once; load_gen then keeps 1, 4, 16 and 64 connections
busy with single soft queries (each connection its own query, closed loop) for each setting, and hard
queries at 1 and 64 connections. Writes bench/results/COALESCING.md and coalescing.png.
Usage: coalescing_bench.py --build build [--n 1000000] [--seconds 6]
"""
import argparse
import datetime
import os
import re
import shutil
import signal
import subprocess
import tempfile

from run_bench import free_port, wait_port, run

LINE = re.compile(r"([\d.]+) requests/s, p50 ([\d.]+) us, p99 ([\d.]+) us")
CONNECTIONS = (1, 4, 16, 64)


def serve(build, data, port, coalesce):
    return subprocess.Popen([f"{build}/server/softkv-server", "--data", data, "--port", str(port), "--fsync", "never",
                             "--snapshot-after-mb", "0", "--coalesce", coalesce], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(build, port, op, connections, seconds):
    out = run([f"{build}/bench/load_gen", "--port", str(port), "--op", op, "--connections", str(connections), "--seconds", str(seconds)])
    return tuple(float(x) for x in LINE.search(out).groups())  # requests/s, p50 us, p99 us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--seconds", type=float, default=6)
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as data:
        for coalesce in ("on", "off"):
            port = free_port()
            server = serve(a.build, data, port, coalesce)
            try:
                wait_port(port, seconds=120)  # the second start loads the snapshot the first one wrote
                if coalesce == "on":
                    run([f"{a.build}/bench/load_gen", "--port", str(port), "--setup", "--n", str(a.n), "--d", "128", "--op", "ping",
                         "--connections", "1", "--seconds", "1"])
                    measure(a.build, port, "soft", 1, 2)  # warm the pages up before anything is timed
                for c in CONNECTIONS:
                    results[(coalesce, "soft", c)] = measure(a.build, port, "soft", c, a.seconds)
                for c in (1, 64):
                    results[(coalesce, "hard", c)] = measure(a.build, port, "hard", c, a.seconds)
            finally:
                server.send_signal(signal.SIGINT)  # writes the snapshot the "off" run starts from
                server.wait(timeout=300)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown CPU")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    lines = [f"# Coalesced queries ({datetime.date.today()}, {cpu}, {os.cpu_count()} cores)", "",
             f"`bench/coalescing_bench.py --n {a.n} --seconds {a.seconds:g}` (run by `make bench`): softkv-server with "
             "`--coalesce on` and `off`, N = {:,} entries, d = dv = 128, `--fsync never`; load_gen keeps each connection "
             "busy with its own single query (closed loop).".format(a.n), "",
             "| query | connections | on: queries/s | on: p50 ms | on: p99 ms | off: queries/s | off: p50 ms | off: p99 ms | on / off |",
             "|---|---|---|---|---|---|---|---|---|"]
    for op, conns in (("soft", CONNECTIONS), ("hard", (1, 64))):
        for c in conns:
            on, off = results[("on", op, c)], results[("off", op, c)]
            lines.append(f"| {op} | {c} | {on[0]:.1f} | {on[1] / 1e3:.1f} | {on[2] / 1e3:.1f} | {off[0]:.1f} | {off[1] / 1e3:.1f} | "
                         f"{off[2] / 1e3:.1f} | {on[0] / off[0]:.2f}x |")
    s64, s1, h64 = results[("on", "soft", 64)], results[("on", "soft", 1)], results[("on", "hard", 64)]
    goals = [("64 connections, soft: >= 150 queries/s with coalescing on", s64[0] >= 150, f"{s64[0]:.1f}/s"),
             ("64 connections, soft: >= 5x off", s64[0] >= 5 * results[("off", "soft", 64)][0],
              f"{s64[0] / results[('off', 'soft', 64)][0]:.1f}x"),
             ("64 connections, soft: p99 <= 0.5 s", s64[2] <= 0.5e6, f"{s64[2] / 1e3:.0f} ms"),
             ("1 connection: latency on within 5% of off", s1[1] <= 1.05 * results[("off", "soft", 1)][1],
              f"p50 {s1[1] / 1e3:.1f} vs {results[('off', 'soft', 1)][1] / 1e3:.1f} ms"),
             ("64 connections, hard: >= 5x off", h64[0] >= 5 * results[("off", "hard", 64)][0],
              f"{h64[0] / results[('off', 'hard', 64)][0]:.1f}x")]
    lines += ["", "| goal | met | measured |", "|---|---|---|"] + [f"| {g} | {'yes' if ok else 'no'} | {m} |" for g, ok, m in goals]
    with open(os.path.join(out, "COALESCING.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for coalesce in ("on", "off"):
            ax.plot(CONNECTIONS, [results[(coalesce, "soft", c)][0] for c in CONNECTIONS], marker="o", label=f"coalescing {coalesce}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("connections")
        ax.set_ylabel("soft queries / s")
        ax.set_title(f"softkv-server, N = {a.n:,}, d = dv = 128")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "coalescing.png"), dpi=110)
    except ImportError:
        print("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
