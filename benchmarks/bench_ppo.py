"""PPO step-time breakdown: launches `torchrun -m RL2.trainer.ppo` (envs/answer_match.py on the
make_assets arithmetic prompts) and reads the `time/*` metrics of run_dir/metrics.jsonl.

    python -m benchmarks.bench_ppo [--quick] [--sizes tiny 4M] [--nprocs 1 2]

Full PPO so every stage runs: GAE with a critic (values), a reference model with a KL penalty in
the rewards (ref log-probs, old log-probs). If the critic path fails, the run is repeated without
it (GRPO-style advantages) and the failure is noted under the table. The first step is a warm-up
and is dropped; the table gives the median over the remaining steps, in wall-clock seconds.
"""
import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile

from benchmarks.common import MODEL_SIZES, machine_description, median, table
from RL2.utils.process import port_below_ephemeral

logger = logging.getLogger(__name__)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["rollout", "ref_logps", "values", "old_logps", "advantages", "update", "sync"]


def make_assets(root: str, size: str) -> tuple[str, str]:
    from RL2.tools.make_assets import build_tiny_model, build_tokenizer, write_datasets

    tok = build_tokenizer()
    model = os.path.join(root, f"model_{size}")
    if not os.path.exists(model):
        build_tiny_model(model, tok, "qwen2", **MODEL_SIZES[size])
    data = os.path.join(root, "data")
    if not os.path.exists(data):
        write_datasets(data, n_train=256, n_test=8)
    return model, data


def launch(nproc: int, model: str, data: str, run_dir: str, steps: int, args, gae: bool):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={port_below_ephemeral(host='127.0.0.1')}",
           f"--log-dir={os.path.join(run_dir, 'torchrun')}", "-m", "RL2.trainer.ppo",
           f"actor.model_name={model}", f"data.train.path={data}/ppo_train.jsonl",
           f"actor.rollout.env_path={os.path.join(REPO, 'envs', 'answer_match.py')}",
           f"trainer.save_dir={run_dir}", "trainer.experiment_name=run",
           f"trainer.device={args.device}", f"trainer.total_steps={steps}",
           f"actor.rollout.prompts_per_rollout={args.prompts}",
           f"actor.rollout.responses_per_prompt={args.responses}",
           f"actor.rollout.train_sampling_params.max_new_tokens={args.max_new_tokens}",
           "actor.rollout.dump_rollouts=false", "kl.coef=0.01", "kl.type=reward",
           "actor.lr=1e-4", "critic.lr=1e-4"]
    if gae:
        cmd.append("adv.estimator=gae")
    threads = "1" if args.device == "cpu" else os.environ.get("OMP_NUM_THREADS", "4")
    env = dict(os.environ, OMP_NUM_THREADS=threads, TOKENIZERS_PARALLELISM="false",
               WANDB_MODE="offline", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run_dir,
                          timeout=args.timeout)
    return proc, cmd


def read_steps(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "run", "metrics.jsonl")
    with open(path) as f:
        return [r for r in map(json.loads, f) if "time/step" in r]


def bench_one(size: str, nproc: int, root: str, args) -> tuple[list, str | None]:
    model, data = make_assets(root, size)
    steps = args.steps
    note = None
    for gae in (True, False):
        run_dir = tempfile.mkdtemp(dir=root, prefix=f"ppo_{size}_{nproc}_")
        proc, cmd = launch(nproc, model, data, run_dir, steps, args, gae)
        if proc.returncode == 0:
            break
        # The exception line of the rank traceback, e.g. "[rank0]: TypeError: ...".
        err = [line for line in proc.stderr.splitlines() if re.search(r"\w+(Error|Exception): ", line)]
        msg = err[-1] if err else f"exit code {proc.returncode}"
        note = f"{size}, {nproc} proc, {'GAE' if gae else 'no critic'}: failed: `{msg.strip()[:240]}`"
        logger.warning(f"{' '.join(cmd)}\n{proc.stderr[-1500:]}")
    else:
        return [], note
    rows = read_steps(run_dir)[1:]  # step 1 is the warm-up
    gen_tokens = [r["rollout/response_length"] * args.prompts * args.responses for r in rows]
    med = {s: median([r.get(f"time/{s}", float("nan")) for r in rows]) for s in STAGES + ["step"]}
    tok_s = median([g / r["time/rollout"] for g, r in zip(gen_tokens, rows)])
    out = [f"{size}", nproc, "GAE+KL" if gae else "KL (no critic)"]
    out += [med[s] for s in STAGES] + [med["step"], tok_s]
    return out, note


def run(args) -> str:
    sizes = args.sizes or (["tiny", "1M"] if args.quick else ["tiny", "4M"])
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as root:
        for size in sizes:
            for nproc in args.nprocs:
                row, note = bench_one(size, nproc, root, args)
                if row:
                    rows.append(row)
                if note:
                    notes.append(f"- {note}")
    headers = ["model", "procs", "algorithm"] + [f"{s} s" for s in STAGES] + ["step s", "rollout gen tok/s"]
    parts = [f"### PPO step breakdown ({machine_description(args.device, 1)}; "
             f"{args.prompts} prompts x {args.responses} responses x <= {args.max_new_tokens} new tokens "
             f"per step; median of steps 2..{args.steps}, wall clock)", table(headers, rows)]
    if notes:
        parts.append("\n".join(notes))
    return "\n\n".join(parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", nargs="*", choices=sorted(MODEL_SIZES))
    p.add_argument("--nprocs", nargs="*", type=int, default=[1, 2])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--responses", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.quick else 4
    return args


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(run(args))


if __name__ == "__main__":
    main()
