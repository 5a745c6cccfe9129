"""Where each full tensor of a weight sync lives (RL2/rollout/weight_sync.py): bucket regions,
the slices of a full tensor a rank writes, and the per-rank packing of the gather transport.
Pure planning: it depends on names, shapes, dtypes and shard placements only, so every rank
computes the same layout without talking to the others."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

ALIGN = 64  # region alignment: any dtype view is legal, cache lines are not shared


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def make_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into buckets of one dtype holding <= bucket_bytes (a tensor
    larger than bucket_bytes gets a bucket of its own). Streams: a bucket is yielded as soon as the
    next tensor of its dtype would overflow it; the rest are yielded at the end. Within a dtype
    the input order is kept. Deterministic: every rank of a group gets the same buckets."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    open_buckets: dict[torch.dtype, tuple[list, int]] = {}
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        bucket, size = open_buckets.get(tensor.dtype, ([], 0))
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        open_buckets[tensor.dtype] = (bucket, size + nbytes)
    for bucket, _ in open_buckets.values():
        if bucket:
            yield bucket


@dataclass
class Region:
    """Where one full tensor lives in a bucket, and which part of it this rank writes."""
    name: str
    bucket: int
    offset: int          # bytes from the bucket start
    shape: tuple
    dtype: torch.dtype
    index: tuple | None  # slices of the full tensor this rank writes; None = another rank does

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


def piece(buffer: torch.Tensor, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A typed view of `buffer` (uint8) starting at byte `offset`."""
    nbytes = numel(shape) * dtype.itemsize
    return buffer[offset:offset + nbytes].view(dtype).view(shape)


def shard_index(tensor: torch.Tensor):
    """Slices of the full tensor held by this rank, or None when an equal replica on another rank
    writes it (the replica at coordinate 0 of every Replicate mesh dim writes)."""
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, s) for s in tensor.shape) if dist.get_rank() == 0 else None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = tensor.device_mesh
    coord = mesh.get_coordinate()
    if any(isinstance(p, Replicate) and coord[d] != 0 for d, p in enumerate(tensor.placements)):
        return None
    if any(p.is_partial() for p in tensor.placements):
        raise ValueError("weight sync: partial (unreduced) DTensors cannot be synced")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def plan(params: dict, bucket_bytes: int, dtype_of) -> list[Region]:
    """Bucket layout of `params` (name -> tensor) in the sync dtype `dtype_of(tensor)`: regions
    in state-dict order, a new bucket whenever the next tensor would overflow this one."""
    regions, bucket, offset = [], 0, 0
    for name, tensor in params.items():
        dtype = dtype_of(tensor)
        nbytes = tensor.numel() * dtype.itemsize
        if offset and offset + nbytes > bucket_bytes:
            bucket, offset = bucket + 1, 0
        regions.append(Region(name, bucket, offset, tuple(tensor.shape), dtype, shard_index(tensor)))
        offset += padded(nbytes)
    return regions


def gather_plan(regions: list[Region], indices: list[list]) -> tuple[list, list[int]]:
    """The gather transport's packing, from every rank's `shard_index` per region (`indices[q]`
    for rank q): per bucket and rank the (region number, slices, byte offset) pieces it packs,
    and per bucket the bytes every rank contributes (the largest rank's share, padded)."""
    n_buckets = regions[-1].bucket + 1 if regions else 0
    pieces = [[[] for _ in indices] for _ in range(n_buckets)]
    segment = [0] * n_buckets
    for q, rank_indices in enumerate(indices):
        used = [0] * n_buckets
        for i, (r, index) in enumerate(zip(regions, rank_indices)):
            if index is None:
                continue
            nbytes = numel(s.stop - s.start for s in index) * r.dtype.itemsize
            pieces[r.bucket][q].append((i, index, used[r.bucket]))
            used[r.bucket] += padded(nbytes)
        segment = [max(a, b) for a, b in zip(segment, used)]
    return pieces, segment
