"""RL2 side of bench_vs_trl for SFT and DPO, launched with torchrun (1 x 2 threads or 2 x 1).

    torchrun --nproc_per_node=N benchmarks/vs_trl_rl2.py --workload sft --assets DIR --out r.json

The library path of RL2's trainers: an `Actor` (FSDP2 over every rank) with `sft_update`, and for
DPO a frozen reference `Actor` whose sequence log-probs are computed live every step before
`dpo_update` (what RL2.trainer.dpo does). Each step is timed on the wall clock between barriers;
rank 0 writes {"steps": [{"time", "tokens"}, ...]} (first step = warm-up included).
GRPO runs RL2.trainer.ppo itself (see bench_vs_trl.py).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=["sft", "dpo"], required=True)
    p.add_argument("--assets", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--sft-max-length", type=int, default=1024)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    from benchmarks.vs_trl_data import dpo_pairs, load_rows, sft_steps
    from RL2.algorithms.dpo import dpo_update
    from RL2.algorithms.sft import sft_update
    from RL2.data.pairs import flatten_pairs
    from RL2.parallel.mesh import init_distributed
    from RL2.utils.config import load_config
    from RL2.workers.actor import Actor

    init_distributed("cpu")
    model = os.path.join(args.assets, "model")
    keys = [f"actor.model_name={model}", "data.train.path=unused", "actor.lr=1e-5",
            "actor.scheduler=constant", "actor.warmup_ratio=0", "actor.max_grad_norm=1.0"]
    cfg = load_config(args.workload, keys)
    actor = Actor(cfg.actor, "cpu", total_steps=10 ** 6)
    if args.workload == "sft":
        batches = sft_steps(load_rows(args.assets, "sft"), args.sft_max_length)[:args.steps]

        def step(batch):
            sft_update(actor, batch)
            return sum(len(s["input_ids"]) for s in batch)
    else:
        from transformers import AutoTokenizer

        ref_cfg = cfg.actor.copy()
        ref = Actor(ref_cfg, "cpu", train=False)
        pairs = dpo_pairs(load_rows(args.assets, "dpo"), AutoTokenizer.from_pretrained(model))
        batches = [pairs[i:i + args.pairs] for i in range(0, args.pairs * args.steps, args.pairs)]

        def step(batch):
            samples = flatten_pairs(batch)[0]
            dpo_update(actor, batch, ref.compute_sequence_logps(samples))  # live reference
            return sum(len(s["input_ids"]) + 1 for s in samples)  # + 1: TRL counts the last token
    if len(batches) < args.steps:
        raise SystemExit(f"only {len(batches)} {args.workload} steps of data for --steps {args.steps}")
    steps = []
    for batch in batches:
        dist.barrier()
        start = time.perf_counter()
        tokens = step(batch)
        dist.barrier()
        steps.append({"time": time.perf_counter() - start, "tokens": tokens})
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"steps": steps}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
