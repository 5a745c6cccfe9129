"""RL2/rollout/trajectory.py: the generate <-> step loop with a scripted engine (no model)."""
import asyncio
import json
import textwrap
import time

import pytest

from RL2.rollout.engine import SamplingParams
from RL2.rollout.env import load_env
from RL2.rollout.trajectory import run_trajectory
from RL2.tools.make_assets import build_tokenizer
from tests.fakes import ScriptedEngine


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def make_prompt(tok, text="reach the target", extra_info=None):
    prompt_text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True)
    return {"prompt_ids": tok.encode(prompt_text, add_special_tokens=False), "prompt_text": prompt_text,
            "extra_info": extra_info or {}}


def write_env(tmp_path, source):
    path = tmp_path / "env.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


# The env extends state + action with a user turn (chat format) until its third step.
MERGING_ENV = """
    SEEN = []
    CLOSED = []
    def step(state, action, extra_info):
        t = extra_info.get("t", 0)
        SEEN.append((state, action, dict(extra_info)))
        if t == 2:
            return {"next_state": None, "reward": 1.0, "done": True}
        obs = f"<|im_start|>user\\nobs {t} is lower<|im_end|>\\n<|im_start|>assistant\\n"
        return {"next_state": state + action + obs, "reward": 0.1 * (t + 1), "done": False,
                "extra_info": {**extra_info, "t": t + 1}}
    def close(extra_info):
        CLOSED.append(extra_info["uid"])
"""
ACTIONS = ["guess one<|im_end|>", "guess two two<|im_end|>", "final answer<|im_end|>"]


def run(engine, tok, env, prompt, max_turns=5, params=None, uid="u0", **kw):
    return asyncio.run(run_trajectory(engine, tok, env, prompt, params or SamplingParams(max_new_tokens=16),
                                      max_turns, uid, **kw))


def test_prefix_merge_gives_one_sequence(tok, tmp_path):
    env = load_env(write_env(tmp_path, MERGING_ENV), {"difficulty": "easy"})
    engine = ScriptedEngine(tok, ACTIONS)
    prompt = make_prompt(tok, extra_info={"row": 7})
    traj = run(engine, tok, env, prompt)

    assert not traj.failed and not traj.truncated and traj.num_turns == 3
    assert len(traj.samples) == 1
    obs = [f"<|im_start|>user\nobs {t} is lower<|im_end|>\n<|im_start|>assistant\n" for t in range(2)]
    parts = [(prompt["prompt_ids"], 0), (enc(tok, ACTIONS[0]), 1), (enc(tok, obs[0]), 0),
             (enc(tok, ACTIONS[1]), 1), (enc(tok, obs[1]), 0), (enc(tok, ACTIONS[2]), 1)]
    full, is_action, logps, rewards = [], [], [], []
    turn = 0
    for ids, act in parts:
        full += ids
        is_action += [float(act)] * len(ids)
        logps += [-(turn + 1) - 0.01 * i for i in range(len(ids))] if act else [0.0] * len(ids)
        rewards += [0.0] * len(ids)
        if act:
            rewards[-1] = [0.1, 0.2, 1.0][turn]  # the turn reward sits on its last action token
            turn += 1
    s = traj.samples[0]
    assert s["input_ids"].tolist() == full[:-1] and s["labels"].tolist() == full[1:]
    assert s["action_mask"].tolist() == is_action[1:]
    assert s["engine_logps"].tolist() == pytest.approx(logps[1:])
    assert s["rewards"].tolist() == pytest.approx(rewards[1:])
    assert int(s["action_mask"].sum()) == sum(len(enc(tok, a)) for a in ACTIONS) == traj.num_action_tokens
    # The engine continued the same token sequence every turn (no re-tokenisation of actions).
    n0, n1 = len(prompt["prompt_ids"]), len(enc(tok, ACTIONS[0])) + len(enc(tok, obs[0]))
    assert [c[0] for c in engine.calls] == [full[:n0], full[:n0 + n1],
                                            full[:n0 + n1 + len(enc(tok, ACTIONS[1])) + len(enc(tok, obs[1]))]]
    # The env saw decoded text with special tokens kept, env_args as defaults and the uid.
    state0, action0, info0 = env.module.SEEN[0]
    assert state0 == prompt["prompt_text"] and action0 == ACTIONS[0]
    assert info0 == {"difficulty": "easy", "row": 7, "uid": "u0"}
    assert traj.reward == pytest.approx(1.3) and traj.score == pytest.approx(1.3)
    assert env.module.CLOSED == ["u0"]
    dump = json.loads(json.dumps(traj.to_json()))
    assert [t["action"] for t in dump["turns"]] == ACTIONS
    assert [t.get("env_text") for t in dump["turns"]] == obs + [None]
    assert dump["num_sequences"] == 1 and dump["prompt"] == prompt["prompt_text"]


