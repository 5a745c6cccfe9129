"""DPO trainer end to end under torchrun/gloo: log(2) at step 0, the first step's log-probs and
SFT term against plain HF, parallel == serial (dp, HSDP, sp), margin growth, bad input."""
import math

import pytest
import torch

from tests.run_utils import (SFT_COEF, assert_close, bad_rows_file, dpo_args, layout, parallel_cases,
                             read_metrics, run_trainer, serial_runs, shared_pairs, train_rows)


@pytest.fixture(scope="module")
def serial(assets, tmp_path_factory):
    """serial(dtype): run dir of the 1-process reference (one micro-batch per step), run once."""
    return serial_runs("dpo", dpo_args, assets, tmp_path_factory)


@pytest.fixture(scope="module")
def serial_unshared(assets, tmp_path_factory):
    """The reference with actor.share_prompt=false: sp layouts cannot share a prompt (auto
    leaves it off there), and they are compared with the same setting."""
    return serial_runs("dpo", lambda a, *e: dpo_args(a, "actor.share_prompt=false", *e), assets,
                       tmp_path_factory)


def test_first_step_is_log2_and_matches_hf(assets, serial):
    rows = read_metrics(serial("float32"))
    first = next(r for r in rows if "train/dpo_loss" in r)
    # trainer.test_at_start: the step-0 test row sees the same policy == reference.
    start = rows[0]
    assert start["step"] == 0 and abs(start["test/rewards/margin"]) < 1e-6
    assert abs(start["test/loss"] - math.log(2)) < 1e-6
    # Policy == reference: every log-ratio is 0, so the DPO loss is log(2) and margins are 0.
    assert abs(first["train/dpo_loss"] - math.log(2)) < 1e-6
    for key in ("train/rewards/chosen", "train/rewards/rejected", "train/rewards/margin"):
        assert abs(first[key]) < 1e-6, key
    assert math.isclose(first["train/loss"], first["train/dpo_loss"] + SFT_COEF * first["train/sft_loss"],
                        rel_tol=1e-12)
    # Summed response log-probs and the chosen-side NLL of the first batch, from plain HF.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from RL2.data.formats import tokenize_pair
    from RL2.data.io import load_rows
    from RL2.data.loader import StepSampler

    model = AutoModelForCausalLM.from_pretrained(assets["model"], attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(assets["model"])
    rows = load_rows(f"{assets['data']}/pref_train.jsonl")
    sums, nll, n_tokens = {"chosen": [], "rejected": []}, 0.0, 0.0
    for i in StepSampler(len(rows), 16, seed=0).batch(0):
        for side, s in zip(("chosen", "rejected"), tokenize_pair(rows[i], tok, for_reward_model=False, max_length=1024)):
            with torch.no_grad():
                logits = model(input_ids=s["input_ids"][None]).logits[0].double()
            lp = logits.log_softmax(-1).gather(-1, s["labels"][:, None])[:, 0] * s["action_mask"]
            sums[side].append(lp.sum().item())
            if side == "chosen":
                nll, n_tokens = nll - lp.sum().item(), n_tokens + s["action_mask"].sum().item()
    for side in ("chosen", "rejected"):
        assert math.isclose(first[f"train/logps/{side}"], sum(sums[side]) / 16, rel_tol=1e-5)
    assert math.isclose(first["train/sft_loss"], nll / n_tokens, rel_tol=1e-5)


def test_margin_increases(serial):
    rows = read_metrics(serial("float32"))
    margins = train_rows(serial("float32"), "train/rewards/margin")
    assert margins[-1] > 0.05 and margins[-1] > margins[0]
    test = [r for r in rows if "test/rewards/margin" in r][-1]
    # The test margin starts at exactly 0 (policy == reference) and must have grown.
    assert test["test/rewards/margin"] > 0.05 and test["test/accuracy"] >= 0.8
    assert test["test/loss"] < math.log(2)


def test_token_metrics_count_both_sides_of_every_pair(assets, serial):
    """README's meaning, counted here with the tokenizer on the rendered chats: train/tokens = the
    input tokens of both sides of the step's 16 pairs; train/loss_tokens = their response tokens
    (+ <|im_end|>), the tokens whose log-probs enter the loss."""
    from RL2.data.io import load_rows
    from RL2.data.loader import StepSampler

    tok, rows = assets["tokenizer"], load_rows(f"{assets['data']}/pref_train.jsonl")
    logged = [r for r in read_metrics(serial("float32")) if "train/tokens" in r]
    assert len(logged) == 3
    for step, r in enumerate(logged):
        tokens = loss_tokens = 0
        for i in StepSampler(len(rows), 16, seed=0).batch(step):
            for side in ("chosen", "rejected"):
                chat = [{"role": "user", "content": rows[i]["prompt"]},
                        {"role": "assistant", "content": rows[i][side]}]
                text = tok.apply_chat_template(chat, tokenize=False)
                tokens += len(tok.encode(text, add_special_tokens=False)) - 1  # inputs: all but the last
                loss_tokens += len(tok.encode(rows[i][side], add_special_tokens=False)) + 1  # + eos
        assert (r["train/tokens"], r["train/loss_tokens"]) == (tokens, loss_tokens), step
        assert math.isclose(r["train/tokens_per_s"], tokens / r["train/step_time"], rel_tol=1e-12)


# Pairs are <= 69 tokens (72 padded for sp=2), so every layout packs several micro-batches.
BUDGETS = {"fsdp2": 80, "ddp2xfsdp2": 160, "sp2": 48, "dp2xsp2": 64, "tp2": 40,
           # The 4-rank grid of the parallelism issue.
           "fsdp4": 80, "tp2xfsdp2": 40, "tp2xsp2": 24}
CASES = parallel_cases(BUDGETS)
KEYS = ("train/loss", "train/dpo_loss", "train/sft_loss", "train/rewards/margin", "train/grad_norm",
        "test/loss", "test/rewards/margin")


def _assert_matches_serial(run_dir, serial_dir, rtol):
    for key in KEYS:
        # Margins start at ~0 (policy == reference): compare them with an absolute floor too.
        assert_close(train_rows(run_dir, key), train_rows(serial_dir, key), rtol, key,
                     atol=rtol / 10 if "margin" in key else 0.0)


@pytest.mark.parametrize("name,dtype,rtol", CASES)
def test_parallel_equals_serial(assets, serial, serial_unshared, tmp_path, name, dtype, rtol):
    nproc, extra = layout(name, BUDGETS[name])
    proc = run_trainer("dpo", nproc, dpo_args(assets, f"actor.dtype={dtype}", *extra), tmp_path)
    # the CPU default (auto): gathered weights kept until backward, the reference's for the run
    assert "reshard_after_forward=False" in proc.stdout + proc.stderr
    _assert_matches_serial(tmp_path, (serial_unshared if "sp" in name else serial)(dtype), rtol)


def test_bad_rows_are_counted_and_a_pair_over_budget_stops_before_training(assets, tmp_path):
    # skip_bad_rows: the missing-key and identical rows are skipped and counted; then a pair
    # (<= 69 tokens) over a budget that each side (<= 37) fits stops the run before any step.
    args = [f"actor.model_name={assets['model']}", f"data.train.path={bad_rows_file(assets, tmp_path)}",
            "data.train.batch_size=4", "trainer.total_steps=1", "data.train.skip_bad_rows=true",
            "actor.max_length_per_device=60"]
    proc = run_trainer("dpo", 1, args, tmp_path, check=False)
    assert proc.returncode != 0
    assert "row 3: missing key 'rejected'" in proc.stderr
    assert "row 7: keys 'chosen' and 'rejected' are identical" in proc.stderr
    assert "skipped 2 of 20 rows" in proc.stderr
    assert "bad.jsonl row 0: the pair needs" in proc.stderr
    assert "actor.max_length_per_device*sp_size*tp_size = 60" in proc.stderr
    assert "2*data.train.max_length" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_weights_gathered_again_in_backward_equal_serial(assets, serial, tmp_path):
    """actor.reshard_after_forward=true (the GPU default; the CPU default, auto, keeps gathered
    weights from forward to backward and the frozen reference's for the run, as every other
    test here runs): same losses, margins, gradients, evaluation and final model as serial."""
    from transformers import AutoModelForCausalLM

    nproc, extra = layout("fsdp2", BUDGETS["fsdp2"])
    proc = run_trainer("dpo", nproc, dpo_args(assets, "actor.dtype=float64", "actor.reshard_after_forward=true",
                                              *extra), tmp_path)
    out = proc.stdout + proc.stderr
    assert "reshard_after_forward=True" in out and "reshard_after_forward=False" not in out
    _assert_matches_serial(tmp_path, serial("float64"), 1e-9)
    got, want = (AutoModelForCausalLM.from_pretrained(d / "run" / "final", dtype=torch.float64).state_dict()
                 for d in (tmp_path, serial("float64")))
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-9, atol=1e-12, msg=name)


