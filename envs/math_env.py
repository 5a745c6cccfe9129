r"""Math (single turn): the model's final answer in \boxed{...} is checked with math-verify.

Prompt rows carry `extra_info = {"answer": GOLD}` (LaTeX or plain text, e.g. "\frac{1}{2}", "42").
The LAST \boxed{...} of the action is parsed and compared with the gold answer by
`math_verify.verify` (symbolic equivalence: 1/2 == 0.5 == \frac{1}{2}); reward 1.0 or 0.0; no
\boxed{} gives 0.0. Needs the `math` extra (`pip install math-verify`).

The rollout runs this synchronous step in an env worker process (`actor.rollout.env_workers`),
killed and replaced when it exceeds `env_timeout`: a GIL-holding sympy bigint power such as
`9^{9^{9^{9}}}` is stopped there. Inside the worker the step runs in the main thread, so
math-verify's own signal.alarm limits (PARSE_SECONDS, VERIFY_SECONDS) also apply, and answers
longer than MAX_ANSWER_CHARS are wrong without being parsed. In a thread (env_workers=0) the
alarms cannot be used and only the length limit and `env_timeout` remain.
"""
import logging
import threading

try:
    from math_verify import parse, verify
except ImportError as e:
    raise ImportError(
        "envs/math_env.py needs math-verify: install the `math` extra or `pip install math-verify`"
    ) from e

PARSE_SECONDS = 5
VERIFY_SECONDS = 5
MAX_ANSWER_CHARS = 1000
logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" warnings per call


def _limit(seconds: int) -> int | None:
    # signal.alarm only works in the main thread
    return seconds if threading.current_thread() is threading.main_thread() else None


def last_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j].strip()
        start = text.rfind("\\boxed", 0, start)  # unbalanced: try the previous one
    return None


def _parse(latex: str):
    return parse(f"${latex}$", parsing_timeout=_limit(PARSE_SECONDS))


def is_correct(pred: str | None, gold) -> bool:
    if pred is None or len(pred) > MAX_ANSWER_CHARS:
        return False
    gold = str(gold)
    gold_parsed = (parse(gold, parsing_timeout=_limit(PARSE_SECONDS)) if ("$" in gold or "\\boxed" in gold)
                   else _parse(gold))
    pred_parsed = _parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=_limit(VERIFY_SECONDS)))


def step(state: str, action: str, extra_info: dict) -> dict:
    reward = 1.0 if is_correct(last_boxed(action), extra_info["answer"]) else 0.0
    return {"next_state": None, "reward": reward, "done": True}
