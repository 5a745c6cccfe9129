"""SFT training throughput: RL2's packed `sft_update` vs plain right-padded batches, and MFU.

    python -m benchmarks.bench_sft [--quick] [--sizes 1M 25M] [--profile]

Same seeded workload (lengths 20-1000, log-normal), same initial weights, same global batches,
same optimizer (AdamW, grad clip 1.0), same loss (token-level NLL on the response tokens):
- padded: a TRL-style loop: plain HF model (sdpa), micro-batches of `--padded-batch` sequences in
  data order, right-padded with an attention mask, gradient accumulation over the global batch;
- packed (plain HF): the same plain loop on RL2's packed micro-batches (plan_micro_batches + pack
  + the rl2_packed attention), without the worker: separates the algorithmic gain from the
  library's overhead;
- RL2 Actor: the real library path (Worker on a 1-rank process group: FSDP2, planning broadcast,
  packing, logps, loss weights, clip, step).
Modes are interleaved batch by batch so machine-load drift hits them equally; the table gives the
median over batches of non-padding tokens/s, the median of the per-batch ratio to padded, and
MFU = 6 * params * tokens / time / peak, with peak a matmul measured in this run (same device,
dtype and threads). The step-0 loss of every mode is shown: equal losses = same computation.
"""
import argparse
import logging
import os
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.common import (MODEL_SIZES, machine_description, matmul_peak, median, params_of,
                               pick_device, sample_lengths, setup_threads, sync, table)

logger = logging.getLogger(__name__)


