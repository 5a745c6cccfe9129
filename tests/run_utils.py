"""Launch a trainer under real torchrun (gloo) and read back its per-step metrics; the layouts,
arguments and reference runs the trainer tests share."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port

# The shipped arithmetic env the PPO runs train against.
ANSWER_MATCH = str(Path(__file__).resolve().parents[1] / "envs" / "answer_match.py")
# An env whose reward varies between samples of any model (even an untrained one), so every
# step has advantages and the policy moves; write it to a file for actor.rollout.env_path.
LENGTH_ENV = '''
async def step(state, action, extra_info):
    return {"next_state": None, "reward": float(len(action) % 3 == 0), "done": True}
'''
# A task an untrained tiny model learns in a few PPO steps (reward 1 when the response's first
# word has 3 letters; ~10% of random samples do): a reward rise that does not need a warm start.
FIRST_WORD_ENV = '''
async def step(state, action, extra_info):
    words = action.split()
    return {"next_state": None, "reward": float(bool(words) and len(words[0]) == 3), "done": True}
'''


def min_version(traj: dict) -> int:
    """The oldest weight version that generated any token of a dumped trajectory."""
    return min(v for turn in traj["turns"] for v, _ in turn["versions"])


def run_trainer(trainer: str, nproc: int, overrides: list[str], run_dir, timeout: float = 600,
                extra_env: dict | None = None, check: bool = True,
                crash_after_step: int | None = None,
                crash_after_log_step: int | None = None,
                sigkill_in_update: int | None = None) -> subprocess.CompletedProcess:
    """`crash_after_step=N`: the run dies (like a killed job) right after saving step N's
    checkpoint (tests/crash_entry.py); set trainer.save_freq so that step N is saved.
    `crash_after_log_step=N`: it dies right after logging step N (not checkpointed).
    `sigkill_in_update=N`: every rank SIGKILLs itself as its N-th PPO actor update starts."""
    entry = [f"RL2.trainer.{trainer}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
    env.update(extra_env or {})
    if crash_after_step is not None:
        entry = ["tests.crash_entry", trainer]
        env["RL2_TEST_CRASH_AFTER_STEP"] = str(crash_after_step)
    if crash_after_log_step is not None:
        entry = ["tests.crash_entry", trainer]
        env["RL2_TEST_CRASH_AFTER_LOG_STEP"] = str(crash_after_log_step)
    if sigkill_in_update is not None:
        entry = ["tests.crash_entry", trainer]
        env["RL2_TEST_SIGKILL_IN_UPDATE"] = str(sigkill_in_update)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           # torchrun's own log directory in the run's (else a torchelastic_* left in /tmp per run)
           f"--log-dir={os.path.join(run_dir, 'torchrun')}", "-m", *entry,
           f"trainer.save_dir={run_dir}", "trainer.experiment_name=run", "trainer.device=cpu",
           *overrides]
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


# The parallel layouts the tests run, in one table: name -> (processes, worker keys). Each test
# gives every layout it runs a per-device token budget (its sequence lengths decide how many
# micro-batches a budget makes).
LAYOUTS = {
    "serial": (1, {}),
    "fsdp2": (2, {}),
    "sp2": (2, {"sp_size": 2}),
    "tp2": (2, {"tp_size": 2}),
    "fsdp4": (4, {}),
    "ddp2xfsdp2": (4, {"ddp_size": 2}),
    "dp2xsp2": (4, {"sp_size": 2}),
    "tp2xfsdp2": (4, {"tp_size": 2}),
    "tp2xsp2": (4, {"tp_size": 2, "sp_size": 2}),
    "ddp2xtp2": (4, {"ddp_size": 2, "tp_size": 2}),
}


def layout(name: str, budget: int | None = None, worker: str = "actor") -> tuple[int, list[str]]:
    """(processes, `worker`.* overrides) of layout `name`, with max_length_per_device=budget
    unless budget is None."""
    nproc, keys = LAYOUTS[name]
    if budget is not None:
        keys = {**keys, "max_length_per_device": budget}
    return nproc, [f"{worker}.{k}={v}" for k, v in keys.items()]


def sft_args(assets, *extra):
    return [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/sft_train.jsonl",
            f"data.test.path={assets['data']}/sft_test.jsonl", "data.train.batch_size=16",
            "actor.lr=1e-3", "trainer.total_steps=3", *extra]


SFT_COEF = 0.1  # dpo_args' actor.sft_coef


def dpo_args(assets, *extra):
    return [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/pref_train.jsonl",
            f"data.test.path={assets['data']}/pref_test.jsonl", "data.train.batch_size=16",
            "data.test.batch_size=8", "actor.lr=1e-3", "actor.beta=0.5", f"actor.sft_coef={SFT_COEF}",
            "trainer.total_steps=3", *extra]


PPO_REQUIRED = ["actor.model_name=m", "data.train.path=d", "actor.rollout.env_path=e"]


def cfg_with(*overrides):
    """The PPO config with placeholder required keys and `overrides` (config checks, no run)."""
    from RL2.utils.config import load_config

    return load_config("ppo", PPO_REQUIRED + list(overrides))


def hf_test_loss(model_dir, data_dir) -> float:
    """Token-mean NLL of the SFT test split under plain HF (no packing, eager attention): the
    reference an exported model's logged test loss must reproduce."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from RL2.data.formats import tokenize_sft
    from RL2.data.io import load_rows

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(model_dir)
    total, n = 0.0, 0
    for i, row in enumerate(load_rows(f"{data_dir}/sft_test.jsonl")):
        s = tokenize_sft(row, tok, max_length=1024, row_index=i, source="test")
        with torch.no_grad():
            logits = model(input_ids=s["input_ids"][None]).logits[0]
        logps = logits.log_softmax(-1).gather(-1, s["labels"][:, None])[:, 0]
        total -= (logps * s["action_mask"]).sum().item()
        n += s["action_mask"].sum().item()
    return total / n


