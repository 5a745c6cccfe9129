"""Balanced partition of a global batch into micro-batches, packing of a micro-batch into one row
(with the zig-zag split over a sequence-parallel group), and the inverse for per-token outputs.

Partition (`plan_micro_batches`): find the smallest number k of micro-batches per dp rank such
that dp_size*k bins, balanced by Karmarkar-Karp largest differencing, each fit `capacity` padded
tokens; then hand the bins to ranks (exactly k each) with Karmarkar-Karp under an equal-count
constraint so that per-rank token totals are balanced too. Everything is deterministic.
"""
import heapq
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from RL2.utils.config import resolve_cpu_auto


@dataclass
class MicroBatch:
    data: dict[str, Tensor]  # 1-D tensors of the local length T, incl. position_ids
    cu_seqlens: Tensor  # int32 (n_seqs+1,), local boundaries (same on every rank of an sp group)
    max_seqlen: int  # max local sequence length
    # index of each sequence in the global list; empty for a dummy (zero-weight filler)
    indices: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # original (unpadded) length of each sequence
    # per sequence: how many leading tokens of its root (the last sequence before it with
    # prefix 0) it continues: it attends to them and its position_ids start there
    # (`shared_tail`); empty: none does
    prefix_lens: list[int] = field(default_factory=list)

    def to(self, device) -> "MicroBatch":
        return MicroBatch(
            {k: v.to(device) for k, v in self.data.items()}, self.cu_seqlens.to(device),
            self.max_seqlen, list(self.indices), list(self.lengths), list(self.prefix_lens),
        )


def token_capacity(worker_cfg) -> int:
    """Tokens one micro-batch holds: `max_length_per_device` on each of the sp*tp devices that
    share it (the longest trainable sequence, or pair of sequences)."""
    return worker_cfg.max_length_per_device * worker_cfg.sp_size * worker_cfg.tp_size


def check_fits(samples: list[dict], worker_cfg, section: str = "actor"):
    """Stop before training if a sequence does not fit one micro-batch."""
    capacity = token_capacity(worker_cfg)
    longest = max(len(s["input_ids"]) for s in samples)
    if longest > capacity:
        raise SystemExit(
            f"a sequence of {longest} tokens exceeds the per-device budget "
            f"{section}.max_length_per_device*sp_size*tp_size = {capacity}; raise "
            f"{section}.max_length_per_device or {section}.sp_size, or lower data.train.max_length")


