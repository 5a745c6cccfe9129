"""RL2 vs TRL side by side on TRL's own workloads (issue 20), in one invocation.

    python -m benchmarks.bench_vs_trl [--quick] [--repeats 3] [--rounds 1] [--only sft dpo grpo]
                                      [--no-trl] [--model DIR]

Same model (Qwen2 from a config: hidden 512, 8 layers, 8/4 heads, vocab 2048, 25.7M params; no
download; or a checkpoint with `--model DIR`, e.g. SmolLM2-135M), same rows
(benchmarks/vs_trl_data.py), same settings (fp32, AdamW lr 1e-5, clip 1.0):
- SFT: ~1020 tokens/step, packed (TRL: BFD packing into 1024-token rows, batch 1; RL2: the same
  sequences grouped by best-fit decreasing into <= 1024 tokens per step);
- DPO: 4 pairs/step, beta 0.1, the reference model run live every step;
- GRPO: 4 prompts x 4 samples x 64 new tokens, temperature 1, no KL, one update per rollout
  (TRL GRPOTrainer with HF generate; RL2.trainer.ppo with its embedded engine); the rollout
  (generation + rewards) and the update are timed separately.
TRL runs in one process with 2 threads; RL2 as 1 process x 2 threads and 2 processes x 1 thread
(torchrun). On a loaded machine two OpenMP threads in one process can run far slower than one
(they wait for each other at every op): `--threads 1` compares TRL and RL2 1x1 (plus RL2 2x1).
"RL2 2x1 alone" (SFT, DPO): two one-thread processes that never communicate, each computing one
rank's share of every batch: about what 2 x 1 would reach if its collectives cost nothing (each
also steps the optimizer over the whole model, where a 2 x 1 rank steps half).
Each figure is the median over `--repeats` steps after one warm-up step, wall clock; with
`--rounds R` every library runs R times, interleaved, and each figure and speed-up is the median
over the rounds (either library's speed moved 5-10% between processes on one shared machine).
Every figure is also given as a fraction of the fp32 matmul peak measured in this run on the
cores the configuration uses (FLOPs: 6N per trained token, 2N per reference/generation token, N = parameters): what a
library reaches out of what the machine can do. TRL is optional: without it, its column says so.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks.common import machine_description, matmul_peak, median, table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(REPO, "benchmarks")
WORKLOADS = ("sft", "dpo", "grpo")


def layouts(threads: int) -> list[tuple[str, int, int, list[str], tuple]]:
    """(column, processes, threads per process, config keys, workloads) of RL2's runs; TRL uses
    one process x threads. "2x1 ddp": the two ranks hold replicas (actor.ddp_size=2): one
    gradient all-reduce per step instead of FSDP's parameter all-gathers and gradient
    reduce-scatters. "2x1 sp": both ranks share every sequence (actor.sp_size=2, ring attention),
    so a step of few long sequences (SFT's 600 + 250 + 100 + 50 + 20 tokens: 600 / 420 by whole
    sequences) splits evenly. GRPO's 2 x 1 runs share one engine for both ranks (the default
    actor.rollout.tp_size=auto on CPU), whose leader decodes 16 rows with both ranks' threads;
    "2x1 rg1" (GRPO only) has an engine per rank (actor.rollout.tp_size=1, the default before
    fix 24), each streaming the whole model for 8 rows."""
    return [(f"RL2 1x{threads}", 1, threads, [], WORKLOADS), ("RL2 2x1", 2, 1, [], WORKLOADS),
            ("RL2 2x1 ddp", 2, 1, ["actor.ddp_size=2"], WORKLOADS),
            ("RL2 2x1 sp", 2, 1, ["actor.sp_size=2"], WORKLOADS),
            ("RL2 2x1 rg1", 2, 1, ["actor.rollout.tp_size=1"], ("grpo",))]


# Two one-thread processes that never talk, each computing one data-parallel rank's share of every
# SFT / DPO batch (vs_trl_rl2.py --part): what 2 x 1 costs without FSDP's collectives and without
# the ranks waiting for each other at every step (but each steps the optimizer over the whole
# model, a 2 x 1 rank over half); a step counts as the slower process's.
ALONE = "RL2 2x1 alone"
ALONE_WORKLOADS = ("sft", "dpo")


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def _env(threads: int) -> dict:
    """The environment of a benchmark process: its thread count, no tokenizer threads, wandb
    offline, this checkout importable."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
                WANDB_MODE="offline", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(cmd, threads: int, timeout: float, cwd: str):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(threads), cwd=cwd,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed:\n{proc.stderr[-2000:]}")


