"""Reward-model trainer end to end under torchrun/gloo: parallel == serial (dp, HSDP, sp),
above-chance test accuracy, HF export reproduces the trainer's rewards, bad input. Also the
autograd-aware sp collectives it relies on."""
import math
import os

import pytest
import torch

from tests.dist_utils import run_dist
from tests.run_utils import (assert_close, bad_rows_file, layout, parallel_cases, read_metrics,
                             run_trainer, serial_runs, shared_pairs, train_rows)


def rm_args(assets, *extra):
    return [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/pref_train.jsonl",
            f"data.test.path={assets['data']}/pref_test.jsonl", "data.train.batch_size=16",
            "data.test.batch_size=8", "actor.lr=1e-3", "trainer.total_steps=3", *extra]


# ----------------------------------------------------------------- collectives (2 gloo ranks)

def _sp_sum_grad(rank, world_size):
    from RL2.parallel.collectives import segment_sum, sequence_sums

    # Two sequences of local lengths 2 and 3 on each rank; rank r holds x = (r + 1) * base.
    base = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    x = ((rank + 1) * base).requires_grad_()
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    local = segment_sum(x, cu)
    total = sequence_sums(x, cu, torch.distributed.group.WORLD)
    # Every rank computes the same loss from the reduced sums; scale by 1/world for one copy.
    loss = (total[0] ** 2 + 3 * total[1]) / world_size
    loss.backward()
    return local.tolist(), total.tolist(), x.grad.tolist()


def test_sequence_sums_forward_and_backward_over_sp():
    out = run_dist(_sp_sum_grad, 2)
    # Sums over both ranks: (1+2)*3 = 9 and (3+4+5)*3 = 36.
    for rank, (local, total, grad) in enumerate(out):
        assert local == [3.0 * (rank + 1), 12.0 * (rank + 1)]
        assert total == [9.0, 36.0]
        # d/dx of total[0]^2 + 3*total[1] (counted once): 2*9 on seq 0 tokens, 3 on seq 1 tokens.
        assert grad == [18.0, 18.0, 3.0, 3.0, 3.0]


# ----------------------------------------------------------------- trainer runs

@pytest.fixture(scope="module")
def serial(assets, tmp_path_factory):
    """serial(dtype): run dir of the 1-process reference (one micro-batch per step), run once."""
    return serial_runs("rm", rm_args, assets, tmp_path_factory)


@pytest.fixture(scope="module")
def serial_unshared(assets, tmp_path_factory):
    """The reference with actor.share_prompt=false: sp layouts cannot share a prompt (auto
    leaves it off there), and they are compared with the same setting."""
    return serial_runs("rm", lambda a, *e: rm_args(a, "actor.share_prompt=false", *e), assets,
                       tmp_path_factory)


# Pairs are <= 71 tokens (76 padded for sp=2), so every layout packs several micro-batches.
BUDGETS = {"fsdp2": 80, "ddp2xfsdp2": 160, "sp2": 48, "dp2xsp2": 64, "tp2": 40}
CASES = parallel_cases(BUDGETS)
KEYS = ("train/loss", "train/accuracy", "train/margin", "train/grad_norm", "test/loss", "test/margin")


def _assert_matches_serial(run_dir, serial_dir, rtol):
    for key in KEYS:
        # A margin is a difference of two rewards ~100x larger: give it a matching absolute floor.
        assert_close(train_rows(run_dir, key), train_rows(serial_dir, key), rtol, key,
                     atol=rtol / 100 if "margin" in key else 0.0)


@pytest.mark.parametrize("name,dtype,rtol", CASES)
def test_parallel_equals_serial(assets, serial, serial_unshared, tmp_path, name, dtype, rtol):
    nproc, extra = layout(name, BUDGETS[name])
    run_trainer("rm", nproc, rm_args(assets, f"actor.dtype={dtype}", *extra), tmp_path)
    _assert_matches_serial(tmp_path, (serial_unshared if "sp" in name else serial)(dtype), rtol)


def test_each_rejected_side_continues_its_chosen_sides_prompt(assets):
    """flatten_pairs(share_prompt=True) on reward-model pairs (input_ids and eos_mask only): every
    rejected side starts at its first token that differs from the chosen side (position_ids
    from there) and keeps its scored last token."""
    from RL2.data.packing import resolve_share_prompt

    cfg, pairs, samples = shared_pairs(assets, "rm", rm_args(assets))
    assert resolve_share_prompt(cfg.actor, "cpu")  # the default (auto) on the CPU: the runs here share
    for p, chosen, tail in zip(pairs, samples[0::2], samples[1::2]):
        c, r = p["chosen"]["input_ids"], p["rejected"]["input_ids"]
        start = int((c[:len(r)] != r[:len(c)]).nonzero()[0])  # the first token that differs
        assert start > 0 and tail["position_ids"].tolist() == list(range(start, len(r)))
        assert torch.equal(tail["input_ids"], r[start:])
        assert tail["eos_mask"].tolist() == [0] * (len(r) - start - 1) + [1]
        assert chosen["position_ids"].tolist() == list(range(len(c)))


