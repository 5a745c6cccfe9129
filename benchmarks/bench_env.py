"""Cost of running sync env hooks in worker processes (`actor.rollout.env_workers`) instead of
in-process threads: the rollout of many multi-turn trajectories on the calculator env, and
single-step math (math-verify) grading, with an engine that answers instantly from a script
(tests/fakes.ScriptedEngine), so the table shows env + trajectory overhead only (a real engine's
generation time comes on top).

    python -m benchmarks.bench_env [--trajectories 64] [--repeats 5] [--workers 4]
"""
import argparse
import asyncio
import importlib.util
import os
import time

from benchmarks.common import median, table
from RL2.rollout.engine import SamplingParams
from RL2.rollout.env import load_env
from RL2.rollout.trajectory import run_trajectory
from RL2.tools.make_assets import build_tokenizer
from tests.fakes import ScriptedEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALCULATOR_TURNS = ["<calculator>12*(3+4)</calculator>", "<calculator>84/2</calculator>",
                    "<answer>42</answer>"]


def by_turn(n_texts: int):
    """A ScriptedEngine `pick` answering turn k with texts[k]: every trajectory plays the same
    script, so the prompt length of a call names its turn (lengths grow turn by turn)."""
    turns: dict[int, int] = {}
    return lambda prompt_ids: min(turns.setdefault(len(prompt_ids), len(turns)), n_texts - 1)


def rollout_seconds(env, tok, texts, n: int, max_turns: int) -> float:
    prompt_ids = tok.encode("What is 12*(3+4)/2?", add_special_tokens=False)
    engine = ScriptedEngine(tok, texts, pick=by_turn(len(texts)))

    async def main():
        jobs = [run_trajectory(engine, tok, env, {"prompt_ids": prompt_ids, "prompt_text": "What is 12*(3+4)/2?",
                                                  "extra_info": {"answer": "42"}},
                               SamplingParams(max_new_tokens=32, seed=i), max_turns, f"t{i}")
                for i in range(n)]
        return await asyncio.gather(*jobs)

    start = time.perf_counter()
    trajs = asyncio.run(main())
    elapsed = time.perf_counter() - start
    assert all(t.reward == 1.0 and not t.failed for t in trajs), [t.error for t in trajs if t.failed][:3]
    return elapsed


def measure(name, path, texts, max_turns, args, tok) -> list:
    row = [name, args.trajectories * len(texts)]
    times = {}
    for workers in (0, args.workers):
        env = load_env(path, {}, timeout=60, workers=workers)
        env.start()
        try:
            rollout_seconds(env, tok, texts, 4, max_turns)  # warm-up (imports, first calls)
            times[workers] = median([rollout_seconds(env, tok, texts, args.trajectories, max_turns)
                                     for _ in range(args.repeats)])
        finally:
            env.shutdown()
    steps = args.trajectories * len(texts)
    t0, t1 = times[0], times[args.workers]
    return row + [t0, t1, t1 / t0, (t1 - t0) / steps * 1e6]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 3
    tok = build_tokenizer()
    rows = [measure("calculator (3 turns)", os.path.join(ROOT, "envs", "calculator_tool.py"),
                    CALCULATOR_TURNS, 3, args, tok)]
    if importlib.util.find_spec("math_verify") is not None:
        rows.append(measure("math (math-verify, 1 turn)", os.path.join(ROOT, "envs", "math_env.py"),
                            [r"so \boxed{42}"], 1, args, tok))
    print(f"### Env isolation: in-process threads vs {args.workers} worker processes\n")
    print(f"{args.trajectories} concurrent trajectories, instant scripted engine, median of {args.repeats} "
          f"rollouts (wall clock; a shared machine: noisy).\n")
    print(table(["env", "env steps", "in-process s", "processes s", "ratio", "overhead us/step"], rows))


if __name__ == "__main__":
    main()