def test_non_extending_states_start_new_sequences(tok, tmp_path):
    # Turn 0: a fresh state (new sequence); turn 1: extends; turn 2: done.
    env = load_env(write_env(tmp_path, """
        def step(state, action, extra_info):
            t = extra_info.get("t", 0)
            if t == 2:
                return {"next_state": None, "reward": 2.0, "done": True}
            nxt = "fresh start: summary of turn 0\\n" if t == 0 else state + action + " more\\n"
            return {"next_state": nxt, "reward": 0.5, "done": False, "extra_info": {**extra_info, "t": t + 1}}
    """), {})
    engine = ScriptedEngine(tok, ACTIONS)
    prompt = make_prompt(tok)
    traj = run(engine, tok, env, prompt)
    assert len(traj.samples) == 2 and traj.num_turns == 3 and not traj.failed
    seq0 = prompt["prompt_ids"] + enc(tok, ACTIONS[0])
    seq1 = (enc(tok, "fresh start: summary of turn 0\n") + enc(tok, ACTIONS[1]) + enc(tok, " more\n")
            + enc(tok, ACTIONS[2]))
    assert traj.samples[0]["labels"].tolist() == seq0[1:]
    assert traj.samples[1]["input_ids"].tolist() == seq1[:-1]
    assert traj.samples[1]["labels"].tolist() == seq1[1:]
    a1, e1 = len(enc(tok, ACTIONS[1])), len(enc(tok, " more\n"))
    start = len(enc(tok, "fresh start: summary of turn 0\n"))
    mask1 = [0.0] * start + [1.0] * a1 + [0.0] * e1 + [1.0] * len(enc(tok, ACTIONS[2]))
    assert traj.samples[1]["action_mask"].tolist() == mask1[1:]
    assert engine.calls[1][0] == enc(tok, "fresh start: summary of turn 0\n")
    # Rewards: 0.5 on the last token of sequence 0; 0.5 and 2.0 on the two action ends of seq 1.
    assert traj.samples[0]["rewards"].tolist()[-1] == 0.5 and traj.samples[0]["rewards"].sum() == 0.5
    r1 = traj.samples[1]["rewards"].tolist()
    assert r1[start + a1 - 2] == 0.5 and r1[-1] == 2.0 and sum(r1) == 2.5
    assert [t["new_sequence"] for t in traj.turns[:2]] == [True, False]


def test_max_turns_truncates(tok, tmp_path):
    env = load_env(write_env(tmp_path, MERGING_ENV), {})
    traj = run(ScriptedEngine(tok, ACTIONS), tok, env, make_prompt(tok), max_turns=2)
    assert traj.truncated and not traj.failed and traj.num_turns == 2
    # The last next_state is not tokenised: the sample ends with the second action.
    assert traj.samples[0]["labels"].tolist()[-len(enc(tok, ACTIONS[1])):] == enc(tok, ACTIONS[1])
    assert traj.reward == pytest.approx(0.3)


@pytest.mark.parametrize("body, match", [
    ("raise ValueError('env exploded')", "ValueError: env exploded"),
    ("return {'next_state': None, 'done': True}", "returned no 'reward'"),
])
def test_step_failure_marks_trajectory_failed(tok, tmp_path, body, match):
    env = load_env(write_env(tmp_path, f"""
        CLOSED = []
        def step(state, action, extra_info):
            if extra_info.get("t"):
                {body}
            return {{"next_state": state + action + "ok\\n", "reward": 0.25, "done": False,
                    "extra_info": {{**extra_info, "t": 1}}}}
        def close(extra_info):
            CLOSED.append(extra_info["uid"])
    """), {})
    traj = run(ScriptedEngine(tok, ACTIONS), tok, env, make_prompt(tok), uid="f1")
    assert traj.failed and "step (turn 1)" in traj.error and match in traj.error
    assert traj.num_turns == 2 and traj.reward == 0.25
    assert traj.turns[1]["error"] == traj.error
    assert len(traj.samples) == 1 and int(traj.samples[0]["action_mask"].sum()) == (
        len(enc(tok, ACTIONS[0])) + len(enc(tok, ACTIONS[1])))
    assert env.module.CLOSED == ["f1"]
    json.dumps(traj.to_json())