@pytest.mark.slow  # two more serial runs; shared prompts stay in the fast set via test_share_prompt
def test_shared_prompt_equals_unshared(serial, serial_unshared):
    """actor.share_prompt (auto: on in the CPU serial run) computes each pair's prompt once, in
    training and in evaluation; off, every metric agrees (float64 to 1e-7: HF's RMSNorm computes
    in float32, see tests/test_dpo.py; a wrong mask or position moves them by > 1e-3)."""
    _assert_matches_serial(serial_unshared("float64"), serial("float64"), 1e-7)
    _assert_matches_serial(serial_unshared("float32"), serial("float32"), 1e-5)
    # and the shared run did share: its float64 gradients were summed in another order (the
    # same code path would give the same bits)
    grad_norms = [train_rows(serial_unshared("float64"), "train/grad_norm"),
                  train_rows(serial("float64"), "train/grad_norm")]
    assert grad_norms[0] != grad_norms[1]


def test_accuracy_above_chance_and_hf_export_reproduces_rewards(assets, serial):
    rows = read_metrics(serial("float32"))
    test = [r for r in rows if "test/accuracy" in r][-1]
    assert test["test/accuracy"] >= 0.8 and test["test/margin"] > 0
    losses = train_rows(serial("float32"), "train/loss")
    assert losses[-1] < losses[0]
    # The exported checkpoint, run by plain HF (no packing, eager attention), gives the rewards
    # behind the trainer's final test metrics.
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from RL2.data.formats import tokenize_pair
    from RL2.data.io import load_rows

    final = os.path.join(serial("float32"), "run", "final")
    model = AutoModelForTokenClassification.from_pretrained(final, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(final)
    margins = []
    for i, row in enumerate(load_rows(f"{assets['data']}/pref_test.jsonl")):
        sides = tokenize_pair(row, tok, for_reward_model=True, max_length=1024, row_index=i)
        with torch.no_grad():
            r = [model(input_ids=s["input_ids"][None]).logits[0, -1, 0].item() for s in sides]
        margins.append(r[0] - r[1])
    m = torch.tensor(margins, dtype=torch.float64)
    assert math.isclose(test["test/margin"], m.mean().item(), rel_tol=1e-4, abs_tol=1e-6)
    assert math.isclose(test["test/loss"], -torch.nn.functional.logsigmoid(m).mean().item(), rel_tol=1e-5)
    assert test["test/accuracy"] == (m > 0).double().mean().item()


def test_token_metrics_count_both_sides_and_one_scored_token_each(assets, serial):
    """README's meaning, counted here with the tokenizer on the rendered chats: train/tokens = all
    tokens of both sides of the step's 16 pairs (a reward model reads every token, no shift);
    train/loss_tokens = the one scored (last) token of each of the 32 sequences."""
    from RL2.data.io import load_rows
    from RL2.data.loader import StepSampler

    tok, rows = assets["tokenizer"], load_rows(f"{assets['data']}/pref_train.jsonl")
    logged = [r for r in read_metrics(serial("float32")) if "train/tokens" in r]
    assert len(logged) == 3
    for step, r in enumerate(logged):
        tokens = 0
        for i in StepSampler(len(rows), 16, seed=0).batch(step):
            for side in ("chosen", "rejected"):
                chat = [{"role": "user", "content": rows[i]["prompt"]},
                        {"role": "assistant", "content": rows[i][side]}]
                tokens += len(tok.encode(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False))
        assert (r["train/tokens"], r["train/loss_tokens"]) == (tokens, 2 * 16), step
        assert math.isclose(r["train/tokens_per_s"], tokens / r["train/step_time"], rel_tol=1e-12)


# ----------------------------------------------------------------- bad input

def test_bad_row_stops_with_the_row_named(assets, tmp_path):
    # (tests/test_dpo.py runs the same file with skip_bad_rows=true.)
    args = [f"actor.model_name={assets['model']}", f"data.train.path={bad_rows_file(assets, tmp_path)}",
            "data.train.batch_size=4", "trainer.total_steps=1"]
    proc = run_trainer("rm", 1, args, tmp_path, check=False)
    assert proc.returncode != 0
    assert "bad.jsonl row 3: missing key 'rejected'" in proc.stderr
    assert "data.train.skip_bad_rows=true" in proc.stderr
