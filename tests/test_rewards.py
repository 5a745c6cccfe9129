"""Composable reward functions: registry, weights, the shipped think_format reward and env, and
per-component logging; an end-to-end run where the composed reward rises (slow)."""
import asyncio
from pathlib import Path

import pytest

from RL2.rollout import rewards
from RL2.rollout.env import load_env
from RL2.rollout.rollout import Rollout
from tests.fakes import traj

ENV = str(Path(__file__).resolve().parents[1] / "envs" / "composed_reward.py")


def test_builtin_rewards_by_hand():
    assert rewards.answer_match("so 3 + 4 = 7", {"answer": "7"}) == 1.0
    assert rewards.answer_match("7 or maybe 8", {"answer": 7}) == 0.0
    assert rewards.answer_match("7", {"answer": "seven"}) == 0.0
    assert rewards.length_penalty("x" * 50, {"length_limit": 200}) == -0.25
    assert rewards.length_penalty("x" * 500, {"length_limit": 200}) == -1.0


def test_compose_weights_and_components():
    fn = rewards.compose({"answer_match": 1.0, "length_penalty": 0.5})
    total, parts = fn("12", {"answer": "12", "length_limit": 8})
    assert parts == {"answer_match": 1.0, "length_penalty": -0.25}
    assert total == 1.0 - 0.125


def test_compose_rejects_unknown_names_and_bad_weights():
    with pytest.raises(ValueError, match=r"unknown reward\(s\) \['nope'\]; registered: .*answer_match"):
        rewards.compose({"answer_match": 1.0, "nope": 1.0})
    with pytest.raises(ValueError, match="weight of reward 'answer_match' must be a number"):
        rewards.compose({"answer_match": "high"})
    with pytest.raises(ValueError, match="already registered"):
        rewards.register("answer_match")(lambda a, e: 0.0)


def test_shipped_env_combines_answer_and_think_format():
    env = load_env(ENV, {"rewards": {"answer_match": 1.0, "think_format": 0.5}})
    info = env.initial_extra_info({"answer": "5"}, uid="u")
    cases = {
        "<think>2 + 3 is 5</think> 5": (1.5, 1.0, 1.0),
        "<think> </think> 5": (1.0, 0.0, 1.0),        # an empty think block is not the format
        "5": (1.0, 0.0, 1.0),
        "<think>hmm</think> 6": (0.5, 1.0, 0.0),
        "<think>no answer after</think>": (0.0, 0.0, 0.0),
    }
    for action, (total, fmt, score) in cases.items():
        res = asyncio.run(env.step("prompt", action, info))
        assert res["reward"] == total and res["score"] == score, action
        assert res["extra_info"]["reward_components"] == {"answer_match": score, "think_format": fmt}
    load_env(ENV, {})  # loading the script again re-registers its own reward without error


def test_rollout_logs_each_component():
    groups = [[traj(1.0, "a"), traj(0.0, "a")]]
    groups[0][0].extra_info["reward_components"] = {"answer_match": 1.0, "think_format": 1.0}
    groups[0][1].extra_info["reward_components"] = {"answer_match": 0.0, "think_format": 1.0}
    m = Rollout.metrics(groups, 2)
    assert m["reward/answer_match"] == 0.5 and m["reward/think_format"] == 1.0
