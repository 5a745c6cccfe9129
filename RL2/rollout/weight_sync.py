"""Weight sync: training shards (FSDP2 / TP DTensors) -> full tensors with HF names -> engine.

Every rank walks the state dict in the same order (`full_tensor()` is a collective), so this must
run outside any rollout coroutine. Tensors are handed to the engine in buckets of bounded size,
grouped by dtype, so peak extra memory is one bucket rather than the whole model.
"""
import logging
import time
from typing import Iterator

import torch
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


def iter_full_tensors(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter and buffer of a sharded model; a collective."""
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor


def iter_buckets(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int):
    """Group consecutive tensors of one dtype into lists of at most `bucket_bytes` (a tensor
    larger than the limit forms its own bucket)."""
    bucket, size, dtype = [], 0, None
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and (t.dtype != dtype or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
        dtype = t.dtype
    if bucket:
        yield bucket


def sync_weights(model, engine, bucket_mb: float = 512, dtype: torch.dtype | None = None) -> dict:
    """Push the current training weights into `engine` (None on ranks that hold no engine; they
    still take part in the gathers). Returns timing metrics."""
    start = time.perf_counter()
    n_bytes = 0
    if engine is not None:
        engine.resume_memory(["weights"])
    for bucket in iter_buckets(iter_full_tensors(model, dtype), int(bucket_mb * 2**20)):
        n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        if engine is not None:
            engine.update_weights(bucket)
    if engine is not None:
        engine.resume_memory(["kv_cache"])
    return {"sync_seconds": time.perf_counter() - start, "sync_bytes": n_bytes}