def serial_runs(trainer, make_args, assets, tmp_path_factory):
    """serial(dtype) -> run dir of the 1-process reference run (one micro-batch per step), each
    dtype run once."""
    runs = {}

    def get(dtype):
        if dtype not in runs:
            d = tmp_path_factory.mktemp(f"{trainer}_serial_{dtype}")
            run_trainer(trainer, 1, make_args(assets, f"actor.dtype={dtype}", "actor.max_length_per_device=4096"), d)
            runs[dtype] = d
        return runs[dtype]
    return get


def shared_pairs(assets, trainer: str, args: list[str], n: int = 8):
    """The first n training pairs tokenized for `trainer` ("dpo" or "rm"), and their samples as
    flatten_pairs(share_prompt=True) lays them out (chosen, rejected tail; groups checked)."""
    from RL2.data.io import load_rows
    from RL2.data.pairs import flatten_pairs, pair_tokenizer
    from RL2.utils.config import load_config

    cfg = load_config(trainer, args)
    tokenize = pair_tokenizer(cfg.data.train, assets["tokenizer"], for_reward_model=trainer == "rm")
    rows = load_rows(f"{assets['data']}/pref_train.jsonl")
    pairs = [tokenize(rows[i], i, "pref_train") for i in range(n)]
    samples, groups = flatten_pairs(pairs, share_prompt=True)
    assert groups == [[2 * i, 2 * i + 1] for i in range(n)]
    return cfg, pairs, samples


def write_rows(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def bad_rows_file(assets, tmp_path) -> str:
    """20 preference rows; row 3 lacks 'rejected', row 7 has rejected == chosen."""
    with open(f"{assets['data']}/pref_train.jsonl") as f:
        rows = [json.loads(line) for line in f][:20]
    del rows[3]["rejected"]                     # row 3: missing key
    rows[7]["rejected"] = rows[7]["chosen"]     # row 7: identical sides
    path = tmp_path / "bad.jsonl"
    write_rows(path, rows)
    return str(path)


def biased_warm_start(root, tokenizer, **shape) -> dict:
    """A tiny Qwen2 (`shape`: build_tiny_model's hidden/layers/heads/kv_heads) SFT'd 256 steps on
    answers with a systematic mistake (sft_biased: a+b+1 more frequent than a+b), so sampling is
    right ~30% of the time and RL must move the mode. The PPO e2e tests' warm start."""
    from RL2.tools.make_assets import build_tiny_model, write_datasets

    build_tiny_model(str(root / "model"), tokenizer, "qwen2", **shape)
    write_datasets(str(root / "data"), n_train=1024, n_test=64)
    run_trainer("sft", 1, [f"actor.model_name={root / 'model'}",
                           f"data.train.path={root / 'data' / 'sft_biased_train.jsonl'}",
                           "data.train.batch_size=32", "actor.lr=3e-3", "actor.scheduler=cosine",
                           "trainer.n_epochs=8"], root / "sft")
    return {"model": str(root / "sft" / "run" / "final"), "data": root / "data"}


def fixed_batch(vocab: int, n: int = 12, seed: int = 0) -> list[dict]:
    """Sequences with a prompt, 1-2 action turns separated by environment tokens, and per-token
    advantages / old / ref / engine log-probs / values / returns drawn around the tiny model's
    actual scale (log-probs ~ -log(vocab)) so that both clips and the TIS cap are active."""
    import torch

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = int(torch.randint(10, 34, (1,), generator=g))
        ids = torch.randint(0, vocab, (length + 1,), generator=g)
        mask = torch.zeros(length)
        p = length // 3
        mask[p:] = 1.0
        if i % 3 == 0:  # a second turn: environment tokens in between
            mask[p + 3:p + 6] = 0.0
        noise = lambda scale: scale * torch.randn(length, generator=g)  # noqa: E731
        old = -math.log(vocab) + noise(0.3)
        samples.append({
            "input_ids": ids[:-1], "labels": ids[1:], "action_mask": mask,
            "advantages": noise(1.0) * mask, "old_logps": old, "ref_logps": old + noise(0.2),
            "engine_logps": old + noise(0.5), "values": noise(0.5), "returns": noise(1.0),
        })
    return samples
