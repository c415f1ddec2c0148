"""The README's TCP example (tests/python/readme_client_example.py) is shown verbatim in README.md and,
run against a live softkv-server, prints the answer a float64 reference gives.

Usage: PYTHONPATH=BUILD/python test_readme_client.py --server PATH/softkv-server
The server is started on a port it picks (--port 0); the example's one port number, 7878 (the port
`make run` listens on), is the only text replaced before it runs.
"""

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

import numpy as np

from server_process import start_server

ROOT = pathlib.Path(__file__).resolve().parents[2]


def reference(temperature):
    keys = np.array([[1, 0, 0], [0, 1, 0], [0.9, 0.1, 0]], dtype=np.float64)
    values = np.array([[1, 0], [0, 1], [0.5, 0.5]], dtype=np.float64)
    q = np.array([1, 0.2, 0], dtype=np.float64)
    s = keys @ q / (np.sqrt(3) * temperature)
    w = np.exp(s - s.max())
    w /= w.sum()
    best = int(np.argmax(s))
    return w @ values, best, values[best]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    args = parser.parse_args()
    example = (ROOT / "tests" / "python" / "readme_client_example.py").read_text()
    readme = (ROOT / "README.md").read_text()
    assert example in readme, "copy tests/python/readme_client_example.py into the README's server example block"
    assert example.count("7878") == 1, "the example names its port once"
    with tempfile.TemporaryDirectory() as w:
        proc, port = start_server([args.server, "--data", os.path.join(w, "data")], os.path.join(w, "server.log"))
        try:
            script = os.path.join(w, "example.py")
            pathlib.Path(script).write_text(example.replace("7878", str(port)))
            out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    soft, best, hard = reference(0.5)
    expected = f"soft {soft.astype(np.float32).round(3)}, hard {hard.astype(np.float32)} (id {best})"
    assert out.stdout.strip() == expected, (out.stdout, expected)
    print(out.stdout.strip())


if __name__ == "__main__":
    main()
