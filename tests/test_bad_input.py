"""Bad config and data stop a run before training, with a message naming the key/file/row."""
import json
import os

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


RUN_DEFAULTS = ["actor.model_name=m", "data.train.path=d"]


@pytest.mark.parametrize("trainer,override", [
    ("sft", "trainer.total_steps=0"), ("sft", "trainer.n_epochs=0"), ("sft", "trainer.save_freq=-1"),
    ("sft", "trainer.test_freq=0"), ("sft", "trainer.keep_last=-1"), ("sft", "trainer.keep_last=0"),
    ("sft", "data.train.batch_size=0"), ("dpo", "data.test.batch_size=0"), ("kto", "data.train.max_length=-5"),
    ("ppo", "data.train.max_length=0"), ("sft", "trainer.total_steps=1.5"),
])
def test_bad_counts_name_the_key(trainer, override):
    from RL2.utils.config import check_run_config, load_config

    extra = ["actor.rollout.env_path=e"] if trainer == "ppo" else []
    with pytest.raises(SystemExit, match=f"{override.split('=')[0]}=.* must be an integer >= 1"):
        check_run_config(load_config(trainer, RUN_DEFAULTS + extra + [override]))


def test_default_and_null_counts_pass():
    from RL2.utils.config import check_run_config, load_config

    for trainer in ("sft", "dpo", "rm", "kto"):
        check_run_config(load_config(trainer, RUN_DEFAULTS + ["trainer.total_steps=null", "trainer.keep_last=2"]))


def test_missing_local_model_paths_are_named(tmp_path):
    from RL2.utils.config import missing_local_paths

    home = os.path.expanduser("~")
    paths = {"actor.model_name": str(tmp_path / "nomodel"), "critic.model_name": "./foo",
             "actor.rollout.reward_model": "../nope", "actor.tokenizer_name": "Qwen/Qwen2.5-0.5B",
             "ok": str(tmp_path), "unset": None}
    assert missing_local_paths(paths) == [
        f"actor.model_name='{tmp_path / 'nomodel'}': no such local directory",
        "critic.model_name='./foo': no such local directory",
        "actor.rollout.reward_model='../nope': no such local directory"]
    # HF loaders take an existing ~/... for a repo id
    assert missing_local_paths({"actor.model_name": "~"}) == [
        f"actor.model_name='~': give the full path '{home}' (~ is not expanded when loading)"]


def test_ppo_checks_the_critic_and_reward_model_paths_too():
    from RL2.trainer.ppo import PPOTrainer
    from tests.run_utils import cfg_with

    def paths(*overrides):
        trainer = object.__new__(PPOTrainer)  # the config only: nothing built
        trainer.cfg = cfg_with(*overrides)
        return trainer.model_paths()

    got = paths("adv.estimator=gae", "critic.model_name=./critic", "actor.rollout.reward_model=./rm")
    assert got["critic.model_name"] == "./critic" and got["actor.rollout.reward_model"] == "./rm"
    assert got["actor.model_name"] == "m" and "critic.model_name" not in paths()  # no critic without gae


def test_missing_local_model_is_named_before_anything_loads(assets, tmp_path):
    out = fails_with(assets, tmp_path, [f"actor.model_name={tmp_path}/nomodel"] + base(assets)[1:],
                     f"actor.model_name='{tmp_path}/nomodel': no such local directory")
    assert "Repo id" not in out


def test_a_mixture_outside_ppo_is_a_clear_error():
    from types import SimpleNamespace

    from RL2.trainer.base import Trainer
    from RL2.utils.config import load_config

    for trainer in ("sft", "dpo", "rm", "kto"):
        cfg = load_config(trainer, ["actor.model_name=m", "data.train.path=[a.jsonl, b.jsonl]"])
        with pytest.raises(SystemExit, match="data.train.path is a list: .* PPO trainer only"):
            Trainer.load_splits(SimpleNamespace(cfg=cfg), None)


def test_ppo_mixture_with_a_missing_file_names_it(assets, tmp_path):
    from tests.run_utils import ANSWER_MATCH, run_trainer

    mix = f"[{assets['data']}/ppo_train.jsonl, {tmp_path}/gone.jsonl]"
    proc = run_trainer("ppo", 1, [f"actor.model_name={assets['model']}", f"data.train.path={mix}",
                                  f"actor.rollout.env_path={ANSWER_MATCH}"], tmp_path, check=False, timeout=300)
    assert proc.returncode != 0
    assert f"bad data config: data file or directory '{tmp_path}/gone.jsonl' does not exist" in proc.stderr
    # no raw traceback from the worker (torchrun prints its own after any failed worker)
    assert "mixture.py" not in proc.stderr and "Applied FSDP" not in proc.stderr + proc.stdout


def test_row_hint_counts_lines_the_loader_reads(tmp_path):
    from RL2.trainer.base import row_hint

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"a": 1}\n\n  \n{"a": 2}\n\n{"a": 3}\n')  # blank lines are skipped by the loader
    assert row_hint(str(jsonl), 2, 3) == f"rows count from 0: row 2 is line 6 of {jsonl}"
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,response\nx,y\nz,w\n")
    for source, n in ((str(csv), 2), (str(jsonl), 2), (f"{jsonl} (test_ratio split)", 1)):
        hint = row_hint(source, 1, n)  # CSV, or a split's part: no line number is claimed
        assert "line" not in hint.replace("blank lines", "") and "CSV header not counted" in hint
