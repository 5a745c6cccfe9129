"""Resume rewrites the run directory's logs to the checkpoint step: each step appears once."""
import json

from RL2.utils.logging import drop_dumps_after, keep_rows_up_to


def test_resume_cuts_metrics_and_dumps_back_to_the_checkpoint(tmp_path):
    rows = [{"step": s, "train/loss": float(s)} for s in (1, 2, 3)] + [{"step": 2, "test/reward": 0.5}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "train/lo')  # killed mid-line
    keep_rows_up_to(str(metrics), 2)
    assert [json.loads(line) for line in metrics.read_text().splitlines()] == [rows[0], rows[1], rows[3]]
    dumps = tmp_path / "rollouts"
    dumps.mkdir()
    for name in ("step1", "step2", "step3", "test_step2", "test_step4", "notes"):
        (dumps / f"{name}.jsonl").write_text("{}\n")
    drop_dumps_after(str(dumps), 2)
    assert sorted(p.name for p in dumps.iterdir()) == ["notes.jsonl", "step1.jsonl", "step2.jsonl", "test_step2.jsonl"]
    drop_dumps_after(str(tmp_path / "nothing"), 2)  # no dumps yet: nothing to do
