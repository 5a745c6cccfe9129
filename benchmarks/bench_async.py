"""Asynchronous rollout: PPO steps per minute for actor.rollout.max_staleness = 0, 1, 2, with an
agentic environment whose `step` sleeps (tool latency 0.2-1 s per turn, 3 turns) and without it.

    python -m benchmarks.bench_async [--quick] [--nproc 1] [--steps 8] [--update-epochs 4] [--servers 1]

Launches `torchrun -m RL2.trainer.ppo` per setting (GRPO, tiny model, 1 process by default);
with `--servers N` the engines are N RL2 engine servers (`placement=disaggregated`, one thread
each) and the trainer builds none, so generation and the update run in separate processes;
steps per minute = 60 / mean wall time of a step over steps 2..N (`time/step`: for k >= 1 the
trainer's wait for its batch plus the update; step 1 is the warm-up). `--update-epochs` scales
the update so that it takes about as long as a rollout with latency (the k = 0 row prints both).
"""
import argparse
import os
import subprocess
import sys
import tempfile

from benchmarks.bench_ppo import make_assets, read_steps
from benchmarks.common import machine_description, table
from RL2.utils.process import port_below_ephemeral
from tests.server_utils import kill, start_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tool latency: a deterministic 0.2-1.0 s per (trajectory, turn); 3 turns per trajectory.
ENV = '''
import asyncio
import random

LATENCY = {latency}


async def step(state, action, extra_info):
    turn = extra_info.get("turn", 0)
    if LATENCY:
        await asyncio.sleep(random.Random(f"{{extra_info['uid']}}:{{turn}}").uniform(0.2, 1.0))
    if turn == 2:
        return {{"next_state": None, "reward": float(str(extra_info.get("answer")) in action), "done": True}}
    return {{"next_state": state + action + " Check again:", "reward": 0.0, "done": False,
            "extra_info": {{**extra_info, "turn": turn + 1}}}}
'''


def launch(args, model, data, env_path, k, run_dir, servers=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           "--master_addr=127.0.0.1", f"--master_port={port_below_ephemeral(host='127.0.0.1')}",
           f"--log-dir={os.path.join(run_dir, 'torchrun')}", "-m", "RL2.trainer.ppo",
           f"actor.model_name={model}", f"data.train.path={data}/ppo_train.jsonl",
           f"actor.rollout.env_path={env_path}", "actor.rollout.max_turns=3",
           f"trainer.save_dir={run_dir}", "trainer.experiment_name=run", "trainer.device=cpu",
           f"trainer.total_steps={args.steps}", f"actor.rollout.prompts_per_rollout={args.prompts}",
           f"actor.rollout.responses_per_prompt={args.responses}",
           f"actor.rollout.train_sampling_params.max_new_tokens={args.max_new_tokens}",
           f"actor.update_epochs={args.update_epochs}", "actor.lr=1e-4", "actor.rollout.dump_rollouts=false",
           "actor.rollout.env_workers=0", f"actor.rollout.max_staleness={k}"]
    if servers:
        cmd += ["actor.rollout.placement=disaggregated", f"actor.rollout.servers=[{','.join(servers)}]"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=run_dir, timeout=args.timeout)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return read_steps(run_dir)[1:]


def run(args) -> str:
    rows = []
    with tempfile.TemporaryDirectory() as root:
        model, data = make_assets(root, args.size)
        started = [start_server(model, os.path.join(root, f"server{i}.log")) for i in range(args.servers)]
        try:
            _measure(args, root, model, data, [a for _, a in started], rows)
        finally:
            for proc, _ in started:
                kill(proc)
    headers = ["env latency", "max_staleness", "steps/min", "vs k=0", "rollout s (generation)",
               "trainer waits s", "update s"]
    where = f"{args.servers} engine server(s)" if args.servers else "colocated engine"
    return "\n\n".join([
        f"### Asynchronous rollout ({machine_description('cpu', 1)}; {args.nproc} process(es), {where}, "
        f"model {args.size}, {args.prompts} prompts x {args.responses} responses x 3 turns x <= "
        f"{args.max_new_tokens} new tokens, update_epochs={args.update_epochs}; mean of steps 2..{args.steps})",
        table(headers, rows)])


def _measure(args, root, model, data, servers, rows) -> None:
    """One row per (env latency, k): steps/min and where a step's time goes."""
    for latency in (True, False):
        env_path = os.path.join(root, f"env_{latency}.py")
        with open(env_path, "w") as f:
            f.write(ENV.format(latency=latency))
        base = None
        for k in (0, 1, 2):
            steps = launch(args, model, data, env_path, k, tempfile.mkdtemp(dir=root), servers)
            mean = sum(r["time/step"] for r in steps) / len(steps)
            per_min = 60.0 / mean
            base = base or per_min
            update = sum(r.get("time/update", 0.0) for r in steps) / len(steps)
            wait = sum(r["time/rollout"] for r in steps) / len(steps)
            gen = sum(r.get("rollout/generate_seconds", r["time/rollout"]) for r in steps) / len(steps)
            rows.append(["0.2-1 s x 3 turns" if latency else "none", k, per_min, per_min / base,
                         gen, wait, update])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--responses", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--update-epochs", type=int, default=8)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--servers", type=int, default=0, help="RL2 engine servers (0: colocated engine)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 5 if args.quick else 8
    return args


def main(argv=None):
    print(run(parse_args(argv)))


if __name__ == "__main__":
    main()
