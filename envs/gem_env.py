"""Any GEM environment (the `gem-llm` package, `gem.make(env_id)`) as an RL2 environment.

Keys read from extra_info (prompt row values win over `actor.rollout.env_args`):
    env_id          GEM id, e.g. "game:GuessTheNumber-v0-easy", "rg:countdown" (required)
    seed            seed for env.reset (optional; rows of one prompt share it, so the n samples
                    of a GRPO group play the same game)
    env_kwargs      dict of keyword arguments for gem.make (optional)
    chat_template   "chatml" (default): observations become user turns
                    `<|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n`; "none": plain
                    text, each observation on its own line.
Prompt rows need no prompt: `reset` creates the game and returns its first observation.

One GEM object per trajectory, keyed by extra_info["uid"] (set by the rollout): created in
`reset` (or lazily by the first `step` when the row had a prompt), released when GEM says
terminated/truncated or when the rollout calls `close` (also after a failure). Every later turn
extends `state + action`, so the rollout keeps one sequence per trajectory.

The hooks are synchronous on purpose: the rollout runs sync hooks in env worker processes
(`actor.rollout.env_workers`, RL2/rollout/env_workers.py) that are killed and replaced on timeout,
and sends every call of one trajectory to the same worker, so `_ENVS` below lives there.
"""
from typing import Any

try:
    import gem
except ImportError as e:
    raise ImportError("envs/gem_env.py needs GEM: install the `gem` extra or `pip install gem-llm`") from e

_ENVS: dict[str, Any] = {}   # uid -> live GEM env; each uid is touched by one trajectory only
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def _create(extra_info: dict):
    env_id = extra_info.get("env_id")
    if not env_id:
        raise KeyError("gem_env needs extra_info['env_id'] (from the prompt row or env_args)")
    env = gem.make(env_id, **dict(extra_info.get("env_kwargs") or {}))
    obs, info = env.reset(seed=extra_info.get("seed"))
    _ENVS[extra_info["uid"]] = env
    return obs, info


def _release(uid: str) -> None:
    env = _ENVS.pop(uid, None)
    close = getattr(env, "close", None)
    if callable(close):
        close()


def _user_turn(obs: str, template: str) -> str:
    if template == "chatml":
        return f"<|im_start|>user\n{obs}<|im_end|>\n<|im_start|>assistant\n"
    if template == "none":
        return obs if obs.endswith("\n") else obs + "\n"
    raise ValueError(f"gem_env: chat_template must be 'chatml' or 'none', got {template!r}")


def reset(extra_info: dict) -> str:
    obs, _ = _create(extra_info)
    return _user_turn(obs, extra_info.get("chat_template", "chatml"))


def step(state: str, action: str, extra_info: dict) -> dict:
    uid = extra_info["uid"]
    if uid not in _ENVS:
        _create(extra_info)
    move = action
    for end in _END_TOKENS:  # GEM parses plain text; the chat end token is ours, not the move
        move = move.removesuffix(end)
    obs, reward, terminated, truncated, info = _ENVS[uid].step(move)
    if terminated or truncated:
        _release(uid)
        return {"next_state": None, "reward": float(reward), "done": True}
    if info.get("suffix"):
        obs = f"{obs}\n{info['suffix']}"
    template = extra_info.get("chat_template", "chatml")
    if template == "chatml":
        # Close the assistant turn if the engine stopped without the end token (e.g. length).
        sep = "\n" if action.endswith("<|im_end|>") else "<|im_end|>\n"
    else:
        sep = "" if action.endswith("\n") else "\n"
    return {"next_state": state + action + sep + _user_turn(obs, template),
            "reward": float(reward), "done": False}


def close(extra_info: dict) -> None:
    _release(extra_info["uid"])
