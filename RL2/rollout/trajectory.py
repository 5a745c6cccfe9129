"""One multi-turn trajectory: engine.generate <-> env.step, turned into training samples.

Token-in, token-out: the engine continues from token ids, the generated ids are kept as they are
(never re-tokenised) and only text produced by the environment is tokenised. When the new state
extends `state + action` (compared as decoded text with special tokens kept), only the new suffix
is tokenised and appended to the SAME sequence (environment tokens, action_mask 0); otherwise the
sequence is closed and a new one starts from the tokenised next_state. Each sequence becomes one
Sample in the DEV_SPEC layout (per-token tensors aligned to label positions).
"""
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from RL2.rollout.env import Env
from RL2.utils.seeding import derive_seed

logger = logging.getLogger(__name__)


@dataclass
class Trajectory:
    uid: str
    prompt_text: str = ""
    samples: list[dict[str, torch.Tensor]] = field(default_factory=list)  # one per sequence
    reward: float = 0.0          # sum of turn rewards (what lands on the action tokens)
    score: float = 0.0           # sum of turn scores (a metric; defaults to the rewards)
    num_turns: int = 0           # number of generate calls
    failed: bool = False         # an env hook raised, timed out or returned a malformed dict
    error: str | None = None
    truncated: bool = False      # stopped by max_turns / max_length before the env said done
    turns: list[dict] = field(default_factory=list)   # per-turn record for the rollout JSONL
    extra_info: dict = field(default_factory=dict)    # as after the last step

    @property
    def min_version(self) -> int | None:
        """The oldest weight version any of its tokens was generated with (None: unrecorded)."""
        versions = [v for t in self.turns for v, _ in t.get("versions", ())]
        return min(versions) if versions else None

    @property
    def num_action_tokens(self) -> int:
        return int(sum(s["action_mask"].sum().item() for s in self.samples))

    def to_json(self) -> dict:
        """A JSON-serialisable record (non-JSON values in extra_info become their repr)."""
        record = {
            "uid": self.uid, "prompt": self.prompt_text, "turns": self.turns,
            "reward": self.reward, "score": self.score, "num_turns": self.num_turns,
            "failed": self.failed, "error": self.error, "truncated": self.truncated,
            "num_sequences": len(self.samples), "num_action_tokens": self.num_action_tokens,
            "extra_info": self.extra_info,
        }
        return json.loads(json.dumps(record, default=repr))


class _Sequence:
    """Token ids of one growing sequence with per-token flags, indexed by token position."""

    def __init__(self, ids: list[int]):
        self.ids = list(ids)
        self.is_action = [0.0] * len(ids)
        self.logps = [0.0] * len(ids)
        self.rewards = [0.0] * len(ids)

    def add(self, ids: list[int], action: bool, logps: list[float] | None = None):
        self.ids += ids
        self.is_action += [1.0 if action else 0.0] * len(ids)
        self.logps += list(logps) if logps is not None else [0.0] * len(ids)
        self.rewards += [0.0] * len(ids)

    def last_action_index(self) -> int | None:
        for i in range(len(self.ids) - 1, -1, -1):
            if self.is_action[i]:
                return i
        return None

    def to_sample(self) -> dict[str, torch.Tensor]:
        # Label-aligned: position t predicts ids[t+1], so every per-token flag shifts by one.
        return {
            "input_ids": torch.tensor(self.ids[:-1], dtype=torch.long),
            "labels": torch.tensor(self.ids[1:], dtype=torch.long),
            "action_mask": torch.tensor(self.is_action[1:], dtype=torch.float32),
            "engine_logps": torch.tensor(self.logps[1:], dtype=torch.float32),
            "rewards": torch.tensor(self.rewards[1:], dtype=torch.float32),
        }


_TOKEN_CHARS: dict[int, int] = {}


def _max_token_chars(tokenizer) -> int:
    """Longest text one token can stand for (in characters, bytes for byte-level BPE): any text of
    k * this many characters has at least k tokens, so cutting env text there keeps every token
    that can fit."""
    key = id(tokenizer)
    if key not in _TOKEN_CHARS:
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        _TOKEN_CHARS[key] = max(1, max(len(t) for t in tokens if t is not None))
    return _TOKEN_CHARS[key]


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _decode(tokenizer, ids: list[int]) -> str:
    # Special tokens kept and no space clean-up: the env must see what the tokens really say.
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _turn_params(params, turn: int, room: int | None):
    """One sample per call (each sample of a prompt is its own trajectory with its own env); a
    distinct, reproducible seed per turn; max_new_tokens capped by the room left in the sequence."""
    changes: dict[str, Any] = {}
    if getattr(params, "n", 1) != 1:
        changes["n"] = 1
    if getattr(params, "seed", None) is not None:
        changes["seed"] = derive_seed(params.seed, "turn", turn)
    if room is not None and params.max_new_tokens > room:
        changes["max_new_tokens"] = room
    return dataclasses.replace(params, **changes) if changes else params


