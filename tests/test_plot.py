"""python -m RL2.tools.plot: panels chosen from the metrics present, runs overlaid, resumed steps
deduplicated, a real PNG written."""
import json

import pytest

pytest.importorskip("matplotlib")

from RL2.tools.plot import main, plot  # noqa: E402


def write_run(path, rows):
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def ppo_rows(offset=0.0, turns=1.0, kl=0.0):
    rows = [{"step": 0, "time": 0.0, "test/reward": 0.2 + offset, "test/response_length": 3.0, "test/turns": turns}]
    for s in range(1, 5):
        rows.append({"step": s, "time": float(s), "rollout/reward": 0.1 * s + offset,
                     "rollout/response_length": 4.0, "rollout/turns": turns + s * (turns > 1),
                     "actor/loss": -0.01 * s, "actor/entropy": 1.0, "actor/approx_kl": kl * s,
                     "time/rollout": 0.5, "time/update": 0.2, "time/sync": 0.1, "time/step": 0.8})
    rows.append({"step": 4, "time": 5.0, "test/reward": 0.6 + offset})
    return rows


def lines(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_one_ppo_run(tmp_path):
    # A crash after step 3 and a resume from step 2 log step 3 twice: the last value wins.
    rows = ppo_rows()
    rows.insert(3, {"step": 3, "time": 2.5, "rollout/reward": 9.0})
    run = write_run(tmp_path / "ppo", rows)
    fig = plot([run], str(tmp_path / "out" / "c.png"))
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    # Single-turn, one update per rollout: the constant "turns" and "KL" panels are left out; no
    # SFT/RM accuracy panel.
    assert list(axes) == ["reward", "loss", "entropy", "response length", "step time"]
    reward = lines(axes["reward"])
    assert reward["rollout/reward"] == ([1, 2, 3, 4], [0.1, 0.2, pytest.approx(0.3), 0.4])
    assert reward["test/reward"] == ([0, 4], [0.2, 0.6])
    # One run: the step time is broken down (stacked areas, one per part).
    assert [t.get_text() for t in axes["step time"].get_legend().get_texts()] == ["time/rollout", "time/update", "time/sync"]
    assert len(axes["step time"].collections) == 3
    png = (tmp_path / "out" / "c.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_runs_overlaid_and_default_output(tmp_path, capsys):
    a = write_run(tmp_path / "a" / "ppo", ppo_rows(turns=2.0, kl=0.01))
    b = write_run(tmp_path / "b" / "ppo", ppo_rows(offset=0.1, turns=2.0))
    sft = write_run(tmp_path / "sft", [{"step": 0, "time": 0.0, "test/loss": 3.0},
                                       {"step": 1, "time": 1.0, "train/loss": 2.5, "train/step_time": 0.3},
                                       {"step": 2, "time": 2.0, "train/loss": 2.0, "test/loss": 2.2}])
    main([a, b, sft])
    out = capsys.readouterr().out.strip()
    assert out == str(tmp_path / "a" / "ppo" / "curves.png") and (tmp_path / "a" / "ppo" / "curves.png").exists()
    fig = plot([a, b, sft], str(tmp_path / "x.png"))
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert "turns" in axes and "KL" in axes  # they change in these runs
    # Same directory names: legends use enough of the path to tell runs apart.
    assert set(lines(axes["reward"])) == {"a/ppo: rollout/reward", "a/ppo: test/reward",
                                          "b/ppo: rollout/reward", "b/ppo: test/reward"}
    assert lines(axes["loss"])["sft: test/loss"] == ([0, 2], [3.0, 2.2])
    # Several runs: each run's total step time.
    assert set(lines(axes["step time"])) == {"a/ppo: time/step", "b/ppo: time/step", "sft: train/step_time"}
    assert fig.legends[0].get_texts()[2].get_text() == "sft"


def test_clear_errors(tmp_path):
    with pytest.raises(SystemExit, match="no metrics file"):
        plot([str(tmp_path)], str(tmp_path / "c.png"))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0}\nnot json\n')
    with pytest.raises(SystemExit, match="metrics.jsonl:2: not JSON"):
        plot([str(tmp_path)], str(tmp_path / "c.png"))
