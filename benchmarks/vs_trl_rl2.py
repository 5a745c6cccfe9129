"""RL2 side of bench_vs_trl, launched with torchrun (1 x T threads or 2 x 1).

    torchrun --nproc_per_node=N benchmarks/vs_trl_rl2.py --workload sft --assets DIR --out r.json

The library path of RL2's trainers:
- sft: an `Actor` (FSDP2 over every rank) and `sft_update`;
- dpo: the same plus a frozen reference `Actor` whose sequence log-probs are computed live every
  step before `dpo_update` (what RL2.trainer.dpo does);
- grpo: `RL2.trainer.ppo.PPOTrainer.train_step` itself (embedded engine rollout, advantages,
  actor update, weight sync), its rollout and actor update wrapped by timers.
Each step is timed on the wall clock (between barriers) and in process CPU time (rank 0; what
the step costs without the other tenants of a loaded machine). Rank 0 writes
{"steps": [{"time", "cpu", "tokens", ...}, ...]} with the first step (warm-up) included.

`--part H/N` (sft, dpo; one process): every step computes only the share of its batch that
data-parallel rank H of N would get (the Worker's plan), with no other rank to talk to. N such
processes side by side are what N ranks cost without their collectives and without waiting for
each other at every step; but each steps the optimizer over the whole model, where a rank of N
steps its 1/N shard.
"""
import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENV = '''async def step(state, action, extra_info):
    reward = float(len(action) % 2)  # the TRL reward function of vs_trl_trl.py
    return {"next_state": None, "reward": reward, "score": reward, "done": True}
'''


@contextmanager
def clocks(record: dict, name: str):
    start, cpu = time.perf_counter(), time.process_time()
    yield
    record[name] = record.get(name, 0.0) + time.perf_counter() - start
    record[f"{name}_cpu"] = record.get(f"{name}_cpu", 0.0) + time.process_time() - cpu


def part_of(lengths: list[int], part: tuple[int, int], capacity: int,
            groups: list[list[int]] | None = None) -> list[int]:
    """Indices of the samples data-parallel rank part[0] of part[1] gets: the plan a Worker makes
    (`plan_micro_batches` with its capacity and groups), all of that rank's micro-batches."""
    from RL2.data.packing import plan_micro_batches

    rank, n = part
    return sorted(i for mb in plan_micro_batches(lengths, n, capacity, groups=groups)[rank] for i in mb)


def _parts(batches: list[list], shares: list[list[int]], part: tuple[int, int]) -> list[list]:
    """Each batch cut to the items (indices into it) of its share."""
    out = [[b[i] for i in share] for b, share in zip(batches, shares)]
    if not all(out):
        raise SystemExit(f"--part {part[0]}/{part[1]}: a batch has fewer items than {part[1]} ranks")
    return out


