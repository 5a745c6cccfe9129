"""Run every benchmark and print (and optionally save) the markdown tables.

    python -m benchmarks.run_all [--quick] [--out benchmarks/results.md] [--only sft ppo ...]

Each benchmark runs in its own subprocess (clean process group, thread settings and memory);
its stdout is markdown. CPU defaults take 7-9 minutes on 2 cores (within 15; `--quick`: fewer
repeats, smaller models);
with CUDA the scripts pick bigger defaults themselves (SFT batch, PPO on the GPU). Ratios are
always taken within one invocation, so they stay meaningful on a loaded machine even when the
absolute numbers do not.
"""
import argparse
import datetime
import logging
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
logger = logging.getLogger("benchmarks")


def commands(quick: bool, cuda: bool) -> dict[str, list[str]]:
    py = [sys.executable, "-m"]
    q = ["--quick"] if quick else []
    engine = [sys.executable, os.path.join(REPO, "benchmarks", "bench_engine.py"),
              "--repeats", "2" if quick else "3"]
    if cuda:
        engine += ["--hidden", "512", "--layers", "8", "--prompts", "128", "--agents", "64"]
    return {
        "packing": py + ["benchmarks.bench_packing", *q],
        "sft": py + ["benchmarks.bench_sft", *q],
        "weight_sync": py + ["benchmarks.bench_weight_sync", *q],
        "ppo": py + ["benchmarks.bench_ppo", *q] + (["--device", "cuda", "--sizes", "4M", "25M"] if cuda else []),
        "engine": engine,
        "sp": [sys.executable, os.path.join(REPO, "benchmarks", "bench_sp.py"), "--sp", "1", "2",
               "--repeats", "2"] + (["--length", "4096"] if quick else []),
        "env": py + ["benchmarks.bench_env", *q],
    }


def run_one(name: str, cmd: list[str], timeout: float) -> tuple[str, float]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"### {name}\n\n_timed out after {timeout:.0f} s_", time.perf_counter() - start
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return f"### {name}\n\n_failed (exit {proc.returncode}):_\n\n```\n{tail}\n```", elapsed
    out = proc.stdout.strip()
    if name == "engine" and not out.startswith("#"):  # plain-text table: keep it verbatim
        out = f"### Rollout engine vs HF generate\n\n```\n{out}\n```"
    elif not out.startswith("#"):
        out = f"### {name}\n\n{out}"
    return out, elapsed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller models")
    parser.add_argument("--out", default=None, help="also write the tables to this markdown file")
    parser.add_argument("--only", nargs="*", default=None,
                        choices=["packing", "sft", "weight_sync", "ppo", "engine", "sp", "env"])
    parser.add_argument("--timeout", type=float, default=1800, help="per benchmark, seconds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    import torch

    cuda = torch.cuda.is_available()
    cmds = commands(args.quick, cuda)
    names = args.only or list(cmds)
    command = "python -m benchmarks.run_all " + " ".join(sys.argv[1:] if argv is None else argv)
    sections = [
        "## Benchmarks",
        f"Command: `{command.strip()}` ({datetime.datetime.now():%Y-%m-%d %H:%M}, "
        f"{'CUDA' if cuda else 'CPU'} path). Machine: {os.cpu_count()} CPU cores"
        + (f", {torch.cuda.get_device_name()}" if cuda else "")
        + (f", load average at start {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "")
        + ". Absolute numbers move with machine load; ratios are taken within one invocation.",
    ]
    total = time.perf_counter()
    for name in names:
        logger.info(f"running {name}: {' '.join(cmds[name])}")
        text, elapsed = run_one(name, cmds[name], args.timeout)
        text += f"\n\n_({name}: {elapsed:.0f} s)_"
        print(text + "\n", flush=True)
        sections.append(text)
    sections.append(f"_Total: {time.perf_counter() - total:.0f} s._")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n\n".join(sections) + "\n")
        logger.info(f"wrote {args.out}")


if __name__ == "__main__":
    main()
