"""Launch a trainer under real torchrun (gloo) and read back its per-step metrics."""
import json
import math
import os
import subprocess
import sys

import pytest

from tests.dist_utils import free_port


def run_trainer(trainer: str, nproc: int, overrides: list[str], run_dir, timeout: float = 600,
                extra_env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", f"RL2.trainer.{trainer}",
           f"trainer.save_dir={run_dir}", "trainer.experiment_name=run", "trainer.device=cpu",
           *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
    env.update(extra_env or {})
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "run", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_rows(run_dir, key: str) -> list[float]:
    return [r[key] for r in read_metrics(run_dir) if key in r]


def assert_close(a, b, rtol, what, atol=0.0):
    """Per-step metric lists are equal within rtol (and atol) — the parallel == serial check."""
    assert len(a) == len(b), (what, a, b)
    for x, y in zip(a, b):
        assert math.isclose(x, y, rel_tol=rtol, abs_tol=atol), f"{what}: {a} vs {b}"


def parallel_cases(layouts) -> list:
    """(layout, dtype, rtol) cases of a parallel == serial test: float64 over every layout (tight:
    catches real bugs), float32 on one 2-rank (fast set) and one 4-rank layout (slow)."""
    slow = [("ddp2xfsdp2", "float32", 1e-5)] + [(name, "float64", 1e-9) for name in layouts]
    return [pytest.param("fsdp2", "float32", 1e-5, id="fsdp2-float32")] + [
        pytest.param(name, dtype, rtol, id=f"{name}-{dtype}", marks=pytest.mark.slow)
        for name, dtype, rtol in slow]
