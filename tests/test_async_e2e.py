"""Asynchronous rollout end to end under torchrun (2 gloo ranks, tiny model): kill and resume at
max_staleness=2 trains every prompt exactly once and repeats the uninterrupted run; the weight
versions of every trained token respect the staleness bound; in-flight updates (pause) run."""
import json
from pathlib import Path

import pytest

from tests.run_utils import min_version, read_metrics, run_trainer

pytestmark = pytest.mark.slow
ANSWER_MATCH = str(Path(__file__).resolve().parents[1] / "envs" / "answer_match.py")


def args(assets, *extra):
    return [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/ppo_train.jsonl",
            f"actor.rollout.env_path={ANSWER_MATCH}", "actor.lr=1e-3",
            "actor.rollout.prompts_per_rollout=8", "actor.rollout.responses_per_prompt=2",
            "actor.rollout.train_sampling_params.max_new_tokens=6", *extra]


def dumps(run_dir, steps):
    """{step: [trajectory records]} of the rollout dumps (the trained batches)."""
    root = Path(run_dir) / "run" / "rollouts"
    return {s: [json.loads(line) for line in (root / f"step{s}.jsonl").read_text().splitlines()]
            for s in steps}



def test_resume_after_kill_at_k2_trains_every_prompt_once(assets, tmp_path):
    run = args(assets, "actor.rollout.max_staleness=2", "actor.is_correction=mis", "trainer.total_steps=6",
               f"data.test.path={assets['data']}/ppo_test.jsonl", "trainer.test_freq=3")
    straight = tmp_path / "straight"
    run_trainer("ppo", 2, run, straight)
    resumed = tmp_path / "resumed"
    # SIGKILLed in the middle of step 4 (its batch taken, its update starting; step 3 logged);
    # the checkpoint of step 2 holds the generated batches of steps 3-5, the producer was
    # generating further ones
    proc = run_trainer("ppo", 2, run + ["trainer.save_freq=2"], resumed, sigkill_in_update=4, check=False)
    assert proc.returncode != 0 and (resumed / "run" / "latest").read_text() == "step2"
    assert max(r["step"] for r in read_metrics(resumed)) == 3  # died inside step 4
    run_trainer("ppo", 2, run + ["trainer.load_ckpt_from=latest"], resumed)

    steps = range(1, 7)
    want, got = dumps(straight, steps), dumps(resumed, steps)
    assert got == want  # the same trajectories, each step once
    # every prompt id trained exactly once (48 of the 64 prompts in one epoch)
    ids = [t["uid"].split("-")[1] for s in steps for t in got[s] if t["uid"].endswith("-0")]
    assert len(ids) == 6 * 8 and len(set(ids)) == len(ids)
    # staleness: step s (version s - 1 trains) used exactly version max(0, s - 1 - 2): the bound
    for s in steps:
        assert {min_version(t) for t in got[s]} == {max(0, s - 3)}
        assert all(s - 1 - min_version(t) <= 2 for t in got[s])
    w = {r["step"]: r for r in read_metrics(straight) if "actor/loss" in r}
    g = {r["step"]: r for r in read_metrics(resumed) if "actor/loss" in r}
    assert sorted(g) == list(steps)
    for s in steps:
        for key in ("rollout/reward", "actor/loss", "actor/grad_norm", "off_policy/masked_ratio",
                    "async/staleness_max"):
            assert g[s][key] == w[s][key], (s, key, g[s][key], w[s][key])
        assert g[s]["async/staleness_max"] == min(s - 1, 2) and g[s]["async/dropped_stale"] == 0
    tests = [r["step"] for r in read_metrics(straight) if "test/reward" in r]
    assert tests == [0, 3, 6]  # test_at_start, then every 3 steps (the producer parked)


SLOW_ENV = '''
import asyncio


async def step(state, action, extra_info):
    turn = extra_info.get("turn", 0)
    await asyncio.sleep(0.05)
    if turn == 2:
        return {"next_state": None, "reward": float("1" in action), "done": True}
    return {"next_state": state + action + " again:", "reward": 0.0, "done": False,
            "extra_info": {**extra_info, "turn": turn + 1}}
'''


def test_inflight_pause_keeps_the_staleness_bound(assets, tmp_path):
    (tmp_path / "env.py").write_text(SLOW_ENV)
    run_trainer("ppo", 2, args(assets, f"actor.rollout.env_path={tmp_path / 'env.py'}", "actor.rollout.max_turns=3",
                               "actor.rollout.max_staleness=1", "actor.rollout.inflight_update=pause",
                               "actor.rollout.train_sampling_params.max_new_tokens=24",
                               "actor.is_correction=seq_mis", "actor.is_high=10", "trainer.total_steps=5"),
                tmp_path / "out")
    got = dumps(tmp_path / "out", range(1, 6))
    versions = [v for s in got for t in got[s] for turn in t["turns"] for v, _ in turn["versions"]]
    for s, trajs in got.items():
        assert all(s - 1 - min_version(t) <= 1 for t in trajs)
    assert max(versions) >= 3  # later batches were generated with newer weights
    rows = [r for r in read_metrics(tmp_path / "out") if "actor/loss" in r]
    assert len(rows) == 5 and all(r["async/dropped_stale"] == 0 for r in rows)
