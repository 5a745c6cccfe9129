"""Calculator tool (multi-turn): the model may call a calculator before answering.

Protocol, inside the assistant's text:
    ... <calculator>12*(3+4)</calculator>        -> the env appends <result>84</result>
    ... <answer>84</answer>                       -> the trajectory ends, graded vs extra_info["answer"]

The next state is `state + action (+ "</calculator>" if a stop string cut it off) + <result>...</result>`,
so it extends `state + action` and the rollout keeps ONE sequence (only the result is tokenised).
Use `stop: ["</calculator>", "</answer>"]` in the sampling params so that the model waits for the
result. An action with neither tag ends the trajectory with reward 0, as does exceeding
`max_calls` calls (from extra_info / env_args, default 4). Reward 1.0 when the answer equals
extra_info["answer"] (numerically, within 1e-6 relative, when both parse as arithmetic; else as
stripped strings). Expressions are evaluated by countdown.safe_eval (ast whitelist, never eval),
here with `**` allowed and bounded.
"""
import importlib.util
import re
from pathlib import Path


def _load_countdown():
    # Env scripts are loaded by path, not as a package: import the sibling file the same way.
    spec = importlib.util.spec_from_file_location("rl2_envs_countdown", Path(__file__).with_name("countdown.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_countdown = _load_countdown()
safe_eval, last_answer, UnsafeExpression = _countdown.safe_eval, _countdown.last_answer, _countdown.UnsafeExpression

DEFAULT_MAX_CALLS = 4
_CALL = re.compile(r"<calculator>(.*?)(</calculator>|$)", re.DOTALL)


def format_value(value) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def is_correct(answer: str, gold) -> bool:
    try:
        a, g = safe_eval(answer, allow_pow=True), safe_eval(str(gold), allow_pow=True)
    except UnsafeExpression:
        return answer.strip() == str(gold).strip()
    return abs(float(a - g)) <= 1e-6 * max(1.0, abs(float(g)))


def step(state: str, action: str, extra_info: dict) -> dict:
    answer = last_answer(action)
    if answer is not None:
        reward = 1.0 if is_correct(answer, extra_info["answer"]) else 0.0
        return {"next_state": None, "reward": reward, "done": True}
    calls = list(_CALL.finditer(action))
    calls_so_far = int(extra_info.get("calculator_calls", 0))
    if not calls or calls_so_far >= int(extra_info.get("max_calls", DEFAULT_MAX_CALLS)):
        return {"next_state": None, "reward": 0.0, "done": True}
    call = calls[-1]
    try:
        result = format_value(safe_eval(call.group(1).strip(), allow_pow=True))
    except UnsafeExpression as e:  # the model sees the error and may retry
        result = f"error: {e}"
    closing = "" if call.group(2) else "</calculator>"
    return {
        "next_state": state + action + closing + f"<result>{result}</result>",
        "reward": 0.0,
        "done": False,
        "extra_info": {**extra_info, "calculator_calls": calls_so_far + 1},
    }