@pytest.mark.parametrize("src", [
    "import asyncio\nasync def step(state, action, extra_info):\n    await asyncio.sleep(3600)\n",
    "import time\ndef step(state, action, extra_info):\n    time.sleep(20)\n",
])
def test_hanging_step_times_out(tok, tmp_path, src):
    env = load_env(write_env(tmp_path, src), {}, timeout=0.5)
    t0 = time.monotonic()
    traj = run(ScriptedEngine(tok, ACTIONS), tok, env, make_prompt(tok))
    assert time.monotonic() - t0 < 1.0  # within 2x the limit
    assert traj.failed and "EnvTimeout" in traj.error and len(traj.samples) == 1


def test_reset_gives_initial_state(tok, tmp_path):
    env = load_env(write_env(tmp_path, """
        def reset(extra_info):
            return f"<|im_start|>user\\ngame {extra_info['uid']} seed {extra_info['seed']}<|im_end|>\\n<|im_start|>assistant\\n"
        def step(state, action, extra_info):
            return {"next_state": None, "reward": 1.0, "done": True, "score": 0.5,
                    "extra_info": {"seed": extra_info["seed"]}}
    """), {"seed": 3})
    traj = run(ScriptedEngine(tok, ACTIONS), tok, env, {"extra_info": {}}, uid="g7")
    state = "<|im_start|>user\ngame g7 seed 3<|im_end|>\n<|im_start|>assistant\n"
    assert traj.prompt_text == state
    assert traj.samples[0]["input_ids"].tolist()[:len(enc(tok, state))] == enc(tok, state)
    assert traj.score == 0.5 and traj.reward == 1.0
    assert traj.extra_info == {"seed": 3, "uid": "g7"}  # the uid survives an env that drops it


def test_reset_failure_and_missing_prompt(tok, tmp_path):
    env = load_env(write_env(tmp_path, """
        def reset(extra_info):
            raise RuntimeError("no such game")
        def step(state, action, extra_info):
            return {"next_state": None, "reward": 1.0, "done": True}
    """), {})
    traj = run(ScriptedEngine(tok, ACTIONS), tok, env, {"extra_info": {}})
    assert traj.failed and "reset" in traj.error and "no such game" in traj.error and traj.samples == []


def test_sampling_params_per_turn(tok, tmp_path):
    env = load_env(write_env(tmp_path, MERGING_ENV), {})
    engine = ScriptedEngine(tok, ACTIONS)
    prompt = make_prompt(tok)
    max_length = len(prompt["prompt_ids"]) + 30
    traj = run(engine, tok, env, prompt, params=SamplingParams(n=4, seed=11, max_new_tokens=64),
               max_length=max_length)
    params = [c[1] for c in engine.calls]
    assert all(p.n == 1 for p in params)
    assert len({p.seed for p in params}) == len(params)  # distinct and reproducible per turn
    assert [p.max_new_tokens for p in params] == [max_length - len(c[0]) for c in engine.calls]
    assert traj.num_turns == len(engine.calls)


def test_concurrent_trajectories_keep_their_own_state(tok, tmp_path):
    env = load_env(write_env(tmp_path, MERGING_ENV), {})

    async def main():
        engines = [ScriptedEngine(tok, ACTIONS) for _ in range(4)]
        return await asyncio.gather(*(run_trajectory(e, tok, env, make_prompt(tok), SamplingParams(), 5, f"u{i}")
                                      for i, e in enumerate(engines)))

    trajs = asyncio.run(main())
    assert [t.uid for t in trajs] == ["u0", "u1", "u2", "u3"]
    assert all(t.num_turns == 3 and len(t.samples) == 1 for t in trajs)
    assert sorted(env.module.CLOSED) == ["u0", "u1", "u2", "u3"]