def pair_part(pairs: list[dict], part: tuple[int, int], capacity: int, share_prompt: bool) -> list[int]:
    """The pairs (indices) of rank part[0]'s share, planned as dpo_update plans them: the
    samples of `flatten_pairs` (a rejected side as its tail past a shared prompt) kept by pair."""
    from RL2.data.pairs import flatten_pairs

    samples, groups = flatten_pairs(pairs, share_prompt)
    lengths = [len(s["input_ids"]) for s in samples]
    return sorted({i // 2 for i in part_of(lengths, part, capacity, groups)})


def parse_part(text: str) -> tuple[int, int]:
    rank, _, n = text.partition("/")
    if not (rank.isdigit() and n.isdigit() and 0 <= int(rank) < int(n)):
        raise argparse.ArgumentTypeError(f"--part {text!r}: expected H/N with 0 <= H < N")
    return int(rank), int(n)


def sft_dpo_steps(args, model: str):
    """(batches, step function) for sft / dpo on an Actor (+ reference)."""
    from benchmarks.vs_trl_data import dpo_pairs, load_rows, sft_steps
    from RL2.algorithms.dpo import dpo_update
    from RL2.algorithms.sft import sft_update
    from RL2.data.pairs import flatten_pairs
    from RL2.utils.config import load_config
    from RL2.workers.actor import Actor

    keys = [f"actor.model_name={model}", "data.train.path=unused", "actor.lr=1e-5",
            "actor.scheduler=constant", "actor.warmup_ratio=0", "actor.max_grad_norm=1.0",
            f"actor.dtype={args.dtype}"] + args.override
    cfg = load_config(args.workload, keys)
    actor = Actor(cfg.actor, "cpu", total_steps=10 ** 6)
    if args.workload == "sft":
        def step(batch, record):
            sft_update(actor, batch)
            return sum(len(s["input_ids"]) for s in batch)
        steps = sft_steps(load_rows(args.assets, "sft"), args.sft_max_length)
        # the Worker's layout (`share_prefixes`) leaves these rows as they are: none shares a prefix
        if getattr(args, "part", None):
            steps = _parts(steps, [part_of([len(s["input_ids"]) for s in b], args.part, actor.capacity)
                                   for b in steps], args.part)
        return steps, step
    from transformers import AutoTokenizer

    ref = Actor(cfg.actor.copy(), "cpu", train=False)
    pairs = dpo_pairs(load_rows(args.assets, "dpo"), AutoTokenizer.from_pretrained(model))

    def step(batch, record):
        dpo_update(actor, batch, ref.compute_sequence_logps(*flatten_pairs(batch, ref.share_prompt)))  # live reference
        # the pairs' tokens in full (+ 1: TRL counts the last token), shared prompt or not
        return sum(len(s["input_ids"]) + 1 for s in flatten_pairs(batch)[0])
    batches = [pairs[i:i + args.pairs] for i in range(0, len(pairs), args.pairs)]
    if getattr(args, "part", None):
        batches = _parts(batches, [pair_part(b, args.part, actor.capacity, actor.share_prompt)
                                   for b in batches], args.part)
    return batches, step


def grpo_steps(args, model: str):
    """(step indices, step function) running PPOTrainer.train_step with timed stages."""
    import RL2.trainer.ppo as ppo
    from RL2.utils.config import load_config

    env_path = os.path.join(args.assets, "parity_env.py")
    if not os.path.exists(env_path):
        with open(env_path, "w") as f:
            f.write(ENV)
    run_dir = os.path.join(args.assets, f"rl2_grpo_run_{os.environ.get('WORLD_SIZE', '1')}")
    cfg = load_config("ppo", [
        f"actor.model_name={model}", f"data.train.path={args.assets}/grpo.jsonl",
        "data.train.apply_chat_template=false", f"actor.rollout.env_path={env_path}",
        "actor.rollout.env_workers=0", f"trainer.save_dir={run_dir}", "trainer.device=cpu",
        "actor.rollout.prompts_per_rollout=4", "actor.rollout.responses_per_prompt=4",
        f"actor.rollout.train_sampling_params.max_new_tokens={args.new_tokens}",
        "actor.rollout.dump_rollouts=false", "kl.coef=0", "adv.norm_var=true", "actor.lr=1e-5",
        "actor.max_grad_norm=1.0", f"actor.dtype={args.dtype}",
        f"actor.rollout.torch.dtype={args.dtype}"] + args.override)  # bf16: TRL generates under autocast
    trainer = ppo.PPOTrainer(cfg)
    record = {}
    run, update = trainer.rollout.run, ppo.actor_update

    def timed_run(*a, **kw):
        with clocks(record, "generation"):
            return run(*a, **kw)

    def timed_update(*a, **kw):
        with clocks(record, "update"):
            return update(*a, **kw)
    trainer.rollout.run, ppo.actor_update = timed_run, timed_update

    def step(i, out):
        record.clear()
        metrics = trainer.train_step(i)
        out.update(record, generated_tokens=metrics["rollout/train_tokens"])
        return metrics["train/tokens"]
    step.close = trainer.close  # engine shutdown, then the process group
    return list(range(args.steps)), step


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=["sft", "dpo", "grpo"], required=True)
    p.add_argument("--assets", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--sft-max-length", type=int, default=1024)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--override", nargs="*", default=[], help="extra RL2 config keys (key=value)")
    p.add_argument("--part", type=parse_part, default=None, metavar="H/N",
                   help="sft/dpo, one process: compute only rank H of N's share of every batch")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    from RL2.parallel.mesh import init_distributed

    init_distributed("cpu")
    if args.part and (args.workload == "grpo" or dist.get_world_size() > 1):
        raise SystemExit("--part: sft or dpo in one process")
    model = os.path.join(args.assets, "model")
    batches, step = (grpo_steps if args.workload == "grpo" else sft_dpo_steps)(args, model)
    if len(batches) < args.steps:
        raise SystemExit(f"only {len(batches)} {args.workload} steps of data for --steps {args.steps}")
    steps = []
    for batch in batches[:args.steps]:
        record = {}
        dist.barrier()
        with clocks(record, "time"):
            record["tokens"] = step(batch, record)
            dist.barrier()
        record["cpu"] = record.pop("time_cpu")
        steps.append(record)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"steps": steps}, f)
    getattr(step, "close", dist.destroy_process_group)()


if __name__ == "__main__":
    main()
