"""The environments shipped in envs/: countdown (safe evaluator), calculator tool, math, GEM."""
import asyncio
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from RL2.rollout.engine import SamplingParams
from RL2.rollout.env import EnvError, load_env
from RL2.rollout.trajectory import run_trajectory
from RL2.tools.make_assets import build_tokenizer
from tests.fakes import ScriptedEngine

ENVS = Path(__file__).resolve().parents[1] / "envs"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def chat_prompt(tok, text, extra_info):
    prompt_text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True)
    return {"prompt_ids": tok.encode(prompt_text, add_special_tokens=False), "prompt_text": prompt_text,
            "extra_info": extra_info}


def trajectory(tok, env, actions, prompt, max_turns=5, uid="t0"):
    return asyncio.run(run_trajectory(ScriptedEngine(tok, actions), tok, env, prompt,
                                      SamplingParams(max_new_tokens=32), max_turns, uid))


# ---------------------------------------------------------------- countdown
@pytest.fixture(scope="module")
def countdown():
    return load_env(str(ENVS / "countdown.py"), {})


@pytest.mark.parametrize("expr, value", [
    ("1+2*3", 7), ("(25-5)/4*8", 40), ("-(-3) + +2", 5), ("0.1+0.2", Fraction(3, 10)),
    ("100/3*3", 100), ("((((7))))", 7), (" 6 / (1 - 3/4) ", 24),
])
def test_safe_eval_correct(countdown, expr, value):
    assert countdown.module.safe_eval(expr) == value


@pytest.mark.parametrize("expr", [
    "__import__('os').system('true')", "a+1", "(1).real", "abs(-3)", "[1][0]", "'ab'*3",
    "2**3", "9**9**9", "10**10**10", "1 if 1 else 2", "lambda: 1", "1/0", "True+1", "1e999",
    "1<2", "3 % 2", "7 // 2", "1j+1", "x := 3", "1;2", "9" * 300, "+".join(["1"] * 100),
    "-" * 60 + "1", "99999999*99999999*99999999",
])
def test_safe_eval_rejects(countdown, expr):
    with pytest.raises(countdown.module.UnsafeExpression):
        countdown.module.safe_eval(expr)


def test_safe_eval_bounded_power(countdown):
    m = countdown.module
    assert m.safe_eval("2**10", allow_pow=True) == 1024
    assert m.safe_eval("(1/2)**-3", allow_pow=True) == 8
    for expr in ("9**9**9", "2**0.5", "10**100", "0**-1"):
        with pytest.raises(m.UnsafeExpression):
            m.safe_eval(expr, allow_pow=True)


@pytest.mark.parametrize("action, extra, reward", [
    ("think... <answer>(25-5)/4*8</answer>", {}, 1.0),
    ("<answer>1+1</answer> then <answer>8*(25-5)/4</answer>", {}, 1.0),  # the last answer counts
    ("<answer>(25-5)*8/4</answer><answer>25*8</answer>", {}, 0.0),
    ("<answer>25*8/5</answer>", {}, 0.0),                                  # misses 4 (use_all)
    ("<answer>25*8/5</answer>", {"use_all": False}, 1.0),                 # at most once
    ("<answer>5*8</answer>", {"use_all": False}, 1.0),                    # at most once
    ("<answer>5*8</answer>", {}, 0.0),
    ("<answer>5*8*1</answer>", {"use_all": False}, 0.0),                  # 1 is not given
    ("<answer>(25-5-5)*8/3</answer>", {"use_all": False}, 0.0),           # 5 used twice
    ("no answer tag 40", {}, 0.0),
    ("<answer>__import__('os')</answer>", {}, 0.0),
])
def test_countdown_grading(countdown, action, extra, reward):
    info = {"numbers": [25, 5, 4, 8], "target": 40, "uid": "c", **extra}
    out = asyncio.run(countdown.step("prompt", action, info))
    assert out["done"] and out["next_state"] is None and out["reward"] == reward


def test_countdown_trajectory(tok, countdown):
    prompt = chat_prompt(tok, "Use 25 5 4 8 to reach 40.", {"numbers": [25, 5, 4, 8], "target": 40})
    traj = trajectory(tok, countdown, ["<answer>(25-5)/4*8</answer><|im_end|>"], prompt)
    assert traj.reward == 1.0 and traj.num_turns == 1 and traj.samples[0]["rewards"][-1] == 1.0


# ---------------------------------------------------------------- calculator tool
@pytest.fixture(scope="module")
def calculator():
    return load_env(str(ENVS / "calculator_tool.py"), {"max_calls": 3})


