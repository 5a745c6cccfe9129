"""The run directory: a fresh run refuses a non-empty one, a resume keeps each step's metrics
once; every tokenizer RL2 writes reloads (with AutoTokenizer) to the identical tokenisation; a
finished launch leaves the exit's garbage collections out."""
import json
import logging
import os
import shutil

from tests.run_utils import read_metrics, run_trainer, sft_args


def test_fresh_run_refuses_a_non_empty_run_dir(assets, tmp_path):
    # A run stopped before its first step leaves only config.yaml: running again is fine.
    proc = run_trainer("sft", 1, sft_args(assets, "actor.max_length_per_device=8"), tmp_path, check=False)
    assert proc.returncode != 0 and os.listdir(tmp_path / "run") == ["config.yaml"]
    run_trainer("sft", 1, sft_args(assets, "trainer.total_steps=1"), tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path) if "train/loss" in r] == [1]
    shutil.rmtree(tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = run_trainer("sft", 1, sft_args(assets, "trainer.total_steps=1"), tmp_path, check=False)
    assert proc.returncode != 0
    assert "is not empty" in proc.stderr and "trainer.load_ckpt_from=latest" in proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


def test_resume_drops_metric_rows_after_its_checkpoint(tmp_path):
    from RL2.utils.logging import keep_rows_up_to

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train/loss": s}) + "\n" for s in (1, 2, 3, 4)))
    keep_rows_up_to(str(path), 2)  # a run that died at step 4 resumes from its step-2 checkpoint
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def corpus(assets) -> list[str]:
    """Every row of the generated datasets, as raw JSON and as rendered chat."""
    from RL2.data.io import load_rows

    tok, texts = assets["tokenizer"], []
    for name in ("sft_train", "chat_train", "pref_train", "ppo_train"):
        for row in load_rows(f"{assets['data']}/{name}.jsonl"):
            texts.append(json.dumps(dict(row)))
            if "messages" in row:
                texts.append(tok.apply_chat_template(row["messages"], tokenize=False))
    return texts + ["Numbers 12 345 6789, spaces  and\ttabs; Ünïcode!"]


def assert_same_tokenisation(a, b, texts):
    bad = [t for t in texts if a.encode(t) != b.encode(t)]
    assert not bad, f"{len(bad)} of {len(texts)} texts split differently, e.g. {bad[0]!r}"


def test_make_assets_model_dir_tokenizer_reloads_identically(assets):
    from transformers import AutoTokenizer

    texts = corpus(assets)
    from_tokenizer_dir = AutoTokenizer.from_pretrained(str(assets["root"] / "tokenizer"))
    from_model_dir = AutoTokenizer.from_pretrained(assets["model"])  # rebuilt as a Qwen2Tokenizer
    assert_same_tokenisation(assets["tokenizer"], from_tokenizer_dir, texts)
    assert_same_tokenisation(assets["tokenizer"], from_model_dir, texts)


def test_checkpoint_and_final_tokenizers_reload_identically(assets, tmp_path):
    from transformers import AutoTokenizer

    # Trained with the tokenizer directory (actor.tokenizer_name), saved next to a qwen2 config.
    args = sft_args(assets, "trainer.total_steps=1", "trainer.save_freq=1",
                    f"actor.tokenizer_name={assets['root'] / 'tokenizer'}")
    run_trainer("sft", 1, args, tmp_path)
    assert read_metrics(tmp_path)
    texts = corpus(assets)
    for d in ("step1", "final"):
        assert_same_tokenisation(assets["tokenizer"], AutoTokenizer.from_pretrained(str(tmp_path / "run" / d)), texts)


def test_a_tokenizer_that_reloads_differently_is_reported(assets, tmp_path, caplog):
    """The case the check exists for: a plain byte-level BPE (not Qwen2's pipeline) saved next to
    a qwen2 config reloads as a Qwen2Tokenizer that splits digits differently."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from RL2.utils.checkpoint import check_tokenizer_reload

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([f"the answer is {i}" for i in range(300)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")
    AutoConfig.from_pretrained(assets["model"]).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        check_tokenizer_reload(tok, str(tmp_path))
    assert "splits text differently" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_tokenizer_reload(assets["tokenizer"], assets["model"])
    assert "splits text differently" not in caplog.text


def test_launch_freezes_the_collector_at_exit_once_the_run_is_closed(monkeypatch):
    """Trainer.launch: build, fit, close, then `gc.freeze` registered to run at exit, so the
    interpreter's exit does not walk every object again (~1 s of each worker's exit) while a
    process that goes on keeps collecting; stand-ins for the run's parts."""
    import gc

    from RL2.trainer import base

    calls = []

    class Run(base.Trainer):
        def __init__(self, cfg):
            calls.append(("init", cfg))

        def fit(self):
            calls.append("fit")

        def close(self):
            calls.append("close")

    monkeypatch.setattr(base, "die_with_torchrun_agent", lambda: None)
    monkeypatch.setattr(base, "load_config", lambda name: f"config {name}")
    monkeypatch.setattr(base.atexit, "register", lambda f: calls.append(("at exit", f)))
    Run.launch("sft")
    assert calls == [("init", "config sft"), "fit", "close", ("at exit", gc.freeze)]


