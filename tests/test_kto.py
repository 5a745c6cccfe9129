"""KTO trainer (RL2/trainer/kto.py): the loss against hand-computed values, the z0 examples, the
first step (policy == reference: loss 1/2), parallel == serial, implied rewards moving the right
way, bad labels."""
import json
import math

import pytest
import torch

from tests.run_utils import (assert_close, layout, parallel_cases, read_metrics, run_trainer,
                             train_rows, write_rows)


def unpaired_file(assets, split: str, tmp_dir) -> str:
    """KTO rows from the preference pairs: the chosen answer desirable, the rejected one not."""
    path = tmp_dir / f"kto_{split}.jsonl"
    if not path.exists():
        with open(f"{assets['data']}/pref_{split}.jsonl") as f:
            pairs = [json.loads(line) for line in f]
        write_rows(path, [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                          for p in pairs for side in ("chosen", "rejected")])
    return str(path)


def kto_args(assets, *extra):
    root = assets["root"]
    return [f"actor.model_name={assets['model']}", f"data.train.path={unpaired_file(assets, 'train', root)}",
            f"data.test.path={unpaired_file(assets, 'test', root)}", "data.train.batch_size=16",
            "actor.lr=1e-3", "actor.beta=0.5", "actor.undesirable_weight=1.5", "trainer.total_steps=4",
            "trainer.test_freq=2", *extra]


# ----------------------------------------------------------------- pure parts

def test_kto_loss_by_hand():
    from RL2.trainer.kto import kl_estimate, kto_loss

    logps = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)  # r = [0.5, -1.0]
    loss, rewards = kto_loss(logps, ref, torch.tensor([1.0, 0.0]), z0=0.2, beta=0.5,
                             desirable_weight=1.0, undesirable_weight=2.0)
    # desirable:   1 * (1 - sigmoid(0.5 * (0.5 - 0.2)))  = 1 - sigmoid(0.15) = 0.4625701546
    # undesirable: 2 * (1 - sigmoid(0.5 * (0.2 + 1.0)))  = 2 * (1 - sigmoid(0.6)) = 0.7086873873
    assert loss.tolist() == pytest.approx([0.4625701546, 0.7086873873], abs=1e-9)
    assert rewards.tolist() == pytest.approx([0.25, -0.5], abs=1e-12)
    # The gradient pushes the desirable log-prob up and the undesirable one down.
    lp = logps.clone().requires_grad_()
    kto_loss(lp, ref, torch.tensor([1.0, 0.0]), 0.2, 0.5)[0].sum().backward()
    assert lp.grad[0] < 0 < lp.grad[1]
    # z0: mean log-ratio of the mismatched examples, never below 0.
    assert kl_estimate(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0])) == 0.0
    assert kl_estimate(torch.tensor([-1.0, -1.5]), torch.tensor([-2.0, -2.0])) == 0.75


def test_mismatched_examples_pair_prompt_i_with_completion_i_plus_1():
    from RL2.trainer.kto import mismatched

    def sample(prompt, completion):
        tokens, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
        return {"input_ids": torch.tensor(tokens[:-1]), "labels": torch.tensor(tokens[1:]),
                "action_mask": torch.tensor(mask[1:], dtype=torch.float32)}

    out = mismatched([sample([1, 2], [3]), sample([4], [5, 6, 7])], max_length=4)
    # prompt [1, 2] + completion [5, 6, 7] cut to 4 tokens; prompt [4] + completion [3]
    assert out[0]["input_ids"].tolist() == [1, 2, 5] and out[0]["labels"].tolist() == [2, 5, 6]
    assert out[0]["action_mask"].tolist() == [0, 1, 1]
    assert out[1]["input_ids"].tolist() == [4] and out[1]["labels"].tolist() == [3]
    assert out[1]["action_mask"].tolist() == [1]


# ----------------------------------------------------------------- trainer runs

@pytest.fixture(scope="module")
def serial(assets, tmp_path_factory):
    runs = {}

    def get(dtype):
        if dtype not in runs:
            d = tmp_path_factory.mktemp(f"kto_serial_{dtype}")
            run_trainer("kto", 1, kto_args(assets, f"actor.dtype={dtype}", "actor.max_length_per_device=4096"), d)
            runs[dtype] = d
        return runs[dtype]
    return get


