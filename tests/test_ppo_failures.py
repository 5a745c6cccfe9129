"""PPO trainer under misbehaving environments: a step that raises, hangs or returns malformed
dicts is counted, logged and dumped with its error, its group is left out of the update, and
the run stops only above max_failed_ratio; a missing or step-less env script is a clear error
before any model loads."""
import json
import textwrap

import pytest

from tests.run_utils import read_metrics, run_trainer

# The answer of each prompt row selects a behaviour.
FLAKY_ENV = '''
import time


def step(state, action, extra_info):  # sync: a hang blocks its thread, the timeout still fires
    answer = extra_info["answer"]
    if answer == "raise":
        raise ValueError("boom from the env")
    if answer == "hang":
        time.sleep(600)
    if answer == "no_done":
        return {"next_state": None, "reward": 1.0}
    if answer == "bad_reward":
        return {"next_state": None, "reward": "high", "done": True}
    return {"next_state": None, "reward": float(len(action) % 2), "done": True}
'''
BEHAVIOURS = ["raise", "hang", "no_done", "bad_reward", "ok", "ok"]
ERRORS = {"raise": "ValueError: boom from the env", "hang": "EnvTimeout: step() of env",
          "no_done": "returned no 'done'", "bad_reward": "'reward' must be a number"}


@pytest.fixture
def flaky(tmp_path):
    env = tmp_path / "flaky_env.py"
    env.write_text(textwrap.dedent(FLAKY_ENV))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus 1?", "extra_info": {"answer": b}}) + "\n"
                            for i, b in enumerate(BEHAVIOURS)))
    return str(env), str(data)


def flaky_args(assets, flaky, *extra):
    env, data = flaky
    return [f"actor.model_name={assets['model']}", f"data.train.path={data}", f"actor.rollout.env_path={env}",
            "actor.rollout.env_timeout=2", "actor.rollout.prompts_per_rollout=6",
            "actor.rollout.responses_per_prompt=2", "actor.rollout.train_sampling_params.max_new_tokens=4",
            "trainer.total_steps=1", *extra]


def dumped(run_dir):
    return [json.loads(line) for line in (run_dir / "run" / "rollouts" / "step1.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_failed_trajectories_are_counted_dumped_and_left_out(assets, flaky, tmp_path):
    run_trainer("ppo", 2, flaky_args(assets, flaky, "actor.rollout.max_failed_ratio=0.8"), tmp_path)
    row = next(r for r in read_metrics(tmp_path) if "rollout/failed" in r)
    assert row["rollout/failed"] == 8 and row["rollout/failed_groups"] == 4
    assert "actor/loss" in row  # the two good groups were trained on
    by_answer = {}
    for t in dumped(tmp_path):
        by_answer.setdefault(t["extra_info"]["answer"], []).append(t)
    for behaviour, error in ERRORS.items():
        for t in by_answer[behaviour]:
            assert t["failed"] and error in t["error"] and t["group_status"] == "failed", t
            assert error in t["turns"][0]["error"]
    assert all(not t["failed"] and t["group_status"] == "kept" for t in by_answer["ok"])


@pytest.mark.slow
def test_failures_above_the_budget_stop_the_run_with_the_errors(assets, flaky, tmp_path):
    proc = run_trainer("ppo", 1, flaky_args(assets, flaky), tmp_path, check=False)  # default budget 0.5
    assert proc.returncode != 0
    assert "8/12 trajectories failed, more than actor.rollout.max_failed_ratio=0.5" in proc.stderr
    assert "ValueError: boom from the env" in proc.stderr
    assert sum(t["failed"] for t in dumped(tmp_path)) == 8  # dumped before stopping


@pytest.mark.parametrize("script,message", [
    (None, "environment error: env_path .*missing_env.py does not exist"),
    ("def reset(extra_info):\n    return 'hi'\n", "environment error: env_path .* defines no step"),
    ("import not_a_module_anywhere\n", "environment error: importing env_path .* failed: ModuleNotFoundError"),
])
def test_bad_env_path_is_a_clear_error_before_any_model_loads(assets, tmp_path, script, message):
    from RL2.trainer.ppo import PPOTrainer
    from RL2.utils.config import load_config

    env = tmp_path / "missing_env.py"
    if script is not None:
        env.write_text(script)
    # The model path does not exist either: the env is checked first, before the process group,
    # the tokenizer or any model.
    cfg = load_config("ppo", ["actor.model_name=/no/such/model", f"data.train.path={assets['data']}/ppo_train.jsonl",
                              f"actor.rollout.env_path={env}"])
    with pytest.raises(SystemExit, match=message):
        PPOTrainer(cfg)


def test_missing_env_path_under_torchrun(assets, tmp_path):
    proc = run_trainer("ppo", 1, [f"actor.model_name={assets['model']}",
                                  f"data.train.path={assets['data']}/ppo_train.jsonl",
                                  f"actor.rollout.env_path={tmp_path}/nope.py"], tmp_path, check=False)
    assert proc.returncode != 0
    assert f"env_path {tmp_path}/nope.py does not exist" in proc.stderr
    assert "Applied FSDP" not in proc.stderr + proc.stdout