def test_calculator_end_to_end(tok, calculator):
    prompt = chat_prompt(tok, "What is 12*(3+4)+5?", {"answer": 89})
    actions = ["Let me compute <calculator>12*(3+4)</calculator>",
               " then <calculator>84+5",           # a stop string cut off the closing tag
               " so <answer>89</answer><|im_end|>"]
    traj = trajectory(tok, calculator, actions, prompt)
    assert not traj.failed and traj.num_turns == 3 and traj.reward == 1.0
    assert len(traj.samples) == 1
    env_texts = ["<result>84</result>", "</calculator><result>89</result>"]
    assert [t.get("env_text") for t in traj.turns] == env_texts + [None]
    full = prompt["prompt_ids"]
    mask = [0] * len(full)
    for action, env_text in zip(actions, env_texts + [""]):
        a, e = tok.encode(action, add_special_tokens=False), tok.encode(env_text, add_special_tokens=False)
        full, mask = full + a + e, mask + [1] * len(a) + [0] * len(e)
    s = traj.samples[0]
    assert s["labels"].tolist() == full[1:] and s["action_mask"].tolist() == mask[1:]
    assert s["rewards"].tolist()[-1] == 1.0 and s["rewards"].sum() == 1.0
    assert traj.extra_info["calculator_calls"] == 2


def test_calculator_errors_wrong_answers_and_limits(calculator):
    def step(action, **info):
        return asyncio.run(calculator.step("S", action, {"uid": "x", "answer": 3, "max_calls": 3, **info}))

    out = step("<calculator>__import__('os')</calculator>")
    assert not out["done"] and out["next_state"].startswith("S<calculator>") and "<result>error:" in out["next_state"]
    assert step("<calculator>1/3</calculator>")["next_state"].endswith("<result>0.3333333333</result>")
    assert step("<answer>3.0000000001</answer>")["reward"] == 1.0
    assert step("<answer>4</answer>")["reward"] == 0.0
    assert step("I give up")["done"] and step("I give up")["reward"] == 0.0
    over = step("<calculator>1+1</calculator>", calculator_calls=3)
    assert over["done"] and over["reward"] == 0.0


# ---------------------------------------------------------------- math (math-verify)
def test_math_env_missing_package_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    with pytest.raises(EnvError, match="math_env.py .*pip install math-verify"):
        load_env(str(ENVS / "math_env.py"), {})


def test_math_env_verifies_boxed_answers():
    pytest.importorskip("math_verify")
    env = load_env(str(ENVS / "math_env.py"), {})

    def reward(action, gold):  # through the loader: sync steps run in a worker thread
        return asyncio.run(env.step("S", action, {"uid": "m", "answer": gold}))["reward"]

    assert reward("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert reward("\\boxed{3} no wait \\boxed{x(x+2)}", "x^2+2x") == 1.0
    assert reward("\\boxed{41}", "42") == 0.0
    assert reward("the answer is 42", "42") == 0.0
    assert env.module.last_boxed("a \\boxed{\\sqrt{\\frac{1}{2}}} b") == "\\sqrt{\\frac{1}{2}}"


# ---------------------------------------------------------------- GEM
def test_gem_env_missing_package_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gem", None)
    with pytest.raises(EnvError, match="gem_env.py .*pip install gem-llm"):
        load_env(str(ENVS / "gem_env.py"), {})


def test_gem_guess_the_number(tok):
    gem = pytest.importorskip("gem")
    env_id, seed = "game:GuessTheNumber-v0-easy", 1
    ref = gem.make(env_id)
    ref.reset(seed=seed)
    target = ref.game_number
    wrong = 1 if target != 1 else 2
    env = load_env(str(ENVS / "gem_env.py"), {"env_id": env_id})
    actions = [f"\\boxed{{{wrong}}}<|im_end|>", f"I think \\boxed{{{target}}}<|im_end|>"]
    traj = trajectory(tok, env, actions, {"extra_info": {"seed": seed}}, uid="gem0")
    assert not traj.failed and traj.num_turns == 2 and traj.reward == pytest.approx(1.0)
    assert traj.prompt_text.startswith("<|im_start|>user\nYou are playing Guess The Number.")
    assert len(traj.samples) == 1  # each observation extends the chat: one sequence
    feedback = traj.turns[0]["env_text"]
    assert feedback.startswith("\n<|im_start|>user\nAt turn 1, you guessed") and feedback.endswith(
        "<|im_end|>\n<|im_start|>assistant\n")
    assert env.module._ENVS == {}  # released when done

    # Cut short by max_turns: the rollout's close() releases the GEM object.
    traj = trajectory(tok, env, actions[:1], {"extra_info": {"seed": seed}}, max_turns=1, uid="gem1")
    assert traj.truncated and env.module._ENVS == {}
