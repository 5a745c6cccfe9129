"""Packing quality: RL2's balanced partition (`plan_micro_batches`) vs a naive first-fit, and the
padding of plain right-padded batches, on a seeded realistic length mix (20-1000 tokens).

    python -m benchmarks.bench_packing [--quick]

Per global batch (one optimizer step), averaged over several seeded batches:
- mb/rank: micro-batches each data-parallel rank runs (equal on every rank);
- imbalance: max / mean real tokens per dp rank, minus 1 (rank-level load imbalance);
- lockstep waste: FSDP all-gathers every layer of every micro-batch, so ranks wait for each other
  micro-batch by micro-batch: 1 - real tokens / (dp * sum_j max_rank tokens of micro-batch j);
- pad %: padding tokens / tokens computed (packed rows pad only for sp > 1);
- plan ms: time to compute the partition (Python, once per step on rank 0).
"""
import argparse
import logging
import time

from benchmarks.common import median, sample_lengths, table
from RL2.data.packing import micro_batch_loads, padded_length, plan_micro_batches

logger = logging.getLogger(__name__)


def first_fit(lengths: list[int], dp: int, capacity: int, sp_size: int = 1) -> list[list[list[int]]]:
    """Naive baseline: first-fit in data order, bins dealt to ranks round-robin, ranks with fewer
    bins padded with empty micro-batches so every rank runs the same count."""
    bins, loads = [], []
    for i, n in enumerate(lengths):
        w = padded_length(n, sp_size)
        for b, load in enumerate(loads):
            if load + w <= capacity:
                bins[b].append(i)
                loads[b] += w
                break
        else:
            bins.append([i])
            loads.append(w)
    plan = [bins[r::dp] for r in range(dp)]
    k = max(len(p) for p in plan)
    return [p + [[] for _ in range(k - len(p))] for p in plan]


def plan_stats(plan, lengths: list[int], sp_size: int = 1) -> dict:
    dp = len(plan)
    k = len(plan[0]) if plan else 0
    real = [[sum(lengths[i] for i in mb) for mb in rank] for rank in plan]
    padded = micro_batch_loads(plan, lengths, sp_size)
    per_rank = [sum(r) for r in real]
    total_real = sum(per_rank)
    mean_rank = total_real / dp
    # Lock-step cost: micro-batch j takes as long as its largest (padded) instance over ranks.
    lockstep = sum(max(padded[r][j] for r in range(dp)) for j in range(k))
    total_padded = sum(sum(r) for r in padded)
    return {
        "k": k,
        "imbalance": max(per_rank) / mean_rank - 1 if mean_rank else 0.0,
        "waste": 1 - total_real / (dp * lockstep) if lockstep else 0.0,
        "pad": 1 - total_real / total_padded if total_padded else 0.0,
    }


def padded_batch_fraction(lengths: list[int], batch: int) -> float:
    """Padding fraction of right-padded micro-batches of `batch` sequences in data order."""
    real = computed = 0
    for s in range(0, len(lengths), batch):
        chunk = lengths[s:s + batch]
        real += sum(chunk)
        computed += max(chunk) * len(chunk)
    return 1 - real / computed


def run(quick: bool = False, batch_size: int = 256, n_steps: int | None = None) -> str:
    n_steps = n_steps or (4 if quick else 16)
    dps = [1, 2, 4, 8]
    capacities = [1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192]
    batches = [sample_lengths(batch_size, seed=100 + s) for s in range(n_steps)]
    rows = []
    # sp=2 pads every sequence to an even length (zig-zag halves): a few layouts show its cost.
    layouts = [(1, dp) for dp in dps] + [(2, dp) for dp in ((2,) if quick else (1, 4))]
    for sp, dp in layouts:
        for cap in capacities:
            res = {}
            for name, fn in (("ff", first_fit), ("kk", plan_micro_batches)):
                stats, times = [], []
                for lengths in batches:
                    start = time.perf_counter()
                    plan = fn(lengths, dp, cap, sp_size=sp)
                    times.append(time.perf_counter() - start)
                    stats.append(plan_stats(plan, lengths, sp))
                res[name] = {key: sum(s[key] for s in stats) / len(stats) for key in stats[0]}
                res[name]["ms"] = 1000 * median(times)
            ff, kk = res["ff"], res["kk"]
            rows.append([sp, dp, cap, f"{ff['k']:.1f} / {kk['k']:.1f}",
                         100 * ff["imbalance"], 100 * kk["imbalance"], 100 * ff["waste"],
                         100 * kk["waste"], 100 * kk["pad"], kk["ms"]])
    mean_len = sum(map(sum, batches)) / (len(batches) * batch_size)
    headers = ["sp", "dp", "capacity", "mb/rank FF / KK", "imbalance % FF", "imbalance % KK",
               "lockstep waste % FF", "lockstep waste % KK", "pad % KK", "plan ms KK"]
    pad_rows = [[f"right-padded, {b} seqs/micro-batch (data order)",
                 100 * sum(padded_batch_fraction(x, b) for x in batches) / len(batches)]
                for b in (4, 8, 16)]
    return "\n\n".join([
        f"### Packing quality ({batch_size} sequences per step, lengths 20-1000, mean {mean_len:.0f}; "
        f"average of {n_steps} seeded steps). FF = naive first-fit, KK = RL2 plan_micro_batches; "
        "capacity = max_length_per_device * sp tokens per micro-batch",
        table(headers, rows),
        "Padding of plain padded batches on the same steps (what packing removes):",
        table(["batching", "pad %"], pad_rows),
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    print(run(args.quick, args.batch_size))


if __name__ == "__main__":
    main()