def test_first_step_and_rewards_move_the_right_way(assets, serial):
    from RL2.data.io import load_rows
    from RL2.data.loader import StepSampler

    rows = read_metrics(serial("float32"))
    first = next(r for r in rows if "train/loss" in r)
    # Policy == reference: every log-ratio and z0 are 0 (up to fp32 rounding of two passes), so
    # each example loses half its weight: 1/2 (desirable) or 1.5/2 (undesirable).
    train = load_rows(unpaired_file(assets, "train", assets["root"]))
    labels = [train[i]["label"] for i in StepSampler(len(train), 16, seed=0).batch(0)]
    want = sum(0.5 if d else 0.75 for d in labels) / 16
    assert 0 < sum(labels) < 16 and math.isclose(first["train/loss"], want, abs_tol=1e-6)
    for key in ("train/kl", "train/rewards/chosen", "train/rewards/rejected"):
        assert abs(first[key]) < 1e-5, key
    assert first["train/tokens"] > first["train/loss_tokens"] > 0
    start, *tests = [r for r in rows if "test/loss" in r]
    assert [r["step"] for r in (start, *tests)] == [0, 2, 4]  # trainer.test_at_start, test_freq=2
    # Step 0 (policy == reference): rewards 0; the test split is half desirable, half not.
    assert abs(start["test/rewards/chosen"]) < 1e-5 and abs(start["test/rewards/rejected"]) < 1e-5
    assert math.isclose(start["test/loss"], (0.5 + 0.75) / 2, abs_tol=1e-6)
    for r in tests:
        assert r["test/rewards/chosen"] > 0 > r["test/rewards/rejected"]
    assert tests[-1]["test/rewards/chosen"] - tests[-1]["test/rewards/rejected"] > \
        tests[0]["test/rewards/chosen"] - tests[0]["test/rewards/rejected"]
    assert tests[-1]["test/loss"] < tests[0]["test/loss"] < start["test/loss"]


# Examples are <= 37 tokens (38 padded for sp=2), so every layout packs several micro-batches.
BUDGETS = {"fsdp2": 80, "sp2": 40, "tp2": 40, "dp2xsp2": 48, "ddp2xfsdp2": 160}
KEYS = ("train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/kl", "train/grad_norm",
        "test/loss", "test/rewards/chosen")


@pytest.mark.parametrize("name,dtype,rtol", parallel_cases(BUDGETS))
def test_parallel_equals_serial(assets, serial, tmp_path, name, dtype, rtol):
    nproc, extra = layout(name, BUDGETS[name])
    run_trainer("kto", nproc, kto_args(assets, f"actor.dtype={dtype}", *extra), tmp_path)
    for key in KEYS:
        # Rewards and z0 start at exactly 0 (policy == reference): an absolute floor too.
        assert_close(train_rows(tmp_path, key), train_rows(serial(dtype), key), rtol, key, atol=rtol / 10)


def test_csv_string_labels(assets, tmp_path):
    from RL2.data.formats import DataError
    from RL2.data.io import load_rows
    from RL2.trainer.kto import tokenize_unpaired
    from RL2.utils.config import load_config

    path = tmp_path / "kto.csv"  # CSV cells reach the trainer as strings
    path.write_text("prompt,completion,label\nq,a,True\nq,b,false\nq,c,1\nq,d,0\nq,e,yes\n")
    d = load_config("kto", [f"actor.model_name={assets['model']}", f"data.train.path={path}"]).data.train
    rows = load_rows(str(path))
    got = [tokenize_unpaired(rows[i], i, "kto.csv", tokenizer=assets["tokenizer"], d=d)["desirable"]
           for i in range(4)]
    assert got == [True, False, True, False]
    with pytest.raises(DataError, match="row 4: key 'label' must be true"):
        tokenize_unpaired(rows[4], 4, "kto.csv", tokenizer=assets["tokenizer"], d=d)


def test_bad_label_names_row_and_key(assets, tmp_path):
    path = tmp_path / "bad.jsonl"
    write_rows(path, [{"prompt": "q", "completion": "a", "label": True},
                      {"prompt": "q", "completion": "b", "label": "yes"}])
    proc = run_trainer("kto", 1, [f"actor.model_name={assets['model']}", f"data.train.path={path}",
                                  "data.train.batch_size=1"], tmp_path, check=False)
    assert proc.returncode != 0
    assert "bad.jsonl row 1: key 'label' must be true (desirable) or false" in proc.stderr
