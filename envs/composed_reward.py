"""Single-turn env whose reward is a weighted sum of named reward functions (RL2/rollout/rewards.py).

    actor.rollout.env_path=envs/composed_reward.py \
    '+actor.rollout.env_args.rewards={answer_match: 1.0, think_format: 0.5, length_penalty: 0.1}'

Ships the `think_format` reward: 1 when the response is a non-empty <think>...</think> block
followed by an answer, else 0. Built-ins: `answer_match` (last number == extra_info["answer"]),
`length_penalty` (-len / extra_info["length_limit"]). The score (pass@k, mean@k) is the answer
match when it is used, else the total. Each component is logged as rollout/reward/<name>.
"""
import re

from RL2.rollout.rewards import compose, register

_THINK = re.compile(r"\s*<think>(.+?)</think>\s*\S", re.DOTALL)


@register("think_format")
def think_format(action: str, extra_info: dict) -> float:
    match = _THINK.match(action)
    return float(bool(match and match.group(1).strip()))


_reward = compose({"answer_match": 1.0})


def configure(rewards: dict | None = None, **_):
    global _reward
    if rewards is not None:
        _reward = compose(dict(rewards))


async def step(state: str, action: str, extra_info: dict) -> dict:
    total, parts = _reward(action, extra_info)
    score = parts.get("answer_match", total)
    return {"next_state": None, "reward": total, "score": score, "done": True,
            "extra_info": {**extra_info, "reward_components": parts}}