def padded_length(length: int, sp_size: int = 1) -> int:
    """Length of a sequence after padding for `pack` (a multiple of 2*sp for the zig-zag split)."""
    unit = 2 * sp_size if sp_size > 1 else 1
    return -(-length // unit) * unit


# ---------------------------------------------------------------- shared prefixes
# A sample whose first tokens repeat another's (a DPO pair's prompt, a GRPO group's prompt) can
# be packed as a tail that continues that "root" sample: position_ids start where the tail
# starts, and attention lets the tail see the root's first tokens (attention.PackedContext).
# The log-probs are the same; the shared tokens are computed once.

MIN_SHARED_TOKENS = 4  # shorter common prefixes are not worth tying samples to one micro-batch


def resolve_share_prompt(worker_cfg, device: str) -> bool:
    """`share_prompt`: true, false or auto. auto = on where it has run, the CPU; CUDA's path
    (flash-attn over gathered keys) is written but has not run, so there it needs `true`."""
    # off where a trainer's config has no such key (SFT)
    return resolve_cpu_auto(worker_cfg, "share_prompt", device, "ring attention cannot split a "
                            "sequence that continues another's prompt", default=False)


def shared_length(first: dict, second: dict) -> int:
    """How many leading positions `second` can take from `first`: equal input_ids (and labels,
    if the samples have them), and no action token (action_mask) or scored token (eos_mask, a
    reward model's) in either: what is read per sample is never shared. Other per-token keys at
    those positions are dropped with them: every loss and metric reads them through those
    masks, which are 0 there. At least `second`'s last position stays its own."""
    n = min(len(first["input_ids"]), len(second["input_ids"]) - 1)
    if n <= 0:
        return 0
    same = first["input_ids"][:n] == second["input_ids"][:n]
    if "labels" in first:
        same &= first["labels"][:n] == second["labels"][:n]
    for mask in ("action_mask", "eos_mask"):
        if mask in first:
            same &= (first[mask][:n] == 0) & (second[mask][:n] == 0)
    differs = (~same).nonzero()
    return int(differs[0]) if len(differs) else n


def shared_tail(first: dict, second: dict, start: int | None = None) -> dict:
    """`second` from `shared_length(first, second)` (or `start`) on, with `position_ids`
    counting on from there: it continues `first`. For a DPO pair: the rejected side from the
    last prompt token, whose label is the rejected response's first token."""
    if set(first) - {"position_ids"} != set(second) - {"position_ids"}:
        raise ValueError(f"the two samples have different keys: {sorted(first)} vs {sorted(second)}")
    start = shared_length(first, second) if start is None else start
    tail = {k: v[start:] for k, v in second.items()}
    tail["position_ids"] = torch.arange(start, len(second["input_ids"]))
    return tail


def share_prefixes(samples: list[dict], capacity: int,
                   dp_size: int = 1) -> tuple[list[dict], list[list[int]], list[int]]:
    """Group samples that begin with the same >= MIN_SHARED_TOKENS tokens (`shared_length`) and
    compute those tokens once: each group gets one extra prefix-only sequence (appended after
    the samples, index >= len(samples); its outputs are not any sample's), and every member,
    the first included, becomes a tail continuing it. So a sample is computed the same way
    whatever the order it comes in: the old log-probs (all samples) and the update (a shuffled
    mini-batch) agree, which a root computed whole and its copies as tails would not (their
    kernels differ in the last bits). Returns (samples + prefixes, groups (prefix first),
    tokens each sample leaves to its prefix).

    Samples are visited in the lexicographic order of their input_ids, where the samples
    sharing most with one another are neighbours: one tuple sort and a comparison or two per
    sample, not one per pair. A group's members share the same number of tokens with its first;
    a sample that shares more with the next one starts a group of its own (prompts behind a
    common chat header share their whole prompt). A group holds at most `capacity` tokens, and
    with dp_size > 1 at most a rank's share of the batch, so that groups still balance over the
    ranks. Deterministic: every rank gets the same result."""
    order = sorted(range(len(samples)), key=lambda i: (samples[i]["input_ids"].tolist(), i))
    total_tokens = sum(len(s["input_ids"]) for s in samples)
    limit = capacity if dp_size <= 1 else min(capacity, -(-total_tokens // dp_size))
    runs = []  # [first, shared length (None until a second member), members, tokens]
    for k, i in enumerate(order):
        n = len(samples[i]["input_ids"])
        run = runs[-1] if runs else None
        length = shared_length(samples[run[0]], samples[i]) if run else 0
        ahead = shared_length(samples[i], samples[order[k + 1]]) if k + 1 < len(order) else 0
        p = length if run is None or run[1] is None else run[1]
        tokens = (run[3] + n - length) if run else 0
        if (run is None or length < MIN_SHARED_TOKENS or length != p or ahead > length
                or tokens > limit):
            runs.append([i, None, [i], n])
            continue
        run[1], run[3] = length, tokens
        run[2].append(i)
    out = [dict(s, position_ids=torch.arange(len(s["input_ids"]))) for s in samples]
    dropped, groups = [0] * len(samples), []
    for first, p, members, _ in runs:
        if len(members) < 2:
            continue
        prefix = {k: v[:p] for k, v in samples[first].items()}
        prefix["position_ids"] = torch.arange(p)
        groups.append([len(out)] + members)
        out.append(prefix)
        for i in members:
            out[i], dropped[i] = shared_tail(prefix, samples[i], p), p
    return out, groups, dropped


# ---------------------------------------------------------------- partition
# A KK "state" is a list of parts, sorted by total descending; a part is (total, items).


def _kk_merge(a: list, b: list, n_parts: int) -> list:
    """Combine two partial partitions: a's heaviest part with b's lightest, and so on.

    Parts missing from a state are empty; only non-empty results are kept, so a state costs
    O(non-empty parts), not O(n_parts).
    """
    merged = []
    # Only slots where a or b has a non-empty part can give a non-empty result.
    for j in sorted(set(range(len(a))) | set(range(max(0, n_parts - len(b)), n_parts))):
        pa = a[j] if j < len(a) else None
        jb = n_parts - 1 - j  # b's j-th lightest part is its (n_parts-1-j)-th heaviest
        pb = b[jb] if jb < len(b) else None
        if pa is None and pb is None:
            continue
        if pa is None:
            merged.append(pb)
        elif pb is None:
            merged.append(pa)
        else:
            merged.append((pa[0] + pb[0], pa[1] + pb[1]))
    # Ties broken by the items so equal inputs always give the same result.
    merged.sort(key=lambda p: (-p[0], p[1]))
    return merged


def _spread(state: list, n_parts: int) -> int:
    """Max minus min part total (an absent part counts as 0)."""
    return state[0][0] - (state[-1][0] if len(state) == n_parts else 0)


def karmarkar_karp(states: list[list], n_parts: int) -> list[tuple[int, list]]:
    """Largest differencing: repeatedly merge the two states with the largest spread.

    `states` are initial partial partitions (each a list of (total, items) parts). Returns
    exactly `n_parts` parts (some possibly empty), heaviest first.
    """
    heap = [(-_spread(s, n_parts), i, s) for i, s in enumerate(states)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        m = _kk_merge(a, b, n_parts)
        heapq.heappush(heap, (-_spread(m, n_parts), counter, m))
        counter += 1
    parts = heap[0][2] if heap else []
    return parts + [(0, [])] * (n_parts - len(parts))


def _units(lengths, groups, sp_size):
    """Items to place: groups (kept together) and the remaining single samples."""
    owner = {}
    for g, members in enumerate(groups or []):
        for i in members:
            if not 0 <= i < len(lengths):
                raise ValueError(f"group {g} names sample {i}, but there are {len(lengths)} samples")
            if i in owner:
                raise ValueError(f"sample {i} is in groups {owner[i]} and {g}")
            owner[i] = g
    units = [list(members) for members in (groups or []) if members]
    units += [[i] for i in range(len(lengths)) if i not in owner]
    return [(sum(padded_length(lengths[i], sp_size) for i in u), u) for u in units]


def plan_micro_batches(lengths: list[int], dp_size: int, capacity: int,
                       groups: list[list[int]] | None = None, sp_size: int = 1) -> list[list[list[int]]]:
    """Partition samples into micro-batches: result[dp_rank][micro_batch] = sample indices.

    Every rank gets the same number k of micro-batches (some may be empty); each holds at most
    `capacity` tokens counted with `padded_length(L, sp_size)`; samples in one of
    `groups` stay in the same micro-batch, in the given order. No samples -> k = 0.
    """
    if dp_size < 1 or capacity < 1:
        raise ValueError(f"dp_size ({dp_size}) and capacity ({capacity}) must be positive")
    units = _units(lengths, groups, sp_size)
    for weight, members in units:
        if weight > capacity:
            lens = [lengths[i] for i in members]
            what = (f"sample {members[0]} has length {lens[0]}" if len(members) == 1
                    else f"group of samples {members} has lengths {lens}")
            raise ValueError(
                f"{what} ({weight} tokens after padding) > micro-batch capacity {capacity}; "
                "raise max_length_per_device or lower the data max_length"
            )
    if not units:
        return [[] for _ in range(dp_size)]
    # Heaviest first, ties by index: the KK input order (and so the result) is deterministic.
    units.sort(key=lambda u: (-u[0], u[1]))
    total = sum(w for w, _ in units)
    k = max(1, -(-total // (dp_size * capacity)))
    while True:
        n_bins = dp_size * k
        bins = karmarkar_karp([[(w, [tuple(u)])] for w, u in units], n_bins)
        if bins[0][0] <= capacity:
            break
        k += 1  # terminates: with n_bins >= len(units) every unit gets its own bin
    return _bins_to_ranks(bins, dp_size, k)


def micro_batch_loads(plan: list[list[list[int]]], lengths: list[int], sp_size: int = 1) -> list[list[int]]:
    """The padded tokens of each micro-batch of a `plan_micro_batches` result, per dp rank."""
    return [[sum(padded_length(lengths[i], sp_size) for i in mb) for mb in rank] for rank in plan]


def imbalance_note(loads: list[list[int]], threshold: float = 0.1) -> str | None:
    """A message when the dp ranks of a plan (`micro_batch_loads`) would wait for each other
    for >= `threshold` of a step: they run micro-batch j together (FSDP's collectives), so a
    step lasts the sum over j of its busiest micro-batch. None when balanced, or one rank."""
    if len(loads) < 2:
        return None
    step = sum(max(mbs) for mbs in zip(*loads))
    totals = [sum(r) for r in loads]
    waiting = 1 - sum(totals) / (len(loads) * step) if step else 0.0
    if waiting < threshold:
        return None
    return (f"data-parallel ranks wait for each other ~{waiting:.0%} "
            f"of a step (the least loaded {1 - min(totals) / step:.0%}; {min(totals)} to "
            f"{max(totals)} tokens a rank): micro-batches hold whole sequences. A larger sp_size "
            "spreads each sequence over more ranks (ring attention, which share_prompt and "
            "prune_last_layer do not take), and larger batches balance better")


def _bins_to_ranks(bins, dp_size: int, k: int) -> list[list[list[int]]]:
    """Give each rank exactly k bins with balanced totals: KK over chunks of dp_size bins (each
    chunk contributes one bin to every rank, so counts stay equal)."""
    bins = sorted(bins, key=lambda b: (-b[0], b[1]))
    states = []
    for c in range(k):
        chunk = bins[c * dp_size:(c + 1) * dp_size]
        states.append([(w, [(w, units)]) for w, units in chunk])  # one bin per rank
    ranks = karmarkar_karp(states, dp_size)
    plan = []
    for _, rank_bins in sorted(ranks, key=lambda r: r[1]):  # rank order: fixed for determinism
        # heaviest micro-batch first on every rank: the ranks run micro-batch j together (FSDP's
        # collectives), and equal orders make the sum over j of the slowest the least
        rank_bins = sorted(((w, sorted(units)) for w, units in rank_bins), key=lambda b: (-b[0], b[1]))
        plan.append([[i for unit in units for i in unit] for _, units in rank_bins])
    return plan


# ---------------------------------------------------------------- pack / unpack


def _zigzag(t: Tensor, sp_size: int, sp_rank: int) -> Tensor:
    """Keep chunks sp_rank and 2*sp-1-sp_rank of a padded sequence (balances causal work)."""
    chunks = t.chunk(2 * sp_size)
    return torch.cat([chunks[sp_rank], chunks[2 * sp_size - 1 - sp_rank]])


def pack(samples: list[dict], indices: list[int], sp_size: int = 1, sp_rank: int = 0) -> MicroBatch:
    """Concatenate samples[indices] into one row; pad per sequence and zig-zag split over sp.

    Padding: 0 for every tensor; position_ids keep counting into the padding. An empty `indices`
    gives a dummy micro-batch: one padded sequence whose tensors (float keys included) are 0.
    Samples may carry position_ids (consecutive); one that starts at p > 0 continues the first p
    tokens of the last sample before it that starts at 0 (`MicroBatch.prefix_lens`; not with sp).
    """
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} not in [0, sp_size={sp_size})")
    seqs = [samples[i] for i in indices]
    if seqs:
        keys = list(seqs[0])
        for i, s in zip(indices, seqs):
            if list(s) != keys:
                raise ValueError(f"sample {i} has keys {list(s)}, expected {keys}")
        lengths = [len(s["input_ids"]) for s in seqs]
        for i, s, n in zip(indices, seqs, lengths):
            bad = [k for k in keys if len(s[k]) != n]
            if bad:
                raise ValueError(f"sample {i}: {bad} not of the input_ids length {n}")
    else:  # dummy: the keys (and dtypes) of any sample, all zeros
        template = samples[0] if samples else {
            "input_ids": torch.zeros(1, dtype=torch.long),
            "labels": torch.zeros(1, dtype=torch.long),
            "action_mask": torch.zeros(1),
        }
        keys = list(template)
        seqs = [{k: torch.zeros(1, dtype=template[k].dtype) for k in keys}]
        lengths = [1]
    keys = [k for k in keys if k != "position_ids"]
    parts = {k: [] for k in keys + ["position_ids"]}
    local_lens, prefix_lens, root_len = [], [], None
    for j, (s, n) in enumerate(zip(seqs, lengths)):
        n_pad = padded_length(n, sp_size)
        padded = {k: torch.nn.functional.pad(s[k], (0, n_pad - n)) for k in keys}
        start = _prefix_len(s, j, root_len, sp_size, indices)
        prefix_lens.append(start)
        root_len = n if start == 0 else root_len
        padded["position_ids"] = torch.arange(start, start + n_pad, dtype=torch.long)
        for k, v in padded.items():
            parts[k].append(_zigzag(v, sp_size, sp_rank) if sp_size > 1 else v)
        local_lens.append(n_pad // sp_size)
    cu = torch.zeros(len(local_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(local_lens), 0)
    data = {k: torch.cat(v) for k, v in parts.items()}
    real = bool(indices)
    return MicroBatch(data, cu, max(local_lens), list(indices) if real else [],
                      lengths if real else [], prefix_lens if any(prefix_lens) else [])


def _prefix_len(sample: dict, j: int, root_len: int | None, sp_size: int, indices: list[int]) -> int:
    """Where a sample's own position_ids start (0 without them): the leading tokens of the last
    sample before it that starts at 0 (its root, of `root_len` tokens; None: no root yet) it
    continues."""
    pos = sample.get("position_ids")
    if pos is None:
        return 0
    start = int(pos[0]) if len(pos) else 0
    if not torch.equal(pos, torch.arange(start, start + len(pos), dtype=pos.dtype)):
        raise ValueError(f"sample {indices[j]}: position_ids must count up by 1")
    if start and sp_size > 1:
        raise ValueError(f"sample {indices[j]} continues another sample (position_ids from "
                         f"{start}), which sp_size={sp_size} cannot split")
    if start and (root_len is None or root_len < start):
        raise ValueError(f"sample {indices[j]} continues the first {start} tokens of the last sample "
                         f"before it that starts at 0, but {'none is' if root_len is None else 'that one has fewer'}")
    return start


def unpack(mb: MicroBatch, local: Tensor, sp_group=None) -> list[Tensor]:
    """Per-sequence outputs (e.g. log-probs) from a packed per-token output.

    With an sp group (size > 1), gathers the local outputs of every rank (no autograd), undoes
    the zig-zag, and strips padding. Returns one tensor of length lengths[i] per sequence
    (an empty list for a dummy micro-batch). Extra trailing dims of `local` are kept.
    """
    sp_size = dist.get_world_size(sp_group) if sp_group is not None else 1
    if sp_size > 1:
        local = local.detach().contiguous()
        gathered = [torch.empty_like(local) for _ in range(sp_size)]
        dist.all_gather(gathered, local, group=sp_group)
    else:
        gathered = [local]
    cu = mb.cu_seqlens.tolist()
    out = []
    for j, n in enumerate(mb.lengths):
        start, end = cu[j], cu[j + 1]
        half = (end - start) // 2
        if sp_size == 1:
            full = gathered[0][start:end]
        else:
            # Rank r holds chunk r then chunk 2*sp-1-r of the padded sequence.
            chunks = [None] * (2 * sp_size)
            for r, g in enumerate(gathered):
                chunks[r] = g[start:start + half]
                chunks[2 * sp_size - 1 - r] = g[start + half:end]
            full = torch.cat(chunks)
        out.append(full[:n])
    return out
