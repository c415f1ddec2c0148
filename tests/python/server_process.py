"""Starting a softkv-server (or an mpirun job of them) for a test, on a port the server picks itself.

Guessing a free port and passing it is racy: under ctest -j another test's server can take the port
first, and the test would then talk to that server. The server is started with --port 0 --port-file F
and writes the port it bound to F once it listens.
"""

import os
import signal
import subprocess
import tempfile
import time


def start_server(cmd, log_path, timeout=60.0):
    """Starts cmd (softkv-server or mpirun ... softkv-server, without --port) in its own session, so a
    whole mpirun job can be killed with os.killpg; returns (process, port) once it listens."""
    fd, port_file = tempfile.mkstemp(prefix="softkv-test-", suffix=".port")
    os.close(fd)
    os.unlink(port_file)  # the server creates it (by a rename) once it listens
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd + ["--port", "0", "--port-file", port_file], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                with open(port_file) as f:
                    return proc, int(f.read())
            except FileNotFoundError:
                pass
            if proc.poll() is not None:
                raise AssertionError(f"{cmd[0]} exited with {proc.returncode}: {open(log_path).read()}")
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        raise AssertionError(f"{cmd[0]} did not start listening: {open(log_path).read()}")
    finally:
        if os.path.exists(port_file):
            os.unlink(port_file)
