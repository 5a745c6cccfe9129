"""Countdown (single turn): combine the given numbers with + - * / and parentheses to reach a target.

Prompt rows carry `extra_info = {"numbers": [int, ...], "target": int}`. The model answers with
`<answer>EXPRESSION</answer>`; the LAST such tag is graded. Reward 1.0 when the expression is
valid, evaluates exactly (rational arithmetic) to the target and uses each given number exactly
once (`use_all=True`, the default, as in TinyZero) or at most once (`use_all=False`, from
`extra_info` or `actor.rollout.env_args`); otherwise 0.0. The trajectory ends after one step.

The expression is never passed to eval/exec: `safe_eval` parses it with `ast` and evaluates only
whitelisted nodes (numeric literals, + - * /, unary +/-; `**` only when allowed, with a bounded
exponent), with limits on length, node count, depth and the size of every intermediate value.
"""
import ast
import re
from fractions import Fraction

MAX_CHARS = 256          # longer expressions are rejected before parsing
MAX_NODES = 128          # AST nodes
MAX_DEPTH = 32           # nesting depth
MAX_ABS = 10 ** 15       # bound on |value| and on the denominator of every intermediate result
MAX_EXPONENT = 64        # for ** (when allowed)

_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class UnsafeExpression(ValueError):
    """The expression is not plain arithmetic, is too large, or cannot be evaluated."""


def _check(x: Fraction) -> Fraction:
    if abs(x) > MAX_ABS or x.denominator > MAX_ABS:
        raise UnsafeExpression("intermediate value too large")
    return x


def _eval(node: ast.AST, depth: int, allow_pow: bool, literals: list) -> Fraction:
    if depth > MAX_DEPTH:
        raise UnsafeExpression("expression nested too deeply")
    if isinstance(node, ast.Constant):
        # bool is an int subclass; complex/str/bytes/None are not arithmetic literals.
        if type(node.value) not in (int, float):
            raise UnsafeExpression(f"literal {node.value!r} is not a number")
        literals.append(node.value)
        try:  # via the decimal text, so that 0.1 is 1/10 and not a 55-bit binary fraction
            return _check(Fraction(repr(node.value)))
        except (ValueError, OverflowError):  # 1e999 parses as inf
            raise UnsafeExpression(f"literal {node.value!r} is not finite") from None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        x = _eval(node.operand, depth + 1, allow_pow, literals)
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp) and (isinstance(node.op, _BINOPS) or (allow_pow and isinstance(node.op, ast.Pow))):
        a = _eval(node.left, depth + 1, allow_pow, literals)
        b = _eval(node.right, depth + 1, allow_pow, literals)
        if isinstance(node.op, ast.Add):
            return _check(a + b)
        if isinstance(node.op, ast.Sub):
            return _check(a - b)
        if isinstance(node.op, ast.Mult):
            return _check(a * b)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise UnsafeExpression("division by zero")
            return _check(a / b)
        # Pow: integer exponents only, bounded BEFORE computing (9**9**9 never gets evaluated).
        if b.denominator != 1 or abs(b) > MAX_EXPONENT:
            raise UnsafeExpression(f"exponent {b} not allowed (integer, |e| <= {MAX_EXPONENT})")
        if a == 0 and b < 0:
            raise UnsafeExpression("division by zero")
        bits = max(a.numerator.bit_length(), a.denominator.bit_length()) * abs(int(b))
        if bits > MAX_ABS.bit_length() + 1:
            raise UnsafeExpression("power too large")
        return _check(a ** int(b))
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        raise UnsafeExpression(f"operator {type(node.op).__name__} is not allowed")
    raise UnsafeExpression(f"{type(node).__name__} is not allowed")


def safe_eval(expr: str, allow_pow: bool = False, literals: list | None = None) -> Fraction:
    """Evaluate an arithmetic expression exactly. Raises UnsafeExpression for anything else.
    If `literals` is a list, the numeric literals of the expression are appended to it."""
    if not isinstance(expr, str) or len(expr) > MAX_CHARS:
        raise UnsafeExpression(f"expression must be a str of at most {MAX_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise UnsafeExpression(f"not a valid expression: {e}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise UnsafeExpression(f"expression has more than {MAX_NODES} nodes")
    return _eval(tree.body, 0, allow_pow, literals if literals is not None else [])


def last_answer(text: str) -> str | None:
    """Content of the last <answer>...</answer> in `text`, or None."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def grade(expr: str | None, numbers: list[int], target: float, use_all: bool = True) -> float:
    """1.0 for a valid expression reaching `target` with the allowed numbers, else 0.0."""
    if expr is None:
        return 0.0
    used: list = []
    try:
        value = safe_eval(expr, literals=used)
    except UnsafeExpression:
        return 0.0
    pool = list(numbers)
    for x in used:  # each given number may be consumed once
        if x not in pool:
            return 0.0
        pool.remove(x)
    if use_all and pool:
        return 0.0
    return 1.0 if value == Fraction(target) else 0.0


def step(state: str, action: str, extra_info: dict) -> dict:
    use_all = bool(extra_info.get("use_all", True))
    reward = grade(last_answer(action), extra_info["numbers"], extra_info["target"], use_all)
    return {"next_state": None, "reward": reward, "done": True}