# ---------------------------------------------------------------- env text bounded by max_length
HUGE_ENV = """
    def step(state, action, extra_info):
        return {"next_state": state + action + "the env talks a lot " * 50_000, "reward": 0.5,
                "done": False}
"""


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "worker-process"])
def test_huge_next_state_ends_the_trajectory_truncated_at_max_length(tok, tmp_path, workers, monkeypatch):
    # A 1 MB next_state used to be tokenised whole: a 10k-character one made a sample longer than
    # any micro-batch, a 1 MB one on 128 trajectories ran a worker out of memory.
    env = load_env(write_env(tmp_path, HUGE_ENV), {}, workers=workers)
    import RL2.rollout.trajectory as trajectory

    encoded = []
    real_encode = trajectory._encode
    monkeypatch.setattr(trajectory, "_encode", lambda t, text: encoded.append(len(text)) or real_encode(t, text))
    prompt = make_prompt(tok)
    max_length = len(prompt["prompt_ids"]) + 40
    try:
        traj = run(ScriptedEngine(tok, ACTIONS), tok, env, prompt, max_length=max_length)
    finally:
        env.shutdown()
    assert traj.truncated and not traj.failed and traj.num_turns == 1
    (sample,) = traj.samples
    assert len(sample["input_ids"]) + 1 == max_length  # every token that fits is kept
    a0 = enc(tok, ACTIONS[0])
    assert sample["action_mask"].sum() == len(a0)
    env_ids = enc(tok, "the env talks a lot " * 50)[:max_length - len(prompt["prompt_ids"]) - len(a0)]
    assert sample["labels"].tolist()[-len(env_ids):] == env_ids
    # Tokenised text is bounded by max_length, not by what step returned (1 MB).
    assert max(encoded) <= max_length * trajectory._max_token_chars(tok) < 100_000
    assert len(traj.turns[0]["env_text"]) < 100_000


def test_env_text_without_tokens_fails_the_trajectory_not_the_run(tok, tmp_path):
    """An empty state from `reset`, or an empty `next_state` that starts a new sequence, would
    reach the engine as an empty prompt (ValueError, which ends the run): the env's bug fails
    its own trajectory, counted and dumped like any env failure."""
    env = load_env(write_env(tmp_path, """
        def step(state, action, extra_info):
            return {"next_state": "", "reward": 0.5, "done": False}
    """), {})
    traj = run(ScriptedEngine(tok, ACTIONS), tok, env, make_prompt(tok))
    assert traj.failed and "step (turn 0)" in traj.error and "neither extends" in traj.error
    assert traj.turns[0]["error"] == traj.error and len(traj.samples) == 1  # turn 0 kept
    env = load_env(write_env(tmp_path, """
        def reset(extra_info):
            return ""
        def step(state, action, extra_info):
            return {"next_state": None, "reward": 1.0, "done": True}
    """), {})
    traj = run(ScriptedEngine(tok, ACTIONS), tok, env, {"extra_info": {}})
    assert traj.failed and "reset" in traj.error and traj.samples == []


def test_env_text_past_the_engines_context_truncates_the_trajectory(tok, tmp_path):
    """actor.rollout.max_length (2048 by default) may exceed the model's context: a sequence is
    bounded by the engine's `max_model_len` as well, so env text that would not fit ends the
    trajectory as truncated instead of the engine refusing the next prompt."""
    words = " ".join(["word"] * 60)
    for merge in (False, True):
        env = load_env(write_env(tmp_path, f"""
            def step(state, action, extra_info):
                text = "<|im_start|>user\\n{words}<|im_end|>\\n<|im_start|>assistant\\n"
                return {{"next_state": (state + action + text) if {merge} else text,
                         "reward": 0.0, "done": False}}
        """), {})
        prompt = make_prompt(tok)
        context = len(prompt["prompt_ids"]) + 20
        engine = ScriptedEngine(tok, ACTIONS, max_model_len=context)
        traj = run(engine, tok, env, prompt, max_length=2048)
        assert not traj.failed and traj.truncated and len(engine.calls) == 1
        assert all(len(s["input_ids"]) <= context for s in traj.samples)
