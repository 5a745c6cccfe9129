"""Composable reward functions: an env script combines named rewards with weights from config.

    from RL2.rollout.rewards import compose, register

    @register("my_reward")
    def my_reward(action: str, extra_info: dict) -> float: ...

    reward_fn = compose({"answer_match": 1.0, "think_format": 0.2})   # e.g. from env_args
    total, parts = reward_fn(action, extra_info)    # parts: {name: unweighted value}

Put `parts` into the step's `extra_info["reward_components"]` and the rollout logs the mean of
each component (`rollout/reward/<name>`). envs/composed_reward.py is a ready env script.
"""
import re
from typing import Callable

RewardFn = Callable[[str, dict], float]
REGISTRY: dict[str, RewardFn] = {}


def register(name: str):
    """Decorator: make `fn(action, extra_info) -> float` available to `compose` as `name`."""
    def wrap(fn: RewardFn) -> RewardFn:
        old = REGISTRY.get(name)
        # the same function loaded again (an env script imported twice) may replace itself
        same = old is not None and (old.__qualname__, old.__code__.co_filename) == \
            (fn.__qualname__, fn.__code__.co_filename)
        if old is not None and not same:
            raise ValueError(f"reward {name!r} is already registered ({REGISTRY[name].__module__})")
        REGISTRY[name] = fn
        return fn
    return wrap


def compose(weights: dict) -> Callable[[str, dict], tuple[float, dict]]:
    """A function (action, extra_info) -> (sum of weight * reward, {name: reward}). Unknown names
    or non-numeric weights raise at once (at env load), naming the key."""
    if not weights:
        raise ValueError("compose needs at least one {reward name: weight}")
    unknown = [n for n in weights if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown reward(s) {unknown}; registered: {sorted(REGISTRY)}")
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise ValueError(f"weight of reward {name!r} must be a number, got {w!r}")
    weights = {n: float(w) for n, w in weights.items()}

    def reward(action: str, extra_info: dict) -> tuple[float, dict]:
        parts = {n: float(REGISTRY[n](action, extra_info)) for n in weights}
        return sum(weights[n] * parts[n] for n in weights), parts
    return reward


# ----- built-in rewards -----
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@register("answer_match")
def answer_match(action: str, extra_info: dict) -> float:
    """1 when the last number of the action equals extra_info["answer"], else 0."""
    numbers = _NUMBER.findall(action)
    answer = str(extra_info.get("answer", "")).strip()
    try:
        return float(bool(numbers) and bool(answer) and float(numbers[-1]) == float(answer))
    except ValueError:  # a non-numeric gold answer never matches a number
        return 0.0


@register("length_penalty")
def length_penalty(action: str, extra_info: dict) -> float:
    """-len(action) / extra_info["length_limit"] (characters; default 1000), at least -1."""
    return -min(1.0, len(action) / float(extra_info.get("length_limit", 1000)))