class Requeue(Exception):
    """New weights aborted this trajectory's generation (actor.rollout.inflight_update=abort):
    the caller runs it again from the start."""


@dataclass
class TurnOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[list[int]]  # [[weight version, tokens generated with it], ...] in order


async def generate_turn(engine, ids: list[int], params, clock=None, on_abort: str | None = None) -> TurnOutput:
    """One turn of generation from `ids`. `clock()` gives the engine's weight version (None: 0).
    An output ended by "abort" (new weights arrived mid-generation) is returned as is when
    `on_abort` is None; with "continue" the turn goes on from its partial tokens under the new
    weights (a partial rollout: one segment per version); with "restart" it raises Requeue."""
    tokens, logps, versions, segment = [], [], [], 0
    while True:
        version = clock() if clock is not None else 0
        p = params
        if segment:  # the rest of the turn: fewer new tokens, its own seed
            seed = None if params.seed is None else derive_seed(params.seed, "segment", segment)
            p = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(tokens), seed=seed)
        out = (await engine.generate(list(ids) + tokens, p))[0]
        if len(out.logprobs) != len(out.token_ids):
            raise ValueError(f"engine returned {len(out.token_ids)} tokens but {len(out.logprobs)} logprobs")
        tokens += list(out.token_ids)
        logps += list(out.logprobs)
        if out.token_ids:
            versions.append([version, len(out.token_ids)])
        finish = out.finish_reason
        if finish != "abort" or on_abort is None:
            return TurnOutput(tokens, logps, finish, versions)
        if on_abort == "restart":
            raise Requeue()
        if len(tokens) >= params.max_new_tokens:
            return TurnOutput(tokens, logps, "length", versions)
        segment += 1


class _Budget:
    """Characters that surely hold a number of tokens (any text of k * max_token_chars
    characters has at least k tokens), so env text is cut before it is tokenised."""

    def __init__(self, tokenizer):
        self.chars_per_token = _max_token_chars(tokenizer)

    def __call__(self, tokens: int | None, text: str | None = None):
        chars = None if tokens is None else max(0, tokens) * self.chars_per_token
        return chars if text is None else (text if chars is None else text[:chars])


def _fail(traj: Trajectory, where: str, e: Exception, record: dict | None = None):
    traj.failed, traj.error = True, f"{where}: {type(e).__name__}: {e}"
    if record is not None:
        record["error"] = traj.error
    logger.warning("trajectory %s failed in %s", traj.uid, traj.error)


async def _initial_state(env: Env, tokenizer, prompt: dict, traj: Trajectory, budget: _Budget,
                         max_length: int | None):
    """(state text, prompt ids, extra_info) from the prompt row or `env.reset`; None when reset
    failed (the trajectory is marked failed)."""
    extra_info = traj.extra_info
    if prompt.get("prompt_ids") is not None:
        ids = list(prompt["prompt_ids"])
        state = prompt.get("prompt_text")
        return (_decode(tokenizer, ids) if state is None else state), ids, extra_info
    try:
        state, extra_info = await env.reset(extra_info)
    except Exception as e:
        _fail(traj, "reset", e)
        return None
    extra_info = extra_info if "uid" in extra_info else {**extra_info, "uid": traj.uid}
    traj.extra_info = extra_info
    state = budget(max_length, state)
    ids = _encode(tokenizer, state)[:max_length]
    if not ids:  # the engine cannot generate from nothing
        _fail(traj, "reset", ValueError(f"reset returned {state!r}: the first turn needs a prompt token"))
        return None
    return state, ids, extra_info


def _take_step_result(traj: Trajectory, seq: _Sequence, res: dict, record: dict) -> dict:
    """Book the env's reward on the turn's last action token (an empty action: the last action
    token of the sequence; none at all: only in the totals); returns the new extra_info."""
    extra_info = res["extra_info"] if "uid" in res["extra_info"] else {**res["extra_info"], "uid": traj.uid}
    traj.extra_info = extra_info
    traj.reward += res["reward"]
    traj.score += res["score"]
    record.update(reward=res["reward"], score=res["score"], done=res["done"])
    last = seq.last_action_index()
    if last is not None:
        seq.rewards[last] += res["reward"]
    return extra_info


