"""Start and kill engine servers (`python -m RL2.rollout.server`, the fake SGLang server) as real
processes."""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request


def start_server(model: str, log_path, *extra: str, timeout: float = 600.0):
    """(process, "127.0.0.1:port"): the server picks a free port and prints it when listening."""
    return _start(["RL2.rollout.server", "--model", model, "--host", "127.0.0.1", "--port", "0",
                   "--threads", "1", *extra], log_path, timeout)


def start_fake_sglang(model: str, log_path, *extra: str, timeout: float = 600.0):
    """The same for tests/fake_sglang_server.py (SGLang 0.5.23's routes over the torch engine)."""
    return _start(["tests.fake_sglang_server", "--model", model, "--port", "0", *extra], log_path, timeout)


def _start(module_args: list[str], log_path, timeout: float, env: dict | None = None):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", *module_args], stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"listening on http://([\d.]+:\d+)", open(log_path).read())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    kill(proc)
    raise AssertionError(f"{module_args[0]} did not start:\n{open(log_path).read()[-4000:]}")


def kill(proc, sig=signal.SIGKILL) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)


def prompts(tok) -> list[list[int]]:
    return [tok.encode(t) for t in ("What is 2 + 3?", "Hello there", "<|im_start|>user\n7 * 6")]


def run(loop, coros):
    async def go():
        return await asyncio.gather(*coros)
    return loop.run_until_complete(go())


def request(address, method, path, body=None, raw: bytes | None = None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://{address}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            text = resp.read()
            return resp.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
