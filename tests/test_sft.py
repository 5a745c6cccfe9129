"""SFT end to end under torchrun/gloo: parallel == serial, resume, HF export."""
import math
import os

import pytest

from tests.run_utils import (assert_close, hf_test_loss, layout, read_metrics, run_trainer, sft_args,
                             train_rows)


BUDGETS = {"fsdp2": 64, "ddp2xfsdp2": 96}


@pytest.mark.parametrize("name", [n if n == "fsdp2" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in BUDGETS])  # fast subset: fsdp2; HSDP in the full suite
@pytest.mark.parametrize("dtype,rtol", [("float64", 1e-10), ("float32", 1e-5)])
def test_parallel_equals_serial(assets, serial, tmp_path, name, dtype, rtol):
    nproc, extra = layout(name, BUDGETS[name])
    run = run_trainer("sft", nproc, sft_args(assets, f"actor.dtype={dtype}", *extra), tmp_path)
    assert "data-parallel ranks wait" not in run.stderr  # 16 rows spread evenly: no warning
    for key in ("train/loss", "train/grad_norm", "train/tokens"):
        assert_close(train_rows(tmp_path, key), train_rows(serial[dtype], key), rtol, key)
    assert_close(train_rows(tmp_path, "test/loss"), train_rows(serial[dtype], "test/loss"), rtol, "test/loss")


def test_unbalanced_ranks_are_reported_once(assets, tmp_path):
    """Two rows a step over two ranks, one ~10x the other: the lighter rank waits for the
    busier one, and the run says so once (naming sp_size), not at every step."""
    import json

    rows = [{"prompt": "hi", "response": "ok"}, {"prompt": "tell me " * 60, "response": "sure " * 60}]
    path = tmp_path / "uneven.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = run_trainer("sft", 2, sft_args(assets, f"data.train.path={path}", "data.train.batch_size=2",
                                         "trainer.total_steps=2", "trainer.test_at_start=false"),
                      tmp_path / "run")
    assert run.stderr.count("data-parallel ranks wait") == 1  # training passes only, once
    line = run.stderr.split("actor: data-parallel ranks wait")[1].splitlines()[0]
    assert "sp_size" in line and "(logged once)" in line


def test_loss_decreases_and_hf_export_reproduces_test_loss(assets, serial):
    rows = read_metrics(serial["float32"])
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < losses[0]
    # The exported HF model, run by plain HF (no packing), gives the trainer's final test loss.
    tests = [(r["step"], r["test/loss"]) for r in rows if "test/loss" in r]
    final = os.path.join(serial["float32"], "run", "final")
    assert math.isclose(hf_test_loss(final, assets["data"]), tests[-1][1], rel_tol=1e-5)
    # trainer.test_at_start (default): step 0 is the test loss of the initial model.
    assert [s for s, _ in tests] == [0, 3]
    assert math.isclose(hf_test_loss(assets["model"], assets["data"]), tests[0][1], rel_tol=1e-5)
    assert tests[-1][1] < tests[0][1]


def test_token_metrics_count_processed_and_trained_tokens(assets, serial):
    """README's meaning, counted here with the tokenizer on the rendered chat (not RL2's span
    tokenisation): train/tokens = the input tokens of the step's 16 rows, template included;
    train/loss_tokens = the trained ones, response + <|im_end|>; tokens/s from train/tokens."""
    from RL2.data.io import load_rows
    from RL2.data.loader import StepSampler

    tok, rows = assets["tokenizer"], load_rows(f"{assets['data']}/sft_train.jsonl")
    logged = [r for r in read_metrics(serial["float32"]) if "train/tokens" in r]
    assert len(logged) == 3
    for step, r in enumerate(logged):
        tokens = loss_tokens = 0
        for i in StepSampler(len(rows), 16, seed=0).batch(step):
            chat = [{"role": "user", "content": rows[i]["prompt"]},
                    {"role": "assistant", "content": rows[i]["response"]}]
            text = tok.apply_chat_template(chat, tokenize=False)
            tokens += len(tok.encode(text, add_special_tokens=False)) - 1  # inputs: all but the last
            loss_tokens += len(tok.encode(rows[i]["response"], add_special_tokens=False)) + 1  # + eos
        assert (r["train/tokens"], r["train/loss_tokens"]) == (tokens, loss_tokens), step
        assert math.isclose(r["train/tokens_per_s"], tokens / r["train/step_time"], rel_tol=1e-12)


@pytest.mark.slow
def test_evaluating_at_start_does_not_change_training(assets, serial, tmp_path):
    run_trainer("sft", 1, sft_args(assets, "actor.dtype=float64", "actor.max_length_per_device=4096",
                                   "trainer.test_at_start=false"), tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path) if "test/loss" in r] == [3]
    for key in ("train/loss", "train/grad_norm"):
        assert train_rows(tmp_path, key) == train_rows(serial["float64"], key), key


@pytest.mark.slow
def test_resume_after_crash_is_exact(assets, tmp_path):
    args = sft_args(assets, "trainer.total_steps=6", "actor.scheduler=cosine", "actor.warmup_ratio=0.3")
    straight = tmp_path / "straight"
    run_trainer("sft", 2, args, straight)
    resumed = tmp_path / "resumed"
    proc = run_trainer("sft", 2, args + ["trainer.save_freq=3"], resumed,
                       crash_after_step=3, check=False)
    assert proc.returncode != 0
    assert (resumed / "run" / "latest").read_text() == "step3"
    run_trainer("sft", 2, args + ["trainer.load_ckpt_from=latest"], resumed)
    rows = [r for r in read_metrics(resumed) if "train/loss" in r]
    by_step = {r["step"]: r for r in rows}  # steps 1-3 from the crashed run, 4-6 after resume
    want = {r["step"]: r for r in read_metrics(straight) if "train/loss" in r}
    assert sorted(by_step) == list(range(1, 7))
    for s in range(1, 7):
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert math.isclose(by_step[s][key], want[s][key], rel_tol=1e-6), (s, key)


@pytest.mark.parametrize("option", [pytest.param("actor.gradient_checkpointing=true", marks=pytest.mark.slow),
                                    "actor.offload_params=true"])
def test_memory_options_do_not_change_numbers(assets, serial, tmp_path, option):
    run_trainer("sft", 2, sft_args(assets, "actor.dtype=float64", option), tmp_path)
    for key in ("train/loss", "train/grad_norm"):
        assert_close(train_rows(tmp_path, key), train_rows(serial["float64"], key), 1e-10, key)


def test_metric_sinks_wandb_offline_and_tensorboard(assets, tmp_path):
    run_trainer("sft", 1, sft_args(assets, "trainer.total_steps=1", "trainer.use_wandb=true",
                                   "trainer.use_tensorboard=true"), tmp_path,
                extra_env={"WANDB_MODE": "offline"})
    run = tmp_path / "run"
    assert len(read_metrics(tmp_path)) >= 1
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run / "wandb").glob("offline-run-*"))