async def run_trajectory(engine, tokenizer, env: Env, prompt: dict, sampling_params, max_turns: int,
                         uid: str, max_length: int | None = None, clock=None,
                         on_abort: str | None = None) -> Trajectory:
    """Run one trajectory. `prompt` has `prompt_ids` (list[int]) and `prompt_text` (str), or
    neither (then `env.reset(extra_info)` gives the initial state), plus `extra_info` (dict).
    `uid` must be unique per trajectory: it is put into extra_info["uid"] to key per-trajectory
    env objects. `max_length` (optional) caps the tokens of any one sequence. `clock` and
    `on_abort`: see `generate_turn` (asynchronous rollout); each turn records the weight
    versions of its tokens.

    Environment failures (exception, timeout, malformed result) end the trajectory with
    `failed=True` and never raise; the samples generated so far are kept. Engine errors propagate.
    """
    max_turns, budget = max(1, int(max_turns)), _Budget(tokenizer)
    # the engine's context bounds a sequence too: env text longer than it ends the trajectory
    # as truncated instead of the engine refusing the prompt (an error that ends the run)
    context = getattr(engine, "max_model_len", None)
    if context is not None:
        max_length = context if max_length is None else min(max_length, context)
    extra_info = env.initial_extra_info(prompt.get("extra_info"), uid)
    traj = Trajectory(uid=uid, extra_info=extra_info)
    sequences: list[_Sequence] = []
    try:
        start = await _initial_state(env, tokenizer, prompt, traj, budget, max_length)
        if start is None:
            return traj
        state, ids, extra_info = start
        traj.prompt_text = state
        sequences.append(_Sequence(ids))
        for turn in range(max_turns):
            state, extra_info, done = await _turn(engine, tokenizer, env, traj, sequences, state, extra_info,
                                                  sampling_params, turn, max_turns, max_length, budget,
                                                  clock, on_abort)
            if done:
                break
    finally:
        await env.close(extra_info)
    traj.samples = [s.to_sample() for s in sequences if len(s.ids) >= 2]
    return traj


async def _turn(engine, tokenizer, env, traj, sequences, state, extra_info, sampling_params, turn,
                max_turns, max_length, budget, clock, on_abort):
    """One generate -> step round; returns (state, extra_info, trajectory over)."""
    seq = sequences[-1]
    room = None if max_length is None else max_length - len(seq.ids)
    if room is not None and room <= 0:
        traj.truncated = True
        return state, extra_info, True
    out = await generate_turn(engine, seq.ids, _turn_params(sampling_params, turn, room), clock, on_abort)
    action = _decode(tokenizer, out.token_ids)
    seq.add(out.token_ids, action=True, logps=out.logprobs)
    record = {"turn": turn, "action": action, "finish_reason": out.finish_reason}
    if clock is not None:
        record["versions"] = out.versions
    traj.turns.append(record)
    traj.num_turns = turn + 1
    try:
        res = await env.step(state, action, extra_info, max_new_chars=budget(max_length))
    except Exception as e:
        _fail(traj, f"step (turn {turn})", e, record)
        return state, extra_info, True
    extra_info = _take_step_result(traj, seq, res, record)
    if res["done"]:
        return state, extra_info, True
    next_state, prefix = res["next_state"], state + action
    merged = next_state.startswith(prefix)
    # Env text is cut to what could fit before it is tokenised: memory stays bounded whatever
    # step returns; a turn that does not fit ends the trajectory as truncated.
    room = None if max_length is None else (max_length - len(seq.ids) if merged else max_length)
    env_text = budget(room, next_state[len(prefix):] if merged else next_state)
    record["env_text"], record["new_sequence"] = env_text, not merged
    state = prefix + env_text if merged else env_text
    if turn == max_turns - 1:
        traj.truncated = True
        return state, extra_info, True
    env_ids = _encode(tokenizer, env_text)
    if not merged:
        if not env_ids:  # a new sequence needs a prompt token; the env's bug, not the run's
            _fail(traj, f"step (turn {turn})", ValueError(
                f"next_state {next_state!r} neither extends state + action nor holds any token "
                "to start a new sequence from"), record)
            return state, extra_info, True
        seq = _Sequence([])
        sequences.append(seq)
    seq.add(env_ids[:room], action=False)
    if room is not None and len(env_ids) >= room:
        traj.truncated = True
        return state, extra_info, True
    return state, extra_info, False


__all__ = ["Requeue", "Trajectory", "generate_turn", "run_trajectory"]
