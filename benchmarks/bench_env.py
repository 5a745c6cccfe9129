"""Cost of running sync env hooks in worker processes (`actor.rollout.env_workers`) instead of
in-process threads: the rollout of many multi-turn trajectories on the calculator env, and
single-step math (math-verify) grading, with an engine that answers instantly from a script, so
the table shows env + trajectory overhead only (a real engine's generation time comes on top).

    python -m benchmarks.bench_env [--trajectories 64] [--repeats 5] [--workers 4]
"""
import argparse
import asyncio
import importlib.util
import os
import time

from benchmarks.common import median, table
from RL2.rollout.engine import Engine, GenerationOutput, SamplingParams
from RL2.rollout.env import load_env
from RL2.rollout.trajectory import run_trajectory
from RL2.tools.make_assets import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALCULATOR_TURNS = ["<calculator>12*(3+4)</calculator>", "<calculator>84/2</calculator>",
                    "<answer>42</answer>"]


class InstantEngine(Engine):
    """Answers turn k of every trajectory with texts[k] (token ids, zero log-probs)."""

    def __init__(self, tokenizer, texts):
        self.ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]

    async def generate(self, prompt_ids, params):
        k = params.seed % 1_000_003  # run_trajectory's per-turn seed is seed * 1_000_003 + turn
        ids = self.ids[min(k, len(self.ids) - 1)]
        await asyncio.sleep(0)  # a real engine yields to the loop
        return [GenerationOutput(list(ids), [0.0] * len(ids), "stop")]

    def update_weights(self, named_tensors):
        pass

    def release_memory(self, tags=None):
        pass

    def resume_memory(self, tags=None):
        pass

    def shutdown(self):
        pass


def rollout_seconds(env, tok, texts, n: int, max_turns: int) -> float:
    prompt_ids = tok.encode("What is 12*(3+4)/2?", add_special_tokens=False)
    engine = InstantEngine(tok, texts)

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
