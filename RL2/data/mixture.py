"""Mixed datasets: `data.train.path` as a list of {path, weight} (or plain paths, weight 1).

    data.train.path='[{path: a.jsonl, weight: 0.7}, {path: b.jsonl, weight: 0.3}]'

Every batch takes from each source a count that follows the weights exactly on average: the
counts carry their rounding remainder from step to step (step s gets floor/ceil of
weight * batch_size so that the cumulative count after s steps is within one of
weight * batch_size * s). Inside a source, rows come from a fresh permutation per pass over it.
The batch of step s is a pure function of (seed, s), so resumed runs repeat it.
"""
import math
import os

import torch

from RL2.utils.seeding import derive_seed


def parse_sources(path_cfg) -> list[dict] | None:
    """[{path, weight, name}] for a list config; None for a single path (no mixture). Bad
    entries raise ValueError naming the entry."""
    if path_cfg is None or isinstance(path_cfg, (str, os.PathLike)):
        return None
    sources = []
    for i, entry in enumerate(path_cfg):
        if isinstance(entry, (str, os.PathLike)):
            entry = {"path": entry}
        entry = dict(entry)
        unknown = set(entry) - {"path", "weight", "name"}
        if "path" not in entry or unknown:
            raise ValueError(f"data path entry {i} {entry}: give `path` (and optional `weight`, `name`)"
                             + (f"; unknown keys {sorted(unknown)}" if unknown else ""))
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"data path entry {i} ({entry['path']}): weight must be a number > 0, got {weight!r}")
        name = entry.get("name") or os.path.splitext(os.path.basename(str(entry["path"]).rstrip("/")))[0]
        sources.append({"path": str(entry["path"]), "weight": float(weight), "name": name})
    if not sources:
        raise ValueError("data path is an empty list")
    names = [s["name"] for s in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"data sources need distinct names (give `name`): {names}")
    return sources


def step_counts(weights: list[float], batch_size: int, n_steps: int) -> list[list[int]]:
    """counts[s][i]: rows of source i in the batch of step s (each row sums to batch_size).

    Error diffusion: each step owes weight_i * batch_size plus last step's remainder; the floors
    are given, and the rows left over go to the largest remainders (ties: lower index)."""
    total = sum(weights)
    share = [w / total * batch_size for w in weights]
    owed = [0.0] * len(weights)
    out = []
    for _ in range(n_steps):
        owed = [o + s for o, s in zip(owed, share)]
        counts = [math.floor(o + 1e-9) for o in owed]
        left = batch_size - sum(counts)
        for i in sorted(range(len(owed)), key=lambda i: (-(owed[i] - counts[i]), i))[:left]:
            counts[i] += 1
        owed = [o - c for o, c in zip(owed, counts)]
        out.append(counts)
    return out


class MixtureSampler:
    """Drop-in for StepSampler over the concatenation of the sources (source i's rows at
    offsets[i] .. offsets[i] + sizes[i])."""

    def __init__(self, sizes: list[int], weights: list[float], batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.sizes, self.weights, self.bs, self.seed = list(sizes), list(weights), batch_size, seed
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.steps_per_epoch = max(1, sum(sizes) // batch_size)
        self._counts: list[list[int]] = []
        self._perms: dict[tuple[int, int], list[int]] = {}

    def _cumulative(self, step: int) -> tuple[list[int], list[int]]:
        """(rows drawn from each source before `step`, counts of `step`)."""
        if len(self._counts) <= step:
            self._counts = step_counts(self.weights, self.bs, 2 * step + 16)
        before = [sum(c[i] for c in self._counts[:step]) for i in range(len(self.sizes))]
        return before, self._counts[step]

    def _row(self, source: int, position: int) -> int:
        """The `position`-th row drawn from `source`: pass = position // size, reshuffled per pass."""
        n = self.sizes[source]
        key = (source, position // n)
        if key not in self._perms:
            g = torch.Generator().manual_seed(derive_seed(self.seed, "mixture", source, position // n))
            self._perms = {k: v for k, v in self._perms.items() if k[0] != source}  # keep one pass per source
            self._perms[key] = torch.randperm(n, generator=g).tolist()
        return self.offsets[source] + self._perms[key][position % n]

    def batch(self, step: int) -> list[int]:
        before, counts = self._cumulative(step)
        return [self._row(i, before[i] + j) for i in range(len(self.sizes)) for j in range(counts[i])]


def _tag(prompts: list[dict], name: str | None) -> list[dict]:
    """Group metrics by the source's name: it becomes each row's data_source."""
    if name is not None:
        for p in prompts:
            p["data_source"] = name
            p["extra_info"]["data_source"] = name
    return prompts


def load_mixed_splits(data, seed: int, tokenize_all):
    """(train, test, train weights or None, train sizes) when data.train.path or data.test.path
    is a list; None otherwise. `tokenize_all(rows, source)` tokenises (and validates) rows.
    With data.test_ratio (and no test path) each train source gives its own held-out part."""
    from RL2.data.io import load_rows, split_train_test

    train_src, test_src = parse_sources(data.train.path), parse_sources(data.test.path)
    if train_src is None and test_src is None:
        return None
    weights = [s["weight"] for s in train_src] if train_src else None
    train_src = train_src or [{"path": data.train.path, "name": None}]
    train, test, sizes = [], [], []
    for s in train_src:
        rows, held = load_rows(s["path"]), None
        if not data.test.path and data.test_ratio > 0:
            rows, held = split_train_test(rows, data.test_ratio, seed)
        part = _tag(tokenize_all(rows, s["path"]), s["name"])
        train += part
        sizes.append(len(part))
        if held is not None:
            test += _tag(tokenize_all(held, f"{s['path']} (test_ratio split)"), s["name"])
    if data.test.path:
        for s in test_src or [{"path": data.test.path, "name": None}]:
            test += _tag(tokenize_all(load_rows(s["path"]), s["path"]), s["name"])
    return train, test, weights, sizes
