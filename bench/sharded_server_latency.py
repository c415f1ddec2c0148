"""Latency of one server against `mpirun -np P softkv-server` on the same data, through the Python client.

Usage: PYTHONPATH=BUILD/python sharded_server_latency.py --server BUILD/server/softkv-server [--ranks 2] [--n 100000]
Prints the median wall time of single soft queries, batches of 64 and an add of 64 rows, for each.
"""

import argparse
import os
import signal
import socket
import subprocess
import tempfile
import time

import numpy as np

import softkv


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd):
    port = free_port()
    proc = subprocess.Popen(cmd + ["--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    for _ in range(1200):
        try:
            return proc, softkv.Client(port=port)
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("server did not start")


def median_ms(f, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--n", type=int, default=100000)
    p.add_argument("--d", type=int, default=128)
    a = p.parse_args()
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((a.n, a.d), dtype=np.float32)
    values = rng.standard_normal((a.n, a.d), dtype=np.float32)
    q = rng.standard_normal(a.d, dtype=np.float32)
    qb = rng.standard_normal((64, a.d), dtype=np.float32)
    with tempfile.TemporaryDirectory() as work:
        for label, cmd in (("single", [a.server]),
                           (f"sharded np{a.ranks}", ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                                                     "-np", str(a.ranks), a.server])):
            proc, c = start(cmd + ["--data", os.path.join(work, label.replace(" ", "_"))])
            try:
                c.create_collection("c", a.d, a.d)
                for i in range(0, a.n, 20000):
                    c.add("c", keys[i:i + 20000], values[i:i + 20000])
                c.query_soft("c", q)  # warm
                one = median_ms(lambda: c.query_soft("c", q), 50)
                batch = median_ms(lambda: c.query_soft_batch("c", qb), 10)
                add = median_ms(lambda: c.add("c", keys[:64], values[:64]), 20)
                print(f"{label:12s} N={a.n} d=dv={a.d}: soft one {one:.2f} ms, soft batch-64 {batch:.2f} ms, add 64 rows {add:.2f} ms")
            finally:
                c.close()
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


if __name__ == "__main__":
    main()