def _torchrun(nproc: int, root: str) -> list[str]:
    from RL2.utils.process import port_below_ephemeral

    port = port_below_ephemeral(host="127.0.0.1")
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1", f"--master_port={port}",
            f"--log-dir={os.path.join(root, 'torchrun')}"]  # not a torchelastic_* left in /tmp


def _load(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["steps"]


def run_trl(workload: str, root: str, args) -> list[dict]:
    out = os.path.join(root, f"trl_{workload}.json")
    _run([sys.executable, os.path.join(HERE, "vs_trl_trl.py"), "--workload", workload,
          "--assets", root, "--steps", str(args.repeats + 1), "--threads", str(args.threads),
          "--new-tokens", str(args.new_tokens), "--dtype", args.dtype, "--out", out],
         args.threads, args.timeout, root)
    return _load(out)


def run_rl2(workload: str, root: str, nproc: int, threads: int, args, keys: list[str]) -> list[dict]:
    out = os.path.join(root, f"rl2_{workload}_{nproc}_{'_'.join(keys)}.json")
    _run(_torchrun(nproc, root) + [os.path.join(HERE, "vs_trl_rl2.py"), "--workload", workload,
                             "--assets", root, "--steps", str(args.repeats + 1),
                             "--threads", str(threads), "--new-tokens", str(args.new_tokens),
                             "--dtype", args.dtype, "--out", out]
         + ["--override", *args.rl2_override, *keys],
         threads, args.timeout, root)
    return _load(out)


def run_rl2_alone(workload: str, root: str, args) -> list[dict]:
    """Both shares at once, each in a 1-process torchrun (`merge_alone` combines their steps).
    Both are waited for within one `args.timeout`, and killed if still running when it ends or
    anything fails."""
    outs = [os.path.join(root, f"rl2_{workload}_alone_{h}.json") for h in (0, 1)]
    logs = [os.path.join(root, f"rl2_{workload}_alone_{h}.log") for h in (0, 1)]
    deadline = time.monotonic() + args.timeout
    procs, errors = [], []
    try:
        for h, (out, log) in enumerate(zip(outs, logs)):
            with open(log, "w") as f:  # a file, not a pipe: a full pipe would stall the process
                procs.append(subprocess.Popen(
                    _torchrun(1, root) + [os.path.join(HERE, "vs_trl_rl2.py"), "--workload", workload,
                                          "--assets", root, "--steps", str(args.repeats + 1),
                                          "--threads", "1", "--dtype", args.dtype, "--part", f"{h}/2",
                                          "--out", out, "--override", *args.rl2_override],
                    stdout=subprocess.DEVNULL, stderr=f, env=_env(1), cwd=root))
        for h, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                errors.append(f"part {h}/2: timed out after {args.timeout} s")
                continue
            if proc.returncode != 0:
                with open(logs[h]) as f:
                    errors.append(f"part {h}/2 failed:\n{f.read()[-2000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if errors:
        raise RuntimeError("vs_trl_rl2.py --part: " + "\n".join(errors))
    return merge_alone([_load(out) for out in outs])


def merge_alone(runs: list[list[dict]]) -> list[dict]:
    """Step by step: the slowest process's wall time, the largest CPU time (each process's own
    cost on a core of its own; the two need not be the same process on a loaded machine), the
    tokens of all. The processes do not wait for each other, so the one that finishes first
    leaves the other a quieter machine for its last steps: slightly in the column's favour."""
    return [{"time": max(s["time"] for s in parts), "cpu": max(s["cpu"] for s in parts),
             "tokens": sum(s["tokens"] for s in parts)} for parts in zip(*runs)]


def summarize(workload: str, steps: list[dict], n_params: int, clock: str = "wall") -> dict:
    """Medians over the steps after the warm-up, and the FLOP rate of each figure, in wall-clock
    (`clock="wall"`) or process CPU seconds (`"cpu"`)."""
    steps = steps[1:] or steps
    suffix = "_cpu" if clock == "cpu" else ""
    m = lambda f: median([f(s) for s in steps])  # noqa: E731
    total = lambda s: s["cpu" if clock == "cpu" else "time"]  # noqa: E731
    flop_per_token = {"sft": 6, "dpo": 8, "grpo": 8}[workload] * n_params  # DPO: + reference fwd
    out = {"tokens/s": m(lambda s: s["tokens"] / total(s)), "s/step": m(total),
           "flop/s": m(lambda s: flop_per_token * s["tokens"] / total(s))}
    if workload == "grpo":
        gen = lambda s: s["generation" + suffix]  # noqa: E731
        # TRL: the step minus its rollout; RL2: actor_update itself
        upd = lambda s: s.get("update" + suffix, total(s) - gen(s))  # noqa: E731
        out.update({
            "gen tokens/s": m(lambda s: s["generated_tokens"] / gen(s)),
            "gen flop/s": m(lambda s: 2 * n_params * s["tokens"] / gen(s)),
            "update s": m(upd), "update flop/s": m(lambda s: 6 * n_params * s["tokens"] / upd(s)),
            "update s/1k tokens": m(lambda s: 1000 * upd(s) / s["tokens"])})
    return out


FIGURES = {  # workload -> (label, key, higher is better)
    "sft": [("SFT ~1020 tokens/step packed: tokens/s", "tokens/s", "flop/s", True)],
    "dpo": [("DPO 4 pairs/step, live reference: tokens/s", "tokens/s", "flop/s", True)],
    "grpo": [("GRPO 4x4x64, no KL: s/step", "s/step", "flop/s", False),
             ("  generation: generated tokens/s", "gen tokens/s", "gen flop/s", True),
             ("  policy update: s/step", "update s", "update flop/s", False),
             ("  policy update: s per 1k tokens", "update s/1k tokens", "update flop/s", False)],
}


def speedup(r: dict, base: dict, key: str, higher: bool) -> float:
    return r[key] / base[key] if higher else base[key] / r[key]


def combine_rounds(rounds: list[dict]) -> tuple[dict, dict]:
    """`rounds`: one {workload: {column: summarize(...)}} per round. Returns each figure's median
    over the rounds and, per workload / column / figure key, the speed-ups over TRL of each
    round (TRL and RL2 measured in the same round, so drift between rounds cancels)."""
    merged, ratios = {}, {}
    for workload in rounds[0]:
        merged[workload], ratios[workload] = {}, {}
        for col in rounds[0][workload]:
            per = [r[workload][col] for r in rounds]
            merged[workload][col] = {k: median([p[k] for p in per]) for k in per[0]}
            if col == "TRL" or "TRL" not in rounds[0][workload]:
                continue
            ratios[workload][col] = {
                key: [speedup(r[workload][col], r[workload]["TRL"], key, higher) for r in rounds]
                for _, key, _, higher in FIGURES[workload]}
    return merged, ratios


def ratio_table(results: dict, peaks: dict, columns: list[str], ratios: dict | None = None) -> str:
    """One row per figure: each column's value, its fraction of the peak of the cores that
    column uses (`peaks[column]`) and its speed-up over TRL (with `ratios` from
    `combine_rounds`: the median of the rounds' speed-ups)."""
    rows = []
    for workload, figures in FIGURES.items():
        if workload not in results:
            continue
        for label, key, flop_key, higher in figures:
            row, base = [label], results[workload].get("TRL")
            for col in columns:
                r = results[workload].get(col)
                if r is None:
                    row.append("skipped")
                    continue
                cell = f"{r[key]:.3g} ({100 * r[flop_key] / peaks[col]:.0f}% peak)"
                if base is not None and col != "TRL":
                    x = (median(ratios[workload][col][key]) if ratios
                         else speedup(r, base, key, higher))
                    cell += f" **{x:.2f}x**"
                row.append(cell)
            rows.append(row)
    return table(["workload"] + columns, rows)


def rounds_table(ratios: dict, columns: list[str]) -> str:
    """Each round's speed-up over TRL, per figure and RL2 column, then their median."""
    rows = []
    for workload, figures in FIGURES.items():
        for label, key, _, _ in figures:
            if workload not in ratios or not any(key in v for v in ratios[workload].values()):
                continue
            row = [label]
            for col in columns[1:]:
                xs = ratios[workload].get(col, {}).get(key)
                row.append("skipped" if xs is None else
                           ", ".join(f"{x:.2f}" for x in xs) + f" (median **{median(xs):.2f}x**)")
            rows.append(row)
    return table(["speed-up over TRL, each round"] + columns[1:], rows)


def run(args) -> str:
    import torch

    dtype = getattr(torch, args.dtype)
    from benchmarks.vs_trl_data import FULL_MODEL, QUICK_MODEL, build_assets

    with_trl = trl_available() and not args.no_trl
    columns = ["TRL"] + [name for name, *_ in layouts(args.threads)] + [ALONE]
    peaks, cpu_peaks, notes = {1: [], args.threads: []}, [], []
    if not with_trl:
        notes.append("TRL skipped: " + ("--no-trl" if args.no_trl else
                                         "`trl` is not installed (pip install trl to compare)"))
    raw = {}
    with tempfile.TemporaryDirectory() as root:
        build_assets(root, args.model or (QUICK_MODEL if args.quick else FULL_MODEL))
        from transformers import AutoModelForCausalLM

        from benchmarks.common import params_of
        n_params = params_of(AutoModelForCausalLM.from_pretrained(os.path.join(root, "model")))
        start = time.perf_counter()
        for _ in range(args.rounds):  # each round runs TRL and RL2 back to back
            for workload in args.only:
                for t in peaks:  # measured before every workload: follows the machine's load
                    torch.set_num_threads(t)
                    peaks[t].append(matmul_peak("cpu", dtype, repeats=3))
                torch.set_num_threads(1)
                cpu_peaks.append(matmul_peak("cpu", dtype, repeats=3, clock=time.process_time))
                runs = raw.setdefault(workload, {})
                if with_trl:
                    runs.setdefault("TRL", []).append(run_trl(workload, root, args))
                for name, nproc, threads, keys, workloads in layouts(args.threads):
                    if workload in workloads:
                        runs.setdefault(name, []).append(
                            run_rl2(workload, root, nproc, threads, args, keys))
                if workload in ALONE_WORKLOADS:
                    runs.setdefault(ALONE, []).append(run_rl2_alone(workload, root, args))
        elapsed = time.perf_counter() - start
    peak = {t: median(v) for t, v in peaks.items()}
    # A column's peak: the matmul rate of the cores it uses (2 x 1 = two one-thread processes).
    col_peak = {c: 2 * peak[1] if "2x1" in c else peak[args.threads] for c in columns}
    def by_round(clock: str) -> tuple[dict, dict]:  # raw[workload][column][round] -> combine_rounds
        return combine_rounds([{w: {c: summarize(w, st[i], n_params, clock) for c, st in r.items()}
                                for w, r in raw.items()} for i in range(args.rounds)])

    results, ratios = by_round("wall")
    name = f"{os.path.basename(os.path.normpath(args.model))}, " if args.model else ""
    head = (f"### RL2 vs TRL ({machine_description('cpu', args.threads)}; model {name}{n_params / 1e6:.1f}M "
            f"params; {args.dtype}; matmul peak {peak[1] / 1e9:.0f} GFLOP/s with 1 thread, "
            f"{peak[args.threads] / 1e9:.0f} with {args.threads} (medians of {len(peaks[1])} "
            f"measurements in this run); medians of {args.repeats} steps after 1 warm-up"
            + (f", then of {args.rounds} rounds" if args.rounds > 1 else "") + f"; {elapsed:.0f} s)")
    legend = ("Each cell: the figure (% of the matmul peak: 6N FLOP per trained token, +2N per "
              "reference or generation token) **speed-up over TRL** (>1 = RL2 faster). TRL runs in "
              f"one process with {args.threads} thread(s); `RL2 PxT` = P torchrun processes x T threads each; "
              "a column's peak is that of the cores it uses (2x1: twice the 1-thread peak).")
    parts = [head, "Wall clock:", ratio_table(results, col_peak, columns, ratios), legend]
    if args.rounds > 1 and with_trl:
        parts += [f"Each round's speed-up (TRL and RL2 run one after the other in every round; the "
                  f"table above gives each figure's median over the {args.rounds} rounds and the "
                  f"median of these speed-ups):", rounds_table(ratios, columns)]
    if args.threads == 1:  # process CPU time = wall time on an idle core, for 1-thread processes
        cpu_peak = median(cpu_peaks)
        cpu, cpu_ratios = by_round("cpu")
        parts += [f"Process CPU time (rank 0; one thread per process, so this is the time each "
                  f"process would take on a core of its own: robust to other tenants' load; gloo "
                  f"waits that sleep are not counted). 1-thread matmul peak in CPU time "
                  f"{cpu_peak / 1e9:.0f} GFLOP/s:",
                  ratio_table(cpu, {c: cpu_peak * (2 if "2x1" in c else 1) for c in columns}, columns,
                              cpu_ratios)]
    return "\n\n".join(parts + notes + ["```json\n" + json.dumps({"peak": col_peak, "raw": raw}) + "\n```"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 1 measured step (smoke test)")
    p.add_argument("--repeats", type=int, default=None, help="measured steps (default 3, quick 1)")
    p.add_argument("--only", nargs="*", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--no-trl", action="store_true", help="skip TRL even when it is installed")
    p.add_argument("--model", help="an HF checkpoint directory (with its tokenizer) instead of "
                                   "the issue's model, e.g. SmolLM2: python -m RL2.tools.smollm2 --out DIR")
    p.add_argument("--threads", type=int, default=2,
                   help="threads of TRL's process and of RL2's one-process run (the issue: 2)")
    p.add_argument("--new-tokens", type=int, default=None, help="GRPO tokens per sample (64; quick 16)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run TRL and RL2 this many times, one after the other each round, and "
                        "report medians over the rounds: TRL's speed moves by several %% between "
                        "processes on a shared machine, which one round cannot show")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--rl2-override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra config keys for every RL2 run, e.g. actor.rollout.torch.dtype=bfloat16")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="bfloat16: TRL's default mixed precision (CPU autocast) against RL2's "
                        "actor.dtype=bfloat16 (FSDP2 bf16 compute, fp32 master weights)")
    args = p.parse_args(argv)
    args.only = list(dict.fromkeys(args.only))  # a workload named twice runs once per round
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.new_tokens is None:
        args.new_tokens = 16 if args.quick else 64
    return args


def main(argv=None):
    print(run(parse_args(argv)))


if __name__ == "__main__":
    main()
