"""Single-turn env: reward 1 when the last number in the response equals extra_info["answer"].

Works with the arithmetic prompts made by `python -m RL2.tools.make_assets` (ppo_*.jsonl) and any
dataset whose rows carry `extra_info: {"answer": ...}`. The response is only searched with a
regular expression; nothing in it is executed.
"""
import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


async def step(state: str, action: str, extra_info: dict) -> dict:
    numbers = _NUMBER.findall(action)
    answer = str(extra_info.get("answer", "")).strip()
    reward = 1.0 if numbers and answer and float(numbers[-1]) == float(answer) else 0.0
    return {"next_state": None, "reward": reward, "score": reward, "done": True}