def test_bad_reshard_after_forward_is_refused_by_name(assets, tmp_path):
    proc = run_trainer("dpo", 1, dpo_args(assets, "actor.reshard_after_forward=sometimes"), tmp_path,
                       check=False)
    assert proc.returncode != 0 and "reshard_after_forward='sometimes'" in proc.stderr + proc.stdout


def test_each_rejected_side_continues_its_chosen_sides_prompt(assets):
    """flatten_pairs(share_prompt=True) on the test data: every rejected side starts at its last
    prompt token (position_ids from there) and keeps every response token."""
    _, pairs, samples = shared_pairs(assets, "dpo", dpo_args(assets))
    for p, chosen, tail in zip(pairs, samples[0::2], samples[1::2]):
        full = p["rejected"]
        start = int(full["action_mask"].nonzero()[0])  # the last prompt token: its label responds
        assert start > 0 and tail["position_ids"][0] == start  # the last prompt token onwards
        assert torch.equal(tail["input_ids"], full["input_ids"][start:])
        assert tail["action_mask"].sum() == full["action_mask"].sum()
        assert chosen["position_ids"].tolist() == list(range(len(chosen["input_ids"])))


@pytest.mark.slow  # two more serial runs; fast set: test_cpu_ops' DPO shared-prompt test
def test_shared_prompt_equals_unshared(serial, serial_unshared):
    """actor.share_prompt (auto: on in the CPU serial run) computes each pair's prompt once; off,
    every metric agrees. Not to 1e-9: HF's RMSNorm computes in float32 even in a float64 model
    (`hidden_states.to(torch.float32)`), and the prompt's gradient is summed before it (shared)
    rather than after it (two copies), which moves gradients by ~1e-8 (the forward agrees to
    1e-16); a wrong mask or position would move them by > 1e-3."""
    _assert_matches_serial(serial_unshared("float64"), serial("float64"), 1e-7)
    _assert_matches_serial(serial_unshared("float32"), serial("float32"), 1e-5)
    # and the shared run did share: its float64 gradients were summed in another order (the
    # same code path would give the same bits)
    grad_norms = [train_rows(serial_unshared("float64"), "train/grad_norm"),
                  train_rows(serial("float64"), "train/grad_norm")]
    assert grad_norms[0] != grad_norms[1]
