"""Start and kill RL2 engine servers (`python -m RL2.rollout.server`) as real processes."""
import os
import re
import signal
import subprocess
import sys
import time


def start_server(model: str, log_path, *extra: str, timeout: float = 600.0):
    """(process, "127.0.0.1:port"): the server picks a free port and prints it when listening."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "RL2.rollout.server", "--model", model,
                             "--host", "127.0.0.1", "--port", "0", "--threads", "1", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"listening on http://([\d.]+:\d+)", open(log_path).read())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    kill(proc)
    raise AssertionError(f"RL2 engine server did not start:\n{open(log_path).read()[-4000:]}")


def kill(proc, sig=signal.SIGKILL) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
