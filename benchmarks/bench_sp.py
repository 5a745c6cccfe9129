"""Sequence parallelism: peak memory per rank and step time vs sp_size on one long sequence.

    python benchmarks/bench_sp.py [--length 8192] [--sp 1 2 4] [--repeats 3]

Each sp_size runs under its own torchrun (sp_size ranks, gloo on CPU). Memory is the growth of
the process's peak RSS over its resident size before training (model and libraries excluded), so it measures
activations plus gradients/optimizer state of the shard; activations should fall ~1/sp_size.
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args):
    import torch
    import torch.distributed as dist

    from RL2.utils.config import load_config
    from RL2.algorithms.sft import sft_update
    from RL2.workers.actor import Actor

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    sp = dist.get_world_size()
    cfg = load_config("sft", [f"actor.model_name={args.model}", "data.train.path=unused",
                              f"actor.sp_size={sp}", f"actor.max_length_per_device={args.length // sp + 64}"])
    actor = Actor(cfg.actor, "cpu", total_steps=args.repeats + 1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, actor.config.vocab_size, (args.length + 1,), generator=g)
    sample = {"input_ids": ids[:-1], "labels": ids[1:], "action_mask": torch.ones(args.length)}
    # Baseline: resident memory now (model + libraries); the peak below includes the first step.
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024
    sft_update(actor, [sample])  # warm-up: allocator, optimizer state
    # Activation memory: bytes of the distinct storages autograd saves for backward (exact and
    # allocator-independent, unlike RSS).
    saved = {}

    def pack(t):
        if t.device.type == "cpu" and not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sft_update(actor, [sample])
    act_mb = sum(saved.values()) / 2**20
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        sft_update(actor, [sample])
        times.append(time.perf_counter() - start)
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    result = torch.tensor([peak_mb, statistics.median(times), act_mb])
    gathered = [torch.zeros(3) for _ in range(sp)]
    dist.all_gather(gathered, result)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"sp": sp, "peak_mb": max(float(t[0]) for t in gathered),
                                      "step_s": float(result[1]),
                                      "act_mb": max(float(t[2]) for t in gathered)}))
    dist.barrier()
    dist.destroy_process_group()


def _launch(args, sp: int, logs: str) -> dict:
    """One sp_size run under torchrun: its RESULT line."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={sp}",
           f"--log-dir={logs}", __file__, "--worker", "--model", args.model, "--length", str(args.length),
           "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if not line:
        raise SystemExit(f"sp={sp} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[0][7:])


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model", default=None)
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.model is None:
        from RL2.tools.make_assets import build_tiny_model, build_tokenizer

        args.model = os.path.join(tempfile.mkdtemp(), "model")
        build_tiny_model(args.model, build_tokenizer(), hidden=args.hidden, layers=args.layers,
                         heads=4, kv_heads=2, intermediate=4 * args.hidden, max_pos=args.length + 64)
    logs = tempfile.mkdtemp()  # torchrun's log dirs, removed below
    try:
        rows = [_launch(args, sp, logs) for sp in args.sp]
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    ref = rows[0]
    print(f"\nSequence parallel, one {args.length}-token sequence, hidden {args.hidden}, "
          f"{args.layers} layers (CPU, gloo; median of {args.repeats} steps)\n")
    print("| sp_size | activations saved for backward per rank (MB) | vs sp=1 | peak RSS growth per rank (MB) | step time (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sp']} | {r['act_mb']:.0f} | {r['act_mb'] / ref['act_mb']:.2f}x | "
              f"{r['peak_mb']:.0f} | {r['step_s']:.2f} |")


if __name__ == "__main__":
    main()
