"""Mixed datasets: config parsing, per-step counts by hand, the sampler's determinism and
coverage, and a PPO run whose batches and metrics follow the sources (slow)."""
import json

import pytest

from RL2.data.mixture import MixtureSampler, parse_sources, step_counts
from tests.run_utils import ANSWER_MATCH, read_metrics, run_trainer


def test_parse_sources():
    assert parse_sources("a.jsonl") is None
    assert parse_sources([{"path": "d/a.jsonl", "weight": 0.7}, "b.parquet"]) == [
        {"path": "d/a.jsonl", "weight": 0.7, "name": "a"}, {"path": "b.parquet", "weight": 1.0, "name": "b"}]


@pytest.mark.parametrize("cfg,message", [
    ([{"path": "a", "weight": 0}], r"entry 0 \(a\): weight must be a number > 0"),
    ([{"path": "a", "weight": "x"}], "weight must be a number"),
    ([{"weight": 1}], "entry 0 .*give `path`"),
    ([{"path": "a", "ratio": 1}], r"unknown keys \['ratio'\]"),
    (["x/a.jsonl", "y/a.jsonl"], "distinct names"),
    ([], "empty list"),
])
def test_bad_sources_name_the_entry(cfg, message):
    with pytest.raises(ValueError, match=message):
        parse_sources(cfg)


def test_step_counts_by_hand():
    # shares 2.8 / 1.2 per step of 4; remainders carried: 14 / 6 rows after 5 steps exactly
    assert step_counts([0.7, 0.3], 4, 5) == [[3, 1], [3, 1], [2, 2], [3, 1], [3, 1]]
    counts = step_counts([2, 1, 1], 3, 40)  # weights need not sum to 1
    assert all(sum(c) == 3 for c in counts)
    totals = [sum(c[i] for c in counts) for i in range(3)]
    assert totals == [60, 30, 30]


def test_sampler_is_deterministic_and_covers_each_source_per_pass():
    sizes = [5, 20]
    s = MixtureSampler(sizes, [0.5, 0.5], 4, seed=3)
    batches = [s.batch(step) for step in range(10)]
    fresh = MixtureSampler(sizes, [0.5, 0.5], 4, seed=3)
    assert fresh.batch(7) == batches[7]  # resume: a pure function of (seed, step)
    assert MixtureSampler(sizes, [0.5, 0.5], 4, seed=4).batch(0) != batches[0]
    drawn = [i for b in batches for i in b]
    small = [i for i in drawn if i < 5]
    big = [i for i in drawn if i >= 5]
    assert len(small) == len(big) == 20  # 2 + 2 per step
    for p in range(4):  # source 0 (5 rows) is gone through 4 times, each a permutation
        assert sorted(small[5 * p:5 * p + 5]) == list(range(5))
    assert sorted(big) == list(range(5, 25))


@pytest.mark.slow
def test_ppo_batches_and_metrics_follow_the_sources(assets, tmp_path):
    rows = [json.loads(line) for line in open(f"{assets['data']}/ppo_train.jsonl")]
    for name, part in (("easy", rows[:40]), ("hard", rows[40:100])):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    mix = f"[{{path: {tmp_path / 'easy.jsonl'}, weight: 3}}, {{path: {tmp_path / 'hard.jsonl'}, weight: 1}}]"
    run_trainer("ppo", 1, [f"actor.model_name={assets['model']}", f"data.train.path={mix}",
                           f"actor.rollout.env_path={ANSWER_MATCH}", "actor.rollout.prompts_per_rollout=4",
                           "actor.rollout.responses_per_prompt=2", "data.test_ratio=0.1",
                           "actor.rollout.train_sampling_params.max_new_tokens=2",
                           "actor.rollout.test_sampling_params.max_new_tokens=2", "trainer.total_steps=2",
                           "trainer.test_freq=2"], tmp_path / "out")
    for step in (1, 2):
        dump = (tmp_path / "out" / "run" / "rollouts" / f"step{step}.jsonl").read_text().splitlines()
        sources = [json.loads(t)["extra_info"]["data_source"] for t in dump]
        assert sources.count("easy") == 6 and sources.count("hard") == 2  # 3:1 of 4 prompts x 2
    m = read_metrics(tmp_path / "out")
    train = [r for r in m if "rollout/easy/mean@2" in r]
    assert len(train) == 2 and all("rollout/hard/mean@2" in r for r in train)
    test = [r for r in m if "test/easy/mean@1" in r]
    assert test and "test/hard/mean@1" in test[0]  # each source's held-out rows, grouped
