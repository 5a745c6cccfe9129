"""Shared by the disaggregated-rollout tests (RL2 servers, fake SGLang servers): the env, the
PPO arguments, the colocated reference runs and the in-flight update check."""
import json

import pytest

from tests.run_utils import min_version, read_metrics, run_trainer

# Two turns, a reward that depends on every generated character (so advantages and losses are
# not all zero on the random tiny model), and an optional fault: on its first call the env
# SIGKILLs the processes named in RL2_TEST_KILL_PIDS (once per run: a marker file).
ENV = '''
import os, signal


async def step(state, action, extra_info):
    pids, marker = os.environ.get("RL2_TEST_KILL_PIDS"), os.environ.get("RL2_TEST_KILL_MARKER")
    if pids and not os.path.exists(marker):
        open(marker, "w").close()
        for pid in pids.split(","):
            os.killpg(int(pid), signal.SIGKILL)
    turn = extra_info.get("turn", 0)
    reward = (sum(map(ord, action)) % 7) / 7.0
    if turn == 1:
        return {"next_state": None, "reward": reward, "done": True}
    return {"next_state": state + action + " and then", "reward": reward, "done": False,
            "extra_info": {**extra_info, "turn": 1}}
'''
KEYS = ("rollout/reward", "rollout/response_length", "adv/mean", "actor/loss", "actor/grad_norm",
        "actor/entropy")


@pytest.fixture(scope="module")
def env_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("disagg_env") / "env.py"
    path.write_text(ENV)
    return str(path)


def args(assets, env_path, *extra):
    return [f"actor.model_name={assets['model']}", f"data.train.path={assets['data']}/ppo_train.jsonl",
            f"actor.rollout.env_path={env_path}", "actor.rollout.engine=torch", "actor.rollout.max_turns=2",
            "actor.lr=1e-3", "actor.strict_on_policy=true",  # engine vs trainer log-probs checked, engine_kl
            "actor.rollout.prompts_per_rollout=4", "actor.rollout.responses_per_prompt=4",
            "actor.rollout.train_sampling_params.max_new_tokens=8", "actor.rollout.env_workers=0",
            "trainer.total_steps=3", *extra]


def disaggregated(servers, *extra):
    return ["actor.rollout.placement=disaggregated", f"actor.rollout.servers=[{','.join(servers)}]",
            "actor.rollout.health_timeout=5", *extra]


def rows(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if "rollout/reward" in r]


def assert_same_run(got, want):
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        for key in KEYS:
            assert g[key] == w[key], (g["step"], key, g[key], w[key])
        assert abs(g["rollout/engine_kl"]) < 1e-5  # the servers hold the trainer's weights
    assert len({r["rollout/reward"] for r in want}) > 1 and any(r["actor/loss"] != 0 for r in want)


@pytest.fixture(scope="module")
def colocated(assets, env_path, tmp_path_factory):
    runs = {}

    def get(nproc):
        if nproc not in runs:
            runs[nproc] = tmp_path_factory.mktemp(f"colocated{nproc}")
            run_trainer("ppo", nproc, args(assets, env_path), runs[nproc])
        return rows(runs[nproc])
    return get


SLOW_ENV = '''
import asyncio


async def step(state, action, extra_info):
    turn = extra_info.get("turn", 0)
    await asyncio.sleep(0.2)  # a tool call: rollouts outlast the update, so weights land mid-batch
    if turn == 2:
        return {"next_state": None, "reward": (sum(map(ord, action)) % 7) / 7.0, "done": True}
    return {"next_state": state + action + " again:", "reward": 0.0, "done": False,
            "extra_info": {**extra_info, "turn": turn + 1}}
'''


def check_inflight_updates(assets, servers, tmp_path, mode):
    """max_staleness=1 with in-flight updates: each new version is pushed to the servers as soon
    as it is published (running requests aborted and continued / restarted); every trained
    token is at most one version old and later tokens come from newer weights."""
    (tmp_path / "env.py").write_text(SLOW_ENV)
    run = args(assets, str(tmp_path / "env.py"), *disaggregated(servers), "actor.strict_on_policy=false",
               "actor.rollout.max_turns=3", "actor.rollout.max_staleness=1",
               f"actor.rollout.inflight_update={mode}", "actor.rollout.train_sampling_params.max_new_tokens=24",
               "actor.is_correction=seq_mis", "actor.is_high=10", "trainer.total_steps=5")
    run_trainer("ppo", 1, run, tmp_path / "out")
    got = rows(tmp_path / "out")
    assert len(got) == 5 and all(r["rollout/failed"] == 0 and r["async/dropped_stale"] == 0 for r in got)
    assert got[-1]["rollout/inflight_updates"] >= 1  # a pause per version published mid-batch (timing)
    root = tmp_path / "out" / "run" / "rollouts"
    trajs = {s: [json.loads(line) for line in (root / f"step{s}.jsonl").read_text().splitlines()]
             for s in range(1, 6)}
    assert all(s - 1 - min_version(t) <= 1 for s in trajs for t in trajs[s])
    versions = {s: {v for t in trajs[s] for turn in t["turns"] for v, _ in turn["versions"]} for s in trajs}
    assert max(max(v) for v in versions.values()) >= 3
    # weights changed in the middle of a batch (with inflight_update=none each batch has one version)
    assert any(len(v) > 1 for v in versions.values()), versions
