r"""Math (single turn): the model's final answer in \boxed{...} is checked with math-verify.

Prompt rows carry `extra_info = {"answer": GOLD}` (LaTeX or plain text, e.g. "\frac{1}{2}", "42").
The LAST \boxed{...} of the action is parsed and compared with the gold answer by
`math_verify.verify` (symbolic equivalence: 1/2 == 0.5 == \frac{1}{2}); reward 1.0 or 0.0; no
\boxed{} gives 0.0. Needs the `math` extra (`pip install math-verify`).

math-verify's own timeouts use signal.alarm, which only works in the main thread, while the
rollout runs synchronous steps in worker threads: they are disabled here and the rollout's
`env_timeout` bounds each step instead.
"""
try:
    from math_verify import parse, verify
except ImportError as e:
    raise ImportError(
        "envs/math_env.py needs math-verify: install the `math` extra or `pip install math-verify`"
    ) from e


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
    return parse(f"${latex}$", parsing_timeout=None)


def is_correct(pred: str | None, gold) -> bool:
    if pred is None:
        return False
    gold = str(gold)
    gold_parsed = parse(gold, parsing_timeout=None) if ("$" in gold or "\\boxed" in gold) else _parse(gold)
    pred_parsed = _parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def step(state: str, action: str, extra_info: dict) -> dict:
    reward = 1.0 if is_correct(last_boxed(action), extra_info["answer"]) else 0.0
    return {"next_state": None, "reward": reward, "done": True}
