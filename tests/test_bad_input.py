"""Bad config and data stop a run before training, with a message naming the key/file/row."""
import json

import pytest

from tests.run_utils import run_trainer


def fails_with(assets, tmp_path, overrides, *needles, nproc=1):
    proc = run_trainer("sft", nproc, overrides, tmp_path, check=False, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for needle in needles:
        assert needle in out, f"{needle!r} not in output:\n{out[-3000:]}"
    assert "train/loss" not in out  # stopped before any step
    return out


def base(assets, data=None):
    return [f"actor.model_name={assets['model']}",
            f"data.train.path={data or assets['data'] + '/sft_train.jsonl'}", "data.train.batch_size=8"]


def test_misspelled_key(assets, tmp_path):
    fails_with(assets, tmp_path, base(assets) + ["actor.learning_rate=1e-3"], "learning_rate")


def test_missing_required_key(assets, tmp_path):
    fails_with(assets, tmp_path, [f"data.train.path={assets['data']}/sft_train.jsonl"], "actor.model_name")


def test_world_size_not_divisible(assets, tmp_path):
    fails_with(assets, tmp_path, base(assets) + ["actor.tp_size=2", "actor.ddp_size=2"],
               "world size 2", "ddp_size*tp_size", nproc=2)


def test_missing_data_file(assets, tmp_path):
    fails_with(assets, tmp_path, base(assets, str(tmp_path / "nope.jsonl")), "nope.jsonl")


@pytest.mark.parametrize("row,needle", [  # one row in the fast subset, all in the full suite
    pytest.param({"prompt": "hi"}, "response", marks=pytest.mark.slow),
    ({"prompt": "hi", "response": ""}, "response"),
    pytest.param({"question": "hi", "answer": "x"}, "prompt", marks=pytest.mark.slow),
], ids=["missing-response", "empty-response", "wrong-keys"])
def test_bad_row_named(assets, tmp_path, row, needle):
    path = tmp_path / "bad.jsonl"
    good = {"prompt": "What is 1 plus 1?", "response": "2"}
    path.write_text("\n".join(json.dumps(r) for r in [good] * 9 + [row] + [good] * 6) + "\n")
    out = fails_with(assets, tmp_path, base(assets, str(path)), "bad.jsonl", "row 9", needle)
    assert "skip_bad_rows" in out
    # With the explicit option the row is skipped, counted, and training runs.
    proc = run_trainer("sft", 1, base(assets, str(path)) + ["data.train.skip_bad_rows=true", "trainer.total_steps=1"],
                       tmp_path / "skip")
    assert "skipped 1 of 16 rows" in proc.stdout + proc.stderr


def test_bad_optimizer_keys_named_before_the_model_loads(assets, tmp_path):
    out = fails_with(assets, tmp_path, base(assets) + ["actor.lr=-1e-5", "actor.scheduler=cosin"],
                     "actor.lr=-1e-05 must be >= 0", "actor.scheduler='cosin': use one of constant, cosine, linear")
    assert "Applied FSDP" not in out


@pytest.mark.parametrize("content,needle", [
    ("", ["data file '{path}' is empty"]),
    ('{"prompt": "hi", "response": "x"}\n{"prompt": "hi", "response": \n', ["'{path}': line 2 is not valid JSON"]),
    ('{"prompt": "hi", "response": "x"}\n{"prompt": null, "response": "x"}\n',
     ["{path} row 1: missing key 'prompt' (null or absent in this row)", "row 1 is line 2"]),
], ids=["empty", "malformed-line", "null-prompt"])
def test_bad_data_file_named_before_the_model_loads(assets, tmp_path, content, needle):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    out = fails_with(assets, tmp_path, base(assets, str(path)), *(n.format(path=path) for n in needle))
    assert "Applied FSDP" not in out