def fake_run(root, name, steps=(2,), metrics=True):
    run = root / name
    for s in steps:
        (run / f"step{s}").mkdir(parents=True)
        (run / f"step{s}" / "trainer_state.json").write_text(json.dumps({"step": s}))
    if steps:
        (run / "latest").write_text(f"step{steps[-1]}")
    if metrics:
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def problem(run_dir, load_ckpt_from=None, log_dir=None):
    from types import SimpleNamespace

    from RL2.trainer.base import _run_dir_problem

    return _run_dir_problem(SimpleNamespace(load_ckpt_from=load_ckpt_from, log_dir=log_dir), str(run_dir))


def test_resume_from_another_runs_checkpoint_cannot_overwrite_a_run(tmp_path):
    a, b = fake_run(tmp_path, "A", (2, 4)), fake_run(tmp_path, "B")
    out = problem(a, str(b / "step2"))
    assert out and str(b / "step2") in out and str(a) in out and "another run" in out
    # its own checkpoints: by path (also relative, or through a symlinked save_dir) and latest
    assert problem(a, str(a / "step2")) is None and problem(a, "latest") is None
    assert problem(a, os.path.relpath(a / "step4")) is None
    os.symlink(tmp_path, tmp_path / "link")
    assert problem(tmp_path / "link" / "A", str(a / "step2")) is None
    # a fresh (or only config.yaml) run may start from any checkpoint
    assert problem(tmp_path / "C", str(b / "step2")) is None
    (tmp_path / "D").mkdir()
    (tmp_path / "D" / "config.yaml").write_text("x: 1\n")
    assert problem(tmp_path / "D", str(b / "step2")) is None


def test_bad_checkpoint_and_log_dir_are_named_before_the_model_loads(tmp_path):
    assert "trainer.load_ckpt_from=latest but" in problem(tmp_path / "fresh", "latest")
    (tmp_path / "half").mkdir()
    assert "trainer.load_ckpt_from: " in problem(tmp_path / "fresh", str(tmp_path / "half"))
    (tmp_path / "file").write_text("")
    out = problem(tmp_path / "fresh", log_dir=str(tmp_path / "file" / "logs"))
    assert out.startswith(f"trainer.log_dir='{tmp_path / 'file' / 'logs'}' cannot be created")
    assert not (tmp_path / "fresh").exists()  # nothing written


def test_keep_last_below_one_is_refused_not_every_checkpoint_deleted(tmp_path):
    import pytest

    from RL2.utils.checkpoint import _prune

    run = fake_run(tmp_path, "run", (1, 2, 3))
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"keep_last={bad} must be >= 1"):
            _prune(str(run), bad)
    _prune(str(run), 2)
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step")) == ["step2", "step3"]