def make_workload(n: int, vocab: int, seed: int = 0) -> list[dict]:
    """Samples in RL2's layout (input_ids, labels, action_mask); the first ~30% of every
    sequence is the prompt (no loss)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for length in sample_lengths(n, seed=seed):
        tokens = torch.randint(4, vocab, (length + 1,), generator=g)
        mask = torch.zeros(length)
        mask[int(0.3 * length):] = 1.0
        samples.append({"input_ids": tokens[:-1], "labels": tokens[1:], "action_mask": mask})
    return samples


def build_model_dir(root: str, size: str):
    from RL2.tools.make_assets import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    path = os.path.join(root, size)
    build_tiny_model(path, tok, "qwen2", max_pos=2048, **MODEL_SIZES[size])
    return path, len(tok)


class PlainTrainer:
    """A TRL-style single-device loop on a plain HF model (no FSDP, no worker)."""

    def __init__(self, path: str, device: str, dtype: torch.dtype, packed: bool, lr: float,
                 padded_batch: int, capacity: int):
        from transformers import AutoModelForCausalLM

        from RL2.parallel.attention import register

        attn = register() if packed else "sdpa"
        self.model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn,
                                                          dtype=torch.float32).to(device)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.device, self.dtype, self.packed = device, dtype, packed
        self.padded_batch, self.capacity = padded_batch, capacity

    def autocast(self):
        return torch.autocast(self.device, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def step(self, samples: list[dict]) -> float:
        n_action = sum(s["action_mask"].sum().item() for s in samples)
        loss_sum = 0.0
        for ids, labels, weights, kw in (self._packed(samples) if self.packed else self._padded(samples)):
            with self.autocast():
                logits = self.model(input_ids=ids, use_cache=False, **kw).logits
            nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
            loss = (nll * weights.flatten()).sum() / n_action
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss_sum

    def _padded(self, samples):
        d = self.device
        for s in range(0, len(samples), self.padded_batch):
            chunk = samples[s:s + self.padded_batch]
            width = max(len(x["input_ids"]) for x in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            labels = torch.zeros_like(ids)
            weights = torch.zeros(len(chunk), width)
            mask = torch.zeros_like(ids)
            for i, x in enumerate(chunk):
                n = len(x["input_ids"])
                ids[i, :n], labels[i, :n], weights[i, :n], mask[i, :n] = (
                    x["input_ids"], x["labels"], x["action_mask"], 1)
            yield ids.to(d), labels.to(d), weights.to(d), {"attention_mask": mask.to(d)}

    def _packed(self, samples):
        from RL2.data.packing import pack, plan_micro_batches
        from RL2.parallel.attention import PackedContext, packed_kwargs

        plan = plan_micro_batches([len(s["input_ids"]) for s in samples], 1, self.capacity)
        for idx in plan[0]:
            mb = pack(samples, idx).to(self.device)
            ctx = PackedContext(mb.cu_seqlens, mb.max_seqlen)
            kw = dict(position_ids=mb.data["position_ids"][None], **packed_kwargs(ctx))
            yield mb.data["input_ids"][None], mb.data["labels"][None], mb.data["action_mask"][None], kw


class RL2Trainer:
    """The library path: RL2.workers.actor.Actor on the current (1-rank) process group."""

    def __init__(self, path: str, device: str, lr: float, capacity: int):
        from RL2.algorithms.sft import sft_update
        from RL2.utils.config import load_config
        from RL2.workers.actor import Actor

        cfg = load_config("sft", [f"actor.model_name={path}", "data.train.path=unused",
                                  f"actor.lr={lr}", f"actor.max_length_per_device={capacity}"])
        self.actor = Actor(cfg.actor, device, total_steps=10 ** 6)
        self.model, self.update = self.actor.model, sft_update

    def step(self, samples: list[dict]) -> float:
        return self.update(self.actor, samples)["loss"]


def timed_step(trainer, batch, device):
    """(wall seconds, process CPU seconds, loss). On a shared CPU machine the process CPU time of
    a 1-thread run is what the step costs without the other tenants; on CUDA use wall time."""
    sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = trainer.step(batch)
    sync(device)
    wall = time.perf_counter() - start
    return wall, (time.process_time() - cpu_start if device == "cpu" else wall), loss


def measure_peak(device, dtype):
    """Matmul FLOP/s in process CPU time on CPU (see timed_step), wall time on CUDA."""
    return matmul_peak(device, dtype, repeats=3,
                       clock=time.process_time if device == "cpu" else time.perf_counter)


def bench_size(size: str, args, device: str, dtype: torch.dtype, root: str) -> list:
    path, vocab = build_model_dir(root, size)
    big = MODEL_SIZES[size]["hidden"] >= 512
    batch = args.batch_size or (8 if big and device == "cpu" else 32)
    repeats = args.repeats or (2 if args.quick else 3)
    data = make_workload(batch * (repeats + 1), vocab, seed=args.seed)
    batches = [data[i * batch:(i + 1) * batch] for i in range(repeats + 1)]
    capacity = args.max_length_per_device
    modes = {
        "padded (HF sdpa + mask)": PlainTrainer(path, device, dtype, False, args.lr, args.padded_batch, capacity),
        "RL2 Actor (packed)": RL2Trainer(path, device, args.lr, capacity),
    }
    if not args.no_plain_packed:
        modes["packed (plain HF loop)"] = PlainTrainer(path, device, dtype, True, args.lr,
                                                       args.padded_batch, capacity)
    n_params = params_of(modes["RL2 Actor (packed)"].model)
    # Warm-up on a short batch (allocator, first-call overheads), not counted.
    warm = batches[0][:2]
    for t in modes.values():
        t.step(warm)
    walls, cpus, losses = ({m: [] for m in modes} for _ in range(3))
    tokens, peaks = [], []
    for b in batches[1:]:
        tokens.append(sum(len(s["input_ids"]) for s in b))
        peaks.append(measure_peak(device, dtype))  # per round: follows the machine's load
        for m, t in modes.items():
            wall, cpu, loss = timed_step(t, b, device)
            walls[m].append(wall)
            cpus[m].append(cpu)
            losses[m].append(loss)
    rows = []
    base = "padded (HF sdpa + mask)"
    for m in modes:
        ratio = median([tb / tm for tm, tb in zip(cpus[m], cpus[base])])
        mfu = median([6 * n_params * n / t / p for n, t, p in zip(tokens, cpus[m], peaks)])
        rows.append([f"{size} ({n_params / 1e6:.2f}M)", m, batch, median(tokens),
                     median([n / t for n, t in zip(tokens, walls[m])]),
                     median([n / t for n, t in zip(tokens, cpus[m])]), ratio, 100 * mfu,
                     f"{losses[m][0]:.6f}"])
    return rows, median(peaks)


def run(args) -> str:
    device = pick_device(args.device)
    threads = setup_threads(args.threads, device)
    from RL2.parallel.mesh import init_distributed
    from RL2.utils.config import resolve_dtype

    init_distributed(device)  # a 1-rank group (gloo on CPU) unless launched under torchrun
    dtype = resolve_dtype("auto", device)
    sizes = args.sizes or (["1M", "25M"])
    rows, peaks = [], []
    with tempfile.TemporaryDirectory() as root:
        for size in sizes:
            r, p = bench_size(size, args, device, dtype, root)
            rows += r
            peaks.append(p)
    mean_len = sum(sample_lengths(4096, seed=args.seed)) / 4096
    clock = "process CPU" if device == "cpu" else "wall"
    headers = ["model", "mode", "seqs/step", "tokens/step", "tokens/s (wall)",
               f"tokens/s ({clock})", "x padded", "MFU %", "loss step 0"]
    return "\n\n".join([
        f"### SFT throughput ({machine_description(device, threads)}; {dtype}; matmul peak "
        f"{median(peaks) / 1e9:.1f} GFLOP/s; lengths 20-1000, mean {mean_len:.0f}; right-padded "
        f"micro-batches of {args.padded_batch}; max_length_per_device {args.max_length_per_device}; "
        f"median over {args.repeats or (2 if args.quick else 3)} batches)",
        table(headers, rows),
        f"`x padded` and MFU use {clock} time (on a shared CPU machine, wall time includes other "
        "tenants' load; the process's CPU time of a 1-thread run does not). MFU = 6 * params * "
        "non-padding tokens / time / matmul peak (peak re-measured before every batch round).",
    ])


def profile(args):
    """One RL2 step under the torch profiler: top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    device = pick_device(args.device)
    setup_threads(args.threads, device)
    from RL2.parallel.mesh import init_distributed

    init_distributed(device)
    size = (args.sizes or ["1M"])[0]
    with tempfile.TemporaryDirectory() as root:
        path, vocab = build_model_dir(root, size)
        trainer = RL2Trainer(path, device, args.lr, args.max_length_per_device)
        data = make_workload(64, vocab, seed=args.seed)
        trainer.step(data[:2])
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            trainer.step(data[:32])
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--sizes", nargs="*", choices=sorted(MODEL_SIZES))
    p.add_argument("--batch-size", type=int, default=None, help="sequences per optimizer step")
    p.add_argument("--padded-batch", type=int, default=8, help="sequences per padded micro-batch")
    p.add_argument("--max-length-per-device", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plain-packed", action="store_true")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table instead")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(profile(args) if args.profile else run(args))


if __name__ == "__main__":
    main()
